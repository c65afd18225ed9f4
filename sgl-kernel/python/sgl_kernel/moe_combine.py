"""The MoE combine in one pass: ``out[t] = sum_j w[t, j] * y[t*k + j] (+ shared[t])``, one rounding.

The routed experts' outputs ``y [T*k, H]`` (pair-major, model dtype), their router weights ``w
[T, k]`` and optionally the shared expert's output ``shared [T, H]`` become the block's output in
one kernel: fp32 products and sums in a fixed order (slot 0, 1, ..., k-1, then the shared row) and
a single rounding to the output dtype. The torch form (cast, multiply, sum, add, cast) is four or
five launches and, with the shared expert added afterwards in the model dtype, two roundings.
No mul+add contraction (``NO_FP_FUSION``), so the result equals :func:`moe_combine_reference`
bit for bit.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel import pdl
from sgl_kernel._triton_mode import INTERPRETED, NO_FP_FUSION

__all__ = ["moe_combine", "moe_combine_reference"]


@triton.jit
def _moe_combine_kernel(y_ptr, w_ptr, s_ptr, out_ptr, H, stride_y, stride_w, stride_s, stride_o,
                        TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, USE_PDL: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    pdl.wait(USE_PDL)
    pdl.launch_dependents(USE_PDL)
    y_rows = y_ptr + t * TOPK * stride_y + offs
    acc = tl.load(y_rows, mask=mask, other=0.0).to(tl.float32) * tl.load(
        w_ptr + t * stride_w).to(tl.float32)
    for j in tl.static_range(1, TOPK):
        wj = tl.load(w_ptr + t * stride_w + j).to(tl.float32)
        yj = tl.load(y_rows + j * stride_y, mask=mask, other=0.0)
        acc += yj.to(tl.float32) * wj
    if HAS_SHARED:
        acc += tl.load(s_ptr + t * stride_s + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_combine(y: torch.Tensor, topk_weights: torch.Tensor,
                shared: Optional[torch.Tensor] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[T, H]`` in y's dtype: the weighted sum of each token's ``k`` expert rows of ``y``
    (``y [T*k, H]``, pair-major; extra rows after the first ``T*k`` are ignored, so the shared
    pairs of a joint launch may follow), plus ``shared [T, H]`` when given."""
    t, k = topk_weights.shape
    if y.dim() != 2 or y.shape[0] < t * k or y.stride(1) != 1:
        raise ValueError(f"moe_combine: y must be [>= {t * k}, H] with a contiguous last dim, "
                         f"got {tuple(y.shape)}")
    h = y.shape[1]
    if shared is not None and (tuple(shared.shape) != (t, h) or shared.stride(1) != 1):
        raise ValueError(f"moe_combine: shared must be [{t}, {h}] with a contiguous last dim, "
                         f"got {tuple(shared.shape)}")
    if out is None:
        out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    if t == 0 or h == 0:
        return out
    block_h = triton.next_power_of_2(h) if INTERPRETED else 1024
    w = topk_weights if topk_weights.stride(1) == 1 else topk_weights.contiguous()
    pdl_on = pdl.use_pdl(t)
    s = shared if shared is not None else y
    _moe_combine_kernel[(t, triton.cdiv(h, block_h))](
        y, w, s, out, h, y.stride(0), w.stride(0), s.stride(0), out.stride(0), TOPK=k,
        HAS_SHARED=shared is not None, USE_PDL=pdl_on, BLOCK_H=block_h, **NO_FP_FUSION,
        **pdl.launch_options(pdl_on))
    return out


def moe_combine_reference(y: torch.Tensor, topk_weights: torch.Tensor,
                          shared: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain-torch :func:`moe_combine` from the module docstring's formula, summed in the
    kernel's order: fp32 products of slots 0, 1, ..., k-1, then the shared row, one rounding to
    y's dtype (the torch-native MoE's ``combine_expert_outputs`` sums alike)."""
    t, k = topk_weights.shape
    rows = y[:t * k].float().view(t, k, -1)
    weights = topk_weights.float()
    acc = rows[:, 0] * weights[:, :1]
    for j in range(1, k):
        acc = acc + rows[:, j] * weights[:, j:j + 1]
    if shared is not None:
        acc = acc + shared.float()
    return acc.to(y.dtype)
