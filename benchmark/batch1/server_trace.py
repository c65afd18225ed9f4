"""Summarise a server's torch-profiler trace (``bench_serving --profile``) per decode step:
how often the host launched a CUDA graph, what the CUDA runtime calls between launches cost,
which of them wait on the device, and how busy the GPU was.

    python benchmark/batch1/server_trace.py TRACE.json.gz [TRACE2.json.gz ...] [--labels a b]
        [--result-filename out.jsonl]

A decode step of a graphed server is one ``cudaGraphLaunch`` on the host and one graph's kernels
on the device. With run-ahead overlap the host launches step ``n + 1`` while the GPU runs step
``n``, so the launch cadence equals the GPU's step time; a runtime call that waits on the device
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, a pageable
device-to-host ``cudaMemcpy``) or frees device memory (``cudaFree``, which synchronises) between
two launches puts the host behind the GPU once per step, and the step time becomes GPU time plus
host time. The table answers which calls those are and how often they come, per step, so two
servers (one with, one without some flag) can be compared line by line. A second table looks
inside the graphs: their span on the GPU, how many consecutive kernels overlap (with
programmatic dependent launch by microseconds; without it only by the trace's rounding, a
tenth of a microsecond) and the gaps between kernels.
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence

# Runtime / driver calls that block the host until the device (or a stream) has drained.
_WAITS = ("Synchronize", "cudaMemcpy", "cuMemcpy", "cudaFree", "cuMemFree", "cudaMalloc",
          "cuMemAlloc", "cudaHostAlloc", "cudaMallocHost")
_ASYNC = ("cudaMemcpyAsync", "cuMemcpyAsync", "cudaMemcpyPeerAsync")
_GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")  # one per replayed graph (decode step)


def load_events(path: str) -> List[Dict[str, Any]]:
    """The complete (``ph == "X"``) events of a Chrome trace, plain or gzipped JSON."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def is_blocking(name: str) -> bool:
    """A runtime call that makes the host wait for the device (see the module docstring)."""
    return any(w in name for w in _WAITS) and not any(name.startswith(a) for a in _ASYNC)


def summarize(events: Sequence[Dict[str, Any]], label: str = "") -> Dict[str, Any]:
    """Per-step numbers of one trace: ``steps`` (graph launches), ``launch_interval_ms``
    (median gap between consecutive launches), ``gpu_busy_ms_per_step`` (kernel time between
    the first and the last launch, per step), ``blocking`` (per blocking call: count per step,
    mean µs per call) and ``runtime_us_per_step`` (every runtime call's time per step)."""
    runtime = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")),
                     key=lambda e: e["ts"])
    launches = [e["ts"] for e in runtime if e["name"] in _GRAPH_LAUNCHES]
    out: Dict[str, Any] = {"label": label, "steps": len(launches)}
    if len(launches) < 3:
        return out
    first, last = launches[0], launches[-1]
    steps = len(launches) - 1  # the intervals between launches
    gaps = [b - a for a, b in zip(launches, launches[1:])]
    out["launch_interval_ms"] = statistics.median(gaps) / 1e3
    out["launch_interval_mean_ms"] = (last - first) / steps / 1e3
    kernels = [e for e in events if e.get("cat") == "kernel" and first <= e["ts"] < last]
    out["gpu_busy_ms_per_step"] = sum(e["dur"] for e in kernels) / steps / 1e3
    per_name: Dict[str, List[float]] = defaultdict(list)
    for e in runtime:
        if first <= e["ts"] < last:
            per_name[e["name"]].append(e["dur"])
    out["runtime_us_per_step"] = sum(sum(v) for v in per_name.values()) / steps
    out["blocking"] = {name: {"per_step": len(v) / steps, "mean_us": statistics.fmean(v)}
                       for name, v in sorted(per_name.items()) if is_blocking(name)}
    out["top_runtime"] = sorted(((name, len(v) / steps, sum(v) / steps)
                                 for name, v in per_name.items()),
                                key=lambda r: -r[2])[:8]
    out.update(graph_shape(runtime, events))
    return out


def graph_shape(runtime: Sequence[Dict[str, Any]],
                events: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """Inside the replayed graphs (kernels matched to their ``cudaGraphLaunch`` by the trace's
    correlation id), medians over the launches: ``graph_span_us`` (first kernel start to last
    kernel end), ``graph_kernels``, ``overlapping_pairs`` (consecutive kernels where the next
    starts before the previous ends), ``inner_gaps_us`` (the gaps between consecutive kernels,
    overlaps counted negative, summed per graph), ``kernel_gap_median_us`` (the median of those
    gaps over every pair of every graph: what one kernel-to-kernel transition costs), ``idle_between_us`` (the
    GPU idle from one graph's last kernel to the next graph's first) and ``launch_lead_us`` (how
    long before the previous graph ends the host starts the next launch). Empty when the trace
    has no correlation ids."""
    by_corr: Dict[Any, List[Dict[str, Any]]] = defaultdict(list)
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") == "kernel" and corr is not None:
            by_corr[corr].append(e)
    graphs = []  # (host launch start, kernels in start order)
    for e in runtime:
        corr = (e.get("args") or {}).get("correlation")
        if e["name"] in _GRAPH_LAUNCHES and by_corr.get(corr):
            graphs.append((e["ts"], sorted(by_corr[corr], key=lambda k: k["ts"])))
    if len(graphs) < 2:
        return {}
    spans, counts, overlaps, gaps, each = [], [], [], [], []
    for _, ks in graphs:
        spans.append(max(k["ts"] + k["dur"] for k in ks) - ks[0]["ts"])
        counts.append(len(ks))
        pairs = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(ks, ks[1:])]
        overlaps.append(sum(1 for g in pairs if g < 0))
        gaps.append(sum(pairs))
        each += pairs
    ends = [max(k["ts"] + k["dur"] for k in ks) for _, ks in graphs]
    idle = [b[1][0]["ts"] - end for end, b in zip(ends, graphs[1:])]
    lead = [end - b[0] for end, b in zip(ends, graphs[1:])]
    med = statistics.median
    return {"graph_span_us": med(spans), "graph_kernels": med(counts),
            "overlapping_pairs": med(overlaps), "inner_gaps_us": med(gaps),
            "kernel_gap_median_us": med(each) if each else 0.0,
            "idle_between_us": med(idle), "launch_lead_us": med(lead)}


def render(rows: Sequence[Dict[str, Any]]) -> str:
    """A Markdown table of the per-step numbers, then each trace's blocking calls."""
    lines = ["| trace | graph launches | launch interval median / mean (ms) | GPU busy per "
             "step (ms) | runtime calls per step (µs) |", "|---|---|---|---|---|"]
    for r in rows:
        if "launch_interval_ms" not in r:
            lines.append(f"| {r['label']} | {r['steps']} | too few launches | | |")
            continue
        lines.append(f"| {r['label']} | {r['steps']} | {r['launch_interval_ms']:.3f} / "
                     f"{r['launch_interval_mean_ms']:.3f} | {r['gpu_busy_ms_per_step']:.3f} | "
                     f"{r['runtime_us_per_step']:.1f} |")
    if any("graph_span_us" in r for r in rows):
        lines += ["", "| trace | graph span (µs) | kernels | pairs starting before the previous "
                  "end | gaps between kernels, sum / median (µs) | GPU idle between graphs (µs) | "
                  "launch lead (µs) |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            if "graph_span_us" in r:
                lines.append(f"| {r['label']} | {r['graph_span_us']:.1f} | "
                             f"{r['graph_kernels']:.0f} | {r['overlapping_pairs']:.0f} | "
                             f"{r['inner_gaps_us']:.1f} / {r['kernel_gap_median_us']:.2f} | "
                             f"{r['idle_between_us']:.1f} | {r['launch_lead_us']:.1f} |")
    for r in rows:
        if "blocking" not in r:
            continue
        calls = "; ".join(f"{name} {b['per_step']:.2f}/step x {b['mean_us']:.1f} µs"
                          for name, b in r["blocking"].items()) or "none"
        top = "; ".join(f"{name} {n:.2f}/step {us:.1f} µs" for name, n, us in r["top_runtime"])
        lines.append(f"\n{r['label']}: blocking calls between launches: {calls}\n"
                     f"{r['label']}: runtime time per step: {top}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", help="Chrome traces (.json or .json.gz)")
    p.add_argument("--labels", nargs="+", default=None, help="one label per trace")
    p.add_argument("--result-filename", default=None, help="append one JSON line per trace")
    args = p.parse_args(argv)
    labels = args.labels or args.traces
    if len(labels) != len(args.traces):
        p.error(f"{len(args.traces)} traces but {len(labels)} labels")
    rows = [summarize(load_events(path), label) for path, label in zip(args.traces, labels)]
    print(render(rows))
    if args.result_filename:
        with open(args.result_filename, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return rows


if __name__ == "__main__":
    main()
