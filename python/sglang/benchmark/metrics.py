"""Per-request timings and the aggregate metrics of a serving benchmark (SGLang's definitions).

Definitions (as upstream SGLang's bench_serving defines them):
- TTFT: send -> first chunk with non-empty text.
- ITL: for each later chunk, the gap since the previous chunk split evenly over the new tokens in
  it, one entry per token (so speculative multi-token chunks give several equal values).
- TPOT: (E2E - TTFT) / (output_len - 1) per request, only when output_len > 1.
- Peak output throughput: token timestamps (start + TTFT, then cumulative ITLs) counted into
  1-second buckets from the earliest request start; the fullest bucket.
- Peak concurrent requests: most requests in flight at the same instant, a request being in
  flight from its send to the last byte of its response, so it never exceeds
  ``--max-concurrency``. (Upstream counts requests per 1-second bucket, which adds up
  back-to-back requests and reported 2 at ``--max-concurrency 1``; this is a deliberate fix.)
- Concurrency: sum(E2E) / duration.
- Speculative rows (sglang backend, from the finishing chunks' ``meta_info``): the accept
  histogram is the sum of the requests' ``spec_correct_drafts_histogram`` ([k]: verify rounds
  that accepted k drafts); the mean cap length is the mean planned verify length over all those
  rounds (from the summed ``spec_cap_lens_histogram``); the block accept length is the requests'
  ``spec_block_accept_length`` weighted by their verify rounds (= output tokens committed by
  verify rounds / verify rounds, over all requests).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np


@dataclass
class RequestFuncOutput:
    """What one benchmark request measured (times in seconds, ``perf_counter`` clock)."""

    generated_text: str = ""
    success: bool = False
    latency: float = 0.0  # E2E: send -> end of stream
    ttft: float = 0.0
    itl: List[float] = field(default_factory=list)
    prompt_len: int = 0
    output_len: int = 0
    start_time: float = 0.0
    spec_accept_length: Optional[float] = None
    error: str = ""
    # Speculative metrics of the finishing chunk (None when the server sent none).
    spec_verify_ct: Optional[int] = None
    spec_correct_drafts_histogram: Optional[List[int]] = None
    spec_cap_lens_histogram: Optional[List[int]] = None
    spec_cap_length: Optional[float] = None
    spec_block_accept_length: Optional[float] = None


class StreamTimer:
    """Turns chunk arrivals into TTFT and per-token ITLs exactly as :mod:`metrics` defines them.

    Call :meth:`on_chunk` with the arrival time and the cumulative completion-token count each time
    a chunk with non-empty text arrives.
    """

    def __init__(self, out: RequestFuncOutput) -> None:
        self.out = out
        self.last_time = out.start_time
        self.last_tokens = 0

    def on_chunk(self, now: float, total_tokens: int) -> None:
        """Record one non-empty chunk; ``total_tokens`` is cumulative over the stream."""
        if self.out.ttft == 0.0:
            self.out.ttft = now - self.out.start_time
        else:
            new_tokens = total_tokens - self.last_tokens
            if new_tokens <= 0:
                # Text moved without new tokens (e.g. held-back bytes released): not a token event.
                return
            gap = now - self.last_time
            self.out.itl.extend([gap / new_tokens] * new_tokens)
        self.last_time = now
        self.last_tokens = total_tokens


@dataclass
class BenchmarkMetrics:
    """Aggregate results; the field names are the JSONL keys SGLang writes."""

    completed: int
    total_input: int
    total_input_text: int
    total_output: int
    total_output_retokenized: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    output_throughput_retokenized: float
    total_throughput: float
    total_throughput_retokenized: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p90_ttft_ms: float
    p95_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p90_tpot_ms: float
    p95_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p90_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    std_e2e_latency_ms: float
    p90_e2e_latency_ms: float
    p95_e2e_latency_ms: float
    p99_e2e_latency_ms: float
    concurrency: float
    accept_length: Optional[float]
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    # Speculative aggregates (aggregate_spec_metrics); None when no request carried them.
    spec_correct_drafts_histogram: Optional[List[int]] = None
    spec_cap_length: Optional[float] = None
    spec_cap_lens_histogram: Optional[List[int]] = None
    spec_block_accept_length: Optional[float] = None


def _stats_ms(values: Sequence[float], name: str) -> Dict[str, float]:
    """mean/median/std/p90/p95/p99 of seconds, in ms; all 0 for an empty list (as upstream)."""
    arr = np.asarray(values if len(values) else [0.0], dtype=np.float64) * 1000.0
    return {
        f"mean_{name}_ms": float(np.mean(arr)),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(np.std(arr)),
        f"p90_{name}_ms": float(np.percentile(arr, 90)),
        f"p95_{name}_ms": float(np.percentile(arr, 95)),
        f"p99_{name}_ms": float(np.percentile(arr, 99)),
    }


def _sum_histograms(hists: Sequence[Sequence[int]]) -> Optional[List[int]]:
    """Bin-wise sum (shorter histograms count as zero beyond their end); None for none."""
    if not hists:
        return None
    total = [0] * max(len(h) for h in hists)
    for h in hists:
        for k, n in enumerate(h):
            total[k] += int(n)
    return total


def aggregate_spec_metrics(outputs: Sequence[RequestFuncOutput]) -> Dict[str, Any]:
    """The benchmark's speculative aggregates over the successful outputs (module docstring):
    ``spec_correct_drafts_histogram``, ``spec_cap_length``, ``spec_cap_lens_histogram`` and
    ``spec_block_accept_length``, each None when no request reported it."""
    ok = [o for o in outputs if o.success]
    accept = _sum_histograms([o.spec_correct_drafts_histogram for o in ok
                              if o.spec_correct_drafts_histogram is not None])
    caps = _sum_histograms([o.spec_cap_lens_histogram for o in ok
                            if o.spec_cap_lens_histogram is not None])
    cap_length = None
    if caps is not None and sum(caps) > 0:
        cap_length = sum(k * n for k, n in enumerate(caps)) / sum(caps)
    block_tokens = block_rounds = 0.0
    for o in ok:
        if o.spec_block_accept_length is None:
            continue
        rounds = o.spec_verify_ct if o.spec_verify_ct is not None else \
            sum(o.spec_correct_drafts_histogram or [])
        block_tokens += o.spec_block_accept_length * rounds
        block_rounds += rounds
    return {
        "spec_correct_drafts_histogram": accept,
        "spec_cap_length": cap_length,
        "spec_cap_lens_histogram": caps,
        "spec_block_accept_length": block_tokens / block_rounds if block_rounds else None,
    }


def peak_in_flight(outputs: Sequence[RequestFuncOutput]) -> int:
    """Most successful requests in flight at one instant; a request occupies the half-open
    interval ``[start_time, start_time + latency)`` (send to last byte)."""
    events = []
    for o in outputs:
        if o.success:
            events.append((o.start_time, 1))
            events.append((o.start_time + o.latency, -1))
    # At equal times the end (-1) sorts first: a request sent the instant another one finished
    # (the next one through a concurrency slot) does not overlap it.
    events.sort()
    peak = running = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def peak_buckets(outputs: Sequence[RequestFuncOutput]) -> tuple:
    """(max output tokens in any 1 s bucket, max requests in flight at one instant)."""
    ok = [o for o in outputs if o.success]
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    t_end = max(o.start_time + o.latency for o in ok)
    n_buckets = int(math.ceil(t_end - t0)) + 1
    tokens = np.zeros(n_buckets)
    for o in ok:
        t = o.start_time + o.ttft
        stamps = [t]
        for gap in o.itl:
            t += gap
            stamps.append(t)
        for s in stamps:
            b = int(s - t0)
            if 0 <= b < n_buckets:
                tokens[b] += 1
    return float(tokens.max()), peak_in_flight(ok)


def calculate_metrics(
    prompt_lens: Sequence[int],
    outputs: Sequence[RequestFuncOutput],
    dur_s: float,
    retokenize: Optional[Callable[[str], int]] = None,
    accept_length: Optional[float] = None,
) -> BenchmarkMetrics:
    """Aggregate per-request outputs over a benchmark that lasted ``dur_s`` seconds.

    ``prompt_lens[i]`` is request i's recorded input length; ``retokenize(text)`` counts tokens of
    generated text with the client's tokenizer (the "(retokenized)" totals).
    """
    if len(prompt_lens) != len(outputs):
        raise ValueError(f"{len(prompt_lens)} prompt lengths for {len(outputs)} outputs")
    if dur_s <= 0:
        raise ValueError(f"benchmark duration must be positive, got {dur_s}")
    output_lens: List[int] = []
    retok_lens: List[int] = []
    total_input = completed = 0
    ttfts: List[float] = []
    tpots: List[float] = []
    itls: List[float] = []
    e2es: List[float] = []
    for plen, out in zip(prompt_lens, outputs):
        if not out.success:
            continue
        completed += 1
        total_input += plen
        output_lens.append(out.output_len)
        retok_lens.append(retokenize(out.generated_text) if retokenize else out.output_len)
        ttfts.append(out.ttft)
        e2es.append(out.latency)
        itls.extend(out.itl)
        if out.output_len > 1:
            tpots.append((out.latency - out.ttft) / (out.output_len - 1))
    total_output = sum(output_lens)
    total_retok = sum(retok_lens)
    peak_tokens, peak_requests = peak_buckets(outputs)
    return BenchmarkMetrics(
        completed=completed,
        total_input=total_input,
        total_input_text=total_input,
        total_output=total_output,
        total_output_retokenized=total_retok,
        request_throughput=completed / dur_s,
        input_throughput=total_input / dur_s,
        output_throughput=total_output / dur_s,
        output_throughput_retokenized=total_retok / dur_s,
        total_throughput=(total_input + total_output) / dur_s,
        total_throughput_retokenized=(total_input + total_retok) / dur_s,
        **_stats_ms(ttfts, "ttft"),
        **_stats_ms(tpots, "tpot"),
        **_stats_ms(itls, "itl"),
        max_itl_ms=float(max(itls) * 1000.0) if itls else 0.0,
        **_stats_ms(e2es, "e2e_latency"),
        concurrency=sum(e2es) / dur_s,
        accept_length=accept_length,
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_requests,
        **aggregate_spec_metrics(outputs),
    )


def format_table(
    m: BenchmarkMetrics,
    backend: str,
    request_rate: float,
    max_concurrency: Optional[int],
    duration: float,
) -> str:
    """SGLang's result table: 40-wide labels, 2-decimal floats, labels in upstream order."""
    lines: List[str] = ["", "{:=^50}".format(" Serving Benchmark Result ")]

    def row(label: str, value: Any) -> None:
        fmt = "{:<40} {:<10.2f}" if isinstance(value, float) else "{:<40} {:<10}"
        lines.append(fmt.format(label, value))

    def section(title: str) -> None:
        lines.append("{:-^50}".format(title))

    row("Backend:", backend)
    row("Traffic request rate:", str(request_rate))  # upstream prints it unformatted
    row("Max request concurrency:", max_concurrency if max_concurrency else "not set")
    row("Successful requests:", m.completed)
    row("Benchmark duration (s):", float(duration))
    row("Total input tokens:", m.total_input)
    row("Total input text tokens:", m.total_input_text)
    row("Total generated tokens:", m.total_output)
    row("Total generated tokens (retokenized):", m.total_output_retokenized)
    row("Request throughput (req/s):", m.request_throughput)
    row("Input token throughput (tok/s):", m.input_throughput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s)
    row("Peak concurrent requests:", m.max_concurrent_requests)
    row("Total token throughput (tok/s):", m.total_throughput)
    row("Concurrency:", m.concurrency)
    if m.accept_length:
        row("Accept length:", float(m.accept_length))
    if m.spec_correct_drafts_histogram is not None:  # [k]: rounds that accepted k drafts
        row("Accept histogram:", str(m.spec_correct_drafts_histogram))
    if m.spec_cap_length is not None:
        row("Mean cap length:", float(m.spec_cap_length))
    if m.spec_cap_lens_histogram is not None:  # [l]: rounds planned with l drafts
        row("Cap length histogram:", str(m.spec_cap_lens_histogram))
    if m.spec_block_accept_length is not None:
        row("Block accept length:", float(m.spec_block_accept_length))
    for title, key, extra_max in (
        ("End-to-End Latency", "E2E Latency", None),
        ("Time to First Token", "TTFT", None),
        ("Time per Output Token (excl. 1st token)", "TPOT", None),
        ("Inter-Token Latency", "ITL", "max_itl_ms"),
    ):
        name = {"E2E Latency": "e2e_latency"}.get(key, key.lower())
        section(title)
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"),
                            ("p95", "P95"), ("p99", "P99")):
            row(f"{label} {key} (ms):", getattr(m, f"{stat}_{name}_ms"))
        if extra_max:
            row(f"Max {key} (ms):", getattr(m, extra_max))
    lines.append("=" * 50)
    return "\n".join(lines)
