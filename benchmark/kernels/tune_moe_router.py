"""Warps per program of the MoE router kernel (``sgl_kernel.moe_router``), at Ling-3.0-flash's
router (512 experts in 8 groups, the best 4 groups, top-8, renormalised, scaled by 2.5).

    python benchmark/kernels/tune_moe_router.py [--tokens 1 4 8192] [--num-warps 1 2 4 8] \\
        [--launches 100] [--iters 20]

At decode the router is one tiny program per token on the critical path of every MoE layer:
what counts is its latency from launch to end. Each row times ``--launches`` back-to-back
launches replayed from one CUDA graph (µs per launch, the graph's kernel-to-kernel cost
included, as in the decode graph), median of ``--iters`` replays. Every warp count's ids are
checked equal to the default's and its weights within 1e-6 relative (the renormalising sum may
add in another order). CUDA (or ``TRITON_INTERPRET=1``: a smoke run, eager, wall clock).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Optional, Tuple

import torch

from cold_l2 import capture_graph  # benchmark/kernels/cold_l2.py
from sgl_kernel import moe_router
from sgl_kernel._triton_mode import INTERPRETED
from sgl_kernel.moe_router import moe_router_topk

FLASH = dict(top_k=8, num_expert_group=8, topk_group=4, renormalize=True,
             routed_scaling_factor=2.5)
EXPERTS = 512


def _timed(fn, launches: int, iters: int, cuda: bool) -> float:
    """µs per launch of ``fn``: ``launches`` of it in one CUDA graph, median of ``iters``
    replays (eager wall clock off CUDA)."""
    if not cuda:
        start = time.perf_counter()
        for _ in range(launches):
            fn()
        return 1e6 * (time.perf_counter() - start) / launches
    graph = capture_graph(fn, launches)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def sweep(tokens: List[int], warps: List[int], launches: int, iters: int
          ) -> Dict[Tuple[int, int], float]:
    """``{(tokens, warps): µs per launch}``, each warp count's output checked against the
    default's."""
    cuda = torch.cuda.is_available() and not INTERPRETED
    device = "cuda" if cuda else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    bias = torch.randn(EXPERTS, device=device, generator=gen) * 0.1
    out = {}
    for t in tokens:
        logits = torch.randn(t, EXPERTS, device=device, generator=gen)
        ref_w, ref_ids = moe_router_topk(logits, expert_bias=bias, **FLASH)
        for w in warps:
            wts, ids = moe_router_topk(logits, expert_bias=bias, num_warps=w, **FLASH)
            if not torch.equal(ids, ref_ids):
                raise SystemExit(f"{w} warps, {t} tokens: expert ids differ from the default's")
            torch.testing.assert_close(wts, ref_w, rtol=1e-6, atol=1e-7)
            out[(t, w)] = _timed(lambda: moe_router_topk(logits, expert_bias=bias, num_warps=w,
                                                         **FLASH), launches, iters, cuda)
    return out


def main(argv: Optional[List[str]] = None) -> Dict[Tuple[int, int], float]:
    ap = argparse.ArgumentParser(prog="benchmark/kernels/tune_moe_router.py")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8192])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--launches", type=int, default=100)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    times = sweep(args.tokens, args.num_warps, args.launches, args.iters)
    print("| tokens | warps | µs per launch |\n|---|---|---|")
    for (t, w), us in times.items():
        mark = " (default)" if w == moe_router.NUM_WARPS else ""
        print(f"| {t} | {w} | {us:.2f}{mark} |")
    return times


if __name__ == "__main__":
    main()
