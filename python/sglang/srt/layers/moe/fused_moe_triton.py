"""Routed (and shared) experts for a few tokens with Triton grouped mat-vecs
(``--moe-runner-backend triton``).

Same math and roundings as :func:`~sglang.srt.layers.moe.fused_moe_native.fused_moe_gather` (the
reference): ``h13 = W13[e] x`` rounded to the model dtype, the (clamped) SwiGLU of
:func:`~sglang.srt.layers.activation.silu_and_mul` in fp32 (here in the up-projection's
epilogue), ``y = W2[e] act`` rounded, then the fp32 weighted combine with the shared expert's row,
rounded once. The difference is where the weights are read: in place by
:func:`sgl_kernel.grouped_gemv.grouped_gemv`, instead of being gathered into a copy first, with
the shared expert as one more pair per token of the same two launches when its weights have the
routed experts' shape. Three launches for the whole block (up, down, combine); device work only,
no host sync, shapes fixed by ``T``: usable inside the NEXTN round and CUDA graphs.

Above :data:`SMALL_M_MAX_PAIRS` (token, expert) pairs (prefill chunks) every pair re-reading its
expert no longer pays; the caller falls back to the native loop over active experts.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from sglang.srt.layers.moe.fused_moe_native import check_moe_inputs, combine_expert_outputs

__all__ = ["fused_moe_small_m", "SharedExpertWeights", "SMALL_M_MAX_PAIRS"]

# 128 tokens x top-8: decode and NEXTN verify batches; beyond, per-expert GEMMs win.
SMALL_M_MAX_PAIRS = 1024


class SharedExpertWeights(NamedTuple):
    """The shared expert as extra pairs: ``w13 [2I, H]`` (gate rows then up rows, the routed
    experts' layout), ``w2 [H, I]``, its SwiGLU clamp (0 = none) and, for block-fp8 weights,
    their block scales."""

    w13: torch.Tensor
    w2: torch.Tensor
    limit: float
    w13_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None


def fused_moe_small_m(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, limit: float = 0.0,
                      shared_weights: Optional[SharedExpertWeights] = None,
                      shared: Optional[torch.Tensor] = None,
                      combine_kernel: bool = True, w13_scale: Optional[torch.Tensor] = None,
                      w2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum_i w_i * Expert_{id_i}(x) + Shared(x)`` per token ``[T, H]``.

    The shared expert either runs inside the two grouped mat-vecs (``shared_weights``) or was
    computed by the caller (``shared [T, H]``, added in the combine); with neither, routed only.
    ``combine_kernel`` picks the one-launch combine; else its torch reference (same result).
    Block-fp8 experts pass their scales (``w13_scale``, ``w2_scale``; ``sgl_kernel.fp8_blocks``).
    """
    from sgl_kernel.grouped_gemv import grouped_gemv  # Triton: imported on first use
    from sgl_kernel.moe_combine import moe_combine

    check_moe_inputs(hidden, w13, w2, topk_ids, topk_weights)
    t, k = topk_ids.shape
    ids = topk_ids.reshape(-1)
    x = hidden.contiguous()
    sw = shared_weights if shared_weights is not None else SharedExpertWeights(None, None, 0.0)
    # Up-projection with SwiGLU in its epilogue -> [T*k (+ T), I]; then the down-projection.
    act = grouped_gemv(x, w13, ids, rows_per_x=k, swiglu_limit=limit, extra_w=sw.w13,
                       extra_limit=sw.limit, w_scale=w13_scale, extra_w_scale=sw.w13_scale)
    y = grouped_gemv(act[:t * k], w2, ids, extra_w=sw.w2, extra_x=act[t * k:],
                     w_scale=w2_scale, extra_w_scale=sw.w2_scale)
    if shared_weights is not None:
        shared = y[t * k:]
    if combine_kernel:
        return moe_combine(y, topk_weights, shared)
    return combine_expert_outputs(y[:t * k], topk_weights, shared)
