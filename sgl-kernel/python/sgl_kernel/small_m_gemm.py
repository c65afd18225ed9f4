"""Batch-invariant ``x @ w.T`` for a few rows: the dense projections and the LM head of decode
and verify.

A library GEMM picks its algorithm by the row count, so one token's output rounds differently
when it is computed alone (a decode, ``M = 1``) and beside others (a NEXTN or DSpark verify,
``M = 4 .. 16``): enough to flip a greedy token after a few dozen steps in bf16, so speculative
decoding stops being bit-equal to plain decoding at batch 1. Here every launch uses the same tile
of ``BLOCK_M = 16`` rows (a tensor-core tile; absent rows are masked) and a tile config fixed by
the weight's shape (:func:`launch_config`), so a row's result depends on its own values only:
bit for bit the same at any ``M``. At these sizes the product is weight streaming; the padded
rows cost tensor-core work only.

Accumulation is fp32 (``tl.dot`` with ``ieee`` precision for fp32 inputs), bias added in fp32,
one rounding to x's dtype. Reference: :func:`small_m_gemm_reference`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from sgl_kernel import pdl
from sgl_kernel.fp8_blocks import QBLOCK, block_dequantize, check_block_scale, dequant_tile
from sgl_kernel._triton_mode import INTERPRETED, LaunchConfig, compiler_options

__all__ = ["small_m_gemm", "small_m_gemm_reference", "launch_config", "SMALL_M_MAX_ROWS",
           "BLOCK_M", "GatedNormPrologue"]

BLOCK_M = 16


class GatedNormPrologue(NamedTuple):
    """``x`` normalised per ``head_dim``-wide head before the product, as
    ``sglang.srt.layers.layernorm.GatedRMSNorm``: ``rmsnorm(x) * weight * act(gate)`` in fp32,
    rounded to x's dtype. ``gate [M, K]`` (contiguous last dim), ``weight [head_dim]``."""

    gate: torch.Tensor
    weight: torch.Tensor
    eps: float
    head_dim: int
    activation: str = "sigmoid"
# Decode and verify batches (DSpark's 16-wide verify x 4 requests); prefill keeps the library GEMM.
SMALL_M_MAX_ROWS = 64


@triton.jit
def _small_m_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, s_ptr, srow_ptr, z_ptr, nw_ptr, M, N, K,
                         stride_xm, stride_wn, stride_om, stride_sn, stride_zm, eps,
                         HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, ROW_MAP: tl.constexpr,
                         QB: tl.constexpr, NORM_D: tl.constexpr, GATE_ACT: tl.constexpr,
                         USE_PDL: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    # Axis 0 walks the weight's row blocks (many programs), axis 1 the 16-row tiles of x.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n, mask_m = offs_n < N, offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    z_rows = z_ptr + offs_m.to(tl.int64)[:, None] * stride_zm
    pdl.wait(USE_PDL)  # x comes from the kernel before
    pdl.launch_dependents(USE_PDL)
    if ROW_MAP:  # a weight of several pieces, each on its own block grid
        s_rows = s_ptr + tl.load(srow_ptr + offs_n, mask=mask_n, other=0).to(tl.int64) * stride_sn
    else:
        s_rows = s_ptr + (offs_n // QB).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if NORM_D > 0:  # gated RMSNorm prologue: per NORM_D-wide head of the tile, as GatedRMSNorm
            x3 = tl.reshape(x.to(tl.float32), (BLOCK_M, BLOCK_K // NORM_D, NORM_D))
            r = tl.rsqrt(tl.sum(x3 * x3, axis=2) / NORM_D + eps)
            y = tl.reshape(x3 * r[:, :, None], (BLOCK_M, BLOCK_K))
            z = tl.load(z_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0).to(tl.float32)
            act = tl.sigmoid(z) if GATE_ACT == 1 else z * tl.sigmoid(z)
            nw = tl.load(nw_ptr + offs_k % NORM_D, mask=mask_k, other=0.0).to(tl.float32)
            x = (y * nw[None, :] * act).to(x_ptr.dtype.element_ty)
        if HAS_SCALE:  # block fp8: dequantise the tile, rounded to the activation dtype
            w = dequant_tile(w, s_rows, k0, K, mask_n, x_ptr.dtype.element_ty, BLOCK_N, BLOCK_K,
                             QB)
        x = x.to(w.dtype)  # e.g. bf16 activations into an fp32 router gate: no cast launch
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def launch_config(n: int, k: int) -> LaunchConfig:
    """The tiles of an ``[n, k]`` weight: a function of the shape only (never of ``M``), which
    is what makes the product batch-invariant. On the GPU one tile for every shape (16 weight
    rows x 256 columns, 4 warps, 4 stages) until ``benchmark/kernels/tune_small_m_gemm.py`` has
    swept them on the H200; under the CPU interpreter the largest tiles (its cost is per
    program and per op)."""
    if INTERPRETED:
        return LaunchConfig(min(triton.next_power_of_2(n), 128),
                            min(triton.next_power_of_2(k), 256))
    return LaunchConfig(16, 256, 4, 4)


def small_m_gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None, config: Optional[LaunchConfig] = None,
                 out_dtype: Optional[torch.dtype] = None,
                 w_scale: Optional[torch.Tensor] = None,
                 w_scale_rows: Optional[torch.Tensor] = None,
                 gated_norm: Optional[GatedNormPrologue] = None) -> torch.Tensor:
    """``x [M, K] @ w [N, K].T (+ bias [N])`` -> ``[M, N]`` in ``out_dtype`` (default x's),
    batch-invariant.

    ``x`` and ``w`` have contiguous last dims (``w`` may be a row slice); ``x`` is converted to
    w's dtype as it is loaded (an fp32 router gate takes the bf16 hidden states as they are), and
    the fp32 accumulator is rounded once to ``out_dtype`` (fp32 router logits stay unrounded).
    A block-fp8 ``w`` (``float8_e4m3fn``) comes with its fp32 block scales ``w_scale``
    (:mod:`sgl_kernel.fp8_blocks`); each tile is dequantised to x's dtype as it is loaded. A
    weight of several pieces each on its own grid (KDA's fused q|k|v|b|f|g) passes
    ``w_scale_rows [N]``, the scale row of every weight row.
    ``gated_norm`` (:class:`GatedNormPrologue`) normalises x per head with its gate as the tiles
    are loaded (KDA's output norm feeding ``o_proj``: one launch for both).
    ``config`` overrides :func:`launch_config` (the tuning script's sweep)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"small_m_gemm: expected x [M, K] and w [N, K], got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    floats = (torch.float32, torch.float16, torch.bfloat16)
    fp8 = w.dtype == torch.float8_e4m3fn
    if x.dtype not in floats or (w.dtype not in floats and not fp8) or x.stride(1) != 1 \
            or w.stride(1) != 1:
        raise ValueError(f"small_m_gemm: x ({x.dtype}) and w ({w.dtype}) must be fp32 / fp16 / "
                         "bf16 (w also float8_e4m3fn) with contiguous last dims")
    if fp8 != (w_scale is not None):
        raise ValueError("small_m_gemm: a float8_e4m3fn weight needs its block scales (w_scale), "
                         "and only it takes one")
    if fp8 and w_scale_rows is None:
        check_block_scale(w, w_scale, name="small_m_gemm w")
    elif fp8 and (tuple(w_scale_rows.shape) != (w.shape[0],) or w_scale_rows.is_floating_point()):
        raise ValueError(f"small_m_gemm: w_scale_rows must be an integer [{w.shape[0]}] tensor")
    (m, k), n = x.shape, w.shape[0]
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"small_m_gemm: bias must be [{n}], got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.stride(1) != 1:
        raise ValueError(f"small_m_gemm: out must be [{m}, {n}] with a contiguous last dim")
    if m == 0 or n == 0:
        return out
    cfg = config or launch_config(n, k)
    norm_d, act, z, nw, eps = 0, 1, x, x, 0.0
    if gated_norm is not None:
        z, nw, eps, norm_d, act_name = gated_norm
        act = {"sigmoid": 1, "swish": 2, "silu": 2}.get(act_name, 0)
        if (act == 0 or tuple(z.shape) != (m, k) or z.stride(1) != 1 or k % norm_d
                or tuple(nw.shape) != (norm_d,) or norm_d & (norm_d - 1)):
            raise ValueError(f"small_m_gemm: gated_norm needs a gate like x ({m}, {k}), a "
                             f"power-of-two head width dividing K, a [head] weight and sigmoid / "
                             f"swish, got {tuple(z.shape)}, {norm_d}, {tuple(nw.shape)}, "
                             f"{act_name!r}")
        if cfg.block_k % norm_d:
            cfg = cfg._replace(block_k=max(cfg.block_k, norm_d) // norm_d * norm_d)
    opts = compiler_options(cfg.num_warps, cfg.num_stages)
    pdl_on = pdl.use_pdl(m)
    compute = x.dtype if fp8 else w.dtype
    _small_m_gemm_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, BLOCK_M))](
        x, w, bias if bias is not None else x, out, w_scale if fp8 else x,
        w_scale_rows if w_scale_rows is not None else x, z, nw, m, n, k, x.stride(0),
        w.stride(0), out.stride(0), w_scale.stride(0) if fp8 else 0, z.stride(0), float(eps),
        HAS_BIAS=bias is not None, HAS_SCALE=fp8, ROW_MAP=fp8 and w_scale_rows is not None,
        QB=QBLOCK, NORM_D=norm_d, GATE_ACT=act, USE_PDL=pdl_on, BLOCK_M=BLOCK_M,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if compute == torch.float32 else "tf32",  # tf32: the default,
        **opts, **pdl.launch_options(pdl_on))  # which 16-bit inputs ignore
    return out


def small_m_gemm_reference(x: torch.Tensor, w: torch.Tensor,
                           bias: Optional[torch.Tensor] = None,
                           out_dtype: Optional[torch.dtype] = None,
                           w_scale: Optional[torch.Tensor] = None,
                           w_scale_rows: Optional[torch.Tensor] = None,
                           gated_norm: Optional[GatedNormPrologue] = None) -> torch.Tensor:
    """Plain-torch :func:`small_m_gemm`: x in w's dtype (a block-fp8 w dequantised to x's dtype
    first), fp32 product (and bias), one rounding to ``out_dtype`` (default x's); with
    ``gated_norm`` x goes through the torch ``GatedRMSNorm`` first."""
    if gated_norm is not None:
        x = gated_norm_reference(x, gated_norm)
    if w_scale is not None and w_scale_rows is not None:
        cols = torch.arange(w.shape[1], device=w.device) // QBLOCK
        w = (w.float() * w_scale[w_scale_rows.long()][:, cols]).to(x.dtype)
    elif w_scale is not None:
        w = block_dequantize(w, w_scale, x.dtype)
    out = x.to(w.dtype).float() @ w.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype)


def gated_norm_reference(x: torch.Tensor, prologue: GatedNormPrologue) -> torch.Tensor:
    """``x [M, K]`` through the project's ``GatedRMSNorm`` math per ``head_dim`` head."""
    from sglang.srt.layers.layernorm import gated_rms_norm

    gate, weight, eps, d, act = prologue
    m, k = x.shape
    return gated_rms_norm(x.reshape(m, k // d, d), gate.reshape(m, k // d, d), weight, eps,
                          act).reshape(m, k)
