"""Eager vs CUDA graphs and overlap on vs off, side by side in one process, at batch 1.

    python benchmark/batch1/graph_ab.py --model-path ling-3.0-flash --load-format dummy \\
        --json-model-override-args '{"num_hidden_layers": 12}' [--speculative-algorithm NEXTN \\
        --speculative-num-steps 3] --prompt-len 1024 --steps 64 --result-filename ab.jsonl

Builds one in-process scheduler (the server's scheduler without sockets; graphs captured as the
server captures them), prefills one request of ``--prompt-len`` random tokens, then times
``--steps`` scheduler iterations in steady state for each configuration, in the same process and
on the same request:

* ``eager`` / ``graph``: the round worker's graph runner removed / in place;
* ``overlap`` on / off: launch round ``k + 1`` before consuming round ``k``, or not.

Per configuration it reports the mean wall time of one iteration (one round: for plain decode
the TPOT; with speculation the round time, TPOT x accept length) and the tokens per iteration.
Then the back-to-back replay time of the round's graph (the device time of a round with no host
work between replays: the floor the served step can approach when the host is hidden), and, if
``--trace-dir`` is given, the GPU idle share of the steady-state loop from a torch profiler trace
(profiled vs unprofiled iteration time printed beside it). One JSON line per configuration goes
to ``--result-filename``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _start(sched: Scheduler, prompt_len: int, budget: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, sched.vocab_size, (prompt_len,), generator=gen).tolist()
    sp = SamplingParams(max_new_tokens=budget, temperature=0.0, ignore_eos=True)
    sp.verify(sched.vocab_size)
    sched.submit(TokenizedGenerateReqInput("ab", None, ids, sp.normalize(None)))
    sched.process_input_requests(sched.recv_requests())
    while sched.running_batch is None:  # prefill (all chunks)
        sched.step()


def _time_steps(sched: Scheduler, steps: int) -> Dict[str, float]:
    """Mean wall time of ``steps`` steady-state iterations and the tokens they produced."""
    before = sched.num_generated_tokens
    for _ in range(3):  # reach steady state (a round in flight with overlap)
        sched.step()
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.step()
    _sync()
    dt = (time.perf_counter() - t0) / steps
    return {"iter_ms": dt * 1e3, "tokens": sched.num_generated_tokens - before}


def _replay_ms(sched: Scheduler, reps: int) -> Optional[float]:
    """Back-to-back replays of the batch-1 greedy graph on the padding slot (no host work)."""
    runner = sched.round_worker.graph_runner
    if runner is None:
        return None
    graphs = [k for k in runner.graphs if k.bs == 1 and k.variant == "greedy"
              and not k.return_logprob]
    if not graphs:
        return None
    graph = runner.graphs[graphs[0]].graph
    runner.slots.zero_()  # padding rows only: the request's state is left alone
    runner.loc.zero_()
    for _ in range(3):
        graph.replay()
    _sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    _sync()
    return (time.perf_counter() - t0) / reps * 1e3


def _idle_share(sched: Scheduler, steps: int, trace_dir: str) -> Dict[str, float]:
    """GPU busy time (union of kernel intervals) over the wall window of ``steps`` profiled
    iterations; writes the Chrome trace to ``trace_dir``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        res = _time_steps(sched, steps)
    prof.export_chrome_trace(f"{trace_dir}/graph_ab_trace.json")
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0)
    if not spans:
        return {"profiled_iter_ms": res["iter_ms"]}
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    window = spans[-1][1] - spans[0][0]
    return {"profiled_iter_ms": res["iter_ms"], "gpu_busy_us": busy,
            "gpu_window_us": window, "gpu_idle_share": 1.0 - busy / max(window, 1e-9)}


def main(argv: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="benchmark/batch1/graph_ab.py")
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--trace-dir", type=str, default=None)
    parser.add_argument("--result-filename", type=str, default=None)
    parser.add_argument("--label", type=str, default="")
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    sched = Scheduler(server_args)
    runner = sched.round_worker.graph_runner
    configs = [("graph", True), ("graph", False), ("eager", True), ("eager", False)]
    if runner is None:
        configs = [c for c in configs if c[0] == "eager"]
    budget = args.steps * (len(configs) + 2) * sched.round_worker.round_tokens + 64
    _start(sched, args.prompt_len, budget, server_args.random_seed or 0)
    results = []
    for mode, overlap in configs:
        sched.round_worker.graph_runner = runner if mode == "graph" else None
        sched.enable_overlap = overlap
        res = _time_steps(sched, args.steps)
        res.update(mode=mode, overlap=overlap)
        results.append(res)
    sched.round_worker.graph_runner = runner
    sched.enable_overlap = True
    extra: Dict[str, Any] = {"replay_ms": _replay_ms(sched, args.replays)}
    if args.trace_dir:
        sched.round_worker.graph_runner = runner
        extra.update(_idle_share(sched, args.steps, args.trace_dir))
    label = args.label or ("nextn%d" % server_args.speculative_num_steps
                           if server_args.speculative_algorithm else "plain")
    print(f"{'config':<18}{'iter ms':>9}{'tok/iter':>10}")
    for r in results:
        r.update(label=label, prompt_len=args.prompt_len, steps=args.steps, **extra)
        print(f"{r['mode'] + (' +overlap' if r['overlap'] else ''):<18}{r['iter_ms']:>9.3f}"
              f"{r['tokens'] / (args.steps + 3):>10.2f}")
    print("back-to-back replay ms:", extra["replay_ms"])
    if "gpu_idle_share" in extra:
        print(f"profiled iter ms {extra['profiled_iter_ms']:.3f}, GPU idle share "
              f"{extra['gpu_idle_share']:.3f}")
    if args.result_filename:
        with open(args.result_filename, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    sched.abort_request(AbortReq(abort_all=True))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
