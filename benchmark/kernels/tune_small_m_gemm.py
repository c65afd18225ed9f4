"""Cold-L2 sweep of ``sgl_kernel.small_m_gemm`` tiles on Ling-3.0-flash's dense shapes, beside
the library GEMM (``F.linear``, cuBLAS) at the same row counts.

    python benchmark/kernels/tune_small_m_gemm.py [--rows 1 4 16] [--iters 30]

For each ``[N, K]`` weight (the KDA fused projection, the attention outputs, MLA's projections,
the dense MLP, the LM head) every (BLOCK_N, BLOCK_K, num_warps, num_stages) is timed at the first
of ``--rows`` with L2 flushed before each call, checked against the fp32 reference, and ranked;
the best config and the current ``launch_config`` are then timed at every row count, next to
``F.linear``. Bandwidth counts the weight's bytes. The config is chosen per shape only: the tiles
fix the summation order, and a decode row must round as its verify row does.

Without CUDA (``TRITON_INTERPRET=1``, fp32, wall-clock times) it is only a smoke run.
"""
from __future__ import annotations

import argparse
import itertools
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F

from cold_l2 import cold_time_us, flush_buffer, kernel_bench_device  # benchmark/kernels/cold_l2.py
from sgl_kernel._triton_mode import LaunchConfig
from sgl_kernel.fp8_blocks import block_dequantize, block_quantize
from sgl_kernel.small_m_gemm import (GatedNormPrologue, launch_config, small_m_gemm,
                                     small_m_gemm_reference)

# name -> (N, K) of Ling-3.0-flash (hidden 2560, 32 heads x 128, dense intermediate 6144).
FLASH_SHAPES: Dict[str, Tuple[int, int]] = {
    "kda qkvbfg": (5 * 4096 + 32, 2560),
    "attn out": (2560, 4096),
    "mla q": (32 * 192, 2560),
    "mla kv_a": (576, 2560),
    "dense gate_up": (2 * 6144, 2560),
    "dense down": (2560, 6144),
    "lm_head": (157184, 2560),
    "router gate": (512, 2560),
    "attn out + norm": (2560, 4096),
}
# Shapes whose launch differs from the plain product: the router gate's weight stays fp32 (also
# under --fp8, as the engine keeps it); KDA's o_proj reads its input through the gated RMSNorm
# prologue (per 128-wide head, sigmoid gate).
FP32_WEIGHT = {"router gate"}
GATED_NORM = {"attn out + norm"}


def label(cfg) -> str:
    """``BLOCK_N/BLOCK_K/num_warps/num_stages/split_k/swap_ab``: the small-M GEMM's fields of a
    LaunchConfig (the later fields belong to other kernels)."""
    return "/".join(str(v) for v in (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages,
                                      cfg.split_k, cfg.swap_ab))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--shapes", nargs="*", default=list(FLASH_SHAPES))
    p.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--block-k", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--num-warps", type=int, nargs="+", default=[4])
    p.add_argument("--num-stages", type=int, nargs="+", default=[3, 5])
    p.add_argument("--split-k", type=int, nargs="+", default=[1],
                   help="K ranges summed in range order (a block-fp8 tile is one block wide)")
    p.add_argument("--swap-ab", type=int, nargs="+", default=[0], choices=(0, 1),
                   help="1: the weight tile as the tensor-core product's first operand")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--scale", type=int, default=1, help="divide N by this (smoke runs)")
    p.add_argument("--fp8", action="store_true",
                   help="block-fp8 weights (float8_e4m3fn + 128x128 scales); F.linear then runs "
                        "on the dequantised bf16 weight, for reference")
    args = p.parse_args()
    dev, dt = kernel_bench_device("tune_small_m_gemm")
    on_cuda = dev == "cuda"
    torch.manual_seed(0)
    flush = flush_buffer(dev)
    grid = [LaunchConfig(*c) for c in itertools.product(
        args.block_n, args.block_k, args.num_warps, args.num_stages, args.split_k,
        [bool(v) for v in args.swap_ab])]
    name_dev = torch.cuda.get_device_name() if on_cuda else "CPU (Triton interpreter)"
    print(f"{name_dev}, {dt}{' (block-fp8 weights)' if args.fp8 else ''}, cold L2, "
          f"{args.iters} iters; config = "
          "BLOCK_N/BLOCK_K/num_warps/num_stages/split_k/swap_ab (a block-fp8 tile steps whole "
          "128-column scale blocks: BLOCK_K rounds down to a multiple of 128)")
    summary: List[str] = []
    for name in args.shapes:
        n, k = FLASH_SHAPES[name]
        n = max(n // args.scale, 1)
        w_dt = torch.float32 if name in FP32_WEIGHT else dt
        w = (torch.randn(n, k, device=dev) / k ** 0.5).to(w_dt)
        scale = None
        if args.fp8 and name not in FP32_WEIGHT:
            w, scale = block_quantize(w)
            w_lib = block_dequantize(w, scale, dt)
        else:
            w_lib = w
        nbytes = w.numel() * w.element_size() + (0 if scale is None else scale.numel() * 4)
        xs = {m: torch.randn(m, k, device=dev).to(dt) for m in args.rows}
        norms = {m: GatedNormPrologue(torch.randn(m, k, device=dev).to(dt),
                                      torch.ones(128, device=dev, dtype=dt), 1e-6, 128)
                 if name in GATED_NORM else None for m in args.rows}
        out_dt = torch.float32 if name in FP32_WEIGHT else None

        def run(m: int, cfg=None):
            return small_m_gemm(xs[m], w, config=cfg, w_scale=scale, gated_norm=norms[m],
                                out_dtype=out_dt)

        m0 = args.rows[0]
        ref = small_m_gemm_reference(xs[m0], w, w_scale=scale, gated_norm=norms[m0],
                                     out_dtype=out_dt)
        timed: List[tuple] = []
        for cfg in grid:
            try:
                out = run(m0, cfg)
            except Exception as exc:  # a config the compiler rejects (e.g. out of resources)
                print(f"  {name} {label(cfg)}: {type(exc).__name__}")
                continue
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            if err > 1e-2:
                raise SystemExit(f"{name} {cfg}: rel. error {err:.2e} vs fp32 reference")
            timed.append((cold_time_us(lambda: run(m0, cfg), args.iters, flush), cfg))
        timed.sort(key=lambda r: r[0])
        print(f"  {name} ranking at M={m0}: "
              + ", ".join(f"{label(c)} {t:.1f}" for t, c in timed[:5]))
        best, current = timed[0][1], launch_config(n, k, w.dtype)  # small_m_gemm's default
        cells = []
        for m in args.rows:
            x = xs[m]
            t_best = cold_time_us(lambda: run(m, best), args.iters, flush)
            t_cur = cold_time_us(lambda: run(m), args.iters, flush)
            t_lib = cold_time_us(lambda: F.linear(x.to(w_lib.dtype), w_lib), args.iters, flush)
            cells.append(f"M={m}: best {t_best:.1f} ({nbytes / t_best / 1e3:.0f} GB/s), "
                         f"current {t_cur:.1f}, F.linear {t_lib:.1f}")
        line = (f"| {name} | {n}x{k} | {label(best)} (current {label(current)}) | "
                + " ; ".join(cells) + " |")
        print(line)
        summary.append(line)
    print("\n| shape | N x K | best config | us (cold L2) |\n|---|---|---|---|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
