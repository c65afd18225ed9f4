"""The kernels that own a batch-1 step: device time per kernel name, per scheduler iteration.

    python benchmark/batch1/top_kernels.py --model-path ling-3.0-flash --load-format dummy \\
        --quantization fp8 [--speculative-algorithm NEXTN ...] --prompt-len 1024 --steps 2

Builds the in-process scheduler as ``graph_ab.py`` does (eager: ``--disable-cuda-graph`` is
added, so every kernel is seen by name), prefills one request, warms up, then profiles
``--steps`` iterations with the torch profiler and prints the ``--top`` kernels by device time
(µs per iteration and share). ``round_census.py`` gives the same time by model category.
``--by-shape`` also splits the small-M GEMM's and the grouped GEMV's time by weight (shape,
dtype, norm prologue): their calls run inside named profiler ranges, in this process only, and
each range is charged the device time of the kernels that run inside its GPU span (the span
itself also covers the gaps of an eager step, so it is not the kernels' time).
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import tempfile
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

from sglang.srt.layers.kernel_choices import add_kernel_choices_arg, kernel_choices_from_args

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_ab import Scheduler, ServerArgs, start_request  # noqa: E402


SHAPED = (("sgl_kernel.small_m_gemm", "small_m_gemm"),
          ("sgl_kernel.grouped_gemv", "grouped_gemv"))


def name_calls_by_shape() -> None:
    """Wrap the shaped kernels' entry points (the engine imports them at call time) so that each
    call opens a profiler range ``name[shape dtype(, norm)]``: the kernels it launches are then
    attributed to that weight."""
    import importlib

    for module_name, fn_name in SHAPED:
        module = importlib.import_module(module_name)
        fn = getattr(module, fn_name)

        def named(x, w, *rest, _fn=fn, _name=fn_name, **kw):
            norm = ", norm" if kw.get("gated_norm") is not None else ""
            dims = "x".join(str(d) for d in w.shape)
            with torch.profiler.record_function(
                    f"{_name}[{dims} {str(w.dtype).replace('torch.', '')}{norm}]"):
                return _fn(x, w, *rest, **kw)

        setattr(module, fn_name, named)


def kernel_time_by_range(trace: Sequence[dict], prefixes: Tuple[str, ...]
                         ) -> Dict[str, Tuple[float, int]]:
    """``{range name: (kernel µs, calls)}`` from a chrome trace's events: every GPU range whose
    name starts with one of ``prefixes`` gets the durations of the kernels that start inside
    it."""
    kernels = sorted((e["ts"], e.get("dur", 0.0)) for e in trace if e.get("cat") == "kernel")
    starts = [ts for ts, _ in kernels]
    out: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    for e in trace:
        if e.get("cat") != "gpu_user_annotation" or not e["name"].startswith(prefixes):
            continue
        lo = bisect.bisect_left(starts, e["ts"])
        hi = bisect.bisect_left(starts, e["ts"] + e.get("dur", 0.0))
        out[e["name"]][0] += sum(d for _, d in kernels[lo:hi])
        out[e["name"]][1] += 1
    return {name: (us, calls) for name, (us, calls) in out.items()}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="benchmark/batch1/top_kernels.py")
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--by-shape", action="store_true",
                        help="also split the small-M GEMM and grouped GEMV time by weight")
    add_kernel_choices_arg(parser)
    args = parser.parse_args(argv)
    if args.by_shape:
        name_calls_by_shape()
    args.disable_cuda_graph = True
    server_args = ServerArgs.from_cli_args(args)
    server_args.kernel_choices = kernel_choices_from_args(args)  # read by the target's runner
    sched = Scheduler(server_args)
    # Tokens for every profiled iteration (a speculative round commits up to round_tokens).
    start_request(sched, args.prompt_len,
                  (args.warmup + args.steps + 3) * sched.round_worker.round_tokens + 64)
    sync = torch.cuda.synchronize if sched.device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        sched.step()
    sync()
    on_cuda = sched.device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]
    if args.by_shape and on_cuda:  # the ranges are host events that own their kernels
        activities.append(ProfilerActivity.CPU)
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            sched.step()
        sync()
    events = prof.key_averages()
    prefixes = tuple(f"{n}[" for _, n in SHAPED)
    rows = [(e.key, e.self_device_time_total if on_cuda else e.self_cpu_time_total, e.count)
            for e in events if not e.key.startswith(prefixes)]
    rows = [r for r in rows if r[1] > 0]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows) or 1.0
    print("| kernel | µs / iteration | calls / iteration | share |\n|---|---|---|---|")
    for name, us, count in rows[:args.top]:
        print(f"| {name[:80]} | {us / args.steps:.1f} | {count / args.steps:.0f} | "
              f"{us / total:.1%} |")
    print(f"| all | {total / args.steps:.1f} | {sum(r[2] for r in rows) / args.steps:.0f} | |")
    if args.by_shape:
        if on_cuda:
            with tempfile.TemporaryDirectory() as tmp:
                prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
                with open(os.path.join(tmp, "trace.json")) as f:
                    trace = json.load(f)["traceEvents"]
            shaped = [(name, us, calls) for name, (us, calls)
                      in kernel_time_by_range(trace, prefixes).items()]
        else:  # off CUDA the ranges' own CPU time is the op's time
            shaped = [(e.key, e.cpu_time_total, e.count) for e in events
                      if e.key.startswith(prefixes)]
        shaped.sort(key=lambda r: -r[1])
        print("\n| weight | µs / iteration | calls / iteration | µs / call |\n|---|---|---|---|")
        for name, us, count in shaped:
            print(f"| {name} | {us / args.steps:.1f} | {count / args.steps:.0f} | "
                  f"{us / max(count, 1):.1f} |")


if __name__ == "__main__":
    main()
