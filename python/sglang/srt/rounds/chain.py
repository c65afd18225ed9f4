"""Device-side building blocks of NEXTN (topk = 1 chain) speculative decoding.

Chain layout (one row per request, ``N = --speculative-num-draft-tokens`` positions)::

    position      0        1       2      ...   N-1
    token         seed     d_1     d_2    ...   d_{N-1}
    sequence pos  P        P+1     P+2    ...   P+N-1        (P = prefix_lens[b])
    target says   t_0      t_1     t_2    ...   t_{N-1}      (t_i = next token after position i)

* ``prefix_lens[b]`` = tokens whose KV is already committed; the seed (the previous round's
  bonus token, or the first token sampled after prefill) is *not* among them: its KV is written by
  this verify, at sequence position ``P``.
* Draft ``d_i`` is accepted while every earlier draft was accepted and it agrees with the target
  at position ``i-1`` (greedy: ``d_i == t_{i-1}``; sampling: the rejection test). With ``a``
  accepted drafts, the round commits ``accept_len = a + 1`` tokens: ``d_1 .. d_a`` and the
  **bonus** token ``t_a`` (the target's choice at the first mismatch, or after the last draft).
* The KV of chain positions ``0 .. a`` (seed + accepted drafts, ``accept_len`` entries) is kept:
  ``new_seq_lens = prefix_lens + accept_len``. Positions ``a+1 .. N-1`` are surplus; their MLA
  entries stay stale (harmless) and the host frees their slots one step late.
* The bonus becomes the next round's seed at sequence position ``new_seq_lens``.
* KDA: the verify stages the state after every chain position; the commit copies position
  ``a = accept_len - 1`` (:func:`last_accepted_index`, then ``KDAStatePool.commit_after_verify``).
* The draft extend that follows runs the MTP layer over the same fixed ``N``-wide window: the
  input at chain position ``i`` is the target's hidden state at ``i`` and the committed token
  ``accepted_tokens[b, i]`` (the token at ``i + 1``); its output at ``last_accepted_row`` is the
  next round's first draft.

Everything here is fixed-shape device arithmetic: no ``.item()``, ``.tolist()``, ``.cpu()`` and no
data-dependent shapes, so the worker can capture it in a CUDA graph and the host learns the
results one step late. Index values (token ids, positions) are therefore not range-checked here;
shapes and dtypes are.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from sglang.srt.layers.sampler import sample_from_probs  # noqa: F401  (re-exported)
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)

__all__ = [
    "ChainVerifyResult",
    "ChainCommitLayout",
    "greedy_verify_chain",
    "rejection_sample_chain",
    "sample_from_probs",
    "last_accepted_index",
    "chain_commit_layout",
    "chain_positions",
    "assign_chain_req_to_token",
    "build_verify_forward_batch",
]


class ChainVerifyResult(NamedTuple):
    """Outcome of verifying a batch of chains (all ``[B]`` / ``[B, N]`` int64 device tensors)."""

    accept_len: torch.Tensor  # [B] in 1..N: accepted drafts + 1 bonus = tokens committed
    accepted_tokens: torch.Tensor  # [B, N]: the committed tokens d_1..d_a, bonus, then pad
    next_seed: torch.Tensor  # [B]: the bonus token (= accepted_tokens[b, accept_len - 1])


class ChainCommitLayout(NamedTuple):
    """What the worker and the host need after a verify (device tensors, see the module doc)."""

    new_seq_lens: torch.Tensor  # [B] int64: prefix_lens + accept_len
    keep_mask: torch.Tensor  # [B, N] bool: chain position's KV slot is kept
    free_mask: torch.Tensor  # [B, N] bool: surplus slot to free (never the padding slot 0)
    last_accepted_index: torch.Tensor  # [B] int64: accept_len - 1 (KDA commit position)
    last_accepted_row: torch.Tensor  # [B] int64: b * N + accept_len - 1 in the flattened chain


# ------------------------------------------------------------------------------------------
# Validation (shapes and dtypes only: values would need a host sync)
# ------------------------------------------------------------------------------------------
def _check_draft_tokens(draft_tokens: torch.Tensor) -> None:
    if draft_tokens.dim() != 2 or draft_tokens.shape[1] < 1:
        raise ValueError(f"draft_tokens must be [B, N] with N >= 1, got {tuple(draft_tokens.shape)}")
    if draft_tokens.is_floating_point():
        raise ValueError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")


def _check_accept_len(accept_len: torch.Tensor) -> None:
    if accept_len.dim() != 1 or accept_len.is_floating_point():
        raise ValueError(f"accept_len must be an integer [B] tensor, got {accept_len.dtype} "
                         f"{tuple(accept_len.shape)}")


def _chain_matrix(x: torch.Tensor, b: int, name: str) -> torch.Tensor:
    """``[B, N]`` or flattened ``[B * N]`` -> ``[B, N]``."""
    if x.dim() == 2 and x.shape[0] == b:
        return x
    if x.dim() == 1 and b > 0 and x.shape[0] % b == 0:
        return x.view(b, -1)
    raise ValueError(f"{name} must be [B={b}, N] or [B*N], got {tuple(x.shape)}")


# ------------------------------------------------------------------------------------------
# Acceptance
# ------------------------------------------------------------------------------------------
def _commit_tokens(base: torch.Tensor, final: torch.Tensor, accepted: torch.Tensor,
                   pad_token_id: int) -> ChainVerifyResult:
    """``base[:, j]`` for ``j < accepted``, ``final`` at ``j == accepted``, pad after."""
    n = base.shape[1]
    j = torch.arange(n, device=base.device).unsqueeze(0)
    a = accepted.unsqueeze(1)
    tokens = torch.where(j < a, base, torch.where(j == a, final.unsqueeze(1), pad_token_id))
    return ChainVerifyResult(accepted + 1, tokens, final)


def greedy_verify_chain(draft_tokens: torch.Tensor, target: torch.Tensor,
                        pad_token_id: int = -1) -> ChainVerifyResult:
    """Greedy acceptance of a chain (see the module doc for the layout).

    ``draft_tokens [B, N]`` (position 0 = seed, not tested); ``target`` is either the target's
    logits for every chain position (float ``[B * N, V]`` or ``[B, N, V]``) or their argmax
    (integer ``[B, N]`` or ``[B * N]``). Draft ``d_i`` is accepted while all earlier ones were and
    ``d_i == argmax_{i-1}``; the bonus is the argmax at the first mismatch (or at ``N - 1``).
    Greedy speculative output therefore equals greedy decoding token for token.
    """
    _check_draft_tokens(draft_tokens)
    b, n = draft_tokens.shape
    if target.is_floating_point():
        if target.dim() == 3 and tuple(target.shape[:2]) == (b, n):
            target = target.reshape(b * n, -1)
        if target.dim() != 2 or target.shape[0] != b * n:
            raise ValueError(f"target logits must be [B*N={b * n}, V] or [B, N, V], "
                             f"got {tuple(target.shape)}")
        target = target.argmax(dim=-1)
    argmax = _chain_matrix(target, b, "target argmax").to(torch.int64)
    if argmax.shape[1] != n:
        raise ValueError(f"target argmax has {argmax.shape[1]} positions per request, drafts {n}")
    drafts = draft_tokens.to(torch.int64)
    match = drafts[:, 1:] == argmax[:, :-1]  # [B, N-1]: d_i vs the target after position i-1
    accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # leading run of matches
    bonus = argmax.gather(1, accepted.unsqueeze(1)).squeeze(1)
    # Where a draft was accepted it equals the target's argmax, so argmax is the committed row.
    return _commit_tokens(argmax, bonus, accepted, pad_token_id)


def rejection_sample_chain(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    pad_token_id: int = -1,
) -> ChainVerifyResult:
    """Exact speculative sampling of a chain (Leviathan et al. / Chen et al.).

    ``draft_tokens [B, N]``; ``draft_probs [B, N-1, V]``: row ``i`` is the distribution draft
    ``d_{i+1}`` was actually sampled from (after the same temperature / top-k / top-p transform as
    the target; a greedy draft passes a one-hot row); ``target_probs [B, N, V]``: row ``i`` is the
    target's distribution of the token after chain position ``i``.
    ``uniforms [B, N]`` in [0, 1): column ``i < N-1`` is the coin of ``d_{i+1}``, column ``N-1``
    draws the final token (drawn with ``torch.rand(generator=...)`` when omitted).

    ``d_{i+1}`` is accepted with probability ``min(1, p_i(x) / q_i(x))`` (``u * q < p``); at the
    first rejection (position ``a``) the final token comes from ``norm(max(p_a - q_a, 0))``; if all
    drafts pass it is the bonus from ``p_{N-1}``. The committed tokens are then distributed
    exactly as ``accept_len`` tokens sampled from the target one by one.
    """
    _check_draft_tokens(draft_tokens)
    b, n = draft_tokens.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (b, n):
        raise ValueError(f"target_probs must be [B={b}, N={n}, V], got {tuple(target_probs.shape)}")
    v = target_probs.shape[2]
    if tuple(draft_probs.shape) != (b, n - 1, v):
        raise ValueError(f"draft_probs must be [B={b}, N-1={n - 1}, V={v}], got "
                         f"{tuple(draft_probs.shape)}")
    dev = target_probs.device
    if uniforms is None:
        uniforms = torch.rand(b, n, generator=generator, device=dev)
    elif tuple(uniforms.shape) != (b, n):
        raise ValueError(f"uniforms must be [B={b}, N={n}], got {tuple(uniforms.shape)}")
    p = target_probs.float()
    q = draft_probs.float()
    drafts = draft_tokens.to(torch.int64)
    x = drafts[:, 1:].unsqueeze(-1)  # [B, N-1, 1]
    p_x = p[:, :-1].gather(-1, x).squeeze(-1)
    q_x = q.gather(-1, x).squeeze(-1)
    passed = uniforms[:, :-1].float() * q_x < p_x  # [B, N-1]
    accepted = passed.to(torch.int64).cumprod(dim=1).sum(dim=1)
    rows = torch.arange(b, device=dev)
    p_a = p[rows, accepted]  # [B, V]: target at the first rejection, or at N-1 if none
    if n > 1:
        # No draft stands at position N-1, so q there is zero and the "residual" is p itself.
        q_a = q[rows, accepted.clamp(max=n - 2)] * (accepted < n - 1).unsqueeze(1)
    else:
        q_a = torch.zeros_like(p_a)
    residual = (p_a - q_a).clamp_(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # A rejection implies residual mass > 0 in exact arithmetic; fall back to p if rounding ate it.
    dist = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(torch.float32).tiny), p_a)
    final = sample_from_probs(dist, uniforms[:, -1])
    base = torch.cat([drafts[:, 1:], final.unsqueeze(1)], dim=1)
    return _commit_tokens(base, final, accepted, pad_token_id)


# ------------------------------------------------------------------------------------------
# Bookkeeping after acceptance
# ------------------------------------------------------------------------------------------
def last_accepted_index(accept_len: torch.Tensor) -> torch.Tensor:
    """Chain position whose staged KDA state becomes persistent: ``accept_len - 1`` (int64)."""
    _check_accept_len(accept_len)
    return accept_len.to(torch.int64) - 1


def chain_commit_layout(prefix_lens: torch.Tensor, accept_len: torch.Tensor,
                        chain_cache_loc: torch.Tensor) -> ChainCommitLayout:
    """New sequence lengths and which chain KV slots to keep / free, given the accept lengths.

    ``prefix_lens [B]`` (committed tokens before the verify), ``accept_len [B]`` in 1..N,
    ``chain_cache_loc [B, N]`` or ``[B * N]``: the KV slot of each chain position. The host,
    one step late, frees ``chain_cache_loc[free_mask]``; padded rows' slot 0 is never freed.
    """
    _check_accept_len(accept_len)
    b = accept_len.shape[0]
    if tuple(prefix_lens.shape) != (b,):
        raise ValueError(f"prefix_lens must be [B={b}], got {tuple(prefix_lens.shape)}")
    loc = _chain_matrix(chain_cache_loc, b, "chain_cache_loc")
    n = loc.shape[1]
    acc = accept_len.to(torch.int64)
    j = torch.arange(n, device=loc.device).unsqueeze(0)
    keep = j < acc.unsqueeze(1)
    last = acc - 1
    return ChainCommitLayout(
        new_seq_lens=prefix_lens.to(torch.int64) + acc,
        keep_mask=keep,
        free_mask=~keep & (loc != 0),
        last_accepted_index=last,
        last_accepted_row=torch.arange(b, device=loc.device) * n + last,
    )


def chain_positions(prefix_lens: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
    """Sequence positions of the chain: ``prefix_lens[b] + i``, shape ``[B, N]`` int64."""
    if prefix_lens.dim() != 1 or num_draft_tokens < 1:
        raise ValueError(f"chain_positions: prefix_lens must be [B] and num_draft_tokens >= 1, "
                         f"got {tuple(prefix_lens.shape)} and {num_draft_tokens}")
    steps = torch.arange(num_draft_tokens, dtype=torch.int64, device=prefix_lens.device)
    return prefix_lens.to(torch.int64).unsqueeze(1) + steps


def assign_chain_req_to_token(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                              prefix_lens: torch.Tensor, chain_cache_loc: torch.Tensor) -> None:
    """Record the chain's KV slots in the request->token map before the verify:
    ``req_to_token[slot_b, prefix_b + i] = chain_cache_loc[b, i]`` for all ``N`` positions (the
    rejected ones become stale and are overwritten by the next round). Positions must stay below
    the map's context length (the scheduler's admission guarantees it; not checked here)."""
    b = req_pool_indices.shape[0]
    if req_pool_indices.dim() != 1 or tuple(prefix_lens.shape) != (b,):
        raise ValueError(f"req_pool_indices and prefix_lens must both be [B], got "
                         f"{tuple(req_pool_indices.shape)} and {tuple(prefix_lens.shape)}")
    loc = _chain_matrix(chain_cache_loc, b, "chain_cache_loc")
    cols = chain_positions(prefix_lens, loc.shape[1])
    rows = req_pool_indices.to(torch.int64).unsqueeze(1).expand_as(cols)
    req_to_token[rows, cols] = loc.to(req_to_token.dtype)


def build_verify_forward_batch(
    draft_tokens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    chain_cache_loc: torch.Tensor,
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.FULL,
    **kwargs: Any,
) -> ForwardBatch:
    """A TARGET_VERIFY :class:`ForwardBatch` from device tensors only (no host mirrors).

    ``draft_tokens [B, N]`` become ``input_ids [B * N]`` at positions ``prefix_lens[b] + i``,
    written to ``chain_cache_loc``; logits come back for every chain position and, by default,
    the hidden states too (the draft extend needs them). ``kwargs`` go to the dataclass
    (pools, backend, ``spec_info``).
    """
    _check_draft_tokens(draft_tokens)
    b, n = draft_tokens.shape
    if tuple(req_pool_indices.shape) != (b,) or tuple(prefix_lens.shape) != (b,):
        raise ValueError(f"req_pool_indices and prefix_lens must be [B={b}], got "
                         f"{tuple(req_pool_indices.shape)} and {tuple(prefix_lens.shape)}")
    loc = _chain_matrix(chain_cache_loc, b, "chain_cache_loc")
    if loc.shape[1] != n:
        raise ValueError(f"chain_cache_loc has {loc.shape[1]} slots per request, drafts {n}")
    dev = draft_tokens.device
    prefix = prefix_lens.to(device=dev, dtype=torch.int64)
    return ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY,
        batch_size=b,
        input_ids=draft_tokens.reshape(-1).to(torch.int64),
        positions=chain_positions(prefix, n).reshape(-1),
        req_pool_indices=req_pool_indices.to(device=dev, dtype=torch.int64),
        seq_lens=prefix + n,
        out_cache_loc=loc.reshape(-1).to(device=dev, dtype=torch.int64),
        extend_seq_lens=torch.full((b,), n, dtype=torch.int64, device=dev),
        extend_prefix_lens=prefix,
        extend_start_loc=torch.arange(b, dtype=torch.int64, device=dev) * n,
        return_full_logits=True,
        capture_hidden_mode=capture_hidden_mode,
        **kwargs,
    )
