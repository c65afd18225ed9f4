"""Scheduler half that launches decode rounds and consumes them one round late (host run-ahead).

Every decode step is a *round* of the round worker: the target :class:`TpModelWorker` (plain
decoding, one token per request) or a speculative worker looked up by ``--speculative-algorithm``
in :mod:`sglang.srt.rounds.registry` (a chain of ``N`` tokens per request). The loop
(:meth:`SchedulerRoundMixin.round_step`) launches round ``k + 1`` of the running batch before it
consumes round ``k`` (overlap schedule): the host never waits for the device to finish a round
before enqueueing the next one, and learns the tokens only through the round's copy-done event.
With ``--disable-overlap-schedule`` each round is consumed right after it is launched; both
orders produce the same tokens. Consequences the bookkeeping handles:

* A request that finishes in round ``k`` (EOS, stop string, ``max_new_tokens``, detected while
  appending its tokens one by one) has already been given round ``k + 1``; that round's tokens
  are discarded and all of its KV slots freed when it is consumed. Tokens of round ``k`` past the
  finish point are dropped the same way.
* KV slots: each round allocates ``N`` per request ahead (an upper bound); the ``N - accept_len``
  surplus ones are freed when the round is consumed. Admission reserves
  ``prompt + max_new_tokens - 1 + token_headroom`` so this never runs dry.
* The host mirrors each request's committed KV slots (``Req.kv_committed_slots``, CPU tensors)
  so that releasing a request never reads the device's request->token map.
* A prefill (or chunk) is launched like a round but consumed right away (its first token is
  needed to admit the request into the running batch).

Speculative metrics (as upstream): per request ``spec_verify_ct``, accepted drafts and the
histogram of accepted drafts per round (plus, when the worker plans a verify length per round,
the histogram and sum of those "cap" lengths and the tokens the rounds committed), sent with the
finishing output; server-wide ``avg_spec_accept_length`` = committed tokens / (requests x
rounds) and the accepted-drafts histogram over every (request, round) pair counted, reset by
``flush_cache``. Every count comes from the host copies a round already makes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from sglang.srt.rounds.relay import PendingRound
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.model_executor.cuda_graph_runner import (capture_batch_sizes,
                                                          captured_graph_count,
                                                          report_graph_count)
from sglang.srt.model_executor.prefill_graph_runner import init_prefill_graphs_from_args
from sglang.srt.model_executor.prefill_warmup import warm_up_prefill
from sglang.srt.rounds.registry import get_spec_worker_class
from sglang.srt.speculative.spec_info import SpecMetricsOutput

if TYPE_CHECKING:
    from sglang.srt.rounds.contract import BaseSpecWorker

# The scheduler's logger: the decode log line keeps the name it has upstream.
logger = logging.getLogger("sglang.srt.managers.scheduler")

@dataclass
class LaunchedRound:
    """A launched round and the requests it ran for (the running batch may change after)."""

    reqs: List[Req]
    result: PendingRound


class SchedulerRoundMixin:
    """Decode-round parts of :class:`~sglang.srt.managers.scheduler.Scheduler`."""

    # ------------------------------------------------------------------ setup
    def init_round_config(self) -> None:
        """Before the target is built: find the speculative worker class and let it validate
        the draft and size what the target must reserve (a target without an MTP layer fails
        here, before any weights are loaded)."""
        args = self.server_args
        self.spec_worker_class = get_spec_worker_class(args.speculative_algorithm)
        self.spec_requirements = None if self.spec_worker_class is None else \
            self.spec_worker_class.requirements(args, self.model_config)
        self.draft_worker: Optional["BaseSpecWorker"] = None
        self.pending_round: Optional[LaunchedRound] = None
        self.enable_overlap = not args.disable_overlap_schedule
        self.reset_spec_metrics()

    def init_round_worker(self) -> None:
        """After the target worker exists: the speculative worker over its pools (if any), and
        the KV headroom a request needs beyond its tokens (one round in flight past its end)."""
        if self.spec_worker_class is not None:
            self.draft_worker = self.spec_worker_class(self.server_args, self.tp_worker,
                                                       self.spec_requirements)
        self.round_worker = self.draft_worker or self.tp_worker
        args = self.server_args
        if not args.disable_cuda_graph and self.tp_worker.device.type == "cuda":
            self.round_worker.init_cuda_graphs(capture_batch_sizes(
                args, self.tp_worker.model_runner.req_to_token_pool.size))
        # The model and its graphs are ready: compile the prefill kernels now, before the rank
        # reports ready, rather than inside the first user prefills (CUDA only; skipped with
        # --skip-server-warmup). Plain prefill of the target only; the slots come back.
        warm_up_prefill(self.tp_worker.model_runner, args)
        before = captured_graph_count()  # the decode graphs (and any earlier in the process)
        init_prefill_graphs_from_args(self.round_worker, args)
        if captured_graph_count():
            report_graph_count(before, captured_graph_count() - before)
        self.token_headroom = (self.spec_requirements.token_headroom
                               if self.spec_requirements is not None
                               else self.round_worker.round_tokens)

    @property
    def spec_enabled(self) -> bool:
        """A speculative worker runs the decode rounds."""
        return self.round_worker.is_speculative

    def reset_spec_metrics(self) -> None:
        """Zero the server-wide acceptance counters (``flush_cache``)."""
        self.spec_num_accept_tokens = 0  # committed tokens over all (request, round) pairs
        self.spec_num_verify_reqs = 0  # (request, round) pairs
        self.spec_num_correct_drafts = 0
        # [k]: (request, round) pairs that accepted k drafts; [l]: pairs planned with cap l.
        self.spec_correct_drafts_histogram: List[int] = []
        self.spec_cap_lens_histogram: List[int] = []

    def avg_spec_accept_length(self) -> float:
        """Committed tokens per request per round since the last flush (0 before any round)."""
        if self.spec_num_verify_reqs == 0:
            return 0.0
        return self.spec_num_accept_tokens / self.spec_num_verify_reqs

    # ------------------------------------------------------------------ loop
    def round_step(self, batch: Optional[ScheduleBatch]) -> bool:
        """One iteration: launch ``batch`` (a round of the running batch, or a prefill), then
        consume the previously launched round (overlap; without it the round just launched);
        a prefill is consumed at once. False when there was nothing to do."""
        if batch is None:
            if self.pending_round is None:
                return False
            self._consume_pending_round()
            return True
        if batch is self.running_batch:
            launched = self.launch_round(batch)
            self._consume_pending_round()
            self.pending_round = launched
            if not self.enable_overlap:
                self._consume_pending_round()
            return True
        result = self.run_batch(batch)
        self._consume_pending_round()
        self.process_batch_result(batch, result)
        return True

    def launch_round(self, batch: ScheduleBatch) -> LaunchedRound:
        """Allocate the round's KV slots and enqueue it on the round worker."""
        self.forward_ct += 1
        worker = self.round_worker
        slots, round_cache_loc, bound = batch.prepare_for_round(
            worker.round_tokens, worker.round_cache_loc_buffer(len(batch.reqs)))
        want_lp = [r for r in batch.reqs if r.return_logprob]
        # Rows whose hidden states the round returns (admission refuses such requests unless
        # the worker's rounds return them).
        hidden = [b for b, r in enumerate(batch.reqs) if r.return_hidden_states]
        result = worker.forward_round(
            slots, round_cache_loc, batch.sampling_info, seq_lens_bound=bound,
            return_logprob=bool(want_lp),
            top_logprobs_num=max([r.top_logprobs_num for r in want_lp], default=0),
            hidden_state_rows=hidden or None)
        return LaunchedRound(list(batch.reqs), result)

    def _consume_pending_round(self) -> None:
        if self.pending_round is not None:
            pending, self.pending_round = self.pending_round, None
            self.process_round(pending)

    # ------------------------------------------------------------------ results
    def process_round(self, pending: LaunchedRound) -> None:
        """Apply a round's outcome (waits for its copy-done event): commit slots, append tokens
        one at a time with the finish checks, free surplus slots, stream, drop finished."""
        out = pending.result.wait()
        to_free: List[torch.Tensor] = []
        active: List[Req] = []
        for b, r in enumerate(pending.reqs):
            loc = out.round_cache_loc[b]
            if r.finished() or r.req_pool_idx is None:
                to_free.append(loc)  # finished (or aborted) before this round: all surplus
                continue
            a = out.accept_lens[b]
            # A copy: a view would keep this round's whole pinned host buffer alive until the
            # request ends (one pinned block per round).
            r.kv_committed_slots.append(loc[:a].clone())
            to_free.append(loc[a:])
            r.kv_len += a
            committed = self._append_round_tokens(r, out, b)
            self._append_round_hidden_states(r, out, b)
            if self.spec_enabled:
                self._count_spec_round(r, a, committed,
                                       None if out.cap_lens is None else out.cap_lens[b])
            active.append(r)
        self.token_to_kv_pool_allocator.free(torch.cat(to_free))
        self._finish_and_stream(active)
        if self.running_batch is not None:
            self.running_batch.filter_batch()
            if self.running_batch.is_empty():
                self.running_batch = None
        if active:  # a round launched past every request's finish decoded nothing: not a step
            self._log_decode_stats()

    def _count_spec_round(self, r: Req, accept_len: int, committed: int,
                          cap: Optional[int]) -> None:
        """One verify round of ``r`` into its counters and the server's: ``accept_len`` tokens
        committed on the device (accepted drafts + the bonus), ``committed`` of them appended
        to the output (fewer when the request finished inside the round), planned verify
        length ``cap`` (None: the worker plans none)."""
        bins = self.round_worker.proposed_per_round + 1
        correct = accept_len - 1
        r.spec_verify_ct += 1
        r.spec_num_correct_drafts += correct
        r.spec_num_block_accept_tokens += committed
        self.spec_num_accept_tokens += accept_len
        self.spec_num_verify_reqs += 1
        self.spec_num_correct_drafts += correct
        for hist in (r.spec_correct_drafts_histogram, self.spec_correct_drafts_histogram):
            _bump(hist, correct, bins, "accepted drafts")
        if cap is not None:
            r.spec_num_cap_tokens += cap
            for hist in (r.spec_cap_lens_histogram, self.spec_cap_lens_histogram):
                _bump(hist, cap, bins, "planned verify length")

    def _append_round_tokens(self, r: Req, out: Any, b: int) -> int:
        """Append request ``b``'s committed tokens until it finishes (the rest is discarded);
        the number appended."""
        for i, token in enumerate(out.tokens[b]):
            r.output_ids.append(token)
            self.num_generated_tokens += 1
            if r.return_logprob and out.token_logprobs is not None:
                r.output_token_logprobs_val.append(out.token_logprobs[b][i])
                r.output_token_logprobs_idx.append(token)
                if r.top_logprobs_num > 0 and out.top_logprobs_val is not None:
                    r.output_top_logprobs_val.append(out.top_logprobs_val[b][i][: r.top_logprobs_num])
                    r.output_top_logprobs_idx.append(out.top_logprobs_idx[b][i][: r.top_logprobs_num])
            r.check_finished(self.tokenizer)
            if r.finished():
                return i + 1
        return len(out.tokens[b])

    def _log_decode_stats(self) -> None:
        """Every ``--decode-log-interval`` rounds that decoded for some request: the decode
        log line (as upstream's), with the accept length and rate under speculation. Skipped
        when no request is left running (the round finished them all): a line saying
        ``#running-req: 0`` would only be noise."""
        self._decode_steps += 1
        if self._decode_steps % self.server_args.decode_log_interval != 0:
            return
        self._update_throughput()
        running = self.num_running()
        if self.tp_rank == 0 and running > 0:
            used = self.kv_tokens_used()
            spec = ""
            if self.spec_enabled:
                drafts = self.spec_num_verify_reqs * self.round_worker.proposed_per_round
                spec = (f"accept len: {self.avg_spec_accept_length():.2f}, accept rate: "
                        f"{self.spec_num_correct_drafts / max(drafts, 1):.2f}, ")
            logger.info(
                "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, %s"
                "gen throughput (token/s): %.2f, #queue-req: %d", running, used,
                used / self.max_total_num_tokens, spec, self.last_gen_throughput,
                len(self.waiting_queue))

    def spec_metrics_message(self, reqs: List[Req]) -> Optional[SpecMetricsOutput]:
        """Counters of the finished requests among ``reqs`` (None if there are none)."""
        done = [r for r in reqs if r.finished() and r.spec_verify_ct > 0]
        if not self.spec_enabled or not done:
            return None
        per_round = self.round_worker.proposed_per_round
        capped = any(r.spec_cap_lens_histogram for r in done)
        return SpecMetricsOutput(
            rids=[r.rid for r in done],
            spec_verify_ct=[r.spec_verify_ct for r in done],
            spec_num_correct_drafts=[r.spec_num_correct_drafts for r in done],
            spec_num_proposed_drafts=[r.spec_verify_ct * per_round for r in done],
            spec_correct_drafts_histogram=[r.spec_correct_drafts_histogram for r in done],
            spec_cap_lens_histogram=[r.spec_cap_lens_histogram for r in done] if capped else None,
            spec_num_cap_tokens=[r.spec_num_cap_tokens for r in done] if capped else None,
            spec_num_block_accept_tokens=[r.spec_num_block_accept_tokens for r in done]
            if capped else None)

    def spec_internal_state(self) -> Dict[str, Any]:
        """Speculative entries of ``get_internal_state`` (empty without speculation)."""
        if not self.spec_enabled:
            return {}
        bins = self.round_worker.proposed_per_round + 1
        caps = {"spec_cap_lens_histogram": _padded(self.spec_cap_lens_histogram, bins)} \
            if self.spec_cap_lens_histogram else {}
        return {
            "avg_spec_accept_length": self.avg_spec_accept_length(),
            "spec_correct_drafts_histogram": _padded(self.spec_correct_drafts_histogram, bins),
            **caps,
            "spec_num_verify_reqs": self.spec_num_verify_reqs,
            "spec_num_accept_tokens": self.spec_num_accept_tokens,
            "speculative_num_steps": self.server_args.speculative_num_steps,
            "speculative_num_draft_tokens": self.server_args.speculative_num_draft_tokens,
            **self.round_worker.internal_state(),  # the algorithm's own entries
        }


def _bump(hist: List[int], k: int, bins: int, what: str) -> None:
    """``hist[k] += 1`` in a histogram of ``bins`` bins (zero-filled on first use)."""
    if not 0 <= k < bins:
        raise RuntimeError(f"speculative round reported {what} {k}, outside 0..{bins - 1} "
                           "(the drafts it proposes per round)")
    if len(hist) < bins:
        hist.extend([0] * (bins - len(hist)))
    hist[k] += 1


def _padded(hist: List[int], bins: int) -> List[int]:
    """A copy of ``hist`` with ``bins`` bins (all zero before the first count)."""
    return list(hist) + [0] * (bins - len(hist))
