"""Routed-expert compute in plain torch over stacked expert weights.

Layout (SGLang's FusedMoE): ``w13 [E, 2*I, H]`` = each expert's ``[gate; up]`` rows, and
``w2 [E, H, I]`` (down). Under TP, ``I`` is this rank's slice of the intermediate dim, so the
result is a partial sum that the caller all-reduces.

Three strategies with identical math:

* gather + bmm (few (token, expert) pairs, e.g. decode): copy the selected experts' weights and
  run batched mat-vecs — fixed shapes and no host sync, so it can be captured in a CUDA graph;
* a loop over the experts that received tokens (many pairs, e.g. prefill): each active expert's
  weights are read once for all its tokens; finding the active set costs one host sync and the
  loop launches a few kernels per active expert (most of 512 in a long prefill);
* grouped GEMMs (many pairs; ``KernelChoices(moe_grouped_mm=True)``, off by default, not yet
  measured on the GPU host): pairs sorted by expert, then ``torch._grouped_mm`` with
  device-side group offsets — two GEMM launches per layer, no host sync. Where torch's kernel
  does not take the inputs (on CUDA it wants bf16 on sm90+; everywhere rows of 16-byte
  multiples) the loop runs instead.
"""
from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.layers.activation import silu_and_mul

__all__ = ["check_moe_inputs", "combine_expert_outputs", "fused_moe", "fused_moe_gather",
           "fused_moe_grouped_mm", "fused_moe_loop", "grouped_mm_supported", "GATHER_MAX_PAIRS"]

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
                     limit: float = 0.0,
                     shared: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gather the selected experts' weights per pair and bmm; returns ``[T, H]`` in hidden's dtype."""
    check_moe_inputs(hidden, w13, w2, topk_ids, topk_weights)
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)
    x = hidden.repeat_interleave(k, dim=0).unsqueeze(-1)  # [P, H, 1]
    h13 = torch.bmm(w13[ids], x).squeeze(-1)  # [P, 2I]
    act = silu_and_mul(h13, limit).unsqueeze(-1)  # [P, I, 1]
    y = torch.bmm(w2[ids], act).squeeze(-1)  # [P, H]
    return combine_expert_outputs(y, topk_weights, shared)


def combine_expert_outputs(y: torch.Tensor, topk_weights: torch.Tensor,
                           shared: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y [T * k, H]`` (pair-major, in the model dtype) -> ``sum_i w_i * y_i (+ shared)`` per
    token ``[T, H]``: fp32 products summed slot by slot, then the shared expert's row
    ``shared [T, H]`` if given, one rounding to y's dtype (the order
    ``sgl_kernel.moe_combine`` sums in, so the two agree bit for bit)."""
    t, k = topk_weights.shape
    rows = y.float().view(t, k, -1)
    weights = topk_weights.float()
    acc = rows[:, 0] * weights[:, :1]
    for j in range(1, k):
        acc = acc + rows[:, j] * weights[:, j:j + 1]
    if shared is not None:
        acc = acc + shared.float()
    return acc.to(y.dtype)


def fused_moe_loop(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   limit: float = 0.0,
                   shared: Optional[torch.Tensor] = None) -> torch.Tensor:
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
    if shared is not None:
        out += shared.float()
    return out.to(hidden.dtype)


def grouped_mm_supported(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these MoE operands (see :func:`fused_moe_grouped_mm`)."""
    if not hasattr(torch, "_grouped_mm") or not hidden.dtype == w13.dtype == w2.dtype:
        return False
    if hidden.is_cuda:
        major, _ = torch.cuda.get_device_capability(hidden.device)
        if hidden.dtype != torch.bfloat16 or major < 9:
            return False
    elif hidden.dtype not in (torch.float32, torch.bfloat16):
        return False
    # Every operand's row (H, 2I and I elements) must span a multiple of 16 bytes.
    size = hidden.element_size()
    return all(d * size % 16 == 0 for d in (w13.shape[2], w13.shape[1], w2.shape[2]))


def fused_moe_grouped_mm(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         limit: float = 0.0,
                         shared: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pairs sorted by expert, two grouped GEMMs (``torch._grouped_mm``), no host sync; returns
    ``[T, H]`` in hidden's dtype. Needs :func:`grouped_mm_supported`."""
    check_moe_inputs(hidden, w13, w2, topk_ids, topk_weights)
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pair indices grouped by expert
    # Group g = rows [ends[g-1], ends[g]) of the sorted pairs; empty groups are allowed.
    ends = torch.bincount(flat_ids, minlength=w13.shape[0]).cumsum(0).to(torch.int32)
    x = hidden[order // k]  # [P, H], row i = the token of sorted pair i
    # The weights' [out, in] rows transposed as views: the column-major B the kernels want.
    h13 = torch._grouped_mm(x, w13.transpose(1, 2), offs=ends)  # [P, 2I]
    y_sorted = torch._grouped_mm(silu_and_mul(h13, limit), w2.transpose(1, 2), offs=ends)
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted  # back to pair-major (token, slot) order
    return combine_expert_outputs(y, topk_weights, shared)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, limit: float = 0.0,
              gather_max_pairs: Optional[int] = None, grouped_mm: bool = False,
              shared: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum_i w_i * Expert_{id_i}(x) (+ shared)`` per token, with SwiGLU clamped at ``limit``
    (0 = off); ``shared [T, H]`` (the shared expert's output) joins the fp32 sum before its one
    rounding.

    Up to ``gather_max_pairs`` (token, expert) pairs: gather + bmm; above: the grouped GEMMs when
    ``grouped_mm`` is set and torch's kernel takes the operands, else the loop over experts."""
    max_pairs = GATHER_MAX_PAIRS if gather_max_pairs is None else gather_max_pairs
    if topk_ids.numel() <= max_pairs:
        return fused_moe_gather(hidden, w13, w2, topk_weights, topk_ids, limit, shared)
    if grouped_mm and grouped_mm_supported(hidden, w13, w2):
        return fused_moe_grouped_mm(hidden, w13, w2, topk_weights, topk_ids, limit, shared)
    return fused_moe_loop(hidden, w13, w2, topk_weights, topk_ids, limit, shared)
