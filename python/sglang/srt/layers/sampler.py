"""Next-token sampling from logits, and the log-probabilities SGLang returns.

Pipeline for logits ``[B, V]`` (fp32):

1. penalties: repetition (HF style over prompt + output: positive logits divided, negative
   multiplied), then frequency/presence (over the output so far), then ``logit_bias``, then EOS /
   stop tokens masked while fewer than ``min_new_tokens`` are generated;
2. greedy rows: ``argmax`` (deterministic);
3. sampled rows: logits / temperature, top-k / top-p / min-p filtering, then the Gumbel-max trick:
   ``argmax(logits + g)`` with ``g = -log(-log(u))`` draws exactly from ``softmax(logits)``;
4. log-probabilities for the response, as SGLang returns them by default: ``log_softmax`` of the
   penalised logits divided by the temperature (1 for greedy rows), before top-k/top-p/min-p;
   with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` of the raw logits instead.

Reproducibility: for a request with ``sampling_seed``, ``u`` is a counter-based hash of
(seed, step, token id), where step = tokens generated so far. So its draw depends on nothing
else: not on the batch it runs in, its row, or other requests' randomness. The hash is plain
integer tensor arithmetic, identical on CPU and CUDA and capturable in a CUDA graph. Requests
without a seed use ``torch.rand``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from sglang.srt.environ import envs
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``x`` in [0, 2**32), without int64 overflow: split ``c`` in
    16-bit halves so that every intermediate product stays below 2**49."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche finalizer (MurmurHash3's fmix32 constants) on int64 tensors."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def seeded_uniform(seeds: torch.Tensor, steps: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
    """Uniform floats in (0, 1) keyed only by (seed, step, lane).

    ``seeds`` and ``steps`` are int64 ``[B]``; ``lanes`` is int64 ``[L]`` (e.g. token ids) or
    ``[B, L]``. Returns float32 ``[B, L]``. Speculative workers reuse it with lanes = draft
    positions for seeded acceptance tests.
    """
    seeds = seeds.to(torch.int64)
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    key = _mix32(lo ^ _mix32(hi + 0x9E3779B9))
    key = _mix32(key ^ _mix32((steps.to(torch.int64) & _MASK32) + 0x7F4A7C15))
    lanes = lanes.to(torch.int64)
    lane_key = _mix32((lanes & _MASK32) ^ 0x165667B1)
    if lanes.dim() == 1:
        lane_key = lane_key.unsqueeze(0)
    h = _mix32(key.unsqueeze(1) ^ lane_key)
    # Top 24 bits -> the centre of one of 2**24 equal cells: never exactly 0 or 1.
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel_from_uniform(u: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise from uniforms in (0, 1)."""
    return -torch.log(-torch.log(u))


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [B, V]`` (non-negative, any positive total) by inverse CDF
    with uniforms ``u [B]`` in [0, 1). Tokens of zero probability are never returned (for rows
    with positive mass). Returns ``[B]`` int64."""
    if probs.dim() != 2 or tuple(u.shape) != (probs.shape[0],):
        raise ValueError(f"sample_from_probs: probs must be [B, V] and u [B], got "
                         f"{tuple(probs.shape)} and {tuple(u.shape)}")
    cdf = probs.float().cumsum(dim=-1)  # non-decreasing even in floating point
    total = cdf[:, -1:]
    # Keep the target strictly below the total: the first cdf entry above it then belongs to a
    # token whose probability is positive, even when u * total rounds up to total.
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(u.float().unsqueeze(1) * total, below_total)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[1] - 1)


def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Penalties, logit bias and the min-new-tokens mask, in place on ``logits`` [B, V]."""
    if info.has_repetition and info.seen_mask is not None:
        rp = info.repetition_penalties.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rp, logits * rp)
        logits.copy_(torch.where(info.seen_mask, penalized, logits))
    if info.has_frequency_presence and info.output_counts is not None:
        counts = info.output_counts
        logits -= info.frequency_penalties.unsqueeze(1) * counts
        logits -= info.presence_penalties.unsqueeze(1) * (counts > 0).to(logits.dtype)
    if info.has_logit_bias and info.logit_bias is not None:
        logits += info.logit_bias
    if info.has_min_new_tokens and info.stop_token_mask is not None:
        too_early = (info.steps < info.min_new_tokens).unsqueeze(1)
        logits.masked_fill_(info.stop_token_mask & too_early, float("-inf"))
    return logits


def sampling_filter_mask(
    logits: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    need_top_k: bool = True,
    need_top_p: bool = True,
    need_min_p: bool = True,
) -> torch.Tensor:
    """Bool ``[B, V]``: True where a token is removed by top-k, top-p or min-p.

    All three look at ``softmax(logits)`` (temperature already applied) and their kept sets
    intersect, as in SGLang's torch path: top-k keeps the ``k`` most likely tokens; top-p keeps
    the shortest prefix of the sorted distribution whose mass reaches ``p`` (a token is kept if
    the mass strictly before it is <= p); min-p keeps tokens with ``prob >= min_p * max_prob``.
    Tokens tied with the last kept one are kept too (the cut is a threshold on the logit).
    """
    bsz, vocab = logits.shape
    removed = torch.zeros((bsz, vocab), dtype=torch.bool, device=logits.device)
    if need_top_k or need_top_p:
        sorted_logits, _ = torch.sort(logits, dim=-1, descending=True)
        keep = torch.full((bsz,), vocab, dtype=torch.int64, device=logits.device)
        if need_top_k:
            keep = torch.minimum(keep, top_ks.to(torch.int64).clamp(1, vocab))
        if need_top_p:
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            n_top_p = (mass_before <= top_ps.unsqueeze(1)).sum(dim=-1)
            # p == 1 keeps everything even when rounding pushes the running mass above 1.
            n_top_p = torch.where(top_ps >= 1.0, torch.full_like(n_top_p, vocab), n_top_p)
            keep = torch.minimum(keep, n_top_p.clamp(min=1))
        threshold = sorted_logits.gather(1, (keep - 1).unsqueeze(1))
        removed |= logits < threshold
    if need_min_p:
        # prob_i < min_p * prob_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf.
        cut = logits.max(dim=-1, keepdim=True).values + torch.log(min_ps).unsqueeze(1)
        removed |= logits < cut
    return removed


@dataclass
class SamplerOutput:
    """What one sampling step returns (all on the logits' device)."""

    next_token_ids: torch.Tensor  # [B] int64
    next_token_logprobs: Optional[torch.Tensor] = None  # [B] float32
    top_logprobs_val: Optional[torch.Tensor] = None  # [B, max k] float32
    top_logprobs_idx: Optional[torch.Tensor] = None  # [B, max k] int64
    logprobs: Optional[torch.Tensor] = None  # [B, V] raw log-probabilities (for token_ids_logprob)


class Sampler(nn.Module):
    """Turns logits into next tokens (and their log-probabilities) for a batch."""

    def __init__(self, generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        self.generator = generator  # randomness for unseeded requests (None: torch default)

    def forward(
        self,
        logits: torch.Tensor,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: Optional[Sequence[int]] = None,
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` [B, V'] (V' >= vocab_size; padded vocabulary
        columns are ignored). ``top_logprobs_nums[i]`` > 0 asks for row i's top log-probs."""
        info = sampling_info
        if logits.dim() != 2 or logits.shape[0] != info.batch_size:
            raise ValueError(
                f"logits must be [batch={info.batch_size}, vocab], got {tuple(logits.shape)}"
            )
        if logits.shape[1] < info.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns < vocab_size {info.vocab_size}")
        logits = logits[:, : info.vocab_size].float()
        processed = apply_penalties(logits.clone(), info)
        greedy_ids = torch.argmax(processed, dim=-1)
        scaled = processed / info.temperatures.unsqueeze(1)  # greedy rows carry temperature 1
        logprobs = None
        if return_logprob:
            source = logits if envs.SGLANG_RETURN_ORIGINAL_LOGPROB.get() else scaled
            logprobs = torch.log_softmax(source, dim=-1)
        if info.is_all_greedy:
            next_ids = greedy_ids
        else:
            removed = sampling_filter_mask(
                scaled, info.top_ks, info.top_ps, info.min_ps,
                info.need_top_k, info.need_top_p, info.need_min_p,
            )
            noise = gumbel_from_uniform(self._uniforms(info, scaled))
            sampled_ids = torch.argmax(scaled.masked_fill(removed, float("-inf")) + noise, dim=-1)
            next_ids = torch.where(info.greedy_mask, greedy_ids, sampled_ids)
        out = SamplerOutput(next_token_ids=next_ids, logprobs=logprobs)
        if logprobs is not None:
            out.next_token_logprobs = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            k = max(top_logprobs_nums or [0])
            if k > 0:
                out.top_logprobs_val, out.top_logprobs_idx = logprobs.topk(
                    min(k, info.vocab_size), dim=-1
                )
        return out

    def _uniforms(self, info: SamplingBatchInfo, like: torch.Tensor) -> torch.Tensor:
        u = torch.rand(like.shape, generator=self.generator, device=like.device, dtype=torch.float32)
        u.clamp_(min=torch.finfo(torch.float32).tiny)  # rand may return exactly 0
        if info.any_seeded:
            lanes = torch.arange(like.shape[1], device=like.device)
            seeded = seeded_uniform(info.seeds, info.steps, lanes)
            u = torch.where(info.has_seed.unsqueeze(1), seeded, u)
        return u


@dataclass
class InputTokenLogprobs:
    """Log-probabilities of prompt tokens from position ``logprob_start_len`` on."""

    token_ids: List[int]
    token_logprobs: List[Optional[float]]  # None for position 0 (nothing predicts it)
    top_logprobs: Optional[List[Optional[List[Tuple[float, int]]]]] = None


def compute_input_token_logprobs(
    logits: torch.Tensor,
    input_ids: Sequence[int],
    logprob_start_len: int = 0,
    top_logprobs_num: int = 0,
    logits_start: int = 0,
) -> InputTokenLogprobs:
    """Input-token log-probabilities of one request from its prefill logits.

    ``logits`` [N, V]: row j is the model's output at prompt position ``logits_start + j``
    (which predicts the token at the next position). The token at position ``i`` gets
    ``log_softmax(logits at position i - 1)[input_ids[i]]``; position 0 gets ``None``. Positions
    ``logprob_start_len .. len(input_ids) - 1`` are returned; rows from position
    ``max(logprob_start_len, 1) - 1`` to ``len(input_ids) - 2`` must be present.
    """
    n_in = len(input_ids)
    if not 0 <= logprob_start_len <= n_in:
        raise ValueError(f"logprob_start_len must be in [0, {n_in}], got {logprob_start_len}")
    if top_logprobs_num < 0:
        raise ValueError(f"top_logprobs_num must be >= 0, got {top_logprobs_num}")
    first = max(logprob_start_len, 1)  # first position that has a predicting row
    lo, hi = first - 1 - logits_start, n_in - 1 - logits_start  # needed rows [lo, hi)
    if first < n_in and (lo < 0 or hi > logits.shape[0]):
        raise ValueError(
            f"logits rows cover positions [{logits_start}, {logits_start + logits.shape[0]}), "
            f"need [{first - 1}, {n_in - 1})"
        )
    token_ids = list(input_ids[logprob_start_len:])
    lead: List[Optional[float]] = [None] if logprob_start_len == 0 and n_in > 0 else []
    top: Optional[List[Optional[List[Tuple[float, int]]]]] = None
    if top_logprobs_num > 0:
        top = [None] * len(lead)
    if first >= n_in:
        return InputTokenLogprobs(token_ids, lead, top)
    logprobs = torch.log_softmax(logits[lo:hi].float(), dim=-1)
    targets = torch.as_tensor(list(input_ids[first:]), dtype=torch.int64, device=logits.device)
    values = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    if top is not None:
        k = min(top_logprobs_num, logprobs.shape[1])
        vals, idx = logprobs.topk(k, dim=-1)
        top += [list(zip(v, i)) for v, i in zip(vals.tolist(), idx.tolist())]
    return InputTokenLogprobs(token_ids, lead + values, top)
