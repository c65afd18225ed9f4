"""Grouped mat-vec over stacked expert weights, read in place: the small-M MoE GEMMs.

``out[p] = W[ids[p]] @ x[p // rows_per_x]`` for every (token, expert) pair ``p``, with ``W
[E, N, K]`` (rows contiguous along K) and ``x [T, K]``. At decode and NEXTN-verify sizes (a few
tokens x top-k) the routed experts are pure weight streaming: each program reads one block of
``BLOCK_N`` rows of one pair's expert and dots it with that pair's activation row. Nothing is
copied (the torch-native gather path materialises every selected expert's weights first), no value
is read on the host, and the grid depends only on shapes, so the launch can be captured in a CUDA
graph.

The same launch can carry one more weight for every token (``extra_w``): the shared expert rides
with the routed ones.

Accumulation is fp32; the result is rounded once to ``out``'s dtype, like a library GEMM with an
fp32 accumulator. Reference: :func:`grouped_gemv_reference`.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel import pdl
from sgl_kernel.fp8_blocks import QBLOCK, block_dequantize, check_block_scale
from sgl_kernel._triton_mode import INTERPRETED, LaunchConfig, compiler_options, placeholder

__all__ = ["grouped_gemv", "grouped_gemv_reference", "launch_config", "LaunchConfig"]


@triton.jit
def _grouped_gemv_kernel(x_ptr, w_ptr, ids_ptr, ex_ptr, ew_ptr, out_ptr, ws_ptr, ews_ptr,
                         N, K, routed_pairs, rows_per_x, stride_x, stride_we, stride_wn,
                         stride_ex, stride_ewn, stride_o, stride_wse, stride_wsn, stride_ewsn,
                         up_scale_row, limit, extra_limit,
                         SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_SCALE: tl.constexpr,
                         QB: tl.constexpr, USE_PDL: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N  # BLOCK_N divides the scale block: one scale row
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    pdl.wait(USE_PDL)  # ids and x come from the kernels before
    pdl.launch_dependents(USE_PDL)
    if pair < routed_pairs:  # a routed pair: its expert's rows, its token's activation
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        x_row = x_ptr + (pair // rows_per_x).to(tl.int64) * stride_x
        w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        up_rows = N * stride_wn
        s_row = ws_ptr + expert * stride_wse + (n0 // QB) * stride_wsn
        s_up = up_scale_row * stride_wsn
        lim = limit
    else:  # an extra pair (shared expert / dense weight): extra row pair - routed_pairs
        x_row = ex_ptr + (pair - routed_pairs).to(tl.int64) * stride_ex
        w_rows = ew_ptr + offs_n.to(tl.int64)[:, None] * stride_ewn
        up_rows = N * stride_ewn
        s_row = ews_ptr + (n0 // QB) * stride_ewsn
        s_up = up_scale_row * stride_ewsn
        lim = extra_limit
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask = mask_n[:, None] & mask_k[None, :]
        x = tl.load(x_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        x_gate, x_up = x, x
        if HAS_SCALE:  # block fp8: the tile's rows share one scale row, so the block scales
            # multiply x (BLOCK_K products) and each weight element costs one conversion and
            # one multiply-add, as a 16-bit weight does.
            x_gate = x * tl.load(s_row + offs_k // QB, mask=mask_k, other=0.0)
            if SWIGLU:
                x_up = x * tl.load(s_row + s_up + offs_k // QB, mask=mask_k, other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(w * x_gate[None, :], axis=1)
        if SWIGLU:  # the up rows follow the N gate rows (their scales on their own grid)
            w_up = tl.load(w_rows + up_rows + offs_k[None, :], mask=mask, other=0.0)
            acc_up += tl.sum(w_up.to(tl.float32) * x_up[None, :], axis=1)
    if SWIGLU:
        # As the unfused path: gate and up rounded to the output dtype, then SwiGLU in fp32.
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        act = gate * tl.sigmoid(gate)
        if HAS_LIMIT:  # a limit of 0 means no clamp (the two pair groups may differ)
            clamp = lim > 0
            act = tl.where(clamp, tl.minimum(act, lim), act)
            up = tl.where(clamp, tl.minimum(tl.maximum(up, -lim), lim), up)
        acc = act * up
    tl.store(out_ptr + pair.to(tl.int64) * stride_o + offs_n,
             acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def launch_config(n: int, k: int, swiglu: bool, fp8: bool = False) -> LaunchConfig:
    """The launch config of an ``[n, k]`` weight (``n`` output rows; SwiGLU reads ``2n``).

    A function of the shape (and the weight's format) only, never of the number of pairs: the
    blocks fix each output's summation order, so a NEXTN verify row and the decode of the same
    token round alike. The up-projection (SwiGLU) streams each expert in narrow row blocks so
    that a few pairs still fill the GPU: a decode routes only a few pairs, and wide row blocks
    would give too few programs to keep every SM streaming weights. bf16 takes 4 rows x 1024
    columns (faster than 32 x 128 on Ling-3.0-flash's experts at 8 pairs), block fp8 16 x 512
    with 8 warps (the best of the cold-L2 sweep, ``benchmark/kernels/tune_grouped_gemv.py
    --fp8``, faster than 4 x 1024 there); timings in docs/performance.md, "The fp8 kernels,
    step by step" and "Decode-kernel fusion". The other shapes keep 32 x 128 (the fp8
    down-projection's sweep found nothing faster). Under
    Triton's CPU interpreter one tile per pair (its cost is per program and per op, not per
    element), at most 128 rows in block fp8.
    """
    if INTERPRETED:  # a block-fp8 tile stays within one scale block of rows
        return LaunchConfig(min(triton.next_power_of_2(n), QBLOCK) if fp8
                            else triton.next_power_of_2(n), min(triton.next_power_of_2(k), 1024))
    if swiglu and fp8:
        return LaunchConfig(16, min(triton.next_power_of_2(k), 512), 8, 3)
    if swiglu:
        return LaunchConfig(4, min(triton.next_power_of_2(k), 1024))
    return LaunchConfig(32, 128)


def grouped_gemv(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                 rows_per_x: int = 1, out: Optional[torch.Tensor] = None,
                 block_n: Optional[int] = None, block_k: Optional[int] = None,
                 swiglu_limit: Optional[float] = None, num_warps: Optional[int] = None,
                 num_stages: Optional[int] = None, extra_w: Optional[torch.Tensor] = None,
                 extra_limit: float = 0.0, extra_x: Optional[torch.Tensor] = None,
                 w_scale: Optional[torch.Tensor] = None,
                 extra_w_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out [P (+ T'), N]`` with ``out[p] = w[ids[p]] @ x[p // rows_per_x]`` for the ``P``
    routed pairs, then, with ``extra_w [N, K]``, ``out[P + t] = extra_w @ extra_x[t]`` for every
    row ``t`` of ``extra_x [T', K]`` (default ``x``).

    The extra pairs are the shared expert riding in the routed experts' launch (one launch for
    both).

    With ``swiglu_limit`` (a float; 0 = no clamp) the weights' rows are ``[gate; up]`` (``2N``)
    and the output is ``silu(gate) * up`` per pair, each clamped at ``swiglu_limit`` (at
    ``extra_limit`` for the extra pairs) as ``sglang.srt.layers.activation.silu_and_mul`` does:
    the MoE up-projection with its activation in the epilogue (no ``[P, 2N]`` intermediate).

    ``x [T, K]`` (last dim contiguous), ``w [E, N, K]`` (last dim contiguous; any expert
    stride, so a TP slice or a view works), ``ids [P]`` integer expert ids with
    ``P = T * rows_per_x`` (``rows_per_x = top_k`` feeds each token to its ``k`` experts).
    ``out`` defaults to a new tensor in x's dtype. Tiles come from :func:`launch_config` unless
    given (``benchmark/kernels/tune_grouped_gemv.py`` sweeps them on the GPU).

    Block-fp8 weights (``float8_e4m3fn``) come with their fp32 block scales ``w_scale [E, ..]``
    / ``extra_w_scale`` in the layout of :mod:`sgl_kernel.fp8_blocks` (SwiGLU: gate and up on
    their own grids). The product is in fp32 with the weight ``q * scale`` (never rounded to
    x's dtype): the scales multiply x, since a tile's rows (``block_n`` dividing 128) share
    one scale row.
    """
    if x.dim() != 2 or w.dim() != 3 or ids.dim() != 1 or x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_gemv: expected x [T, K], w [E, N, K], ids [P]; got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(ids.shape)}")
    _, n, k = w.shape
    if extra_w is not None and tuple(extra_w.shape) != (n, x.shape[1]):
        raise ValueError(f"grouped_gemv: extra_w must be [{n}, {x.shape[1]}], got "
                         f"{tuple(extra_w.shape)}")
    ex = x if extra_x is None else extra_x
    if ex.dim() != 2 or ex.shape[1] != x.shape[1] or ex.dtype != x.dtype or ex.stride(1) != 1:
        raise ValueError(f"grouped_gemv: extra_x must be [T', {x.shape[1]}] in {x.dtype} with a "
                         f"contiguous last dim, got {tuple(ex.shape)} {ex.dtype}")
    if extra_w is not None and w.dtype != extra_w.dtype:
        raise ValueError(f"grouped_gemv: w is {w.dtype} but extra_w is {extra_w.dtype}")
    routed = ids.shape[0]
    if rows_per_x < 1 or routed != x.shape[0] * rows_per_x:
        raise ValueError(f"grouped_gemv: ids must have T * rows_per_x = {x.shape[0]} * "
                         f"{rows_per_x} entries, got {routed}")
    if x.stride(1) != 1 or w.stride(2) != 1 or (extra_w is not None and extra_w.stride(1) != 1):
        raise ValueError("grouped_gemv: the last dim of x and the weights must be contiguous")
    swiglu = swiglu_limit is not None
    if swiglu:
        if n % 2:
            raise ValueError(f"grouped_gemv: SwiGLU needs [gate; up] rows, got {n} rows")
        n //= 2
    fp8 = w.dtype == torch.float8_e4m3fn
    if fp8 != (w_scale is not None) or (extra_w is not None and fp8 != (extra_w_scale is not None)):
        raise ValueError("grouped_gemv: float8_e4m3fn weights need their block scales (w_scale, "
                         "extra_w_scale), and only they take one")
    if fp8:
        split = n if swiglu else None
        check_block_scale(w, w_scale, split, "grouped_gemv w")
        if extra_w is not None:
            check_block_scale(extra_w, extra_w_scale, split, "grouped_gemv extra_w")
    p = routed + (ex.shape[0] if extra_w is not None else 0)
    if out is None:
        out = torch.empty(p, n, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (p, n) or out.stride(1) != 1:
        raise ValueError(f"grouped_gemv: out must be a [{p}, {n}] tensor with a contiguous last "
                         f"dim, got {tuple(out.shape)}")
    if p == 0 or n == 0:
        return out
    cfg = launch_config(n, k, swiglu, fp8)
    block_n, block_k = block_n or cfg.block_n, block_k or cfg.block_k
    if fp8 and (block_n > QBLOCK or QBLOCK % block_n):
        raise ValueError(f"grouped_gemv: a block-fp8 tile's rows must share a scale row "
                         f"(block_n dividing {QBLOCK}), got block_n={block_n}")
    opts = compiler_options(num_warps or cfg.num_warps, num_stages or cfg.num_stages)
    ew = extra_w if extra_w is not None else w  # placeholders when absent: never read
    ws = w_scale if fp8 else placeholder(x.device)
    ews = extra_w_scale if fp8 and extra_w is not None else ws
    limit = float(swiglu_limit or 0.0)
    pdl_on = pdl.use_pdl(p)
    _grouped_gemv_kernel[(p, triton.cdiv(n, block_n))](
        x, w, ids.contiguous(), ex, ew, out, ws, ews, n, k, routed, rows_per_x, x.stride(0),
        w.stride(0), w.stride(1), ex.stride(0), ew.stride(0), out.stride(0),
        ws.stride(0) if fp8 else 0, ws.stride(-2) if fp8 else 0, ews.stride(-2) if fp8 else 0,
        -(-n // QBLOCK), limit, float(extra_limit),
        SWIGLU=swiglu, HAS_LIMIT=limit > 0 or extra_limit > 0, HAS_SCALE=fp8, QB=QBLOCK,
        USE_PDL=pdl_on, BLOCK_N=block_n, BLOCK_K=block_k, **opts, **pdl.launch_options(pdl_on))
    return out


def _silu_and_mul(x: torch.Tensor, limit: float) -> torch.Tensor:
    """``x = [gate | up]`` -> ``silu(gate) * up`` in fp32, rounded to x's dtype; with
    ``limit > 0`` ``min(silu(gate), limit) * clamp(up, -limit, limit)`` (the kernel's epilogue,
    clamped in fp32 so that it compares exact values)."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d].float(), x[..., d:].float()
    act = torch.nn.functional.silu(gate)
    if limit > 0:
        act = act.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return (act * up).to(x.dtype)


def grouped_gemv_reference(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                           rows_per_x: int = 1,
                           swiglu_limit: Optional[float] = None,
                           extra_w: Optional[torch.Tensor] = None,
                           extra_limit: float = 0.0, extra_x: Optional[torch.Tensor] = None,
                           w_scale: Optional[torch.Tensor] = None,
                           extra_w_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain-torch :func:`grouped_gemv` (fp32 products, one rounding to x's dtype; the SwiGLU
    form through :func:`_silu_and_mul`; block-fp8 weights dequantised in fp32)."""
    split = w.shape[1] // 2 if swiglu_limit is not None else None

    def rows_times(weights: torch.Tensor, scale: Optional[torch.Tensor], rows: torch.Tensor,
                   limit: Optional[float]):
        if scale is not None:
            weights = block_dequantize(weights, scale, torch.float32, split)
        out = torch.einsum("pnk,pk->pn", weights.float(), rows.float()).to(x.dtype)
        return out if swiglu_limit is None else _silu_and_mul(out, limit)

    picked = ids.long()
    parts = [rows_times(w[picked], None if w_scale is None else w_scale[picked],
                        x.repeat_interleave(rows_per_x, dim=0), swiglu_limit)]
    if extra_w is not None:
        ex = x if extra_x is None else extra_x
        parts.append(rows_times(extra_w.expand(ex.shape[0], -1, -1),
                                None if extra_w_scale is None
                                else extra_w_scale.expand(ex.shape[0], -1, -1), ex, extra_limit))
    return torch.cat(parts)
