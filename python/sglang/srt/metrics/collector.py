"""Prometheus metrics (``--enable-metrics``), with upstream SGLang's names and a ``model_name``
label.

Two sources feed one private registry (a private one so that several servers or test engines in
one process never clash over metric names):

* :class:`TokenizerMetricsCollector`: per-request counters and latency histograms, observed in
  the TokenizerManager as the detokenizer's outputs arrive. Time to first token, inter-token
  latency and time per output token are observed for streaming requests only: a non-streaming
  request's tokens all reach the TokenizerManager at once, at the end, so their arrival times
  would measure nothing. End-to-end latency and the token counters cover every request; health
  probes (``log_metrics=False``) are left out.
* :class:`SchedulerMetricsCollector`: gauges of the scheduler (running and queued requests, KV
  usage, throughput, speculative accept length), set from its internal state each time
  ``/metrics`` is scraped, so the scheduler process needs no Prometheus machinery of its own.

``prometheus_client`` is imported only when :class:`ServerMetrics` is built, so a server
without ``--enable-metrics`` runs without the package.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

# Histogram buckets in seconds. This engine is built for batch-1 latency, where a decode step is
# a few milliseconds on a GPU: the inter-token buckets are dense below 20 ms; all reach far enough
# up for the CPU, where steps take tens of milliseconds and prompts seconds.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.0,
                               4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008,
                               0.01, 0.015, 0.02, 0.03, 0.05, 0.08, 0.1, 0.25, 0.5, 1.0, 2.0)
E2E_REQUEST_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0,
                               128.0, 256.0, 512.0, 1024.0)


@dataclass
class _Timing:
    """What one request's later observations need, from its registration on."""

    created: float  # time.perf_counter() when the TokenizerManager registered it
    prompt_tokens: int
    stream: bool
    first_token: Optional[float] = None
    last_time: float = 0.0
    last_tokens: int = 0


class TokenizerMetricsCollector:
    """Request counters and latency histograms (thread-safe: outputs are observed on the
    TokenizerManager's receive thread, requests registered on an event loop)."""

    def __init__(self, registry: Any, labels: Dict[str, str]) -> None:
        from prometheus_client import Counter, Histogram

        names = list(labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, names, buckets=buckets, registry=registry).labels(**labels)

        self.prompt_tokens_total = counter("sglang:prompt_tokens_total",
                                           "Prompt tokens of finished requests.")
        self.generation_tokens_total = counter("sglang:generation_tokens_total",
                                               "Generated tokens of finished requests.")
        self.cached_tokens_total = counter("sglang:cached_tokens_total",
                                           "Prompt tokens served from a prefix cache (0: this "
                                           "engine has no prefix cache yet).")
        self.num_requests_total = counter("sglang:num_requests_total", "Finished requests.")
        self.num_aborted_requests_total = counter(
            "sglang:num_aborted_requests_total",
            "Requests that finished aborted (client abort, disconnect, refused by the scheduler).")
        self.time_to_first_token = histogram(
            "sglang:time_to_first_token_seconds",
            "Time to first token of streaming requests, in seconds.", TIME_TO_FIRST_TOKEN_BUCKETS)
        self.inter_token_latency = histogram(
            "sglang:inter_token_latency_seconds",
            "Time between consecutive output tokens of streaming requests (a chunk of n tokens "
            "counts n times its time / n), in seconds.", INTER_TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = histogram(
            "sglang:time_per_output_token_seconds",
            "Per streaming request: (end-to-end latency - time to first token) / (output tokens "
            "- 1), in seconds.", INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = histogram(
            "sglang:e2e_request_latency_seconds",
            "End-to-end latency of finished requests, in seconds.", E2E_REQUEST_LATENCY_BUCKETS)
        self._open: Dict[str, _Timing] = {}
        self._lock = threading.Lock()

    def on_request(self, rid: str, created: float, prompt_tokens: int, stream: bool,
                   log_metrics: bool = True) -> None:
        """Start tracking a request, before it is sent to the scheduler (its output may arrive
        at once). Health probes (``log_metrics=False``) are not tracked."""
        if not log_metrics:
            return
        with self._lock:
            self._open[rid] = _Timing(created, prompt_tokens, stream, last_time=created)

    def forget(self, rid: str) -> None:
        """Stop tracking a request that never reached the scheduler."""
        with self._lock:
            self._open.pop(rid, None)

    def num_tracked(self) -> int:
        """Requests registered and not finished yet."""
        with self._lock:
            return len(self._open)

    def on_output(self, rid: str, completion_tokens: int, cached_tokens: int,
                  finish_reason: Optional[Dict[str, Any]], now: float) -> None:
        """Observe one output update of ``rid`` (cumulative ``completion_tokens``) that arrived
        at ``now`` (``time.perf_counter()``); ``finish_reason`` set on its last update."""
        with self._lock:
            timing = self._open.get(rid)
            if timing is None:
                return  # a health probe, or already finished
            if finish_reason is not None:
                del self._open[rid]
            new_tokens = completion_tokens - timing.last_tokens
            first = timing.first_token is None and completion_tokens > 0
            previous = timing.last_time
            if new_tokens > 0:
                if first:
                    timing.first_token = now
                timing.last_time, timing.last_tokens = now, completion_tokens
        if timing.stream and new_tokens > 0:
            if first:
                self.time_to_first_token.observe(now - timing.created)
            else:
                gap = (now - previous) / new_tokens
                for _ in range(new_tokens):
                    self.inter_token_latency.observe(gap)
        if finish_reason is not None:
            self._finish(timing, completion_tokens, cached_tokens, finish_reason, now)

    def _finish(self, timing: _Timing, completion_tokens: int, cached_tokens: int,
                finish_reason: Dict[str, Any], now: float) -> None:
        self.num_requests_total.inc()
        if finish_reason.get("type") == "abort":
            self.num_aborted_requests_total.inc()
        self.prompt_tokens_total.inc(timing.prompt_tokens)
        self.generation_tokens_total.inc(max(completion_tokens, 0))
        self.cached_tokens_total.inc(max(cached_tokens, 0))
        self.e2e_request_latency.observe(now - timing.created)
        if timing.stream and timing.first_token is not None and completion_tokens > 1:
            self.time_per_output_token.observe(
                (now - timing.first_token) / (completion_tokens - 1))


class SchedulerMetricsCollector:
    """Scheduler gauges, set from ``Scheduler.get_internal_state()`` when metrics are scraped."""

    def __init__(self, registry: Any, labels: Dict[str, str]) -> None:
        from prometheus_client import Gauge

        self.labels = labels

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, list(labels), registry=registry)

        # (gauge, how to read it from the internal state); a missing key leaves the gauge alone.
        self._gauges = (
            (gauge("sglang:num_running_reqs", "Running requests."), ("num_running_reqs",)),
            (gauge("sglang:num_queue_reqs", "Requests in the waiting queue."),
             ("num_waiting_reqs",)),
            (gauge("sglang:num_used_tokens", "KV cache slots in use."),
             ("memory_usage", "kv_tokens_used")),
            (gauge("sglang:token_usage", "Fraction of the KV cache slots in use."),
             ("memory_usage", "token_usage")),
            (gauge("sglang:max_total_num_tokens", "KV cache slots in the pool."),
             ("max_total_num_tokens",)),
            (gauge("sglang:gen_throughput", "Generation throughput of the last window "
                                            "(token/s)."), ("last_gen_throughput",)),
            (gauge("sglang:spec_accept_length", "Average speculative accept length (tokens per "
                                                "verify round, bonus included)."),
             ("avg_spec_accept_length",)),
        )

    def log_internal_state(self, state: Dict[str, Any]) -> None:
        """Set every gauge whose value ``state`` holds."""
        for gauge, path in self._gauges:
            value: Any = state
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                gauge.labels(**self.labels).set(value)


class ServerMetrics:
    """The registry of one server (or engine) with both collectors."""

    def __init__(self, model_name: str) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry()
        labels = {"model_name": str(model_name)}
        self.tokenizer = TokenizerMetricsCollector(self.registry, labels)
        self.scheduler = SchedulerMetricsCollector(self.registry, labels)

    def render(self) -> Tuple[bytes, str]:
        """The Prometheus text exposition of every metric, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
