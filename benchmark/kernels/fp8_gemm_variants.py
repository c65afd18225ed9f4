"""Where the time of a weight-only block-fp8 GEMM goes at prefill sizes: kernel variants that
differ in one step each, timed side by side on the H200 (bf16 activations).

    python benchmark/kernels/fp8_gemm_variants.py [--shape 12288 2560] [--rows 4096]

* ``exact``: e4m3 -> bf16 (exact), one dot per 128-column scale block, its fp32 sum times the
  block's scales added to the accumulator (``sgl_kernel.fp8_gemm``'s numerics);
* ``prescale``: the weight tile times its scales in fp32, rounded to bf16, accumulated by the
  dot itself (the numerics of dequantise-to-bf16 + F.linear, the engine's reference path);
* ``convert``: e4m3 -> bf16 and an accumulating dot, no scales (wrong values: the cost of the
  conversion alone);
* ``bf16``: a bf16 weight in the same kernel (Triton's own floor);
and F.linear on the bf16 weight (cuBLAS). Each with and without ``swap_ab``.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sgl_kernel.fp8_blocks import block_dequantize, block_quantize

MODES = {"exact": 0, "prescale": 1, "convert": 2, "bf16": 3}


@triton.jit
def _variant_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_sn,
                    MODE: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (offs_m % M).to(tl.int64)[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + (offs_n % N).to(tl.int64)[:, None] * K + offs_k[None, :]
    s_ptrs = s_ptr + ((offs_n % N) // 128) * stride_sn
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs)
        w = tl.load(w_ptrs)
        if MODE == 0:
            scale = tl.load(s_ptrs + k0 // 128)
            w = w.to(x.dtype)
            if SWAP:
                acc += tl.dot(w, tl.trans(x)) * scale[:, None]
            else:
                acc += tl.dot(x, tl.trans(w)) * scale[None, :]
        else:
            if MODE == 1:
                scale = tl.load(s_ptrs + k0 // 128)
                w = (w.to(tl.float32) * scale[:, None]).to(x.dtype)
            else:
                w = w.to(x.dtype)
            if SWAP:
                acc = tl.dot(w, tl.trans(x), acc)
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP:
        o = out_ptr + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
        tl.store(o, acc.to(out_ptr.dtype.element_ty),
                 mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])
    else:
        o = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(o, acc.to(out_ptr.dtype.element_ty),
                 mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def run(x, w, s, mode: str, swap: bool, bm: int, bn: int, bk: int, warps: int, stages: int):
    """One launch of the variant; ``w`` is fp8 (or bf16 for mode ``bf16``)."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _variant_kernel[grid](x, w, s, out, m, n, k, s.stride(0), MODE=MODES[mode], SWAP=swap,
                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps,
                          num_stages=stages)
    return out


def median_us(fn, iters: int = 20) -> float:
    """Median CUDA-event microseconds after warm-up."""
    for _ in range(3):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for a, b in zip(starts, ends):
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=[12288, 2560])
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 4096])
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_gemm_variants needs CUDA")
    n, k = args.shape
    q, s = (t.cuda() for t in block_quantize(torch.randn(n, k) / k ** 0.5))
    w16 = block_dequantize(q, s, torch.bfloat16)
    configs = [(128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 64, 8, 4),
               (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 128, 4, 4)]
    for m in args.rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, w16).float()
        flops = 2.0 * m * n * k
        t = median_us(lambda: F.linear(x, w16))
        print(f"\n## M={m} N={n} K={k}: F.linear bf16 {t:.1f} µs {flops / t / 1e6:.0f} TF/s")
        print("| mode | swap | BM/BN/BK/warps/stages | µs | TF/s | max rel. err vs F.linear |")
        print("|---|---|---|---|---|---|")
        for mode in MODES:
            for swap in (False, True):
                for cfg in configs:
                    wt = w16 if mode == "bf16" else q
                    try:
                        out = run(x, wt, s, mode, swap, *cfg)
                        t = median_us(lambda: run(x, wt, s, mode, swap, *cfg))
                    except Exception as exc:
                        print(f"| {mode} | {swap} | {cfg} | {type(exc).__name__} | | |")
                        continue
                    err = float((out.float() - ref).abs().max() / ref.abs().max())
                    print(f"| {mode} | {swap} | {'/'.join(map(str, cfg))} | {t:.1f} | "
                          f"{flops / t / 1e6:.0f} | {err:.1e} |")


if __name__ == "__main__":
    main()
