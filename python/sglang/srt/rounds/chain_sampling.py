"""The target's sampling transform applied at every chain position, for drafts and verify.

Lossless speculation needs the draft and the target to see exactly the distribution plain
decoding would sample from at that position. Plain decoding transforms logits with the request's
penalties (which depend on the tokens generated so far), logit bias, the min-new-tokens EOS mask,
temperature and top-k / top-p / min-p (:mod:`sglang.srt.layers.sampler`). At chain position ``i``
the history is the committed output plus the drafts ``d_1 .. d_i`` (position ``i`` only matters
when they are all accepted), so :func:`expand_for_chain` builds a :class:`SamplingBatchInfo` whose
row ``(b, i)`` is request ``b`` with those tokens appended, and the sampler's own functions do the
rest. Device ops only; the dense ``[B * n, V]`` history tensors are built only for requests with
frequency / presence / repetition penalties.

Randomness: for requests with ``sampling_seed`` every uniform comes from
:func:`~sglang.srt.layers.sampler.seeded_uniform` keyed by (seed, tokens generated so far, lane).
Within one round the counter is fixed, so the lanes tell the draws apart
(:func:`verify_lanes` for the acceptance coins and the final token, :func:`draft_lane` for the
draft tokens); the counter grows by at least one token per round, so no key repeats.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from sglang.srt.layers.sampler import apply_penalties, sampling_filter_mask, seeded_uniform
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

__all__ = [
    "needs_history",
    "has_logit_transform",
    "expand_for_chain",
    "processed_logits",
    "transformed_probs",
    "verify_lanes",
    "draft_lane",
    "chain_uniforms",
]

# Row fields repeated per chain position (steps and the dense history fields are rebuilt).
_REPEATED = ("temperatures", "top_ps", "top_ks", "min_ps", "greedy_mask", "seeds", "has_seed",
             "frequency_penalties", "presence_penalties", "repetition_penalties",
             "min_new_tokens")


def needs_history(info: SamplingBatchInfo) -> bool:
    """Some request's logits depend on which tokens were generated (not just how many)."""
    return info.output_counts is not None or info.seen_mask is not None


def has_logit_transform(info: SamplingBatchInfo) -> bool:
    """``apply_penalties`` would change some logits (otherwise it can be skipped)."""
    return (info.has_frequency_presence or info.has_repetition or info.has_logit_bias
            or info.has_min_new_tokens)


def expand_for_chain(info: SamplingBatchInfo, history: Optional[torch.Tensor], n: int,
                     start: int = 0) -> SamplingBatchInfo:
    """``B * n`` rows; row ``b * n + k`` is request ``b`` at chain position ``i = start + k``,
    i.e. after ``history[b, :i]`` were generated (``history [B, m]`` int64, ``m >= start+n-1``;
    may be ``None`` when ``start + n == 1``)."""
    b = info.batch_size
    if n < 1 or start < 0:
        raise ValueError(f"expand_for_chain: need n >= 1 and start >= 0, got {n}, {start}")
    last = start + n - 1
    if last > 0 and (history is None or history.dim() != 2 or history.shape[0] != b
                     or history.shape[1] < last):
        raise ValueError(f"expand_for_chain: positions up to {last} need history [B={b}, >= "
                         f"{last}], got {None if history is None else tuple(history.shape)}")
    dev = info.device

    def rep(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(n, dim=0)

    changes = {name: rep(getattr(info, name)) for name in _REPEATED}
    offsets = torch.arange(start, start + n, dtype=torch.int64, device=dev).repeat(b)
    changes["steps"] = rep(info.steps) + offsets
    for name in ("logit_bias", "stop_token_mask"):
        value = getattr(info, name)
        changes[name] = None if value is None else rep(value)
    extra = None
    if needs_history(info) and last > 0:
        # extra[b, k, v] = occurrences of v in history[b, :start + k]
        hist = history[:, :last].to(torch.int64)
        per_pos = torch.zeros(b, last, info.vocab_size, dtype=torch.float32, device=dev)
        per_pos.scatter_(2, hist.unsqueeze(-1), 1.0)
        cum = torch.cat([torch.zeros(b, 1, info.vocab_size, dtype=torch.float32, device=dev),
                         per_pos.cumsum(dim=1)], dim=1)  # [B, last + 1, V]
        extra = cum[:, start:start + n].reshape(b * n, info.vocab_size)
    if info.output_counts is not None:
        counts = rep(info.output_counts)
        changes["output_counts"] = counts if extra is None else counts + extra
    if info.seen_mask is not None:
        seen = rep(info.seen_mask)
        changes["seen_mask"] = seen if extra is None else seen | (extra > 0)
    return dataclasses.replace(info, **changes)


def processed_logits(logits: torch.Tensor, rows_info: SamplingBatchInfo) -> torch.Tensor:
    """Penalties, bias and the min-new-tokens mask on fp32 ``logits [R, V']`` (a new tensor,
    cut to the vocabulary) — what plain decoding takes the argmax of for greedy rows."""
    out = logits[:, : rows_info.vocab_size].float().clone()
    if has_logit_transform(rows_info):
        apply_penalties(out, rows_info)
    return out


def transformed_probs(processed: torch.Tensor, rows_info: SamplingBatchInfo) -> torch.Tensor:
    """The distribution plain decoding samples from: temperature, then top-k / top-p / min-p
    (the Gumbel-max sampler draws exactly from this softmax). Greedy rows use temperature 1."""
    scaled = processed / rows_info.temperatures.unsqueeze(1)
    removed = sampling_filter_mask(scaled, rows_info.top_ks, rows_info.top_ps, rows_info.min_ps,
                                   rows_info.need_top_k, rows_info.need_top_p,
                                   rows_info.need_min_p)
    return torch.softmax(scaled.masked_fill(removed, float("-inf")), dim=-1)


def verify_lanes(num_draft_tokens: int) -> range:
    """Lanes of the acceptance coins (``0 .. N-2``) and the final token (``N-1``)."""
    return range(num_draft_tokens)


def draft_lane(num_draft_tokens: int, chain_pos: int) -> range:
    """Lane of the draft token at chain position ``chain_pos`` (1 .. N-1), as a one-lane range."""
    lane = num_draft_tokens + chain_pos
    return range(lane, lane + 1)


def chain_uniforms(info: SamplingBatchInfo, lanes: range,
                   generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Uniforms in [0, 1) ``[B, len(lanes)]``: seeded rows from (seed, steps, lane), the others
    from ``torch.rand``. ``info.steps`` is the request's generated-token count. ``lanes`` is a
    ``range`` so that the lane ids are made on the device (a host list would mean a blocking
    host-to-device copy)."""
    dev = info.device
    u = torch.rand(info.batch_size, len(lanes), generator=generator, device=dev)
    if info.any_seeded:
        lane_ids = torch.arange(lanes.start, lanes.stop, lanes.step, dtype=torch.int64, device=dev)
        seeded = seeded_uniform(info.seeds, info.steps, lane_ids)
        u = torch.where(info.has_seed.unsqueeze(1), seeded, u)
    return u
