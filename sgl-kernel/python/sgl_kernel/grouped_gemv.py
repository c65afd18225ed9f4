"""Grouped mat-vec over stacked expert weights, read in place: the small-M MoE GEMMs.

``out[p] = W[ids[p]] @ x[p // rows_per_x]`` for every (token, expert) pair ``p``, with ``W
[E, N, K]`` (rows contiguous along K) and ``x [T, K]``. At decode and NEXTN-verify sizes (a few
tokens x top-k) the routed experts are pure weight streaming: each program reads one block of
``BLOCK_N`` rows of one pair's expert and dots it with that pair's activation row. Nothing is
copied (the torch-native gather path materialises every selected expert's weights first), no value
is read on the host, and the grid depends only on shapes, so the launch can be captured in a CUDA
graph.

Accumulation is fp32; the result is rounded once to ``out``'s dtype, like a library GEMM with an
fp32 accumulator. Reference: :func:`grouped_gemv_reference`.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel._triton_mode import INTERPRETED

__all__ = ["grouped_gemv", "grouped_gemv_reference"]


@triton.jit
def _grouped_gemv_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, N, K, rows_per_x,
                         stride_x, stride_we, stride_wn, stride_o, limit,
                         SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // rows_per_x).to(tl.int64) * stride_x
    w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask = mask_n[:, None] & mask_k[None, :]
        x = tl.load(x_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(w_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
        if SWIGLU:  # the up rows follow the N gate rows
            w_up = tl.load(w_rows + N * stride_wn + offs_k[None, :], mask=mask,
                           other=0.0).to(tl.float32)
            acc_up += tl.sum(w_up * x[None, :], axis=1)
    if SWIGLU:
        # As the unfused path: gate and up rounded to the output dtype, then SwiGLU in fp32.
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        act = gate * tl.sigmoid(gate)
        if HAS_LIMIT:
            act = tl.minimum(act, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        acc = act * up
    tl.store(out_ptr + pair.to(tl.int64) * stride_o + offs_n,
             acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def grouped_gemv(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, rows_per_x: int = 1,
                 out: Optional[torch.Tensor] = None, block_n: Optional[int] = None,
                 block_k: Optional[int] = None,
                 swiglu_limit: Optional[float] = None, num_warps: Optional[int] = None,
                 num_stages: Optional[int] = None) -> torch.Tensor:
    """``out [P, N]`` with ``out[p] = w[ids[p]] @ x[p // rows_per_x]``.

    With ``swiglu_limit`` (a float; 0 = no clamp) ``w``'s rows are ``[gate; up]`` (``2N``) and
    the output is ``silu(gate) * up`` per pair, each clamped at ``swiglu_limit`` as
    ``sglang.srt.layers.activation.silu_and_mul`` does: the MoE up-projection with its activation
    in the epilogue (no ``[P, 2N]`` intermediate).

    ``x [T, K]`` (last dim contiguous), ``w [E, N, K]`` (last dim contiguous; any expert
    stride, so a TP slice or a view works), ``ids [P]`` integer expert ids with
    ``P = T * rows_per_x`` (``rows_per_x = top_k`` feeds each token to its ``k`` experts).
    ``out`` defaults to a new ``[P, N]`` tensor in x's dtype. Blocks default to 32 rows x 128
    columns on the GPU; under Triton's CPU interpreter to one tile per pair (its cost is per
    program and per op, not per element), unless given; ``num_warps`` / ``num_stages`` default
    to Triton's (``benchmark/kernels/tune_grouped_gemv.py`` sweeps all four on the GPU). The
    blocks fix each output's summation order, so they must not depend on ``P``: a NEXTN verify
    row and the decode of the same token then round alike.
    """
    if x.dim() != 2 or w.dim() != 3 or ids.dim() != 1 or x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_gemv: expected x [T, K], w [E, N, K], ids [P]; got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(ids.shape)}")
    if rows_per_x < 1 or ids.shape[0] != x.shape[0] * rows_per_x:
        raise ValueError(f"grouped_gemv: ids must have T * rows_per_x = {x.shape[0]} * "
                         f"{rows_per_x} entries, got {ids.shape[0]}")
    if x.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError("grouped_gemv: the last dim of x and w must be contiguous")
    p, (_, n, k) = ids.shape[0], w.shape
    swiglu = swiglu_limit is not None
    if swiglu:
        if n % 2:
            raise ValueError(f"grouped_gemv: SwiGLU needs [gate; up] rows, got {n} rows")
        n //= 2
    if out is None:
        out = torch.empty(p, n, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (p, n) or out.stride(1) != 1:
        raise ValueError(f"grouped_gemv: out must be a [{p}, {n}] tensor with a contiguous last "
                         f"dim, got {tuple(out.shape)}")
    if p == 0 or n == 0:
        return out
    block_n = block_n or (triton.next_power_of_2(n) if INTERPRETED else 32)
    block_k = block_k or (min(triton.next_power_of_2(k), 1024) if INTERPRETED else 128)
    ids = ids.contiguous()  # the kernel indexes ids[p] densely
    grid = (p, triton.cdiv(n, block_n))
    limit = float(swiglu_limit or 0.0)
    _grouped_gemv_kernel[grid](x, w, ids, out, n, k, rows_per_x, x.stride(0), w.stride(0),
                               w.stride(1), out.stride(0), limit, SWIGLU=swiglu,
                               HAS_LIMIT=limit > 0, BLOCK_N=block_n, BLOCK_K=block_k,
                               **_launch_options(num_warps, num_stages))
    return out


def _launch_options(num_warps: Optional[int], num_stages: Optional[int]) -> dict:
    """The launch's compiler options that were given (the interpreter takes none)."""
    if INTERPRETED:
        return {}
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    return {key: val for key, val in opts.items() if val is not None}


def grouped_gemv_reference(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                           rows_per_x: int = 1,
                           swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """Plain-torch :func:`grouped_gemv` (fp32 products, one rounding to x's dtype; the project's
    ``silu_and_mul`` for the SwiGLU form)."""
    rows = x.float().repeat_interleave(rows_per_x, dim=0)  # [P, K]
    out = torch.einsum("pnk,pk->pn", w[ids.long()].float(), rows).to(x.dtype)
    if swiglu_limit is None:
        return out
    from sglang.srt.layers.activation import silu_and_mul

    return silu_and_mul(out, swiglu_limit)
