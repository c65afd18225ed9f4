"""The round-worker contract: what the scheduler and the graph runner know of a worker.

Every decode step is a *round*. A :class:`RoundWorker` runs one for the running batch: it gathers
each request's input from its :class:`~sglang.srt.rounds.relay.FutureMap` by request slot, does
fixed-shape device work (its :meth:`RoundWorker.round_phases`), scatters what the next round
needs back into the map, and returns a :class:`~sglang.srt.rounds.relay.PendingRound` whose
host copies the scheduler waits on one round later. No step of a round reads a device value on
the host, so the scheduler can launch round ``k + 1`` before it reads round ``k``, and a CUDA
graph (:class:`~sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner`) can capture the
round whole.

* **Plain decoding** is :class:`~sglang.srt.rounds.plain.TpModelWorker`: one token per request.
* **A speculative worker** (:class:`BaseSpecWorker`) is registered under its
  ``--speculative-algorithm`` name (:mod:`sglang.srt.rounds.registry`); the scheduler uses it in
  three steps:

  1. *Before the target loads*, :meth:`BaseSpecWorker.requirements` validates the draft and says
     what the target's model runner must provide (:class:`SpecRequirements`).
  2. *After the target loads*, the worker is built over the target's
     :class:`~sglang.srt.rounds.plain.TpModelWorker` (it shares the target's pools).
  3. *Serving*, it answers the same calls as the plain worker: :meth:`RoundWorker.prefill` and
     :meth:`RoundWorker.forward_round`.

This module holds the control flow the two share: the argument checks of a round, replay of a
captured round when one fits the batch (else eager execution), and building the graph runner.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.configs.engine_defaults import SPECULATIVE_MAX_RUNNING_REQUESTS
from sglang.srt.environ import envs
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, RoundPhase, run_phases
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

if TYPE_CHECKING:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.rounds.plain import GenerationBatchResult, TpModelWorker
    from sglang.srt.rounds.relay import FutureMap, PendingRound

logger = logging.getLogger(__name__)

__all__ = ["RoundWorker", "BaseSpecWorker", "SpecRequirements"]


class RoundWorker(ABC):
    """A worker that runs decode rounds (see the module docstring).

    A concrete worker provides ``device``, ``future_map`` (whose ``seq_lens`` are the committed
    lengths), :attr:`round_tokens`, :attr:`proposed_per_round`, :meth:`prefill`,
    :meth:`round_phases`, :meth:`graph_setup` and :meth:`pending_round`; the hooks have
    defaults for a worker whose rounds have one shape and one set of outputs.
    """

    # Counted as speculative by the scheduler's metrics (accept length, verify counters).
    is_speculative = False
    # True for a worker that rebuilds its attention plan on the host every round (a verify
    # width chosen per round): a captured metadata refill would replay its capture's plan, so
    # the metadata glue graph is not used for it (model_executor/graph_refill.py).
    host_planned_attention = False
    # True for a worker whose rounds can also return the hidden states of chosen rows
    # (``return_hidden_states``); the scheduler refuses such requests otherwise.
    returns_hidden_states = False
    graph_runner: Optional[CudaGraphRunner] = None
    device: torch.device
    future_map: "FutureMap"

    # ------------------------------------------------------------------ what a worker defines
    @property
    @abstractmethod
    def round_tokens(self) -> int:
        """KV slots each request of a round is given (an upper bound on what it keeps)."""

    @property
    @abstractmethod
    def proposed_per_round(self) -> int:
        """Draft tokens proposed per request per round (the accept-rate denominator; 0 for
        plain decoding)."""

    @abstractmethod
    def prefill(self, forward_batch: "ForwardBatch", sampling_info: Optional[SamplingBatchInfo],
                sample_rows: Optional[Sequence[int]] = None, return_logprob: bool = False,
                top_logprobs_nums: Optional[Sequence[int]] = None,
                next_prompt_tokens: Optional[Sequence[int]] = None) -> "GenerationBatchResult":
        """Target prefill (or chunk) with sampling, then whatever the worker's rounds need from
        the prompt; the sampled rows' first token and length go into the future map.
        ``next_prompt_tokens[b]``: the prompt token after request ``b``'s chunk, ``-1`` when the
        chunk completes the prompt."""

    @abstractmethod
    def round_phases(self) -> List[RoundPhase]:
        """The round's phases in order (see :data:`RoundPhase`): fixed-shape device work with no
        host reads, which a CUDA graph captures together (or one graph each)."""

    @abstractmethod
    def graph_setup(self) -> dict:
        """Keyword arguments of :class:`CudaGraphRunner` particular to this worker's body:
        ``tokens_per_request``, ``backends``, ``runners`` (model runners whose capture limits
        and width dependence apply)."""

    @abstractmethod
    def pending_round(self, out: Dict[str, torch.Tensor], loc: torch.Tensor,
                      return_logprob: bool, top_logprobs_num: int,
                      on_current_stream: bool = False) -> "PendingRound":
        """Start the host copies of a round's outputs ``out`` (from the body or a replay)."""

    # ------------------------------------------------------------------ hooks with defaults
    def internal_state(self) -> Dict[str, Any]:
        """Worker-specific entries for ``/server_info``'s ``internal_states`` (host values
        only; none by default)."""
        return {}

    def round_cache_loc_buffer(self, bs: int) -> Optional[torch.Tensor]:
        """Where a round of ``bs`` requests should allocate its KV slots (``[bs, N]``): the
        graph runner's static input, so that a replay needs no copy of them; None (allocate a
        new tensor) without graphs. The buffer is overwritten by the next round, so the round's
        host copies run on the current stream (:meth:`run_round`)."""
        runner = self.graph_runner
        if runner is None or runner.refill is None:
            return None
        return runner.refill.loc_buffer(bs)

    def next_round_shape(self) -> Optional[int]:
        """The shape of the round being launched, known on the host before it is enqueued (e.g.
        a verify-width tier chosen from rounds already consumed), or None for a worker whose
        rounds have one shape. Graphs are keyed by it (``GraphKey.round_shape``)."""
        return None

    def apply_round_shape(self, shape: Optional[int]) -> None:
        """Make :meth:`round_phases` run rounds of ``shape`` (a :meth:`next_round_shape`
        value); nothing for a worker with one shape."""

    def round_needs_eager(self) -> bool:
        """True when the round being launched asks for an output no graph holds (it then runs
        eagerly and no graph is captured for it); False by default."""
        return False

    def round_body(self, slots: torch.Tensor, loc: torch.Tensor, info: SamplingBatchInfo,
                   bound: int, return_logprob: bool = False) -> Dict[str, torch.Tensor]:
        """The device work of one round: its phases in order (fixed shapes, no host reads)."""
        return run_phases(self.round_phases(), slots, loc, info, bound, return_logprob)

    # ------------------------------------------------------------------ the shared control flow
    def forward_round(self, req_pool_indices: torch.Tensor, round_cache_loc: torch.Tensor,
                      sampling_info: SamplingBatchInfo, seq_lens_bound: Optional[int] = None,
                      return_logprob: bool = False, top_logprobs_num: int = 0,
                      hidden_state_rows: Optional[Sequence[int]] = None) -> "PendingRound":
        """Launch one round for the requests in ``req_pool_indices [B]`` (device), writing KV
        into ``round_cache_loc [B, round_tokens]`` (allocated by the caller, which frees the
        unkept slots once it has the accept lengths); the returned
        :class:`~sglang.srt.rounds.relay.PendingRound` gives the tokens a round later.
        ``seq_lens_bound``: a host integer no sequence of the round exceeds (the scheduler's,
        ``ScheduleBatch.prepare_for_round``); attention backends size padded gathers with it
        instead of reading device lengths. ``None`` (tests) reads it from the device, a sync.
        ``hidden_state_rows``: rows (indices into the round's requests) whose hidden states the
        round also returns, for workers with :attr:`returns_hidden_states`."""
        n = self.round_tokens
        b = int(req_pool_indices.shape[0])
        if b < 1 or tuple(round_cache_loc.shape) != (b, n):
            raise ValueError(f"forward_round: round_cache_loc must be [B={b}, N={n}] with B >= 1, "
                             f"got {tuple(round_cache_loc.shape)}")
        if sampling_info.batch_size != b:
            raise ValueError(f"forward_round: sampling_info has {sampling_info.batch_size} rows "
                             f"for {b} requests")
        if hidden_state_rows and not self.returns_hidden_states:
            raise ValueError(f"forward_round: {type(self).__name__} does not return hidden states")
        slots = req_pool_indices.to(device=self.device, dtype=torch.int64)
        loc = round_cache_loc.to(device=self.device, dtype=torch.int64)
        if seq_lens_bound is None:
            seq_lens_bound = int(self.future_map.seq_lens[slots].max()) + n
        return self.run_round(slots, loc, sampling_info, seq_lens_bound, return_logprob,
                              top_logprobs_num)

    def prefill_graph_plan(self) -> List[Tuple["ModelRunner", Dict[str, Any]]]:
        """The runners whose one-request prefills ``--prefill-cuda-graph-tokens`` captures, each
        with its ``ModelRunner.init_prefill_graphs`` keywords (the hidden states its prefill
        asks for, its forward mode, its per-token inputs). None by default: a speculative
        worker names its target's (the plain worker's plan) and its draft's, if any."""
        return []

    def init_cuda_graphs(self, batch_sizes: Sequence[int], emulate: Optional[bool] = None,
                         capture_now: bool = True, per_phase: bool = False,
                         refill_mode: Optional[str] = None) -> CudaGraphRunner:
        """Build the graph runner for ``batch_sizes`` (capturing the start-up graphs now). A
        round of several phases is one graph, or one graph per phase with ``per_phase`` (an
        A/B of benchmark/batch1/graph_ab.py). ``refill_mode`` (model_executor/graph_refill.py):
        ``changed`` by default, ``glue`` when ``SGLANG_ENABLE_METADATA_GLUE_GRAPH`` is set,
        ``full`` (the reference refill) when a test or benchmark asks for it."""
        if refill_mode is None:
            glue = envs.SGLANG_ENABLE_METADATA_GLUE_GRAPH.get()
            refill_mode = "glue" if glue else "changed"
        if refill_mode == "glue" and self.host_planned_attention:
            logger.warning("SGLANG_ENABLE_METADATA_GLUE_GRAPH is ignored: %s rebuilds its "
                           "attention plan on the host every round", type(self).__name__)
            refill_mode = "changed"
        phases = self.round_phases()
        setup = self.graph_setup()
        runners = setup.pop("runners")
        limits = [r.max_cuda_graph_tokens() for r in runners]
        limits = [x for x in limits if x is not None]
        first = runners[0]
        self.graph_runner = CudaGraphRunner(
            self.round_body, device=first.device, vocab_size=first.model_config.vocab_size,
            batch_sizes=batch_sizes, max_width=first.req_to_token_pool.req_to_token.shape[1],
            max_graph_tokens=min(limits) if limits else None,
            width_independent=all(b.width_independent for b in setup["backends"]),
            round_tokens=self.round_tokens, emulate=emulate, capture_now=capture_now, phases=phases,
            per_phase=per_phase and len(phases) > 1, refill_mode=refill_mode,
            set_round_shape=self.apply_round_shape, **setup)
        return self.graph_runner

    def run_round(self, slots: torch.Tensor, loc: torch.Tensor, info: SamplingBatchInfo,
                  bound: int, return_logprob: bool, top_logprobs_num: int) -> "PendingRound":
        """The round's :class:`~sglang.srt.rounds.relay.PendingRound`: replayed when a graph
        fits the batch (its static outputs are copied to the host on the current stream, ahead
        of the next replay), else run eagerly."""
        out = None
        runner = self.graph_runner
        shape = self.next_round_shape()
        self.apply_round_shape(shape)
        if runner is not None and not self.round_needs_eager():
            key = runner.key(int(slots.shape[0]), info, return_logprob, bound, shape)
            if key is not None:
                out = runner.replay(key, slots, loc, info)
        if out is not None:
            return self.pending_round(out, loc, return_logprob, top_logprobs_num,
                                      on_current_stream=True)
        out = self.round_body(slots, loc, info, bound, return_logprob)
        in_place = runner is not None and runner.refill is not None
        if in_place:
            runner.refill.forget()  # the eager body advanced the live step counters itself
        # ``loc`` may be the runner's static buffer, which the next round's allocation
        # overwrites: its copy must then be ordered before it on the current stream.
        return self.pending_round(out, loc, return_logprob, top_logprobs_num,
                                  on_current_stream=in_place)


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
    # What the worker itself keeps per request slot of the target's pools (its relay payload,
    # chain buffers), allocated after them: elements in the target's dtype, plus bytes of
    # fixed-dtype buffers (token ids, fp32 distributions). Together with the KDA scratch
    # (``kda_scratch_depth`` copies of a slot's state) this is what speculation adds to a
    # request slot, which the target's memory plan counts when it sizes the slots.
    draft_elems_per_request_slot: int = 0
    draft_bytes_per_request_slot: int = 0
    # The most request slots sized from memory without --max-running-requests (the slot count
    # off CUDA): upstream's speculative default.
    max_request_slots: int = SPECULATIVE_MAX_RUNNING_REQUESTS

    def runner_kwargs(self) -> dict:
        """Keyword arguments of the target's :class:`ModelRunner` that size its pools."""
        return dict(spec_num_draft_tokens=self.kda_scratch_depth,
                    position_headroom=self.position_headroom,
                    draft_extra_mla_layers=self.draft_extra_mla_layers,
                    draft_model_config=self.draft_model_config,
                    draft_weight_elems=self.draft_weight_elems,
                    draft_elems_per_kv_slot=self.draft_elems_per_kv_slot,
                    draft_elems_per_request_slot=self.draft_elems_per_request_slot,
                    draft_bytes_per_request_slot=self.draft_bytes_per_request_slot,
                    request_slot_cap=self.max_request_slots)


class BaseSpecWorker(RoundWorker):
    """A speculative round worker over a target :class:`~sglang.srt.rounds.plain.TpModelWorker`:
    its rounds propose drafts and verify them with one target forward."""

    is_speculative = True

    @classmethod
    @abstractmethod
    def requirements(cls, server_args: Any, target_config: "ModelConfig") -> SpecRequirements:
        """Validate the draft for this target (raise ``ValueError`` naming the flag) and size
        what the target runner must reserve. Called before any weights load."""

    @abstractmethod
    def __init__(self, server_args: Any, target_worker: "TpModelWorker",
                 requirements: SpecRequirements):
        """Build the draft over the target's pools."""
