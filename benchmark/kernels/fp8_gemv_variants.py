"""Which inner loop streams a block-fp8 weight fastest at batch 1: a cold-L2 comparison of
product forms on Ling-3.0-flash's dense shapes, to choose the design of
``sgl_kernel.small_m_gemm``'s fp8 path (not the engine's kernel itself).

    python benchmark/kernels/fp8_gemv_variants.py [--rows 1 4] [--iters 20]

Forms (one 128-column scale block per step; the tile's partial sums of a K split are added
with fp32 atomics, so only the bandwidth is comparable, not the rounding):

- ``bf16-mma``: e4m3 -> bf16, tensor-core product with bf16 x (the engine's form today);
- ``fp16-mma``: e4m3 -> fp16 and x -> fp16 in the loop (e4m3 -> fp16 is one packed
  conversion for two elements; e4m3 -> bf16 adds a conversion per element);
- ``fp16-x``:   the same with x given in fp16 (no per-tile conversion of x's 16 rows);
- ``fma``:      no tensor core, M = 1 only: x scaled by the block scale, one multiply-add per
  weight element in fp32, rows reduced at the end;
- ``bf16-w``:   a bf16 weight of the same shape through the bf16-mma loop (twice the bytes).

Bandwidth counts the weight bytes read.
"""
from __future__ import annotations

import argparse
import itertools
from typing import Dict, List, Tuple

import torch
import triton
import triton.language as tl

from cold_l2 import cold_time_us, flush_buffer, kernel_bench_device  # benchmark/kernels/cold_l2.py
from sgl_kernel.fp8_blocks import QBLOCK, block_dequantize, block_quantize

SHAPES: Dict[str, Tuple[int, int]] = {
    "kda qkvbfg": (5 * 4096 + 32, 2560),
    "attn out": (2560, 4096),
    "mla q": (32 * 192, 2560),
    "router-size": (512, 2560),
}
MODES = {"bf16-mma": 0, "fp16-mma": 1, "fp16-x": 5, "fma": 3, "bf16-w": 4}
# Not a form here: an e4m3 x e4m3 tl.dot of 16-row tiles compiles on sm_90 to the same e4m3 ->
# fp16 conversions and fp16 HMMA (no fp8 MMA at this tile), with x quantised besides.


@triton.jit
def _variant_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, M, N, K, k_per_split,
                    MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n, mask_m = offs_n < N, offs_m < M
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    nkb = tl.cdiv(K, BLOCK_K)
    if MODE == 3:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        s_row = s_ptr + (tl.program_id(0) * BLOCK_N // BLOCK_K) * nkb
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :],
                    mask=mask_n[:, None], other=0.0)
        if MODE == 3:  # fp32 lanes: x times the block scale, one FMA per weight element
            xk = tl.load(x_ptr + offs_k).to(tl.float32) * tl.load(s_row + k0 // BLOCK_K)
            acc2 += w.to(tl.float32) * xk[None, :]
        else:
            x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None],
                        other=0.0)
            if MODE == 4:
                acc = tl.dot(x, tl.trans(w), acc)
            else:
                sc = tl.load(s_ptr + (offs_n // BLOCK_K) * nkb + k0 // BLOCK_K, mask=mask_n,
                             other=0.0)
                if MODE == 0:
                    part = tl.dot(x, tl.trans(w.to(tl.bfloat16)))
                else:  # 1: x converted here; 5: x comes in fp16
                    part = tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)))
                acc += part * sc[None, :]
    if MODE == 3:
        res = tl.sum(acc2, axis=1)
        if SPLIT > 1:
            tl.atomic_add(out_ptr + offs_n, res, mask=mask_n)
        else:
            tl.store(out_ptr + offs_n, res, mask=mask_n)
    else:
        offs_o = offs_m[:, None] * N + offs_n[None, :]
        mask_o = mask_m[:, None] & mask_n[None, :]
        if SPLIT > 1:
            tl.atomic_add(out_ptr + offs_o, acc, mask=mask_o)
        else:
            tl.store(out_ptr + offs_o, acc, mask=mask_o)


def run_variant(mode: str, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
                out: torch.Tensor, block_n: int, stages: int, warps: int, split: int) -> None:
    """One launch of ``mode`` (``out`` fp32 [M, N], zeroed by the caller when split > 1; x
    already in fp16 for ``fp16-x``)."""
    m, k = x.shape
    n = w.shape[0]
    tiles = triton.cdiv(k, QBLOCK)
    k_per = triton.cdiv(tiles, split) * QBLOCK
    _variant_kernel[(triton.cdiv(n, block_n), 1, split)](
        x, s, w, s, out, m, n, k, k_per, MODE=MODES[mode], BLOCK_M=16, BLOCK_N=block_n,
        BLOCK_K=QBLOCK, SPLIT=split, num_warps=warps, num_stages=stages)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--shapes", nargs="*", default=list(SHAPES))
    p.add_argument("--modes", nargs="*", default=list(MODES))
    p.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--num-stages", type=int, nargs="+", default=[3, 5])
    p.add_argument("--num-warps", type=int, nargs="+", default=[4])
    p.add_argument("--split-k", type=int, nargs="+", default=[1, 4])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--scale", type=int, default=1, help="divide N by this (smoke runs)")
    args = p.parse_args()
    dev, dt = kernel_bench_device("fp8_gemv_variants")
    flush = flush_buffer(dev)
    torch.manual_seed(0)
    rows: List[str] = []
    for name in args.shapes:
        n, k = SHAPES[name]
        n = max(n // args.scale, 128)
        w16 = (torch.randn(n, k, device=dev) / k ** 0.5).to(dt)
        q, s = block_quantize(w16)
        w_ref = block_dequantize(q, s, torch.float32)
        for mode, m in itertools.product(args.modes, args.rows):
            if mode == "fma" and m != 1:
                continue
            w = w16 if mode == "bf16-w" else q
            nbytes = w.numel() * w.element_size()
            x = torch.randn(m, k, device=dev).to(dt if dev == "cuda" else torch.float32)
            if mode == "fp16-x":  # converted once, outside the timed call
                x = x.half()
            ref = x.float() @ (w16.float() if mode == "bf16-w" else w_ref).t()
            best = None
            for bn, st, wp, sp in itertools.product(args.block_n, args.num_stages,
                                                     args.num_warps, args.split_k):
                if mode == "fma" and QBLOCK % bn:
                    continue
                out = torch.zeros(m, n, device=dev)

                def call() -> None:
                    if sp > 1:
                        out.zero_()
                    run_variant(mode, x, w, s, out, bn, st, wp, sp)
                try:
                    call()
                except Exception as exc:  # out of resources, unsupported dot
                    print(f"  {name} {mode} M={m} {bn}/{st}/{wp}/{sp}: {type(exc).__name__}")
                    continue
                err = float((out - ref).norm() / ref.norm())
                if err > 1e-2:
                    print(f"  {name} {mode} M={m} {bn}/{st}/{wp}/{sp}: rel. error {err:.1e}")
                    continue
                t = cold_time_us(call, args.iters, flush)
                if best is None or t < best[0]:
                    best = (t, f"{bn}/{st}/{wp}/{sp}", err)
            if best:
                t, cfg, err = best
                line = (f"| {name} | {mode} | {m} | {cfg} | {t:.1f} | "
                        f"{nbytes / t / 1e3:.0f} | {err:.1e} |")
                print(line, flush=True)
                rows.append(line)
    print("\n| shape | form | M | best BLOCK_N/stages/warps/split | us (cold L2) | GB/s | "
          "rel. err |\n|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
