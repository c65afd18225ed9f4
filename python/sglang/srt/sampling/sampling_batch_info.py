"""Batched sampling state: per-request parameters as tensors, plus the penalty histories.

Built once per batch from the requests' ``SamplingParams`` and token histories
(``SamplingBatchInfo.from_reqs``), then kept up to date cheaply as tokens are produced
(``append_tokens``), split (``filter``) and joined (``merge``) as the running batch changes.

Host-side booleans (``is_all_greedy``, ``need_top_k``, ...) let the sampler skip work without
reading the device. After ``filter`` they are kept from the parent batch (conservative: a
superset of the work is still correct, because unused rows hold neutral values), so no
``filter``/``merge`` ever synchronizes with the device.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Union

import torch

from sglang.srt.sampling.sampling_params import SAMPLING_EPS, SamplingParams

# Per-row tensors ([B] or [B, V]) that filter/merge must carry along, in declaration order.
ROW_FIELDS = (
    "temperatures", "top_ps", "top_ks", "min_ps", "greedy_mask", "seeds", "has_seed", "steps",
    "frequency_penalties", "presence_penalties", "repetition_penalties", "min_new_tokens",
)
# Optional dense [B, V] tensors, absent (None) when no request in the batch needs them.
_DENSE_FIELDS = ("output_counts", "seen_mask", "logit_bias", "stop_token_mask")
# Host flags: merged by OR, except is_all_greedy which merges by AND.
_FLAG_FIELDS = (
    "need_top_k", "need_top_p", "need_min_p", "any_seeded",
    "has_frequency_presence", "has_repetition", "has_logit_bias", "has_min_new_tokens",
)


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature < SAMPLING_EPS or p.top_k == 1


def host_flags(sampling_params: Sequence[SamplingParams], vocab_size: int) -> dict:
    """The host-side flags of a batch (``is_all_greedy`` and :data:`_FLAG_FIELDS`), computed
    from its requests' parameters alone (no device read)."""
    greedy = [_is_greedy(p) for p in sampling_params]
    sampled = [p for p, g in zip(sampling_params, greedy) if not g]
    top_ks = [vocab_size if (p.top_k == -1 or p.top_k > vocab_size) else p.top_k for p in sampled]
    return dict(
        is_all_greedy=all(greedy),
        need_top_k=any(k < vocab_size for k in top_ks),
        need_top_p=any(p.top_p < 1.0 for p in sampled),
        need_min_p=any(p.min_p > 0.0 for p in sampled),
        any_seeded=any(p.sampling_seed is not None for p in sampled),
        has_frequency_presence=any(
            p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in sampling_params),
        has_repetition=any(p.repetition_penalty != 1.0 for p in sampling_params),
        has_logit_bias=any(p.logit_bias for p in sampling_params),
        has_min_new_tokens=any(p.min_new_tokens > 0 and not p.ignore_eos
                               for p in sampling_params),
    )


@dataclass
class SamplingBatchInfo:
    """Tensors of one batch's sampling parameters (``B`` requests, vocabulary ``V``)."""

    vocab_size: int
    temperatures: torch.Tensor  # [B] float32; 1.0 for greedy rows
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, clamped to V ("all" == V)
    min_ps: torch.Tensor  # [B] float32
    greedy_mask: torch.Tensor  # [B] bool
    seeds: torch.Tensor  # [B] int64 (0 where unseeded)
    has_seed: torch.Tensor  # [B] bool
    steps: torch.Tensor  # [B] int64: output tokens generated so far (the seeded-noise counter)
    frequency_penalties: torch.Tensor  # [B] float32
    presence_penalties: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    min_new_tokens: torch.Tensor  # [B] int64
    output_counts: Optional[torch.Tensor] = None  # [B, V] float32 counts of output tokens
    seen_mask: Optional[torch.Tensor] = None  # [B, V] bool: token in prompt or output
    logit_bias: Optional[torch.Tensor] = None  # [B, V] float32
    stop_token_mask: Optional[torch.Tensor] = None  # [B, V] bool: EOS/stop ids (min_new_tokens)
    is_all_greedy: bool = True
    need_top_k: bool = False
    need_top_p: bool = False
    need_min_p: bool = False
    any_seeded: bool = False
    has_frequency_presence: bool = False
    has_repetition: bool = False
    has_logit_bias: bool = False
    has_min_new_tokens: bool = False

    @property
    def batch_size(self) -> int:
        """Number of requests (rows)."""
        return int(self.temperatures.shape[0])

    @property
    def device(self) -> torch.device:
        """Device of the tensors."""
        return self.temperatures.device

    @classmethod
    def from_reqs(
        cls,
        sampling_params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: Union[str, torch.device] = "cpu",
        prompt_ids: Optional[Sequence[Sequence[int]]] = None,
        eos_token_ids: Optional[Iterable[int]] = None,
    ) -> "SamplingBatchInfo":
        """Build from per-request parameters and token histories.

        ``output_ids[i]`` are request i's generated tokens so far (frequency/presence penalties
        count them; their number is the seeded-noise step). ``prompt_ids`` are needed only when
        some request has a repetition penalty (it covers prompt + output, as in HF).
        ``eos_token_ids`` are masked, together with each request's ``stop_token_ids``, while
        fewer than ``min_new_tokens`` tokens have been generated (unless ``ignore_eos``).
        Params may be raw or normalized: temperature 0 and ``top_k == 1`` both mean greedy.
        """
        n = len(sampling_params)
        if len(output_ids) != n:
            raise ValueError(f"output_ids has {len(output_ids)} rows for {n} sampling params")
        if prompt_ids is not None and len(prompt_ids) != n:
            raise ValueError(f"prompt_ids has {len(prompt_ids)} rows for {n} sampling params")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        dev = torch.device(device)
        greedy = [_is_greedy(p) for p in sampling_params]
        top_ks = [vocab_size if (p.top_k == -1 or p.top_k > vocab_size) else p.top_k
                  for p in sampling_params]
        seeds = [p.sampling_seed for p in sampling_params]

        def f32(values: List[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=dev)

        def i64(values: List[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=dev)

        info = cls(
            vocab_size=vocab_size,
            temperatures=f32([1.0 if g else float(p.temperature)
                              for p, g in zip(sampling_params, greedy)]),
            top_ps=f32([float(p.top_p) for p in sampling_params]),
            top_ks=i64(top_ks),
            min_ps=f32([float(p.min_p) for p in sampling_params]),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=dev),
            seeds=i64([s if s is not None else 0 for s in seeds]),
            has_seed=torch.tensor([s is not None for s in seeds], dtype=torch.bool, device=dev),
            steps=i64([len(o) for o in output_ids]),
            frequency_penalties=f32([float(p.frequency_penalty) for p in sampling_params]),
            presence_penalties=f32([float(p.presence_penalty) for p in sampling_params]),
            repetition_penalties=f32([float(p.repetition_penalty) for p in sampling_params]),
            min_new_tokens=i64([int(p.min_new_tokens) for p in sampling_params]),
            **host_flags(sampling_params, vocab_size),
        )
        shape = (n, vocab_size)
        if info.has_frequency_presence:
            info.output_counts = torch.zeros(shape, dtype=torch.float32, device=dev)
            for row, toks in enumerate(output_ids):
                _count_into(info.output_counts[row], toks)
        if info.has_repetition:
            if prompt_ids is None:
                raise ValueError("repetition_penalty needs the prompt token ids (prompt_ids)")
            info.seen_mask = torch.zeros(shape, dtype=torch.bool, device=dev)
            for row in range(n):
                toks = list(prompt_ids[row]) + list(output_ids[row])
                if toks:
                    info.seen_mask[row, i64(toks)] = True
        if info.has_logit_bias:
            info.logit_bias = torch.zeros(shape, dtype=torch.float32, device=dev)
            for row, p in enumerate(sampling_params):
                for tok, bias in (p.logit_bias or {}).items():
                    info.logit_bias[row, int(tok)] += float(bias)
        if info.has_min_new_tokens:
            info.stop_token_mask = torch.zeros(shape, dtype=torch.bool, device=dev)
            eos = list(eos_token_ids or [])
            for row, p in enumerate(sampling_params):
                if p.ignore_eos or p.min_new_tokens <= 0:
                    continue
                ids = eos + list(p.stop_token_ids or [])
                if ids:
                    info.stop_token_mask[row, i64(ids)] = True
        return info

    # ------------------------------------------------------------------ updates
    def append_tokens(self, token_ids: torch.Tensor, valid: Optional[torch.Tensor] = None) -> None:
        """Record newly generated tokens: ``token_ids`` is [B] or [B, k] (k accepted positions
        of a speculative step, ``valid`` [B, k] bool marking which ones count). Device-only."""
        ids = token_ids.reshape(self.batch_size, -1).to(torch.int64)
        if valid is None:
            weight = torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
        else:
            weight = valid.reshape(ids.shape).to(torch.float32)
        self.steps += weight.sum(dim=1).to(torch.int64)
        if self.output_counts is not None:
            self.output_counts.scatter_add_(1, ids, weight)
        if self.seen_mask is not None:
            if valid is None:
                self.seen_mask.scatter_(1, ids, True)
            else:
                # Scatter through counts: with duplicate ids a plain scatter of per-position
                # flags would let an invalid position overwrite a valid one.
                hits = torch.zeros(self.seen_mask.shape, dtype=torch.float32, device=ids.device)
                self.seen_mask |= hits.scatter_add_(1, ids, weight) > 0

    def filter(self, keep_indices: Union[Sequence[int], torch.Tensor]) -> "SamplingBatchInfo":
        """A new info holding only the rows ``keep_indices`` (in that order)."""
        idx = torch.as_tensor(keep_indices, dtype=torch.int64).to(self.device)
        changes = {name: getattr(self, name)[idx] for name in ROW_FIELDS}
        for name in _DENSE_FIELDS:
            value = getattr(self, name)
            changes[name] = None if value is None else value[idx]
        return dataclasses.replace(self, **changes)

    def refresh_flags(self, sampling_params: Sequence[SamplingParams]) -> "SamplingBatchInfo":
        """Exact host flags for the rows' parameters (``filter`` keeps the parent's, a
        superset); dense tensors no row needs any more are dropped. Host work only: the rows'
        tensors already hold their values, so results are unchanged, but a batch whose last
        penalised request left can take the lighter paths (and CUDA graphs) again."""
        if len(sampling_params) != self.batch_size:
            raise ValueError(f"refresh_flags: {len(sampling_params)} params for "
                             f"{self.batch_size} rows")
        flags = host_flags(sampling_params, self.vocab_size)
        dense = {"output_counts": flags["has_frequency_presence"],
                 "seen_mask": flags["has_repetition"], "logit_bias": flags["has_logit_bias"],
                 "stop_token_mask": flags["has_min_new_tokens"]}
        drop = {name: None for name, needed in dense.items() if not needed}
        return dataclasses.replace(self, **flags, **drop)

    def merge(self, other: "SamplingBatchInfo") -> "SamplingBatchInfo":
        """A new info with ``other``'s rows appended after this one's."""
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"cannot merge vocab sizes {self.vocab_size} and {other.vocab_size}")
        changes = {name: torch.cat([getattr(self, name), getattr(other, name)])
                   for name in ROW_FIELDS}
        for name in _DENSE_FIELDS:
            a, b = getattr(self, name), getattr(other, name)
            if a is None and b is None:
                changes[name] = None
            else:
                changes[name] = torch.cat([_dense_or_neutral(a, self, name),
                                           _dense_or_neutral(b, other, name)])
        for name in _FLAG_FIELDS:
            changes[name] = getattr(self, name) or getattr(other, name)
        changes["is_all_greedy"] = self.is_all_greedy and other.is_all_greedy
        return dataclasses.replace(self, **changes)


def _count_into(row: torch.Tensor, tokens: Sequence[int]) -> None:
    if len(tokens):
        ids = torch.as_tensor(list(tokens), dtype=torch.int64, device=row.device)
        row.scatter_add_(0, ids, torch.ones(ids.shape, dtype=row.dtype, device=row.device))


def _dense_or_neutral(value: Optional[torch.Tensor], info: SamplingBatchInfo, name: str) -> torch.Tensor:
    # Neutral fill: zero counts / bias, nothing seen, nothing masked.
    if value is not None:
        return value
    dtype = torch.bool if name in ("seen_mask", "stop_token_mask") else torch.float32
    return torch.zeros((info.batch_size, info.vocab_size), dtype=dtype, device=info.device)
