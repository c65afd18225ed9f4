"""Routed experts for a few tokens with Triton grouped mat-vecs (``--moe-runner-backend triton``).

Same math and roundings as :func:`~sglang.srt.layers.moe.fused_moe_native.fused_moe_gather` (the
reference): ``h13 = W13[e] x`` rounded to the model dtype, the (clamped) SwiGLU of
:func:`~sglang.srt.layers.activation.silu_and_mul` in fp32 (here in the up-projection's
epilogue), ``y = W2[e] act`` rounded, then the fp32 weighted combine. The difference is where
the weights are read: in place by :func:`sgl_kernel.grouped_gemv.grouped_gemv`, instead of
being gathered into a copy first. Device work only, no host sync, shapes fixed by ``T``: usable
inside the NEXTN round and CUDA graphs.

Above :data:`SMALL_M_MAX_PAIRS` (token, expert) pairs (prefill chunks) every pair re-reading its
expert no longer pays; the caller falls back to the native loop over active experts.
"""
from __future__ import annotations

import torch

from sglang.srt.layers.moe.fused_moe_native import check_moe_inputs, combine_expert_outputs

__all__ = ["fused_moe_small_m", "SMALL_M_MAX_PAIRS"]

# 128 tokens x top-8: decode and NEXTN verify batches; beyond, per-expert GEMMs win.
SMALL_M_MAX_PAIRS = 1024


def fused_moe_small_m(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      limit: float = 0.0) -> torch.Tensor:
    """``sum_i w_i * Expert_{id_i}(x)`` per token ``[T, H]`` via two grouped mat-vecs."""
    from sgl_kernel.grouped_gemv import grouped_gemv  # Triton: imported on first use

    check_moe_inputs(hidden, w13, w2, topk_ids, topk_weights)
    ids = topk_ids.reshape(-1)
    # Up-projection with SwiGLU in its epilogue -> [P, I]; then the down-projection [P, H].
    act = grouped_gemv(hidden.contiguous(), w13, ids, rows_per_x=topk_ids.shape[1],
                       swiglu_limit=limit)
    y = grouped_gemv(act, w2, ids)
    return combine_expert_outputs(y, topk_weights)
