"""The kernels that own a batch-1 step: device time per kernel name, per scheduler iteration.

    python benchmark/batch1/top_kernels.py --model-path ling-3.0-flash --load-format dummy \\
        --quantization fp8 [--speculative-algorithm NEXTN ...] --prompt-len 1024 --steps 2

Builds the in-process scheduler as ``graph_ab.py`` does (eager: ``--disable-cuda-graph`` is
added, so every kernel is seen by name), prefills one request, warms up, then profiles
``--steps`` iterations with the torch profiler and prints the ``--top`` kernels by device time
(µs per iteration and share). ``round_census.py`` gives the same time by model category.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_ab import Scheduler, ServerArgs, start_request  # noqa: E402


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="benchmark/batch1/top_kernels.py")
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    args.disable_cuda_graph = True
    sched = Scheduler(ServerArgs.from_cli_args(args))
    # Tokens for every profiled iteration (a speculative round commits up to round_tokens).
    start_request(sched, args.prompt_len,
                  (args.warmup + args.steps + 3) * sched.round_worker.round_tokens + 64)
    sync = torch.cuda.synchronize if sched.device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        sched.step()
    sync()
    activities = [ProfilerActivity.CUDA] if sched.device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            sched.step()
        sync()
    rows = [(e.key, e.self_device_time_total if sched.device.type == "cuda"
             else e.self_cpu_time_total, e.count) for e in prof.key_averages()]
    rows = [r for r in rows if r[1] > 0]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows) or 1.0
    print("| kernel | µs / iteration | calls / iteration | share |\n|---|---|---|---|")
    for name, us, count in rows[:args.top]:
        print(f"| {name[:80]} | {us / args.steps:.1f} | {count / args.steps:.0f} | "
              f"{us / total:.1%} |")
    print(f"| all | {total / args.steps:.1f} | {sum(r[2] for r in rows) / args.steps:.0f} | |")


if __name__ == "__main__":
    main()
