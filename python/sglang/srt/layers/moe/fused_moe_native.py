"""Routed-expert compute in plain torch over stacked expert weights.

Layout (SGLang's FusedMoE): ``w13 [E, 2*I, H]`` = each expert's ``[gate; up]`` rows, and
``w2 [E, H, I]`` (down). Under TP, ``I`` is this rank's slice of the intermediate dim, so the
result is a partial sum that the caller all-reduces.

Two strategies with identical math:

* gather + bmm (few (token, expert) pairs, e.g. decode): copy the selected experts' weights and
  run batched mat-vecs — fixed shapes and no host sync, so it can be captured in a CUDA graph;
* a loop over the experts that received tokens (many pairs, e.g. prefill): each active expert's
  weights are read once for all its tokens; finding the active set costs one host sync.
"""
from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.layers.activation import silu_and_mul

__all__ = ["check_moe_inputs", "combine_expert_outputs", "fused_moe", "fused_moe_gather",
           "fused_moe_loop", "GATHER_MAX_PAIRS"]

# Above this many (token, expert) pairs the gathered weight copies outweigh per-expert launches.
GATHER_MAX_PAIRS = 64


def check_moe_inputs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the shapes follow the layout of the module docstring."""
    e, two_i, h = w13.shape
    if hidden.dim() != 2 or hidden.shape[1] != h:
        raise ValueError(f"fused_moe: hidden must be [T, {h}], got {tuple(hidden.shape)}")
    if tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"fused_moe: w2 must be {(e, h, two_i // 2)}, got {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} / topk_weights "
                         f"{tuple(topk_weights.shape)} must be [T, k] with T={hidden.shape[0]}")


def fused_moe_gather(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     limit: float = 0.0) -> torch.Tensor:
    """Gather the selected experts' weights per pair and bmm; returns ``[T, H]`` in hidden's dtype."""
    check_moe_inputs(hidden, w13, w2, topk_ids, topk_weights)
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)
    x = hidden.repeat_interleave(k, dim=0).unsqueeze(-1)  # [P, H, 1]
    h13 = torch.bmm(w13[ids], x).squeeze(-1)  # [P, 2I]
    act = silu_and_mul(h13, limit).unsqueeze(-1)  # [P, I, 1]
    y = torch.bmm(w2[ids], act).squeeze(-1)  # [P, H]
    return combine_expert_outputs(y, topk_weights)


def combine_expert_outputs(y: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``y [T * k, H]`` (pair-major, in the model dtype) -> ``sum_i w_i * y_i`` per token
    ``[T, H]``: fp32 products and sum, one rounding to y's dtype."""
    t, k = topk_weights.shape
    weighted = y.float().view(t, k, -1) * topk_weights.float().unsqueeze(-1)
    return weighted.sum(1).to(y.dtype)


def fused_moe_loop(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   limit: float = 0.0) -> torch.Tensor:
    """Loop over the active experts only; returns ``[T, H]`` in hidden's dtype."""
    check_moe_inputs(hidden, w13, w2, topk_ids, topk_weights)
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # the one host sync
    token_of_pair = order // k
    weight_of_pair = topk_weights.reshape(-1).float()[order]
    out = torch.zeros(t, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of_pair[start:start + n]
        h13 = hidden[tok] @ w13[expert].t()  # [n, 2I]
        y = silu_and_mul(h13, limit) @ w2[expert].t()  # [n, H]
        out.index_add_(0, tok, y.float() * weight_of_pair[start:start + n, None])
        start += n
    return out.to(hidden.dtype)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, limit: float = 0.0,
              gather_max_pairs: Optional[int] = None) -> torch.Tensor:
    """``sum_i w_i * Expert_{id_i}(x)`` per token, with SwiGLU clamped at ``limit`` (0 = off)."""
    max_pairs = GATHER_MAX_PAIRS if gather_max_pairs is None else gather_max_pairs
    if topk_ids.numel() <= max_pairs:
        return fused_moe_gather(hidden, w13, w2, topk_weights, topk_ids, limit)
    return fused_moe_loop(hidden, w13, w2, topk_weights, topk_ids, limit)
