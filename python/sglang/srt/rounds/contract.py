"""The speculative-worker interface: what the generic layers (scheduler, TP worker, model runner)
know of a speculative algorithm.

A worker class is registered under its ``--speculative-algorithm`` name
(:mod:`sglang.srt.rounds.registry`). The scheduler uses it in three steps:

1. **Before the target loads** — :meth:`BaseSpecWorker.requirements` validates the draft
   checkpoint and says what the target's model runner must provide
   (:class:`SpecRequirements`: draft-layer caches, KDA stage-then-commit depth, position and
   KV-slot headroom, weights that load after the pools).
2. **After the target loads** — the worker is built over the target's
   :class:`~sglang.srt.rounds.plain.TpModelWorker` (it shares the target's pools).
3. **Serving** — the same two calls as the target worker's plain decode, so the scheduler's loop
   is one loop for every mode: :meth:`prefill` (target prefill + sampling, then whatever the
   drafter needs from the prompt) and :meth:`forward_round` (one speculative round for the
   running batch, launched without any host read of device values; its
   :class:`~sglang.srt.rounds.relay.PendingRound` is consumed one round later).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

import torch

if TYPE_CHECKING:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.rounds.relay import PendingRound
    from sglang.srt.rounds.plain import GenerationBatchResult, TpModelWorker
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

__all__ = ["SpecRequirements", "BaseSpecWorker"]


@dataclass(frozen=True)
class SpecRequirements:
    """What a speculative worker needs from the target's model runner and the scheduler."""

    kda_scratch_depth: int  # chain positions the KDA pool stages per slot (stage-then-commit)
    position_headroom: int  # positions past the context length a round may touch
    token_headroom: int  # KV slots a request may hold beyond prompt + max_new_tokens - 1
    draft_extra_mla_layers: bool  # the target's MLA pool also holds the draft layer's cache
    # The draft's config: its weights load after the target's pools, so the target's memory plan
    # counts them (per TP rank, once the TP group exists).
    draft_model_config: Optional["ModelConfig"] = None
    # Or, for a draft that is not a target-architecture model: its weight elements (replicated
    # on every TP rank) and the elements of its own store per target KV slot, both in the
    # target's dtype and allocated after the target's pools.
    draft_weight_elems: int = 0
    draft_elems_per_kv_slot: int = 0

    def runner_kwargs(self) -> dict:
        """Keyword arguments of the target's :class:`ModelRunner` that size its pools."""
        return dict(spec_num_draft_tokens=self.kda_scratch_depth,
                    position_headroom=self.position_headroom,
                    draft_extra_mla_layers=self.draft_extra_mla_layers,
                    draft_model_config=self.draft_model_config,
                    draft_weight_elems=self.draft_weight_elems,
                    draft_elems_per_kv_slot=self.draft_elems_per_kv_slot)


class BaseSpecWorker(ABC):
    """A speculative decoding worker over a target :class:`TpModelWorker`."""

    # Counted as speculative by the scheduler's metrics (accept length, verify counters).
    is_speculative = True
    # True for a worker that rebuilds its attention plan on the host every round (a verify
    # width chosen per round): a captured metadata refill would replay its capture's plan, so
    # SGLANG_ENABLE_METADATA_GLUE_GRAPH is ignored for it (model_executor/graph_refill.py).
    host_planned_attention = False

    def internal_state(self) -> Dict[str, Any]:
        """Algorithm-specific entries for ``/server_info``'s ``internal_states`` (host values
        only; none by default)."""
        return {}

    def round_cache_loc_buffer(self, bs: int) -> Optional[torch.Tensor]:
        """Where the scheduler allocates a round's KV slots (``[bs, round_tokens]``); None: a
        new tensor. Graphed workers return their static input (``GraphedRoundMixin``)."""
        return None

    @classmethod
    @abstractmethod
    def requirements(cls, server_args: Any, target_config: "ModelConfig") -> SpecRequirements:
        """Validate the draft for this target (raise ``ValueError`` naming the flag) and size
        what the target runner must reserve. Called before any weights load."""

    @abstractmethod
    def __init__(self, server_args: Any, target_worker: "TpModelWorker",
                 requirements: SpecRequirements):
        """Build the draft over the target's pools."""

    @property
    @abstractmethod
    def round_tokens(self) -> int:
        """KV slots each request of a round is given (an upper bound on what it keeps)."""

    @property
    @abstractmethod
    def proposed_per_round(self) -> int:
        """Draft tokens proposed per request per round (the accept-rate denominator)."""

    @abstractmethod
    def prefill(self, forward_batch: "ForwardBatch", sampling_info: Optional["SamplingBatchInfo"],
                sample_rows: Optional[Sequence[int]] = None, return_logprob: bool = False,
                top_logprobs_nums: Optional[Sequence[int]] = None,
                next_prompt_tokens: Optional[Sequence[int]] = None) -> "GenerationBatchResult":
        """Target prefill (or chunk) with sampling, then the drafter's prompt work.
        ``next_prompt_tokens[b]``: the prompt token after request ``b``'s chunk, ``-1`` when the
        chunk completes the prompt."""

    @abstractmethod
    def forward_round(self, req_pool_indices: torch.Tensor, round_cache_loc: torch.Tensor,
                      sampling_info: "SamplingBatchInfo", seq_lens_bound: Optional[int] = None,
                      return_logprob: bool = False, top_logprobs_num: int = 0) -> "PendingRound":
        """Launch one round for the requests in ``req_pool_indices [B]`` writing KV into
        ``round_cache_loc [B, round_tokens]`` (allocated by the caller, which frees the unkept
        ones once it reads the accept lengths). ``seq_lens_bound`` is a host integer no sequence
        of the round exceeds. Never reads a device value on the host."""
