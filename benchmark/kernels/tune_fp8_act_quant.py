"""Tile sweep of the activation quantisation of the block-fp8 GEMMs (``sgl_kernel.fp8_act_quant``).

    python benchmark/kernels/tune_fp8_act_quant.py [--rows 1024 8192] [--cols 2560 4096] \\
        [--block-m 16 32 64 128] [--num-warps 2 4 8] [--iters 20]

At prefill sizes every fp8 projection's input is quantised per row and 128-column group by one
launch (``per_token_group_quant_fp8``), about 4 per layer. Each tile here is timed with a cold
L2 (``cold_l2.py``: the activations of an 8192-token prefill do not fit L2 either) and checked
bit for bit against the default tile's output (the tiling must not change a value). Prints one
table per shape with µs, the HBM rate of its bytes (read x, write q and the scales) and the
default tile's row marked; the fastest tile per shape last. CUDA (or ``TRITON_INTERPRET=1``
for a smoke run on CPU in fp32).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cold_l2 import cold_time_us, flush_buffer, kernel_bench_device  # noqa: E402
from sgl_kernel import fp8_act_quant  # noqa: E402
from sgl_kernel.fp8_act_quant import per_token_group_quant_fp8  # noqa: E402


def sweep_shape(m: int, k: int, block_ms: List[int], warps: List[int], iters: int,
                device: str, dtype: torch.dtype, flush: torch.Tensor
                ) -> List[Dict[str, object]]:
    """Rows ``{block_m, num_warps, us, gbps, default}`` of one ``[m, k]`` input, each tile's
    output checked against the default tile's."""
    x = torch.randn(m, k, device=device, dtype=dtype) * 3
    ref_q, ref_s = per_token_group_quant_fp8(x)
    moved = x.numel() * x.element_size() + ref_q.numel() + ref_s.numel() * 4
    rows = []
    for bm, w in itertools.product(block_ms, warps):
        q, s = per_token_group_quant_fp8(x, block_m=bm, num_warps=w)
        same = torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
        if not same:
            raise SystemExit(f"block_m {bm}, {w} warps: the output differs from the default "
                             f"tile's on [{m}, {k}]")
        us = cold_time_us(lambda: per_token_group_quant_fp8(x, block_m=bm, num_warps=w), iters,
                          flush)
        rows.append({"block_m": bm, "num_warps": w, "us": us, "gbps": moved / us / 1e3,
                     "default": bm == fp8_act_quant._BLOCK_M and w == 4})
    return rows


def main(argv: Optional[List[str]] = None) -> Dict[Tuple[int, int], List[Dict[str, object]]]:
    ap = argparse.ArgumentParser(prog="benchmark/kernels/tune_fp8_act_quant.py")
    ap.add_argument("--rows", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--cols", type=int, nargs="+", default=[2560, 4096])
    ap.add_argument("--block-m", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    device, dtype = kernel_bench_device("tune_fp8_act_quant.py")
    flush = flush_buffer(device)
    out = {}
    for m, k in itertools.product(args.rows, args.cols):
        rows = sweep_shape(m, k, args.block_m, args.num_warps, args.iters, device, dtype, flush)
        out[(m, k)] = rows
        print(f"\n[{m}, {k}] {dtype}:\n| block_m | warps | us | GB/s |\n|---|---|---|---|")
        for r in rows:
            mark = " (default)" if r["default"] else ""
            print(f"| {r['block_m']} | {r['num_warps']} | {r['us']:.1f}{mark} | {r['gbps']:.0f} |")
    print("\nfastest per shape:")
    for (m, k), rows in out.items():
        best = min(rows, key=lambda r: r["us"])
        default = next((r for r in rows if r["default"]), None)
        base = f" (default {default['us']:.1f} us)" if default else ""
        print(f"  [{m}, {k}]: block_m {best['block_m']}, {best['num_warps']} warps, "
              f"{best['us']:.1f} us{base}")
    return out


if __name__ == "__main__":
    main()
