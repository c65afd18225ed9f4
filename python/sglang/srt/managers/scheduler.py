"""Scheduler: one process per TP rank; turns requests into batches and runs them.

Rank 0 receives requests from the TokenizerManager (ZMQ PULL) and broadcasts them to the other
ranks, so every rank makes the same decisions and runs the same forwards in lockstep. Each
iteration of :meth:`Scheduler.event_loop_normal`: take in requests, pick the next batch (a
prefill of waiting requests, possibly one chunk of a long prompt; else a decode step of the
running batch), run it, process the result (append tokens, finish, free slots, stream).

Memory admission: a request is admitted only if the KV pool can hold its whole future
(prompt + max_new_tokens) on top of what the running requests may still claim, so a decode step
never runs out of slots and nothing is ever retracted. A request that could never fit (longer
than the context or the pool) is finished at once with ``FINISH_ABORT``.

The scheduler also runs in-process without sockets (``port_args=None``): :meth:`submit` queues
request objects, :meth:`step` runs one iteration and outputs collect in :attr:`outbox` (tests).
"""
from __future__ import annotations

import logging
import os
import time
import traceback
from typing import Any, Dict, List, Optional

import torch
import zmq

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed import broadcast_pyobj
from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import (AbortReq, FlushCacheReqInput, FlushCacheReqOutput,
                                           GetInternalStateReq, GetInternalStateReqOutput,
                                           ProfileReq, TokenizedGenerateReqInput)
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch, release_kv_cache
from sglang.srt.managers.scheduler_output_processor import SchedulerOutputProcessorMixin
from sglang.srt.managers.scheduler_profiler_mixin import SchedulerProfilerMixin
from sglang.srt.managers.scheduler_round import SchedulerRoundMixin
from sglang.srt.managers.scheduler_watchdog import SchedulerWatchdog
from sglang.srt.rounds.plain import GenerationBatchResult, TpModelWorker
from sglang.srt.managers.utils import (
    configure_child_logging,
    exit_if_parent_died,
    get_eos_token_ids,
    load_tokenizer,
    set_parent_death_signal,
)
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

logger = logging.getLogger(__name__)

# How long an idle rank 0 waits for a request before looping (also the idle broadcast period
# that keeps the other TP ranks' collectives from timing out).
IDLE_POLL_MS = 200


class Scheduler(SchedulerOutputProcessorMixin, SchedulerRoundMixin, SchedulerProfilerMixin):
    """Request queues, batching, and the event loop of one TP rank."""

    def __init__(self, server_args: Any, port_args: Any = None, tp_rank: int = 0):
        self.server_args = server_args
        self.tp_rank = tp_rank
        self.tp_size = server_args.tp_size
        self.model_config = ModelConfig.from_path(server_args.model_path,
                                                  server_args.json_model_override_args)
        nccl_port = port_args.nccl_port if port_args is not None else None
        self.init_round_config()  # validates a speculative draft before the target loads
        self.tp_worker = TpModelWorker(server_args, tp_rank, nccl_port, self.model_config,
                                       spec_requirements=self.spec_requirements)
        self.init_round_worker()
        runner = self.tp_worker.model_runner
        self.device = runner.device
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool_allocator = runner.token_to_kv_pool_allocator
        self.kda_state_pool = runner.kda_state_pool
        self.max_total_num_tokens = runner.max_total_num_tokens
        self.max_running_requests = self.req_to_token_pool.size
        # Not the map's width: with speculation the map has headroom past the context length.
        self.max_req_len = runner.context_len
        self.vocab_size = self.model_config.vocab_size

        self.tokenizer = load_tokenizer(server_args)
        self.eos_token_ids = get_eos_token_ids(self.model_config, self.tokenizer)
        cps = server_args.chunked_prefill_size
        self.chunked_prefill_size = cps if cps is not None and cps > 0 else None
        self.max_prefill_tokens = server_args.max_prefill_tokens
        # Token cap of a prefill batch that returns prompt logprobs (fp32 logits for every row).
        self.input_logprob_max_tokens = max(
            1, envs.SGLANG_INPUT_LOGPROB_LOGITS_BYTES.get() // (4 * self.vocab_size))
        self.stream_interval = server_args.stream_interval

        self.waiting_queue: List[Req] = []
        self.running_batch: Optional[ScheduleBatch] = None
        self.chunked_req: Optional[Req] = None  # a request whose prompt is partly prefilled
        # The last batch was a chunk with more to come: the running requests decode next.
        self._decode_turn = False

        # Counters (get_internal_state, decode log).
        self.forward_ct = 0
        self.init_profiler()
        self.num_generated_tokens = 0
        self.last_gen_throughput = 0.0
        self._tput_tokens, self._tput_time, self._decode_steps = 0, time.perf_counter(), 0

        if self.tp_rank == 0:
            self._log_startup_choices()

        self.parent_pid = os.getppid()
        self.inbox: List[Any] = []  # in-process mode
        self.outbox: List[Any] = []
        self._init_ipc(port_args)

    def _log_startup_choices(self) -> None:
        """One info line with what the flags and the checkpoint resolved to (``auto`` choices
        made, the checkpoint's own quantization found), so a log says what actually ran."""
        runner = self.tp_worker.model_runner
        quant = getattr(runner.model, "quant_config", None)
        attn = getattr(runner.attn_backend, "full_attn_backend", runner.attn_backend)
        kda = getattr(runner.attn_backend, "linear_attn_backend", None)
        kda_desc = ("none" if kda is None else
                    f"prefill {getattr(kda, 'kda_prefill_impl', '?')}, "
                    f"decode {getattr(kda, 'recurrent_impl', '?')}")
        logger.info(
            "Model %s: device %s, dtype %s, quantization %s, attention backend %s (%s), "
            "MoE runner backend %s, KDA backend %s, speculative algorithm %s",
            self.server_args.resolved_model_path(), self.device,
            str(runner.dtype).replace("torch.", ""),
            "none" if quant is None else quant.get_name(), self.server_args.attention_backend,
            type(attn).__name__, runner.moe_runner_backend, kda_desc,
            self.server_args.speculative_algorithm or "none")

    def _init_ipc(self, port_args: Any) -> None:
        self.recv_from_tokenizer = self.send_to_detok = self.send_to_tokenizer_sock = None
        if port_args is None or self.tp_rank != 0:
            return
        self.zmq_context = zmq.Context(2)
        self.recv_from_tokenizer = self.zmq_context.socket(zmq.PULL)
        self.recv_from_tokenizer.bind(port_args.scheduler_input_ipc_name)
        self.send_to_detok = self.zmq_context.socket(zmq.PUSH)
        self.send_to_detok.connect(port_args.detokenizer_ipc_name)
        self.send_to_tokenizer_sock = self.zmq_context.socket(zmq.PUSH)
        self.send_to_tokenizer_sock.connect(port_args.tokenizer_ipc_name)
        self.poller = zmq.Poller()
        self.poller.register(self.recv_from_tokenizer, zmq.POLLIN)

    def get_init_info(self) -> Dict[str, Any]:
        """What the launcher learns when this rank is ready."""
        return {
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "max_req_input_len": self.max_req_len - 1,
            "context_len": self.max_req_len,
            "vocab_size": self.vocab_size,
        }

    # ------------------------------------------------------------------ I/O
    def send_to_detokenizer(self, obj: Any) -> None:
        """Token outputs go to the detokenizer (in-process mode: the outbox)."""
        if self.send_to_detok is not None:
            self.send_to_detok.send_pyobj(obj)
        else:
            self.outbox.append(obj)

    def send_to_tokenizer(self, obj: Any) -> None:
        """Control replies go straight to the TokenizerManager (rank 0 only)."""
        if self.tp_rank != 0:
            return
        if self.send_to_tokenizer_sock is not None:
            self.send_to_tokenizer_sock.send_pyobj(obj)
        else:
            self.outbox.append(obj)

    def submit(self, obj: Any) -> None:
        """In-process mode: queue a request object for the next iteration."""
        self.inbox.append(obj)

    def has_work(self) -> bool:
        """Any request waiting, being prefilled or decoding, or a launched round unconsumed."""
        return bool(self.waiting_queue or self.chunked_req or self.pending_round or
                    (self.running_batch is not None and not self.running_batch.is_empty()))

    def recv_requests(self) -> List[Any]:
        """Rank 0 drains its socket (waiting up to IDLE_POLL_MS when idle); all ranks get the
        same list through a broadcast."""
        reqs: Optional[List[Any]] = None
        if self.tp_rank == 0:
            if self.recv_from_tokenizer is None:
                reqs, self.inbox = self.inbox, []
            else:
                reqs = []
                if self.poller.poll(0 if self.has_work() else IDLE_POLL_MS):
                    while True:
                        try:
                            reqs.append(self.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK))
                        except zmq.Again:
                            break
        if self.tp_size > 1:
            reqs = broadcast_pyobj(reqs, src=0)
        return reqs

    def process_input_requests(self, recv_reqs: List[Any]) -> None:
        """Dispatch received messages (generate, abort, flush, internal state)."""
        for obj in recv_reqs:
            if isinstance(obj, TokenizedGenerateReqInput):
                self.handle_generate_request(obj)
            elif isinstance(obj, AbortReq):
                self.abort_request(obj)
            elif isinstance(obj, FlushCacheReqInput):
                self.send_to_tokenizer(self.flush_cache())
            elif isinstance(obj, GetInternalStateReq):
                self.send_to_tokenizer(GetInternalStateReqOutput(self.get_internal_state()))
            elif isinstance(obj, ProfileReq):
                self.handle_profile_request(obj)
            else:
                logger.error("scheduler got an unknown message %s; ignored", type(obj).__name__)

    # ------------------------------------------------------------------ requests
    def handle_generate_request(self, recv: TokenizedGenerateReqInput) -> None:
        """Queue a request, or finish it at once with FINISH_ABORT if it can never run."""
        req = Req(recv.rid, recv.input_text, recv.input_ids, recv.sampling_params,
                  return_logprob=recv.return_logprob, logprob_start_len=recv.logprob_start_len,
                  top_logprobs_num=recv.top_logprobs_num, stream=recv.stream,
                  eos_token_ids=self.eos_token_ids,
                  return_hidden_states=recv.return_hidden_states)
        error = self._admission_error(req)
        if error is not None:
            req.finished_reason = FINISH_ABORT(error, status_code=400, err_type="BadRequestError")
            self.stream_output([req])
            return
        self.waiting_queue.append(req)

    def _admission_error(self, req: Req) -> Optional[str]:
        n = len(req.origin_input_ids)
        sp = req.sampling_params
        if n == 0:
            return "the prompt is empty"
        if req.return_hidden_states and not self.round_worker.returns_hidden_states:
            return ("'return_hidden_states' is not supported with speculative decoding "
                    f"(--speculative-algorithm {self.server_args.speculative_algorithm})")
        bad = [t for t in req.origin_input_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"input id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
        if sp.max_new_tokens is None:
            sp.max_new_tokens = max(self.max_req_len - n, 0)  # "until the context is full"
        if n + sp.max_new_tokens > self.max_req_len:
            return (f"the prompt ({n} tokens) plus max_new_tokens ({sp.max_new_tokens}) exceeds "
                    f"the context length ({self.max_req_len} tokens)")
        if self._tokens_needed(req) > self.max_total_num_tokens:
            spec = (f" + {self.token_headroom} run-ahead headroom"
                    if self.token_headroom else "")
            return (f"the request needs {self._tokens_needed(req)} KV cache slots (prompt {n} + "
                    f"max_new_tokens {sp.max_new_tokens}{spec}) but the pool holds only "
                    f"{self.max_total_num_tokens}; lower max_new_tokens or raise --max-total-tokens")
        return None

    def _tokens_needed(self, req: Req) -> int:
        # The last sampled token is never fed back, so it never gets a KV slot. Rounds are
        # allocated ahead and the host learns a finish one round late: the worker's headroom.
        return (len(req.origin_input_ids) + max(req.sampling_params.max_new_tokens - 1, 0)
                + self.token_headroom)

    def abort_request(self, recv: AbortReq) -> None:
        """Abort by rid (or all): free its slots and report FINISH_ABORT to the client."""
        def hit(r: Req) -> bool:
            return recv.abort_all or r.rid == recv.rid

        aborted = [r for r in self.waiting_queue if hit(r)]
        self.waiting_queue = [r for r in self.waiting_queue if not hit(r)]
        if self.chunked_req is not None and hit(self.chunked_req):
            aborted.append(self.chunked_req)
            self.chunked_req = None
        if self.running_batch is not None:
            keep = [i for i, r in enumerate(self.running_batch.reqs) if not hit(r)]
            aborted += [r for r in self.running_batch.reqs if hit(r)]
            self.running_batch.filter_batch(keep)
            if self.running_batch.is_empty():
                self.running_batch = None
        for r in aborted:
            r.finished_reason = FINISH_ABORT("the request was aborted", err_type="Aborted")
            release_kv_cache(r, self.req_to_token_pool, self.token_to_kv_pool_allocator)
        self.stream_output(aborted)
        if self.running_batch is None:
            # Nothing left to run ahead of: settle the round in flight now (its slots come back),
            # so that a state query in the same batch of messages sees the pools as they are.
            self._consume_pending_round()

    # ------------------------------------------------------------------ batching
    def _admitted_reqs(self) -> List[Req]:
        reqs = list(self.running_batch.reqs) if self.running_batch is not None else []
        return reqs + ([self.chunked_req] if self.chunked_req is not None else [])

    def _free_unreserved_tokens(self) -> int:
        """KV slots neither allocated nor promised to an admitted request."""
        promised = sum(max(r.reserved_tokens - r.kv_len, 0) for r in self._admitted_reqs())
        return self.token_to_kv_pool_allocator.available_size() - promised

    def get_new_batch_prefill(self) -> Optional[ScheduleBatch]:
        """The next extend batch: the chunked request's next chunk, then new requests, within
        the chunked-prefill token budget, free request slots and unreserved KV slots."""
        budget = self.chunked_prefill_size or float("inf")
        free_tokens = self._free_unreserved_tokens()
        num_admitted = len(self._admitted_reqs())
        reqs: List[Req] = []
        total = 0  # tokens in the batch so far
        if self.chunked_req is not None:
            r = self.chunked_req
            if r.wants_input_logprobs():
                budget = min(budget, self.input_logprob_max_tokens)
            r.extend_input_len = int(min(len(r.origin_input_ids) - r.kv_len, budget))
            budget -= r.extend_input_len
            total += r.extend_input_len
            reqs.append(r)
            if r.kv_len + r.extend_input_len >= len(r.origin_input_ids):
                self.chunked_req = None
        while self.waiting_queue and budget > 0 and self.chunked_req is None:
            r = self.waiting_queue[0]
            need = self._tokens_needed(r)
            if num_admitted >= self.max_running_requests or need > free_tokens:
                break  # wait for running requests to finish and free their slots
            if reqs and total + len(r.origin_input_ids) > self.max_prefill_tokens:
                break  # --max-prefill-tokens: the next batch (a prompt alone is always taken)
            if r.wants_input_logprobs():  # then every row of the batch returns logits
                if total >= self.input_logprob_max_tokens:
                    break  # next batch
                budget = min(budget, self.input_logprob_max_tokens - total)
            row = self.req_to_token_pool.alloc(1)
            if row is None:
                break
            self.waiting_queue.pop(0)
            r.req_pool_idx, r.reserved_tokens, r.kv_len = row[0], need, 0
            r.kv_committed_slots = []  # host mirror: releasing never reads the device map
            if self.kda_state_pool is not None and self.kda_state_pool.layer_ids:
                self.kda_state_pool.clear_slots(row)  # every sequence starts from zero state
            r.extend_input_len = int(min(len(r.origin_input_ids), budget))
            budget -= r.extend_input_len
            total += r.extend_input_len
            if r.extend_input_len < len(r.origin_input_ids):
                self.chunked_req = r
            reqs.append(r)
            free_tokens -= need
            num_admitted += 1
        if not reqs:
            return None
        batch = ScheduleBatch.init_new(reqs, self.req_to_token_pool,
                                       self.token_to_kv_pool_allocator, self.device)
        rows = [i for i, r in enumerate(reqs)
                if r.kv_len + r.extend_input_len >= len(r.origin_input_ids)
                and r.sampling_params.max_new_tokens > 0]
        batch.sample_rows = rows
        if rows:
            picked = [reqs[i] for i in rows]
            batch.sampling_info = SamplingBatchInfo.from_reqs(
                [r.sampling_params for r in picked], [r.output_ids for r in picked],
                self.vocab_size, self.device, prompt_ids=[r.origin_input_ids for r in picked],
                eos_token_ids=self.eos_token_ids)
        return batch

    def get_next_batch_to_run(self) -> Optional[ScheduleBatch]:
        """Prefill first (lower time to first token), else decode the running batch; while a
        long prompt is prefilled in chunks, the running requests take one decode step between
        its chunks, so their tokens keep coming."""
        decoding = self.running_batch is not None and not self.running_batch.is_empty()
        if decoding and self._decode_turn and self.chunked_req is not None:
            self._decode_turn = False
            return self.running_batch
        batch = self.get_new_batch_prefill()
        if batch is not None:
            self._decode_turn = self.chunked_req is not None
            return batch
        return self.running_batch if decoding else None

    def run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult:
        """Prefill (or a chunk) of ``batch`` on the round worker: forward, sampling of the rows
        whose prompt completes, and the worker's prompt work (its future map, a draft)."""
        self.forward_ct += 1
        self._log_prefill_stats(batch)
        forward_batch = batch.prepare_for_extend()
        if any(r.return_hidden_states for r in batch.reqs):  # the LM head's input: no extra work
            forward_batch.capture_hidden_mode = CaptureHiddenMode.FULL
        rows = batch.sample_rows
        if rows is not None and len(rows) == len(batch.reqs):
            rows = None  # every request gets a token: no row selection needed
        sampled = batch.reqs if rows is None else [batch.reqs[i] for i in rows]
        # A speculative drafter pairs each token's hidden state with the token after it: for a
        # chunk that ends inside the prompt that is the next prompt token.
        next_prompt_tokens = [
            r.origin_input_ids[p + n] if p + n < len(r.origin_input_ids) else -1
            for r, p, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens)]
        return self.round_worker.prefill(
            forward_batch, batch.sampling_info, sample_rows=rows,
            return_logprob=any(r.return_logprob for r in sampled),
            top_logprobs_nums=[r.top_logprobs_num for r in sampled],
            next_prompt_tokens=next_prompt_tokens)

    def _log_prefill_stats(self, batch: ScheduleBatch) -> None:
        """Upstream's prefill log line, once per prefill batch (or chunk). There is no prefix
        cache, so ``#cached-token`` is always 0; ``#running-req`` counts the requests decoding
        before this batch joins them."""
        if self.tp_rank != 0:
            return
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: 0, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d", len(batch.reqs),
            sum(r.extend_input_len for r in batch.reqs),
            self.kv_tokens_used() / self.max_total_num_tokens, self.num_running(),
            len(self.waiting_queue))

    def kv_tokens_used(self) -> int:
        """KV slots allocated now (the log lines' ``#token`` and ``token usage``)."""
        return self.max_total_num_tokens - self.token_to_kv_pool_allocator.available_size()

    def num_running(self) -> int:
        """Requests in the running (decoding) batch."""
        return 0 if self.running_batch is None else self.running_batch.batch_size()

    def process_batch_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        """Apply a prefill's result (decode rounds go through ``process_round``)."""
        self.process_batch_result_prefill(batch, result)

    def step(self) -> bool:
        """One scheduling iteration without I/O waits; False when there was nothing to run."""
        busy = self.round_step(self.get_next_batch_to_run())
        if busy:
            self.profile_tick()
        return busy

    def run_until_idle(self, max_steps: int = 100000) -> None:
        """In-process mode: handle queued requests and step until nothing is left to do."""
        for _ in range(max_steps):
            self.process_input_requests(self.recv_requests())
            if not self.step() and not self.inbox:
                self.on_idle()
                return
        raise RuntimeError(f"scheduler still busy after {max_steps} steps")

    # ------------------------------------------------------------------ loop
    def event_loop_normal(self) -> None:
        """Synchronous loop: receive, schedule, run, process; sleeps in poll() when idle."""
        was_busy = False
        while True:
            self.process_input_requests(self.recv_requests())
            busy = self.step()
            if not busy:
                if was_busy:
                    self.on_idle()
                exit_if_parent_died(self.parent_pid)
            was_busy = busy

    def on_idle(self) -> None:
        """Finish the throughput window and check that every slot came back."""
        self._update_throughput()
        self.check_memory()

    def check_memory(self) -> None:
        """When idle, every KV slot and request row must be free (leak detector). With
        speculative decoding "idle" includes the last launched round having been consumed, so
        chain slots allocated ahead (kept, surplus, or of requests that finished or were aborted
        while the round was in flight) are all accounted for."""
        if self.has_work():
            return
        kv_free = self.token_to_kv_pool_allocator.available_size()
        req_free = self.req_to_token_pool.available_size()
        if kv_free != self.max_total_num_tokens or req_free != self.max_running_requests:
            spec = " (speculative chain slots included)" if self.spec_enabled else ""
            raise RuntimeError(
                f"memory leak: idle scheduler has {kv_free}/{self.max_total_num_tokens} KV slots "
                f"and {req_free}/{self.max_running_requests} request slots free{spec}")

    def _update_throughput(self) -> None:
        now = time.perf_counter()
        tokens = self.num_generated_tokens - self._tput_tokens
        if tokens > 0 and now > self._tput_time:
            self.last_gen_throughput = tokens / (now - self._tput_time)
        self._tput_tokens, self._tput_time = self.num_generated_tokens, now

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> FlushCacheReqOutput:
        """Reset the pools (and the forward counter); refused unless idle."""
        if self.has_work():
            return FlushCacheReqOutput(False, f"cannot flush the cache while requests are in "
                                              f"flight ({self.num_running()} running, "
                                              f"{len(self.waiting_queue)} waiting)")
        self.req_to_token_pool.clear()
        self.token_to_kv_pool_allocator.clear()
        self.forward_ct = 0
        self.reset_spec_metrics()
        return FlushCacheReqOutput(True, "Cache flushed.")

    def get_internal_state(self) -> Dict[str, Any]:
        """Counters for ``/server_info``'s ``internal_states``."""
        if self.running_batch is None:
            # A round still pending now ran only for requests that have finished (launched
            # before their finish was seen): settle it, so that free slots read as free.
            self._consume_pending_round()
        kv_free = self.token_to_kv_pool_allocator.available_size()
        return {
            "last_gen_throughput": self.last_gen_throughput,
            "num_running_reqs": self.num_running(),
            "num_waiting_reqs": len(self.waiting_queue),
            "num_generated_tokens": self.num_generated_tokens,
            "forward_ct": self.forward_ct,
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "available_kv_tokens": kv_free,
            "available_req_slots": self.req_to_token_pool.available_size(),
            "memory_usage": {"kv_tokens_used": self.max_total_num_tokens - kv_free,
                             "token_usage": 1.0 - kv_free / self.max_total_num_tokens},
            **self.spec_internal_state(),
        }


def run_scheduler_process(server_args: Any, port_args: Any, tp_rank: int, pipe_writer: Any) -> None:
    """Process entry point: build the scheduler, report readiness (or the startup error) through
    ``pipe_writer``, then run the event loop until the parent goes away."""
    set_parent_death_signal()
    configure_child_logging(server_args, f"TP{tp_rank}")
    # --cpu-num-threads, else a few threads per TP rank on CPU (ServerArgs.resolved_cpu_num_threads
    # says why). Set again once the scheduler exists: a CPU TP group's setup splits the threads
    # by its own rule (parallel_state.set_cpu_threads_for_rank).
    threads = server_args.resolved_cpu_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        scheduler = Scheduler(server_args, port_args, tp_rank)
    except Exception as e:
        pipe_writer.send({"status": "error", "error": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc()})
        return
    if threads is not None:
        torch.set_num_threads(threads)
    SchedulerWatchdog(scheduler, server_args.watchdog_timeout).start()
    pipe_writer.send({"status": "ready", **scheduler.get_init_info()})
    try:
        scheduler.event_loop_normal()
    except Exception:
        logger.exception("scheduler TP%d crashed", tp_rank)
        os._exit(1)
