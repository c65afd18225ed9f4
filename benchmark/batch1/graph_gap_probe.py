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
one torch ``zero_`` over 64 MiB (a fill kernel of 16K blocks), then one of one device copy
(each followed by an eager launch and a sync, which may undo what it did); a graph of fills
and device copies replayed (the work a captured forward holds besides its kernels); a large
cuBLAS GEMM run eagerly and one replayed from a graph (kernels with a large shared-memory carve-out);
``torch.cuda.empty_cache()`` followed by a 2 GiB allocation (what a prefill capture does before
a long eager prefill); fla-core's ``chunk_kda`` over 1024 tokens, eagerly and then from a
graph, when fla is installed (the prefill's KDA kernels). CUDA only.

``--event NAME`` runs one event instead of the sequence, in a fresh process, so its effect is
its own: two or three more graphs of one launch each (``graphs_2``, ``graphs_3``: three or four
graphs in the process), those three then a freshly compiled Triton kernel run eagerly
(``graphs_3_new_module``; ``new_module`` alone), torch's ``zero_`` (on CUDA a fill kernel, not a memset node) eagerly, or in a graph
replayed (``zero_graph``; over one element: ``small_zero_graph``; on a side stream:
``zero_graph_side_stream``) or only captured (``zero_captured``), ``fill_(1)`` / a Triton
kernel writing the same zeros / a device copy in a graph replayed. After its two rows
the chain is also timed on a new stream (is the state the stream's or the process's?).
``--dump-dir`` writes the event's graphs as DOT files (``CUDAGraph.debug_dump``) and prints
their node kinds.

Each row also carries the GPU's SM and memory clocks, performance state, power, temperature and
active throttle reasons read right after its replays (``nvidia-smi``): a launch-to-launch time
that moves with the SM clock is a clock change, not a state of the process.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

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


_HELD: List[object] = []  # graphs an event keeps alive without replaying them
_DUMPS: List[str] = []  # DOT files of the graphs captured with a dump folder set (--dump-dir)


def _capture(fn: Callable[[], None], pool: object = None, warm: bool = True,
             dump: Optional[str] = None) -> "torch.cuda.CUDAGraph":
    if warm:
        fn()  # warm-up outside the capture (Triton compiles, cuBLAS picks its kernel)
    torch.cuda.synchronize()
    # debug_dump needs the graph's nodes, which torch destroys at the end of the capture
    # unless the graph keeps them (then it is instantiated here, not by the capture).
    graph = torch.cuda.CUDAGraph(keep_graph=bool(dump))
    if dump:
        graph.enable_debug_mode()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    if dump:
        graph.instantiate()
    torch.cuda.synchronize()
    if dump:
        graph.debug_dump(dump)
        _DUMPS.append(dump)
    return graph


_NODE_KINDS = ("KERNEL", "MEMSET", "MEMCPY", "HOST", "EMPTY", "WAIT_EVENT", "EVENT_RECORD",
               "MEM_ALLOC", "MEM_FREE", "BATCH_MEM_OP", "CONDITIONAL")


def labelled_nodes(dot_text: str) -> Iterator[Tuple[str, str]]:
    """``(node type, label)`` of each node statement in a ``cudaGraphDebugDotPrint`` DOT text:
    the first node type name in the label (``other`` when none is); escaped quotes inside a
    label do not end it."""
    kinds = "|".join(_NODE_KINDS)
    for m in re.finditer(r'label="((?:[^"\\]|\\.)*)"', dot_text, flags=re.S):
        found = re.search(rf"\b({kinds})\b", m.group(1))
        yield (found.group(1) if found else "other"), m.group(1)


def node_kinds(dot_text: str) -> Dict[str, int]:
    """Node count per node type (:func:`labelled_nodes`), with the first ``other`` label kept
    under ``other_label`` to read."""
    counts: Dict[str, int] = {}
    for kind, label in labelled_nodes(dot_text):
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "other" and "other_label" not in counts:
            counts["other_label"] = label[:200]  # type: ignore[assignment]
    return counts


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


_SMI_FIELDS = ("clocks.sm", "clocks.mem", "pstate", "power.draw", "temperature.gpu",
               "clocks_throttle_reasons.active")


def _clocks() -> Dict[str, str]:
    """The GPU's clocks, performance state, power and throttle reasons from ``nvidia-smi``
    (empty where it is missing): a near-empty kernel's launch-to-launch time follows the SM
    clock, so a row that moves with these is a clock change, not a graph state."""
    index = str(torch.cuda.current_device())
    for fields in (_SMI_FIELDS, _SMI_FIELDS[:3]):  # older drivers lack some fields
        try:
            out = subprocess.run(["nvidia-smi", "-i", index, "--format=csv,noheader,nounits",
                                  "--query-gpu=" + ",".join(fields)],
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return {}
        if out.returncode == 0 and out.stdout.strip():
            values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
            return dict(zip(fields, values))
    return {}


def _us_per_node(graph: "torch.cuda.CUDAGraph", nodes: int, replays: int,
                 after: Optional[Callable[[], None]] = None,
                 stream: Optional["torch.cuda.Stream"] = None) -> float:
    """Back-to-back replays of ``graph`` (``after`` called after each) on ``stream`` (default:
    the current one), µs per node."""
    if stream is not None:
        with torch.cuda.stream(stream):
            return _us_per_node(graph, nodes, replays, after)

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


@triton.jit
def _zero_kernel(x_ptr, n, BLOCK: tl.constexpr):
    # Zeros written by a kernel, not by a memset node.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=offs < n)


def _single_events(buf: torch.Tensor, other: torch.Tensor, dump: Optional[str]
                   ) -> Dict[str, Callable[[], None]]:
    """``--event`` choices: one thing a process does, each run in a fresh process so that its
    effect on the chain is its own (``dump``: a folder for the DOT files of its graphs)."""
    def path(name: str) -> Optional[str]:
        return os.path.join(dump, f"{name}.dot") if dump else None

    def triton_zero() -> None:
        _zero_kernel[(triton.cdiv(buf.numel(), 1024),)](buf, buf.numel(), BLOCK=1024)

    def on_side_stream(graph: "torch.cuda.CUDAGraph") -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.replay()
        torch.cuda.current_stream().wait_stream(side)
    def one_node_graphs(count: int) -> None:
        # ``count`` more graphs of one launch each, captured and replayed: with the chain, a
        # process of ``count + 1`` graphs (servers slow from the fourth: docs/performance.md,
        # "The fourth CUDA graph").
        cell = torch.zeros(1, device=buf.device)
        for i in range(count):
            graph = _capture(lambda: _bump_kernel[(1,)](cell), dump=path(f"one_node_{i}"))
            graph.replay()
            _HELD.append(graph)

    def new_module() -> None:
        # A kernel compiled and loaded now (a new module in the context), launched eagerly:
        # what fla's first chunk_kda call does among other things.
        @triton.jit
        def _fresh_kernel(x_ptr, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, tl.load(x_ptr + offs) * 2.0 + 1.0)
        _fresh_kernel[(1,)](other, BLOCK=16)
        torch.cuda.synchronize()
    return {
        "graphs_2": lambda: one_node_graphs(2),
        "graphs_3": lambda: one_node_graphs(3),
        "graphs_3_new_module": lambda: (one_node_graphs(3), new_module()),
        "new_module": new_module,
        "zero_eager": lambda: (buf.zero_(), torch.cuda.synchronize()),
        "zero_graph": lambda: _capture(buf.zero_, warm=False, dump=path("zero")).replay(),
        "small_zero_graph": lambda: _capture(buf[:1].zero_, warm=False,
                                             dump=path("small_zero")).replay(),
        "zero_graph_side_stream": lambda: on_side_stream(_capture(buf.zero_, warm=False,
                                                                  dump=path("zero_side"))),
        "zero_captured": lambda: _HELD.append(_capture(buf.zero_, warm=False,
                                                         dump=path("zero_held"))),
        "fill1_graph": lambda: _capture(lambda: buf.fill_(1.0), warm=False,
                                        dump=path("fill1")).replay(),
        "triton_zero_graph": lambda: _capture(triton_zero, dump=path("triton_zero")).replay(),
        "copy_graph": lambda: _capture(lambda: other.copy_(buf), warm=False,
                                       dump=path("copy")).replay(),
    }


def main(argv: Optional[List[str]] = None) -> List[Dict[str, object]]:
    ap = argparse.ArgumentParser(prog="benchmark/batch1/graph_gap_probe.py")
    ap.add_argument("--nodes", type=int, default=300, help="launches in the timed chain graph")
    ap.add_argument("--replays", type=int, default=200, help="back-to-back replays per row")
    ap.add_argument("--result-filename", default=None, help="append one JSON line per row")
    ap.add_argument("--event", default=None,
                    help="only this event after the first row (graphs_2 / graphs_3: two or "
                         "three more graphs of one launch each; graphs_3_new_module: then a "
                         "freshly compiled kernel run eagerly; new_module: that alone; "
                         "zero_eager, zero_graph, small_zero_graph, zero_graph_side_stream, "
                         "zero_captured, fill1_graph, triton_zero_graph, copy_graph), then the "
                         "chain again twice and once on a new stream")
    ap.add_argument("--dump-dir", default=None,
                    help="with --event: write its graphs' DOT files here and print their node "
                         "kinds")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_gap_probe.py needs a CUDA device")
    x = torch.zeros(1, device="cuda")
    chain = _capture(lambda: _chain(x, args.nodes))  # the "decode graph", in the default pool
    rows: List[Dict[str, object]] = []

    relay = _Relay(x)

    def row(event: str, stream: Optional["torch.cuda.Stream"] = None) -> None:
        us = _us_per_node(chain, args.nodes, args.replays, stream=stream)
        relayed = _us_per_node(chain, args.nodes, args.replays, after=relay, stream=stream)
        clocks = _clocks()  # right after the timed replays, before anything else runs
        rows.append({"event": event, "us_per_node": us, "us_per_node_relayed": relayed,
                     "nodes": args.nodes, "gpu": torch.cuda.get_device_name(), **clocks})
        smi = " ".join(f"{k.split('.')[-1]}={v}" for k, v in clocks.items())
        print(f"{event:<58}{us:8.3f} us/node{relayed:8.3f} with the relay's copy  {smi}",
              flush=True)

    row("the chain alone")
    if args.event:
        buf = torch.empty(1 << 24, device="cuda")  # no fill kernel before the event
        events = _single_events(buf, torch.empty_like(buf), args.dump_dir)
        if args.event not in events:
            raise SystemExit(f"--event {args.event!r}: choose one of {sorted(events)}")
        if args.dump_dir:
            os.makedirs(args.dump_dir, exist_ok=True)
        events[args.event]()
        torch.cuda.synchronize()
        row(f"after {args.event}")
        time.sleep(0.5)
        row(f"after {args.event}, 0.5 s later")
        # Is the state the stream's or the process's?
        row(f"after {args.event}, the chain on a new stream", stream=torch.cuda.Stream())
        append_jsonl(rows, args.result_filename)  # the timings first: a dump cannot lose them
        for dot in _DUMPS:
            with open(dot) as f:
                print(f"{os.path.basename(dot)}: node kinds {node_kinds(f.read())}")
        return rows
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
    row("a graph of one torch zero_ (a fill kernel) replayed")
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
    row("a graph of zero_ fills and device copies replayed")
    gemm = [torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    torch.mm(*gemm)
    torch.cuda.synchronize()
    row("an 8192^3 bf16 cuBLAS GEMM, eager")
    _capture(lambda: torch.mm(*gemm)).replay()
    row("the same GEMM replayed from a graph")
    gemm.clear()  # the operands go before empty_cache
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
    append_jsonl(rows, args.result_filename)
    return rows


def append_jsonl(rows: List[Dict[str, object]], path: Optional[str]) -> None:
    """Append one JSON line per row to ``path`` (nothing without one)."""
    if path:
        with open(path, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
