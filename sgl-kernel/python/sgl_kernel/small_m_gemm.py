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
one rounding to x's dtype. A weight of few row blocks splits K over more programs (the
config's ``split_k``, fixed by the shape): each range's fp32 partial goes to a workspace and the
last range of a tile to finish adds them all in range order, so the split keeps both
properties in one launch. Reference:
:func:`small_m_gemm_reference`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import triton
import triton.language as tl

from sgl_kernel import pdl
from sgl_kernel.fp8_blocks import QBLOCK, block_dequantize, check_block_scale
from sgl_kernel._triton_mode import (INTERPRETED, LaunchConfig, arrival_counts,
                                     compiler_options, sm_count)

__all__ = ["small_m_gemm", "small_m_gemm_reference", "gated_norm_reference", "launch_config",
           "tile_config", "split_target_programs", "SMALL_M_MAX_ROWS", "BLOCK_M",
           "GatedNormPrologue"]

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
def _load_x(x_rows, z_rows, nw_ptr, offs_k, mask_m, K, eps, NORM_D: tl.constexpr,
            GATE_ACT: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """The activation tile ``[BLOCK_M, WIDTH]`` of columns ``offs_k``; with the gated RMSNorm
    prologue normalised per NORM_D-wide head of the tile, as GatedRMSNorm, in x's dtype."""
    mask_k = offs_k < K
    x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    if NORM_D > 0:
        x3 = tl.reshape(x.to(tl.float32), (BLOCK_M, WIDTH // NORM_D, NORM_D))
        r = tl.rsqrt(tl.sum(x3 * x3, axis=2) / NORM_D + eps)
        y = tl.reshape(x3 * r[:, :, None], (BLOCK_M, WIDTH))
        z = tl.load(z_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32)
        act = tl.sigmoid(z) if GATE_ACT == 1 else z * tl.sigmoid(z)
        nw = tl.load(nw_ptr + offs_k % NORM_D, mask=mask_k, other=0.0).to(tl.float32)
        x = (y * nw[None, :] * act).to(x_rows.dtype.element_ty)
    return x


@triton.jit
def _small_m_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, s_ptr, srow_ptr, z_ptr, nw_ptr,
                         part_ptr, count_ptr, M, N, K,
                         k_per_split, stride_xm, stride_wn, stride_om, stride_sn, stride_zm,
                         stride_ps, eps,
                         HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, ROW_MAP: tl.constexpr,
                         QB: tl.constexpr, NORM_D: tl.constexpr, GATE_ACT: tl.constexpr,
                         USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                         LINE: tl.constexpr,
                         SPLIT: tl.constexpr, SWAP_AB: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    # Axis 0 walks the weight's row blocks (many programs), axis 1 the 16-row tiles of x, axis 2
    # the K ranges of a split (each writes its fp32 partial; the tile's last one adds them).
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n, mask_m = offs_n < N, offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    z_rows = z_ptr + offs_m.to(tl.int64)[:, None] * stride_zm
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if PREFETCH_LINES > 0:  # the first steps' weight lines (LINE elements each) toward L2
        # while the kernel before finishes (sgl_kernel.pdl): the weights are no kernel's output
        offs_l = k_lo + tl.arange(0, PREFETCH_LINES) * LINE
        pdl.prefetch_l2(w_rows + offs_l[None, :], mask_n[:, None] & (offs_l < k_hi)[None, :])
    pdl.wait(USE_PDL)  # x comes from the kernel before
    pdl.launch_dependents(USE_PDL)
    if ROW_MAP:  # a weight of several pieces, each on its own block grid
        s_rows = s_ptr + tl.load(srow_ptr + offs_n, mask=mask_n, other=0).to(tl.int64) * stride_sn
    else:
        s_rows = s_ptr + (offs_n // QB).to(tl.int64) * stride_sn
    # SWAP_AB: the weight tile is the dot's first operand and the accumulator [BLOCK_N,
    # BLOCK_M] (the weight rows on the tensor-core M axis, the few x rows on N).
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if HAS_SCALE:  # block fp8: raw e4m3 values, exact in x's dtype, through the tensor
            # cores; each scale block's fp32 sum times its scales, added block after block. A
            # step of BLOCK_K // QB blocks adds them in the same order as one block a step does
            # (bit for bit the same sums), but puts that many weight tiles of one step in flight.
            for j in tl.static_range(BLOCK_K // QB):
                offs_k = k0 + j * QB + tl.arange(0, QB)
                x = _load_x(x_rows, z_rows, nw_ptr, offs_k, mask_m, k_hi, eps, NORM_D, GATE_ACT,
                            BLOCK_M, QB)
                w = tl.load(w_rows + offs_k[None, :],
                            mask=mask_n[:, None] & (offs_k < k_hi)[None, :], other=0.0)
                w = w.to(x.dtype)
                scale = tl.load(s_rows + k0 // QB + j, mask=mask_n & (k0 + j * QB < k_hi),
                                other=0.0)
                if SWAP_AB:
                    acc += tl.dot(w, tl.trans(x), input_precision=DOT_PRECISION) * scale[:, None]
                else:
                    acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION) * scale[None, :]
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = _load_x(x_rows, z_rows, nw_ptr, offs_k, mask_m, k_hi, eps, NORM_D, GATE_ACT,
                        BLOCK_M, BLOCK_K)
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k < k_hi)[None, :],
                        other=0.0)
            x = x.to(w.dtype)  # e.g. bf16 activations into an fp32 router gate: no cast launch
            if SWAP_AB:
                acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if SWAP_AB:
        offs_o = offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
        offs_p = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
        mask_o = mask_n[:, None] & mask_m[None, :]
    else:
        offs_o = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        offs_p = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        mask_o = mask_m[:, None] & mask_n[None, :]
    last = True
    if SPLIT > 1:
        # Each range's fp32 partial goes to the workspace [SPLIT, M, N]; the tile's last range
        # to finish (counted by an atomic that orders the stores before it) adds all of them in
        # range order, so the sum is fixed whichever finishes last: deterministic and
        # batch-invariant, without a second launch. It resets the tile's count for the next.
        tl.store(part_ptr + tl.program_id(2) * stride_ps + offs_p, acc, mask=mask_o)
        tl.debug_barrier()  # every thread's partial stored before the count is raised
        count = count_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        last = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        if last:
            acc = tl.load(part_ptr + offs_p, mask=mask_o, other=0.0, cache_modifier=".cg")
            for r in tl.static_range(1, SPLIT):
                acc += tl.load(part_ptr + r * stride_ps + offs_p, mask=mask_o, other=0.0,
                               cache_modifier=".cg")
            tl.atomic_xchg(count, 0)
    if last:
        if HAS_BIAS:
            bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            if SWAP_AB:
                acc += bias[:, None]
            else:
                acc += bias[None, :]
        tl.store(out_ptr + offs_o, acc.to(out_ptr.dtype.element_ty), mask=mask_o)


# Arrival counts of a K split (one per output tile; _triton_mode.arrival_counts): the first
# buffer's 4096 counts hold every split grid of GPUs up to 256 SMs, since launch_config splits
# only a weight of fewer row blocks than split_target_programs (about four per SM) and
# SMALL_M_MAX_ROWS rows make at most four row tiles.


def launch_config(n: int, k: int, weight_dtype: torch.dtype = torch.bfloat16,
                  device: Union[torch.device, str, None] = None) -> LaunchConfig:
    """The tiles of an ``[n, k]`` weight: a function of the shape, the weight's dtype and the
    device's SM count only, never of ``M``, which is what makes the product batch-invariant.

    On the GPU: 16 weight rows x 256 columns for 16-bit weights, 128 columns for fp32 ones (the
    router gate: the same bytes per tile), 4 warps, 4 stages; block fp8 reads one scale block
    (128 columns) per step in 32-row tiles. A weight of few row blocks splits K
    (:func:`_split_for`) so that the GPU's SMs (:func:`sm_count` of ``device``, the current
    CUDA device when ``None``) each stream several programs: a decode-sized product is bound by
    the weight bytes in flight, and a weight of few row blocks in unsplit tiles leaves most SMs
    idle. The fp8 tile is one that a cold-L2 sweep on the GPU host
    (``benchmark/kernels/tune_small_m_gemm.py --fp8``) could not beat on KDA's fused
    projection, the attention output and MLA's q projection, and splitting K is what made the
    attention output (few row blocks) fast (docs/performance.md, "Kernel design measurements
    (moved from code comments)"). The splits of 16-bit and fp32 weights follow the same rule
    without a sweep of their own: re-run the sweep before changing a tile or the rule. Under the
    CPU interpreter the largest tiles (its cost is per program and per op)."""
    fp8 = weight_dtype == torch.float8_e4m3fn
    if INTERPRETED:
        return LaunchConfig(min(triton.next_power_of_2(n), 128),
                            QBLOCK if fp8 else min(triton.next_power_of_2(k), 256))
    if fp8:
        block_n, block_k = 32, QBLOCK
    else:
        block_n, block_k = 16, 128 if weight_dtype == torch.float32 else 256
    return tile_config(n, k, block_n, block_k, device=device)


def tile_config(n: int, k: int, block_n: int, block_k: int, num_stages: int = 4,
                device: Union[torch.device, str, None] = None) -> LaunchConfig:
    """The launch of an ``[n, k]`` weight in ``block_n x block_k`` tiles (4 warps): the K split
    of :func:`_split_for` on ``device``'s SMs. :func:`launch_config`'s tiles go through it, and
    so does a swept tile tried in the model (``benchmark/batch1/graph_ab.py``)."""
    programs = split_target_programs(sm_count(device))
    return LaunchConfig(block_n, block_k, 4, num_stages,
                        _split_for(n, k, block_n, block_k, programs))


def split_target_programs(sms: int) -> int:
    """Programs a split grid aims at on ``sms`` SMs: about four per SM, so that each SM has
    several weight tiles in flight, rounded down to a power of two. On the GPU host that gives
    the fixed target the splits were tuned at (docs/performance.md, "Kernel design measurements
    (moved from code comments)"), so the rule keeps the tuned splits there and follows the SM
    count elsewhere."""
    return 1 << ((4 * max(sms, 1)).bit_length() - 1)


def _split_for(n: int, k: int, block_n: int, block_k: int, programs: int) -> int:
    """K ranges for an ``[n, k]`` weight in these tiles: doubled while the grid has fewer than
    ``programs`` programs (:func:`split_target_programs`), up to 8, each range keeping at least
    two tiles."""
    row_blocks, tiles, split = triton.cdiv(n, block_n), triton.cdiv(k, block_k), 1
    while row_blocks * split < programs and split < 8 and tiles >= 4 * split:
        split *= 2
    return split


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
    (:mod:`sgl_kernel.fp8_blocks`): each 128-column block's fp32 sum is scaled. A
    weight of several pieces each on its own grid (KDA's fused q|k|v|b|f|g) passes
    ``w_scale_rows [N]``, the scale row of every weight row.
    ``gated_norm`` (:class:`GatedNormPrologue`) normalises x per head with its gate as the tiles
    are loaded (KDA's output norm feeding ``o_proj``: one launch for both).
    ``config`` overrides :func:`launch_config` (the tuning script's sweep); for a block-fp8
    weight its ``block_k`` is rounded down to whole 128-column scale blocks (at least one), each
    block's sum scaled and added in order, so the step width changes no bit of the result."""
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
    cfg = config or launch_config(n, k, w.dtype, x.device)
    if fp8 and (cfg.block_k < QBLOCK or cfg.block_k % QBLOCK):  # whole scale blocks a step
        cfg = cfg._replace(block_k=max(QBLOCK, cfg.block_k // QBLOCK * QBLOCK))
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
        if (QBLOCK if fp8 else cfg.block_k) % norm_d:  # fp8 normalises one block at a time
            if fp8:
                raise ValueError(f"small_m_gemm: a block-fp8 weight's gated_norm heads must "
                                 f"divide {QBLOCK}, got {norm_d}")
            cfg = cfg._replace(block_k=max(cfg.block_k, norm_d) // norm_d * norm_d)
    opts = compiler_options(cfg.num_warps, cfg.num_stages)
    pdl_on = pdl.use_pdl(m)
    # Prefetch as many steps as the pipeline keeps in flight (a power of two), or none; a
    # line is 128 bytes.
    line = 128 // w.element_size()
    steps = 1 << ((cfg.num_stages or 1).bit_length() - 1)
    prefetch = triton.next_power_of_2(max(1, steps * cfg.block_k // line)) \
        if pdl.weight_prefetch(m) else 0
    compute = x.dtype if fp8 else w.dtype
    # K ranges of whole tiles; a split's fp32 partials go to a workspace first.
    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), split) * cfg.block_k
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, BLOCK_M), split)
    part, counts = x, x
    if split > 1:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        counts = arrival_counts("small_m_gemm", x.device, grid[0] * grid[1])
    _small_m_gemm_kernel[grid](
        x, w, bias if bias is not None else x, out, w_scale if fp8 else x,
        w_scale_rows if w_scale_rows is not None else x, z, nw, part, counts, m, n, k,
        k_per_split, x.stride(0), w.stride(0), out.stride(0), w_scale.stride(0) if fp8 else 0,
        z.stride(0), m * n, float(eps),
        HAS_BIAS=bias is not None, HAS_SCALE=fp8, ROW_MAP=fp8 and w_scale_rows is not None,
        QB=QBLOCK, NORM_D=norm_d, GATE_ACT=act, USE_PDL=pdl_on,
        PREFETCH_LINES=prefetch, LINE=line, SPLIT=split,
        SWAP_AB=cfg.swap_ab, BLOCK_M=BLOCK_M,
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
    """Plain-torch :func:`small_m_gemm`: x in w's dtype (a block-fp8 w dequantised in fp32),
    fp32 product and bias, one rounding to
    ``out_dtype`` (default x's); with
    ``gated_norm`` x goes through :func:`gated_norm_reference` first."""
    if gated_norm is not None:
        x = gated_norm_reference(x, gated_norm)
    if w_scale is not None:
        w = block_dequantize(w, w_scale, torch.float32, rows=w_scale_rows)
    out = (x.float() if w_scale is not None else x.to(w.dtype).float()) @ w.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype)


def gated_norm_reference(x: torch.Tensor, prologue: GatedNormPrologue) -> torch.Tensor:
    """Plain-torch gated RMSNorm of ``x [M, K]`` per ``head_dim``-wide head, from
    :class:`GatedNormPrologue`'s formula: ``x * rsqrt(mean(x^2) + eps) * weight * act(gate)``
    in fp32 (``act`` sigmoid, or ``g * sigmoid(g)`` for swish / silu), rounded to x's dtype."""
    gate, weight, eps, d, act = prologue
    m, k = x.shape
    xf = x.float().reshape(m, k // d, d)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    gf = gate.float().reshape(m, k // d, d)
    gated = torch.sigmoid(gf) if act == "sigmoid" else gf * torch.sigmoid(gf)
    return (y * weight.float() * gated).to(x.dtype).reshape(m, k)
