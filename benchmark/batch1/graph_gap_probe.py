"""Does anything a server does at start-up slow the kernel-to-kernel step of a replayed graph?

    python benchmark/batch1/graph_gap_probe.py [--nodes 300] [--replays 200] \\
        [--result-filename probe.jsonl]

A server with prefill CUDA graphs replays its decode graph with every kernel-to-kernel
transition about 0.33 µs longer than a server without them (docs/performance.md, "Prefill
graphs and the decode step: three explanations ruled out"), with the same kernels. This probe
looks for the trigger without the model: it captures one *chain* graph of ``--nodes`` tiny
Triton launches (one program each, each reading what the one before wrote, as a decode
graph's kernels do), then goes through the events below in order and after each one times
``--replays`` back-to-back replays of the chain, reported as µs per node (the replay time over
the node count: launch latency plus a near-empty kernel). A row whose µs per node rises over
the first row's, and stays risen in the rows after it, names the trigger. Each row is timed
twice: the replays alone, and each followed by what a server's decode loop adds (a side
stream copying the step's output to pinned host memory after waiting for the main stream).

Events: a second chain of 4x the nodes captured into a pool of its own, then replayed once (a
prefill graph: more kernels, captured after the decode graph), then one of 16x; a graph of
one memset, then one of one device copy (each followed by an eager launch and a sync, which
may undo what it did); a graph of device memsets and
copies replayed (the nodes a captured forward holds besides kernels); a large cuBLAS GEMM run
eagerly and one replayed from a graph (kernels with a large shared-memory carve-out);
``torch.cuda.empty_cache()`` followed by a 2 GiB allocation (what a prefill capture does before
a long eager prefill); fla-core's ``chunk_kda`` over 1024 tokens, eagerly and then from a
graph, when fla is installed (the prefill's KDA kernels). CUDA only.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _bump_kernel(x_ptr):
    # One program: read the value the previous launch wrote and write it back plus one.
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


def _chain(x: torch.Tensor, nodes: int) -> None:
    for _ in range(nodes):
        _bump_kernel[(1,)](x)


def _capture(fn: Callable[[], None], pool: object = None) -> "torch.cuda.CUDAGraph":
    fn()  # warm-up outside the capture (Triton compiles, cuBLAS picks its kernel)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    torch.cuda.synchronize()
    return graph


class _Relay:
    """What a server's decode loop adds after each replay: a side stream waits for the main one
    and copies the step's output to pinned host memory (``sglang.srt.rounds.relay``)."""

    def __init__(self, src: torch.Tensor):
        self.stream = torch.cuda.Stream()
        self.src = src
        self.host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)

    def __call__(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.host.copy_(self.src, non_blocking=True)


def _us_per_node(graph: "torch.cuda.CUDAGraph", nodes: int, replays: int,
                 after: Optional[Callable[[], None]] = None) -> float:
    """Back-to-back replays of ``graph`` (``after`` called after each), µs per node."""
    def replay() -> None:
        graph.replay()
        if after is not None:
            after()
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * nodes)


def _fla_kda(tokens: int) -> Optional[Callable[[], None]]:
    """One chunk_kda forward over ``tokens`` tokens of 32 heads x 128 (None without fla)."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    h, d, dev = 32, 128, "cuda"
    q, k, v = (torch.randn(1, tokens, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    g = -torch.rand(1, tokens, h, d, device=dev, dtype=torch.float32)
    beta = torch.rand(1, tokens, h, device=dev, dtype=torch.float32)

    def run() -> None:
        chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return run


def main(argv: Optional[List[str]] = None) -> List[Dict[str, object]]:
    ap = argparse.ArgumentParser(prog="benchmark/batch1/graph_gap_probe.py")
    ap.add_argument("--nodes", type=int, default=300, help="launches in the timed chain graph")
    ap.add_argument("--replays", type=int, default=200, help="back-to-back replays per row")
    ap.add_argument("--result-filename", default=None, help="append one JSON line per row")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_gap_probe.py needs a CUDA device")
    x = torch.zeros(1, device="cuda")
    chain = _capture(lambda: _chain(x, args.nodes))  # the "decode graph", in the default pool
    rows: List[Dict[str, object]] = []

    relay = _Relay(x)

    def row(event: str) -> None:
        us = _us_per_node(chain, args.nodes, args.replays)
        relayed = _us_per_node(chain, args.nodes, args.replays, after=relay)
        rows.append({"event": event, "us_per_node": us, "us_per_node_relayed": relayed,
                     "nodes": args.nodes, "gpu": torch.cuda.get_device_name()})
        print(f"{event:<58}{us:8.3f} us/node{relayed:8.3f} with the relay's copy", flush=True)

    row("the chain alone")
    big = _capture(lambda: _chain(x, 4 * args.nodes), pool=torch.cuda.graph_pool_handle())
    row(f"a chain of {4 * args.nodes} nodes captured in its own pool")
    big.replay()
    row("... and replayed once")
    huge = _capture(lambda: _chain(x, 16 * args.nodes), pool=torch.cuda.graph_pool_handle())
    huge.replay()
    row(f"a chain of {16 * args.nodes} nodes captured and replayed")
    buf = torch.zeros(1 << 24, device="cuda")
    other = torch.empty_like(buf)
    _capture(lambda: buf.zero_()).replay()
    row("a graph of one memset replayed")
    _chain(x, 1)
    torch.cuda.synchronize()
    row("one eager launch of the chain's kernel, a device sync")
    _capture(lambda: other.copy_(buf)).replay()
    row("a graph of one device-to-device copy replayed")
    _chain(x, 1)
    torch.cuda.synchronize()
    row("one eager launch of the chain's kernel, a device sync")

    def copies() -> None:
        buf.zero_()
        other.copy_(buf)
        buf[: 1 << 10].copy_(other[: 1 << 10])
    _capture(copies).replay()
    row("a graph of memsets and device copies replayed")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, b)
    torch.cuda.synchronize()
    row("an 8192^3 bf16 cuBLAS GEMM, eager")
    _capture(lambda: torch.mm(a, b)).replay()
    row("the same GEMM replayed from a graph")
    del a, b
    torch.cuda.empty_cache()
    held = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    row("empty_cache, then a 2 GiB allocation")
    del held
    kda = _fla_kda(1024)
    if kda is not None:
        kda()
        torch.cuda.synchronize()
        row("fla chunk_kda over 1024 tokens, eager")
        try:
            _capture(kda).replay()
            row("fla chunk_kda over 1024 tokens, replayed from a graph")
        except RuntimeError as e:  # a capture fla does not allow: say so, keep the last row
            print(f"fla chunk_kda could not be captured: {e}")
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    time.sleep(0.5)
    row("the chain alone, at the end")
    if args.result_filename:
        with open(args.result_filename, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
