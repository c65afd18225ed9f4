"""The node kinds of every CUDA graph the engine captures at start-up: kernels, memsets, copies.

    python benchmark/batch1/graph_node_kinds.py --model-path ling-3.0-flash --load-format dummy \\
        --quantization fp8 --json-model-override-args '{"num_hidden_layers": 20}' \\
        --prefill-cuda-graph-tokens 1024 --dump-dir /tmp/graphs

A graph holding a memset node, once replayed, left a process's later graph replays slower at
every kernel-to-kernel transition (``benchmark/batch1/graph_gap_probe.py --event``;
docs/performance.md, "Prefill graphs and the decode step"). This builds the in-process
scheduler as ``graph_ab.py`` does (graphs captured as a server captures them) with every
``torch.cuda.CUDAGraph`` in debug mode, then writes each graph as a DOT file
(``CUDAGraph.debug_dump``) to ``--dump-dir`` and prints its node kinds, in capture order (the
decode graphs first, then the prefill buckets, largest first), with the labels of its first
memset and copy nodes (their sizes; the DOT files name the kernels around them). CUDA only.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Any, Dict, List, Optional

import torch

from graph_gap_probe import append_jsonl, labelled_nodes, node_kinds
from sglang.srt.layers.kernel_choices import add_kernel_choices_arg, kernel_choices_from_args
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.server_args import ServerArgs


def _debug_graph_class(made: List[Any]) -> type:
    """A ``torch.cuda.CUDAGraph`` that keeps its nodes after the capture (``keep_graph``: torch
    destroys them otherwise, and ``debug_dump`` needs them; the first replay instantiates it)
    and records itself in ``made``."""
    class DebugGraph(torch.cuda.CUDAGraph):
        def __new__(cls, keep_graph: bool = False) -> "DebugGraph":
            return super().__new__(cls, keep_graph=True)

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__()
            self.enable_debug_mode()
            made.append(self)
    return DebugGraph


def _labels(dot_text: str, kind: str, limit: int = 3) -> List[str]:
    """The first ``limit`` labels of ``kind`` nodes, shortened."""
    found = (" ".join(label.split())[:240] for k, label in labelled_nodes(dot_text) if k == kind)
    return list(itertools.islice(found, limit))


def main(argv: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="benchmark/batch1/graph_node_kinds.py")
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--dump-dir", required=True, help="folder for one DOT file per graph")
    parser.add_argument("--result-filename", default=None, help="append one JSON line per graph")
    add_kernel_choices_arg(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_node_kinds.py needs a CUDA device")
    made: List[Any] = []
    torch.cuda.CUDAGraph = _debug_graph_class(made)  # before any capture
    server_args = ServerArgs.from_cli_args(args)
    server_args.kernel_choices = kernel_choices_from_args(args)
    Scheduler(server_args)  # captures the decode graphs and any prefill graphs, as a server does
    os.makedirs(args.dump_dir, exist_ok=True)
    rows = []
    for i, graph in enumerate(made):
        path = os.path.join(args.dump_dir, f"graph{i:03d}.dot")
        graph.debug_dump(path)
        with open(path) as f:
            text = f.read()
        kinds = node_kinds(text)
        row = {"graph": i, "kinds": kinds, "memset_labels": _labels(text, "MEMSET"),
               "memcpy_labels": _labels(text, "MEMCPY")}
        rows.append(row)
        print(f"graph {i:3d}: {kinds}", flush=True)
        for label in row["memset_labels"] + row["memcpy_labels"]:
            print(f"    {label}")
    append_jsonl(rows, args.result_filename)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
