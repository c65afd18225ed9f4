"""Acceptance of a DSpark block whose verify length varies per request.

Layout (one row per request; ``g`` = gamma draft tokens, the verify window is ``g + 1``)::

    window index     0        1       2      ...   g
    token            anchor   d_1     d_2    ...   d_g
    target row       p[0]     p[1]    p[2]   ...   p[g]     p[i]: the token after index i
    draft row        q[0]     q[1]    ...    q[g-1]          q[i]: what d_{i+1} was drawn from

``q`` is the Markov-corrected draft distribution under the request's sampling transform (one-hot
for a greedy draft), ``p`` the target's after the same transform. The scheduler gives each
request a verify length ``l`` in ``0 .. g``: the target judges ``d_1 .. d_l`` only.

Rule (exact speculative sampling, capped at ``l``): for ``k = 1 .. l`` accept ``d_k`` with
probability ``min(1, p[k-1](d_k) / q[k-1](d_k))``; at the first rejection emit a token from
``norm(max(0, p[k-1] - q[k-1]))`` (``p[k-1]`` itself when rounding leaves no residual mass). If
all ``l`` are accepted, the token at index ``l`` is drawn from ``p[l]``: for ``l = g`` as the
usual bonus, for ``l < g`` by one more rejection step on ``d_{l+1}`` (commit ``d_{l+1}`` when
its coin passes, the residual draw otherwise) — that step's output is distributed exactly as
``p[l]``, and it lets a capped verdict be the uncapped chain verdict cut at ``l``
(:func:`cap_chain_result`), so the chain code of :mod:`~sglang.srt.rounds.chain` does all the sampling.
Committed tokens: ``num_accepted + 1`` (drafts, then the final token); the final token is the
next round's anchor. Greedy rows reduce to "accept while ``d_k`` equals the target's argmax, then
append the argmax".

Which lengths keep the output exact: ``l`` may depend on ``d_1 .. d_{l+1}`` (and on anything
computed from them, such as the confidences) but not on later drafts. Sketch: the committed
tokens are the uncapped chain's outputs at indices ``0 .. l``; if ``d_{l+1}`` was accepted it
*is* the output at ``l``, and if it was rejected the uncapped chain ends at ``l`` too, so in
both cases it carries no information about the tokens that follow, which the next round draws
afresh. ``d_{l+2}`` does shape the uncapped output at ``l + 1`` that the cap throws away. The
planner's early stop and lagged capacity decide ``l`` from ``a_{r,j}`` with ``j <= l + 1``
only (``a_{r,l+1}`` involves ``d_l``), which is inside that bound.

Uniforms ``[B, g + 1]``: column ``k < g`` is the coin of ``d_{k+1}``, column ``g`` draws the final
token. Fixed shapes and device ops only (no host reads), so a worker can capture it in a CUDA
graph. Verify lengths are clamped into ``0 .. g`` (values cannot be checked without a host read);
target rows past ``l`` are never used for the result, so a compact verify may leave them as
zeros.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from sglang.srt.rounds.chain import (
    ChainVerifyResult,
    greedy_verify_chain,
    rejection_sample_chain,
    sample_from_probs,
)

__all__ = [
    "DSparkVerifyResult",
    "cap_chain_result",
    "greedy_verify_block",
    "rejection_verify_block",
    "verify_block",
    "reference_verify_block",
]


class DSparkVerifyResult(NamedTuple):
    """Outcome of verifying a batch of blocks (int64 device tensors)."""

    accept_len: torch.Tensor  # [B] in 1 .. l_b + 1: tokens committed (num_accepted + 1)
    accepted_tokens: torch.Tensor  # [B, g + 1]: d_1 .. d_a, the final token, then pad
    next_seed: torch.Tensor  # [B]: the final (bonus / residual) token = the next anchor
    num_accepted: torch.Tensor  # [B] in 0 .. l_b: accepted drafts


def _check_block(draft_tokens: torch.Tensor, verify_lens: torch.Tensor) -> None:
    if draft_tokens.dim() != 2 or draft_tokens.is_floating_point():
        raise ValueError(f"draft_tokens must be an integer [B, gamma] tensor, got "
                         f"{draft_tokens.dtype} {tuple(draft_tokens.shape)}")
    b = draft_tokens.shape[0]
    if verify_lens.dim() != 1 or verify_lens.shape[0] != b or verify_lens.is_floating_point():
        raise ValueError(f"verify_lens must be an integer [B={b}] tensor, got "
                         f"{verify_lens.dtype} {tuple(verify_lens.shape)}")


def _chain(draft_tokens: torch.Tensor) -> torch.Tensor:
    """``[B, g]`` drafts -> the ``[B, g + 1]`` chain layout of rounds.chain (index 0 = anchor,
    which acceptance never reads, so a zero column stands in for it)."""
    drafts = draft_tokens.to(torch.int64)
    return torch.cat([torch.zeros_like(drafts[:, :1]), drafts], dim=1)


def cap_chain_result(full: ChainVerifyResult, verify_lens: torch.Tensor,
                     pad_token_id: int = -1) -> DSparkVerifyResult:
    """Cut an uncapped verdict over the whole window (``N = g + 1`` columns) at ``verify_lens``.

    With ``a`` drafts accepted uncapped and ``a >= l``, column ``l`` of the uncapped tokens is
    the output of the rejection step at index ``l`` (``d_{l+1}`` if it passed, else the
    residual / bonus draw), i.e. a draw from ``p[l]``; with ``a < l`` nothing changes.
    """
    tokens = full.accepted_tokens
    n = tokens.shape[1]
    lens = verify_lens.to(device=tokens.device, dtype=torch.int64).clamp(0, n - 1)
    num_accepted = torch.minimum(full.accept_len.to(torch.int64) - 1, lens)
    accept_len = num_accepted + 1
    j = torch.arange(n, device=tokens.device).unsqueeze(0)
    capped = torch.where(j < accept_len.unsqueeze(1), tokens,
                         torch.full_like(tokens, pad_token_id))
    final = tokens.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return DSparkVerifyResult(accept_len, capped, final, num_accepted)


def greedy_verify_block(draft_tokens: torch.Tensor, target: torch.Tensor,
                        verify_lens: torch.Tensor, pad_token_id: int = -1) -> DSparkVerifyResult:
    """Greedy acceptance capped at ``verify_lens [B]``.

    ``draft_tokens [B, g]``; ``target``: the target's scores for the window (float
    ``[B, g + 1, V]`` or ``[B * (g + 1), V]``: logits or probabilities, only the argmax counts)
    or its argmax (integer ``[B, g + 1]`` or ``[B * (g + 1)]``).
    """
    _check_block(draft_tokens, verify_lens)
    full = greedy_verify_chain(_chain(draft_tokens), target, pad_token_id)
    return cap_chain_result(full, verify_lens, pad_token_id)


def rejection_verify_block(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                           target_probs: torch.Tensor, verify_lens: torch.Tensor,
                           uniforms: Optional[torch.Tensor] = None,
                           generator: Optional[torch.Generator] = None,
                           pad_token_id: int = -1) -> DSparkVerifyResult:
    """Exact speculative sampling capped at ``verify_lens [B]`` (module docstring).

    ``draft_tokens [B, g]``, ``draft_probs [B, g, V]``, ``target_probs [B, g + 1, V]``,
    ``uniforms [B, g + 1]`` in [0, 1) (drawn with ``generator`` when omitted).
    """
    _check_block(draft_tokens, verify_lens)
    full = rejection_sample_chain(_chain(draft_tokens), draft_probs, target_probs, uniforms,
                                  generator, pad_token_id)
    return cap_chain_result(full, verify_lens, pad_token_id)


def verify_block(draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
                 target_probs: torch.Tensor, verify_lens: torch.Tensor,
                 uniforms: Optional[torch.Tensor] = None,
                 greedy_mask: Optional[torch.Tensor] = None,
                 target_argmax: Optional[torch.Tensor] = None,
                 generator: Optional[torch.Generator] = None,
                 pad_token_id: int = -1) -> DSparkVerifyResult:
    """A mixed batch: greedy rows (``greedy_mask [B]`` bool) by argmax match, the others by
    rejection sampling. ``draft_probs=None`` means an all-greedy batch. The greedy argmax is
    ``target_argmax [B, g + 1]`` when given (e.g. of the penalised logits), otherwise the argmax
    of ``target_probs``."""
    greedy = greedy_verify_block(draft_tokens,
                                 target_probs if target_argmax is None else target_argmax,
                                 verify_lens, pad_token_id)
    if draft_probs is None:
        return greedy
    sampled = rejection_verify_block(draft_tokens, draft_probs, target_probs, verify_lens,
                                     uniforms, generator, pad_token_id)
    if greedy_mask is None:
        return sampled
    b = draft_tokens.shape[0]
    if tuple(greedy_mask.shape) != (b,) or greedy_mask.dtype != torch.bool:
        raise ValueError(f"greedy_mask must be a bool [B={b}] tensor, got {greedy_mask.dtype} "
                         f"{tuple(greedy_mask.shape)}")
    g = greedy_mask.to(draft_tokens.device)
    return DSparkVerifyResult(*(
        torch.where(g.view(-1, *([1] * (x.dim() - 1))), x, y) for x, y in zip(greedy, sampled)))


def reference_verify_block(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                           target_probs: torch.Tensor, verify_lens: torch.Tensor,
                           uniforms: torch.Tensor, pad_token_id: int = -1) -> DSparkVerifyResult:
    """Plain per-row, left-to-right form of :func:`rejection_verify_block` (the specification;
    same uniform columns, so it agrees token for token)."""
    b, g = draft_tokens.shape
    tokens = torch.full((b, g + 1), pad_token_id, dtype=torch.int64)
    accepted = torch.zeros(b, dtype=torch.int64)

    def draw(dist: torch.Tensor, u: torch.Tensor) -> int:
        return int(sample_from_probs(dist.float().unsqueeze(0), u.reshape(1))[0])

    for r in range(b):
        cap = min(max(int(verify_lens[r]), 0), g)
        p, q, u = target_probs[r].float(), draft_probs[r].float(), uniforms[r].float()
        k = 0
        while True:
            if k == g:  # every draft accepted: the bonus from p[g]
                final = draw(p[g], u[g])
                break
            x = int(draft_tokens[r, k])
            if float(u[k]) * float(q[k, x]) < float(p[k, x]):
                if k < cap:
                    tokens[r, k] = x
                    k += 1
                    continue
                final = x  # index l: the extra rejection step passed, d_{l+1} is the draw
                break
            residual = (p[k] - q[k]).clamp(min=0)
            mass = float(residual.sum())
            final = draw(residual / mass if mass > 0 else p[k], u[g])
            break
        tokens[r, k] = final
        accepted[r] = k
    return DSparkVerifyResult(accepted + 1, tokens, tokens[torch.arange(b), accepted], accepted)
