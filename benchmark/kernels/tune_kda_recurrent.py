"""Cold-L2 sweep of ``sgl_kernel.kda_recurrent``'s value tile (BV) and warps on a Ling-3.0-flash
KDA layer (32 heads, K = V = 128) at batch 1: the decode step and the chain verify.

    python benchmark/kernels/tune_kda_recurrent.py [--chain 1 4 6 17] [--block-v 16 32 64 128] \\
        [--num-warps 2 4 8] [--iters 50]

Per chain length (1: the decode step, state updated in place; above: a verify staging the state
after every position) each (BV, num_warps) is timed with L2 flushed before each call and its
bandwidth counted over the state bytes it moves (read, then written once for decode or per
position for verify). At every num_warps the outputs and staged states of each BV are compared
bit for bit with the first BV's and the table says where they differ: on the GPU they may (the
tile changes the reductions' register layout), so a new tile must serve decode and verify
alike (``launch_config`` has one). Without CUDA (``TRITON_INTERPRET=1``, fp32, scaled-down heads) it is only a smoke run.
"""
from __future__ import annotations

import argparse
from typing import List

import torch

from cold_l2 import cold_time_us, flush_buffer, kernel_bench_device  # benchmark/kernels/cold_l2.py
from sgl_kernel.kda_recurrent import kda_recurrent_reference, kda_recurrent_update, launch_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chain", type=int, nargs="+", default=[1, 4, 6, 17])
    p.add_argument("--block-v", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--num-warps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    dev, _ = kernel_bench_device("tune_kda_recurrent")
    flush = flush_buffer(dev)
    h, d = args.heads, args.head_dim
    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU (Triton interpreter)"
    default = launch_config(d, d)
    print(f"{name}: KDA recurrence, {h} heads x K = V = {d}, batch 1, cold L2, {args.iters} "
          f"iters; default BV/warps {default.block_n}/{default.num_warps}")
    gen = torch.Generator().manual_seed(0)
    summary: List[str] = []
    for n in args.chain:
        def unit(*shape):
            x = torch.randn(*shape, generator=gen)
            return (x / x.norm(dim=-1, keepdim=True)).to(dev)

        q, k = unit(1, n, h, d), unit(1, n, h, d)
        v = torch.randn(1, n, h, d, generator=gen).to(dev)
        g = (-torch.rand(1, n, h, d, generator=gen) * 0.1).to(dev)
        beta = torch.rand(1, n, h, generator=gen).to(dev)
        pool = torch.randn(2, h, d, d, generator=gen).to(dev) * 0.1
        slots = torch.tensor([1], device=dev)
        staged = torch.zeros(2, n, h, d, d, device=dev) if n > 1 else None
        out = torch.empty_like(v)
        state_bytes = h * d * d * 4 * (1 + (n if n > 1 else 1))
        ref_out = torch.empty_like(v)
        ref_pool = pool.clone()
        kda_recurrent_reference(q, k, v, g, beta, d ** -0.5, ref_pool, slots, ref_out,
                                staged=None if staged is None else staged.clone())
        rows = []
        for warps in args.num_warps:
            first = None
            for bv in args.block_v:
                work = pool.clone()

                def call():
                    kda_recurrent_update(q, k, v, g, beta, d ** -0.5, work, slots, out,
                                         staged=staged, block_v=bv, num_warps=warps)

                try:
                    work.copy_(pool)
                    call()
                except Exception as exc:  # a config the compiler rejects (e.g. out of resources)
                    print(f"  chain {n} BV {bv} warps {warps}: {type(exc).__name__}")
                    continue
                got = (out.clone(), work.clone() if staged is None else staged.clone())
                err = float((got[0] - ref_out).norm() / ref_out.norm())
                if err > 1e-3:
                    raise SystemExit(f"chain {n} BV {bv} warps {warps}: rel. error {err:.2e}")
                if first is None:
                    first = got
                same = torch.equal(got[0], first[0]) and torch.equal(got[1], first[1])
                us = cold_time_us(call, args.iters, flush)  # decode: the state keeps moving
                rows.append((us, bv, warps, same))
        rows.sort()
        best = rows[0]
        cur = [r for r in rows if (r[1], r[2]) == (default.block_n, default.num_warps)] or [None]
        cells = "; ".join(f"{bv}/{w} {us:.1f}{'' if same else ' (bits differ)'}"
                          for us, bv, w, same in rows[:6])
        line = (f"| {n} | {best[1]}/{best[2]} {best[0]:.1f} µs "
                f"({state_bytes / best[0] / 1e3:.0f} GB/s) | "
                + (f"{cur[0][0]:.1f} µs" if cur[0] else "not swept")
                + f" | {all(r[3] for r in rows)} | {cells} |")
        print(line)
        summary.append(line)
    print("\n| chain | best BV/warps | default | bit-equal across BV | fastest six (BV/warps µs) |"
          "\n|---|---|---|---|---|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
