"""Per-phase census of one batch-1 decode step or NEXTN round, in process (no server).

    python benchmark/batch1/round_census.py [server flags, e.g. --speculative-algorithm NEXTN
        --speculative-num-steps 3] [--prompt-len 1024] [--steps 20]

One request with a random-id prompt runs through an in-process scheduler; after a warm-up, the
script times ``--steps`` scheduler iterations without a profiler (the calibration: a profiled
step is slower), then profiles the same number with torch.profiler and attributes every top-level
aten op (and, on CUDA, every device launch with its kernel time) to the phase it ran in: target forward, KDA
verify staging, MTP forwards (draft steps and draft extend), draft picks, acceptance, other. It
prints a markdown table per step: op count and kernel time per phase, plus profiled vs unprofiled
wall time. Op counts are what eager mode pays in launches; kernel times are the GPU work.
"""
from __future__ import annotations

import argparse
import collections
import random
import time
from typing import Callable, Dict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from sglang.srt.layers.attention.torch_native_backend import TorchNativeKDABackend
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

PREFIX = "census::"


def _label(obj: object, name: str, phase: str) -> None:
    """Run ``obj.name`` inside a profiler range named after ``phase``."""
    fn: Callable = getattr(obj, name)

    def wrapped(*args, **kwargs):
        with record_function(PREFIX + phase):
            return fn(*args, **kwargs)

    setattr(obj, name, wrapped)


def _instrument(sched: Scheduler) -> None:
    _label(sched.tp_worker.model_runner, "forward", "target forward")
    _label(TorchNativeKDABackend, "_forward_target_verify", "KDA verify (in target)")
    worker = sched.draft_worker
    if worker is not None:
        _label(worker.draft_runner, "forward", "MTP forward")
        _label(worker, "_pick_draft", "draft pick")
        _label(worker, "_verify", "acceptance")


def _phase(event) -> str:
    """The innermost census range above a profiler event ("other" if none)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(PREFIX):
            return parent.name[len(PREFIX):]
        parent = parent.cpu_parent
    return "other"


def _census(prof, steps: int) -> Dict[str, Dict[str, float]]:
    """Per phase and iteration: top-level aten ops, and on CUDA the events that launched device
    work (kernel launches, copies) with the device time of that work."""
    rows: Dict[str, Dict[str, float]] = collections.defaultdict(
        lambda: {"ops": 0, "launches": 0, "kernel_us": 0.0})
    for e in prof.events():
        kernels = getattr(e, "kernels", None) or []
        if kernels:
            row = rows[_phase(e)]
            row["launches"] += 1
            row["kernel_us"] += sum(k.duration for k in kernels)
        if e.name.startswith("aten::") and not (
                e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")):
            rows[_phase(e)]["ops"] += 1
    return {k: {m: v / steps for m, v in row.items()} for k, row in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="measured scheduler iterations")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    server_args = ServerArgs.from_cli_args(args)
    sched = Scheduler(server_args)
    rng = random.Random(0)
    prompt = [rng.randrange(sched.vocab_size) for _ in range(args.prompt_len)]
    # Enough tokens that no iteration finishes the request (every round may commit N tokens).
    per_step = (server_args.speculative_num_draft_tokens or 1) if server_args.speculative_algorithm else 1
    want = (args.warmup + 2 * args.steps + 2) * per_step
    if args.prompt_len + want > sched.max_req_len:
        raise SystemExit(f"--prompt-len {args.prompt_len} leaves fewer than {want} tokens of the "
                         f"context length {sched.max_req_len}")
    params = SamplingParams.from_dict({"max_new_tokens": want, "temperature": 0,
                                       "ignore_eos": True})
    params.verify(sched.vocab_size)
    sched.submit(TokenizedGenerateReqInput("census", None, prompt, params.normalize(None)))
    sched.process_input_requests(sched.recv_requests())
    for _ in range(args.warmup + 1):  # the prefill, then warm decode steps
        sched.step()
    cuda = sched.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            sched.step()
        sync()
        return (time.perf_counter() - t0) / args.steps * 1e3

    plain_ms = timed()
    _instrument(sched)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        profiled_ms = timed()
    census = _census(prof, args.steps)
    spec = server_args.speculative_algorithm or "none"
    print(f"{sched.device}, speculation {spec} (steps {server_args.speculative_num_steps}), "
          f"prompt {args.prompt_len}, {args.steps} iterations")
    print(f"wall per iteration: {plain_ms:.2f} ms unprofiled, {profiled_ms:.2f} ms profiled")
    print("| phase | top-level ops | device launches | device time (us) |")
    print("|---|---|---|---|")
    for name, row in sorted(census.items(), key=lambda kv: -kv[1]["ops"]):
        print(f"| {name} | {row['ops']:.0f} | {row['launches']:.0f} | {row['kernel_us']:.0f} |")
    total = {k: sum(r[k] for r in census.values()) for k in ("ops", "launches", "kernel_us")}
    print(f"| **total** | {total['ops']:.0f} | {total['launches']:.0f} | {total['kernel_us']:.0f} |")


if __name__ == "__main__":
    main()
