"""Batch-1 all-reduce latency across the GPUs of one host: the engine's path vs plain NCCL.

    python benchmark/kernels/bench_allreduce.py [--tp 4] [--bytes 5120 20480 81920] [--iters 200]

The engine's path is ``sglang.srt.distributed.tensor_model_parallel_all_reduce`` on the TP group
``init_distributed_environment`` builds (what every row-parallel layer and the MoE call); the
plain one is ``torch.distributed.all_reduce`` on a separate NCCL group. Each is timed eagerly
(``--iters`` back-to-back calls between two CUDA events: launch + collective, the eager decode
step's cost) and replayed from a CUDA graph of ``--graph-calls`` calls (the collective alone, what
a captured step pays). A bf16 message of 20 KB is a few tokens of hidden state at batch 1. Rows
report the slowest rank's mean; the first call of every variant checks the sum.

NVLink multicast stays off, as in scripts/gpu_tp.sh (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1); this script sets them if unset.
``--device cpu`` (gloo, eager only, wall clock) is a smoke run of the script.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Callable, Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cold_l2 import capture_graph  # benchmark/kernels/cold_l2.py
from sglang.srt.distributed.parallel_state import (destroy_distributed_environment, free_port,
                                                   get_tp_group, init_distributed_environment,
                                                   tensor_model_parallel_all_reduce)

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def _mean_us(fn: Callable[[], object], iters: int, on_cuda: bool) -> float:
    """Mean microseconds per call of ``iters`` back-to-back calls (after all ranks line up)."""
    dist.barrier(group=get_tp_group())
    if not on_cuda:
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return 1e6 * (time.perf_counter() - start) / iters
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return 1000.0 * begin.elapsed_time(end) / iters


def _graph_us(fn: Callable[[], object], calls: int, replays: int) -> float:
    """Mean microseconds per call of ``fn`` captured ``calls`` times in one CUDA graph."""
    graph = capture_graph(fn, calls)
    graph.replay()
    return _mean_us(graph.replay, replays, True) / calls


def _rank(rank: int, tp: int, port: int, args: argparse.Namespace, box: Dict) -> None:
    """One rank: time every path at every size; rank 0 puts the slowest ranks' means in ``box``."""
    on_cuda = args.device == "cuda"
    if on_cuda:
        torch.cuda.set_device(rank)
    init_distributed_environment(tp, rank, f"tcp://127.0.0.1:{port}",
                                 backend="nccl" if on_cuda else "gloo")
    try:
        plain = dist.new_group(list(range(tp)), backend="nccl" if on_cuda else "gloo")
        dev = torch.device("cuda", rank) if on_cuda else torch.device("cpu")
        dtype = torch.bfloat16 if on_cuda else torch.float32
        paths: Dict[str, Callable[[torch.Tensor], object]] = {
            "engine": tensor_model_parallel_all_reduce,
            "NCCL plain" if on_cuda else "gloo plain": lambda t: dist.all_reduce(t, group=plain),
        }
        rows = []
        for nbytes in args.bytes:
            x = torch.empty(nbytes * 8 // torch.finfo(dtype).bits, dtype=dtype, device=dev)
            cells = []
            for name, reduce in paths.items():
                x.fill_(rank + 1)
                reduce(x)
                if not bool((x == tp * (tp + 1) / 2).all()):
                    raise SystemExit(f"{name} all-reduce gave a wrong sum on rank {rank}")
                x.zero_()  # the timed calls below reduce in place: keep the values finite
                cells.append(_mean_us(lambda: reduce(x), args.iters, on_cuda))
                cells.append(_graph_us(lambda: reduce(x), args.graph_calls, args.iters // 10 + 1)
                             if on_cuda else float("nan"))
            slowest = torch.tensor(cells, dtype=torch.float64, device=dev)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=plain)
            rows.append((nbytes, slowest.tolist()))
        if rank == 0:
            box["rows"], box["paths"] = rows, list(paths)
    finally:
        destroy_distributed_environment()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=None, help="ranks (default: every visible GPU)")
    p.add_argument("--bytes", type=int, nargs="+", default=[5120, 20480, 81920])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--graph-calls", type=int, default=20)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("bench_allreduce needs 2 or more GPUs (or --device cpu for a smoke run)")
    tp = args.tp or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if tp < 2 or (args.device == "cuda" and tp > torch.cuda.device_count()):
        raise SystemExit(f"--tp {tp}: needs 2..{torch.cuda.device_count()} ranks on this host")
    for var, val in NO_MULTICAST.items():
        os.environ.setdefault(var, val)
    with mp.Manager() as manager:
        box = manager.dict()
        mp.spawn(_rank, args=(tp, free_port(), args, box), nprocs=tp, join=True)
        rows, paths = box["rows"], box["paths"]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (gloo)"
    print(f"{tp} x {name}, all-reduce (sum) latency, mean us per call, slowest rank; "
          f"eager: {args.iters} back-to-back calls; graph: {args.graph_calls} calls per graph")
    header = " | ".join(f"{p} eager | {p} graph" for p in paths)
    print(f"| bytes | {header} |\n|---|{'---|' * 2 * len(paths)}")
    for nbytes, cells in rows:
        print(f"| {nbytes} | " + " | ".join("-" if c != c else f"{c:.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
