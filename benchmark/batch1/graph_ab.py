"""Eager vs CUDA graphs and overlap on vs off, side by side in one process, at batch 1.

    python benchmark/batch1/graph_ab.py --model-path ling-3.0-flash --load-format dummy \\
        --json-model-override-args '{"num_hidden_layers": 12}' [--speculative-algorithm NEXTN \\
        --speculative-num-steps 3] --prompt-len 1024 --steps 64 --result-filename ab.jsonl
    python benchmark/batch1/graph_ab.py --model-path ling-3.0-flash --load-format dummy \\
        --quantization fp8 --speculative-algorithm DSPARK \\
        --speculative-draft-model-path ling-3.0-flash-dspark [--speculative-dspark-block-size 7] \\
        --prompt-len 1024 --steps 64   # all 42 layers: the draft reads target layer 35

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
to ``--result-filename``. The device memory is reported too (weights, KV / state pools, the
rest of what is allocated: graph pools and activations, free), once after the runs.

``--prefill-graph-ab TOKENS...`` then asks whether capturing one-request prefill graphs
(``--prefill-cuda-graph-tokens TOKENS``) slows the decode that follows: the graph + overlap
iteration before the capture, with the graphs held, after one replay of each (as a server
replays them for its short prompts), on a new request of the same length prefilled eagerly
after them, with the decode graphs captured again (as a server captures the graphs it first
needs while serving), and after they are released (rows ``prefill_graphs``: ``none`` /
``captured`` / ``after a prefill graph replay`` / ``a new request prefilled eagerly after
them`` / ``decode graphs captured after them`` / ``released``; each with the
back-to-back replay time of the decode graph at that point, ``point_replay_ms``).

``--full-memory-ab KEEP_MIB`` asks the same of a nearly full GPU: the graph + overlap iteration
with the free device memory as it is, with all but ``KEEP_MIB`` MiB of it held by one tensor,
and after it is given back (rows ``device_memory``).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import torch

from sglang.srt.layers.kernel_choices import add_kernel_choices_arg, kernel_choices_from_args
from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.prefill_graph_runner import init_prefill_graphs_from_args
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors held by ``obj``'s attributes (directly, or in lists / dicts)."""
    total = 0
    for v in vars(obj).values():
        items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
        total += sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))
    return total


def _memory_report(sched: Scheduler) -> Dict[str, float]:
    """Device memory in GiB: the target (and draft) weights, the pools, the rest allocated."""
    if not torch.cuda.is_available():
        return {}
    gib = float(1 << 30)
    runners = [sched.tp_worker.model_runner]
    draft = getattr(sched.round_worker, "draft_runner", None)
    if draft is not None:
        runners.append(draft)
    weights = {id(t): t.numel() * t.element_size() for r in runners
               for t in list(r.model.parameters()) + list(r.model.buffers())}
    target = runners[0]
    pools = {id(p): _tensor_bytes(p) for r in runners
             for p in (r.req_to_token_pool, r.token_to_kv_pool, r.kda_state_pool)
             if p is not None}
    allocated = torch.cuda.memory_allocated()
    free, total = torch.cuda.mem_get_info()
    out = {"weights_gib": sum(weights.values()) / gib, "pools_gib": sum(pools.values()) / gib,
           "kv_tokens": target.max_total_num_tokens, "context_len": target.context_len,
           "allocated_gib": allocated / gib,
           "reserved_gib": torch.cuda.memory_reserved() / gib,
           "free_gib": free / gib, "total_gib": total / gib}
    out["other_gib"] = out["allocated_gib"] - out["weights_gib"] - out["pools_gib"]
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def start_request(sched: Scheduler, prompt_len: int, budget: int, seed: int = 0,
                  rid: str = "ab") -> None:
    """Submit one greedy request of ``prompt_len`` random ids and ``budget`` new tokens to the
    in-process scheduler and run it through its prefill; exit with the reason if the scheduler
    cannot admit it (it would otherwise wait for ever)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, sched.vocab_size, (prompt_len,), generator=gen).tolist()
    sp = SamplingParams(max_new_tokens=budget, temperature=0.0, ignore_eos=True)
    sp.verify(sched.vocab_size)
    sched.submit(TokenizedGenerateReqInput(rid, None, ids, sp.normalize(None)))
    sched.process_input_requests(sched.recv_requests())
    if not sched.waiting_queue and sched.chunked_req is None and sched.running_batch is None:
        raise SystemExit(f"the scheduler refused the request: prompt {prompt_len} + {budget} new "
                         f"tokens against context {sched.max_req_len} and "
                         f"{sched.max_total_num_tokens} KV slots (raise --context-length or "
                         "lower --prompt-len / --steps)")
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


def _seam_variants(sched: Scheduler) -> List[tuple]:
    """``(name, runner, refill mode)`` of the seam A/B. Variants that change what the graphs
    contain get a runner of their own, captured here (a graph pool is never reused after its
    graphs are freed): the round prep in torch ops instead of the fused kernel, and one graph
    per phase of a speculative round."""
    worker = sched.round_worker
    runner = worker.graph_runner
    sizes = runner.batch_sizes
    variants = [("refill=full", runner, "full"), ("refill=changed", runner, "changed"),
                ("refill=glue", runner, "glue")]
    maps = [w.future_map for w in {id(worker): worker, id(sched.tp_worker): sched.tp_worker}.values()]
    fused = [m.fused_prep for m in maps]
    for m in maps:
        m.fused_prep = False  # only while capturing: the graphs keep the torch ops
    variants.append(("prep=torch", worker.init_cuda_graphs(sizes, per_phase=False), "changed"))
    for m, f in zip(maps, fused):
        m.fused_prep = f
    variants.append(("prep=fused", runner, "changed"))
    if len(worker.round_phases()) > 1:
        variants += [("graph/phase", worker.init_cuda_graphs(sizes, per_phase=True), "changed"),
                     ("graph/round", runner, "changed")]
    worker.graph_runner = runner
    return variants


def _seam_ab(sched: Scheduler, steps: int, repeats: int) -> List[Dict[str, Any]]:
    """Graph + overlap rows for each seam variant, interleaved ``repeats`` times (A B A B)."""
    from sglang.srt.model_executor.graph_refill import GraphRefill

    worker = sched.round_worker
    default = worker.graph_runner
    variants = _seam_variants(sched)
    times: Dict[str, List[float]] = {name: [] for name, _, _ in variants}
    counts: Dict[str, Dict[str, int]] = {}
    for _ in range(repeats):
        for name, runner, mode in variants:
            runner.refill = GraphRefill(mode, runner.slots, runner.loc, runner._info,
                                        runner._new_graph)
            worker.graph_runner = runner
            replays = runner.num_replays
            times[name].append(_time_steps(sched, steps)["iter_ms"])
            counts[name] = {"replays": runner.num_replays - replays,
                            "glue_replays": runner.refill.glue_replays,
                            "failed": len(runner.failed)}
    default.refill = GraphRefill("changed", default.slots, default.loc, default._info,
                                 default._new_graph)
    worker.graph_runner = default
    return [{"mode": "graph", "overlap": True, "seam": name, "iter_ms": sum(v) / len(v),
             "iter_ms_runs": v, **counts[name]} for name, v in times.items()]


def _prefill_graph_ab(sched: Scheduler, tokens: List[int], steps: int,
                      prompt_len: int) -> List[Dict[str, Any]]:
    """Graph + overlap iterations before capturing prefill graphs of ``tokens`` and after each
    thing a server does with them (module docstring: held, replayed once, a new request of
    ``prompt_len`` tokens prefilled after them, the decode graphs captured again, released):
    which of them, if any, changes the decode's speed?"""
    rows: List[Dict[str, Any]] = []
    sched.enable_overlap = True

    def point(name: str, **extra: Any) -> None:
        res = _time_steps(sched, steps)
        res.update(mode="graph", overlap=True, prefill_graphs=name,
                   point_replay_ms=_replay_ms(sched, 50), **extra)
        rows.append(res)

    point("none")
    t0 = time.perf_counter()
    captured = init_prefill_graphs_from_args(sched.round_worker, SimpleNamespace(
        prefill_cuda_graph_tokens=list(tokens), disable_cuda_graph=False))
    held = sum(r.memory_bytes or 0 for r in captured) / 2**30
    point("captured", capture_s=time.perf_counter() - t0, prefill_graph_gib=held,
          buckets=[b for r in captured for b in r.buckets])
    # A server replays them for its short prompts (its own warm-up request among them) before
    # the decode steps it serves; the capture above does not. Replayed as captured: one request
    # in the padding slot, so the live request's state is untouched.
    for runner in captured:
        for graph in runner.graphs.values():
            graph.graph.replay()
    _sync()
    point("after a prefill graph replay")
    # A server prefills the prompts its graphs do not hold eagerly, after the capture; the
    # request timed so far was prefilled before it. A new request of the same length:
    # Its budget covers the points left here and --full-memory-ab's three after them.
    sched.abort_request(AbortReq(abort_all=True))
    start_request(sched, prompt_len, (steps + 3) * 6 * sched.round_worker.round_tokens + 64,
                  rid="ab-after-capture")
    point("a new request prefilled eagerly after them")
    # Decode graphs captured with the prefill graphs held (as a server captures a sampled
    # request's graph, or any graph of a width-dependent backend, at first use): drop them so
    # that the next steps capture them again.
    decode_graphs = sched.round_worker.graph_runner
    if decode_graphs is not None:
        # A fresh pool: the old one is freed with the last graph that used it, and capturing
        # into a freed pool trips an allocator assertion.
        if torch.cuda.is_available():
            decode_graphs._pool = torch.cuda.graph_pool_handle()
        decode_graphs.graphs.clear()
        point("decode graphs captured after them")
    for runner, _ in sched.round_worker.prefill_graph_plan():
        runner.prefill_graphs = None
    del captured
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    point("released")
    return rows


def _full_memory_ab(sched: Scheduler, keep_mib: int, steps: int) -> List[Dict[str, Any]]:
    """Graph + overlap iterations with the device's free memory as it is, with all but
    ``keep_mib`` MiB of it taken by one tensor, and after giving it back: does a nearly full
    GPU (a server at a high ``--mem-fraction-static`` after a long eager prefill grew the
    allocator's cache) slow the replayed decode graphs?"""
    rows: List[Dict[str, Any]] = []
    sched.enable_overlap = True

    def point(name: str) -> None:
        res = _time_steps(sched, steps)
        res.update(mode="graph", overlap=True, device_memory=name,
                   free_mib=torch.cuda.mem_get_info()[0] / 2**20,
                   point_replay_ms=_replay_ms(sched, 50))
        rows.append(res)

    point("as is")
    torch.cuda.empty_cache()
    take = torch.cuda.mem_get_info()[0] - (keep_mib << 20)
    filler = torch.empty(max(take, 0), dtype=torch.uint8, device="cuda") if take > 0 else None
    point(f"filled to {keep_mib} MiB free")
    del filler
    torch.cuda.empty_cache()
    point("given back")
    return rows


def patch_small_m_fp8_tile(block_n: int, block_k: int, num_stages: int) -> None:
    """Make :func:`sgl_kernel.small_m_gemm.launch_config` give block-fp8 weights this tile (its
    K split from the kernel's own rule for the tile); other weights keep theirs. Patched on the
    module, which the kernel's wrapper reads at every call, before the model is built."""
    import sgl_kernel.small_m_gemm as smg

    base = smg.launch_config

    def launch_config(n: int, k: int, weight_dtype: torch.dtype = torch.bfloat16, device=None):
        if weight_dtype != torch.float8_e4m3fn:
            return base(n, k, weight_dtype, device)
        return smg.tile_config(n, k, block_n, block_k, num_stages, device)

    smg.launch_config = launch_config


def default_label(algorithm: Optional[str], nextn_steps: Optional[int], proposed: int) -> str:
    """The rows' label without ``--label``: ``plain``, ``nextn<steps>``, ``dspark<drafts per
    round>`` or the algorithm's name in lower case."""
    if not algorithm:
        return "plain"
    if algorithm == "NEXTN":
        return f"nextn{nextn_steps}"
    if algorithm == "DSPARK":
        return f"dspark{proposed}"
    return algorithm.lower()


def main(argv: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="benchmark/batch1/graph_ab.py")
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--trace-dir", type=str, default=None)
    parser.add_argument("--result-filename", type=str, default=None)
    parser.add_argument("--label", type=str, default="")
    parser.add_argument("--seam-ab", type=int, default=0, metavar="REPEATS",
                        help="Also time the seam variants (graph refill full / changed / glue, "
                             "round prep torch / fused, one graph per phase / per round), "
                             "interleaved REPEATS times, with graphs and overlap.")
    parser.add_argument("--prefill-graph-ab", type=int, nargs="+", default=None, metavar="TOKENS",
                        help="Also time graph + overlap before capturing prefill graphs of TOKENS, "
                             "with them held and after releasing them (module docstring).")
    parser.add_argument("--full-memory-ab", type=int, default=None, metavar="KEEP_MIB",
                        help="Also time graph + overlap with all but KEEP_MIB MiB of the free "
                             "device memory taken, against before and after (module docstring).")
    parser.add_argument("--small-m-fp8-tile", type=str, default=None, metavar="N/K/STAGES",
                        help="Replace the small-M GEMM's block-fp8 tile (BLOCK_N, BLOCK_K, "
                             "num_stages; the K split follows the kernel's rule for the new "
                             "tile) in this process: the in-model A/B of a swept tile "
                             "(benchmark/kernels/tune_small_m_gemm.py --fp8).")
    add_kernel_choices_arg(parser)
    args = parser.parse_args(argv)
    if args.small_m_fp8_tile:
        parts = args.small_m_fp8_tile.split("/")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            parser.error(f"--small-m-fp8-tile takes BLOCK_N/BLOCK_K/STAGES (positive integers), "
                         f"got {args.small_m_fp8_tile!r}")
        patch_small_m_fp8_tile(*(int(p) for p in parts))
    server_args = ServerArgs.from_cli_args(args)
    server_args.kernel_choices = kernel_choices_from_args(args)  # read by the target's runner
    sched = Scheduler(server_args)
    runner = sched.round_worker.graph_runner
    configs = [("graph", True), ("graph", False), ("eager", True), ("eager", False)]
    if runner is None:
        configs = [c for c in configs if c[0] == "eager"]
    rows = len(configs) + 2 + (args.seam_ab * 8 if runner is not None else 0) \
        + (6 if args.prefill_graph_ab and runner is not None else 0) \
        + (3 if args.full_memory_ab is not None and runner is not None else 0)
    budget = (args.steps + 3) * rows * sched.round_worker.round_tokens + 64
    start_request(sched, args.prompt_len, budget, server_args.random_seed or 0)
    results = []
    for mode, overlap in configs:
        sched.round_worker.graph_runner = runner if mode == "graph" else None
        sched.enable_overlap = overlap
        res = _time_steps(sched, args.steps)
        res.update(mode=mode, overlap=overlap)
        results.append(res)
    sched.round_worker.graph_runner = runner
    sched.enable_overlap = True
    if args.seam_ab and runner is not None:
        results += _seam_ab(sched, args.steps, args.seam_ab)
    if args.prefill_graph_ab and runner is not None:
        results += _prefill_graph_ab(sched, args.prefill_graph_ab, args.steps, args.prompt_len)
    if args.full_memory_ab is not None and runner is not None and torch.cuda.is_available():
        results += _full_memory_ab(sched, args.full_memory_ab, args.steps)
    extra: Dict[str, Any] = {"replay_ms": _replay_ms(sched, args.replays),
                             "memory": _memory_report(sched),
                             "kernel_choices": sched.tp_worker.model_runner.kernel_choices
                             .describe(), "small_m_fp8_tile": args.small_m_fp8_tile}
    if args.trace_dir:
        sched.round_worker.graph_runner = runner
        extra.update(_idle_share(sched, args.steps, args.trace_dir))
    label = args.label or default_label(server_args.speculative_algorithm,
                                        server_args.speculative_num_steps,
                                        sched.round_worker.proposed_per_round)
    extra["round_tokens"] = sched.round_worker.round_tokens  # the verify window (1: plain)
    print(f"{'config':<28}{'iter ms':>9}{'tok/iter':>10}")
    for r in results:
        r.update(label=label, prompt_len=args.prompt_len, steps=args.steps, **extra)
        name = r.get("seam") or r["mode"] + (" +overlap" if r["overlap"] else "") + (
            f" pg:{r['prefill_graphs']}" if "prefill_graphs" in r else "") + (
            f" mem:{r['device_memory']}" if "device_memory" in r else "")
        if "tokens" in r:
            replay = (f"  replay {r['point_replay_ms']:.3f}" if r.get("point_replay_ms")
                      else "")
            print(f"{name:<28}{r['iter_ms']:>9.3f}{r['tokens'] / (args.steps + 3):>10.2f}{replay}")
        else:
            print(f"{name:<28}{r['iter_ms']:>9.3f}  runs {[round(x, 3) for x in r['iter_ms_runs']]}"
                  f" replays {r['replays']} glue {r['glue_replays']} failed {r['failed']}")
    print("back-to-back replay ms:", extra["replay_ms"])
    mem = extra["memory"]
    if mem:
        print("memory GiB: " + ", ".join(f"{k[:-4]} {v:.2f}" for k, v in mem.items()
                                          if k.endswith("_gib"))
              + f"; KV tokens {mem['kv_tokens']}, context {mem['context_len']}")
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
