"""Block-fp8 dense projections at prefill row counts: ``sgl_kernel.fp8_gemm.block_fp8_gemm``
(weight-only, and "w8a8" on fp8 activations) against the engine's reference path (dequantise
the whole weight to bf16, then ``F.linear``) and ``F.linear`` on a bf16 weight of the same
shape (cuBLAS: the floor a weight-only fp8 kernel aims at), on Ling-3.0-flash's dense fp8
shapes.

    python benchmark/kernels/bench_fp8_gemm.py [--rows 1024 4096 8192] [--iters 20]

For each weight (pieces on their own block grids where the layer fuses several) the script
checks the kernel (both fp8 inner loops) against the fp32 reference at the first row count,
times a small sweep of tile configs at every row count, each with both inner loops (median of
CUDA-event timings, L2 flushed before each call), and prints one table row per (shape, M) with
microseconds and TFLOP/s (``2 M N K`` flops) of the default config (per-block product
scaling), the default tiles with pre-scaled weight tiles (``LaunchConfig.fp8_prescale``), the
best swept config of each inner loop, dequantise + F.linear and bf16 F.linear, then w8a8
(``block_fp8_linear(..., fp8_activations=True)``, ``KernelChoices.dense_fp8_activations``): the
per-token-group quantisation and the fused fp8 GEMM timed together at the default tiles, the
quantisation alone, and the quantisation's time plus the best swept config's fp8 GEMM on
pre-quantised activations (checked against the fp32 reference on the same quantised
activations at the first row count), and the same w8a8 product on the library's block-scaled
fp8 GEMM (``sgl_kernel.fp8_scaled_mm.blockwise_linear``: torch's ``_scaled_mm`` per row group,
``KernelChoices.dense_scaled_mm``; the column says "lib" where the library took every
grid-aligned group, "deq" where it refused one and the dequantised path ran), as the layer runs
it (groups off the library's rules on weights dequantised once). The last table
adds the shapes up over the 42-layer model (how many layers have each projection) for one
prefill of M tokens.

Without CUDA (``TRITON_INTERPRET=1``, fp32, wall-clock times, ``--scale`` shrinks N and M)
it is only a smoke run.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from cold_l2 import flush_buffer, kernel_bench_device  # benchmark/kernels/cold_l2.py
from sgl_kernel._triton_mode import LaunchConfig
from sgl_kernel.fp8_act_quant import per_token_group_quant_fp8
from sgl_kernel.fp8_blocks import block_quantize
from sgl_kernel.fp8_scaled_mm import (blockwise_linear, library_status, row_groups,
                                      scaled_mm_eligible, weight_only_groups)
from sgl_kernel.fp8_gemm import (block_fp8_dequantize, block_fp8_gemm, block_fp8_gemm_reference,
                                 block_fp8_linear, gemm_config, launch_config)

# name -> (row pieces, K, layers of Ling-3.0-flash whose prefill runs it as a dense projection):
# hidden 2560, 32 heads x 128, KDA's fused q|k|v|b|f|g and o_proj (35 KDA layers), MLA's fused
# q | kv_a | g input projection ("mla qkv_a_g") and its output projection (7 layers), the dense
# MLP (the first 2 layers, width 6144). MLA's pieces alone and the shared expert (width 768) are
# timed for reference with no layers: at prefill the shared expert rides the MoE's grouped GEMM
# (python/sglang/srt/layers/moe/fused_moe_triton.py), so the model's total leaves them out.
FLASH_SHAPES: Dict[str, Tuple[Sequence[int], int, int]] = {
    "kda qkvbfg": ([4096, 4096, 4096, 32, 4096, 4096], 2560, 35),
    "kda o_proj": ([2560], 4096, 35),
    "mla qkv_a_g": ([6144, 576, 32], 2560, 7),
    "mla q": ([6144], 2560, 0),
    "mla kv_a": ([576], 2560, 0),
    "mla g": ([32], 2560, 0),
    "mla dense": ([2560], 4096, 7),
    "shared gate_up": ([768, 768], 2560, 0),
    "shared down": ([2560], 768, 0),
    "dense gate_up": ([6144, 6144], 2560, 2),
    "dense down": ([2560], 6144, 2),
}

# The sweep: BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, swap_ab (each timed with
# both fp8 inner loops).
SWEEP = [
    gemm_config(128, 128, 128, 8, 8, 3),
    gemm_config(128, 128, 128, 8, 8, 4),
    gemm_config(128, 128, 128, 8, 4, 4),
    gemm_config(128, 128, 64, 8, 4, 4),
    gemm_config(128, 64, 128, 8, 4, 4),
    gemm_config(64, 128, 128, 8, 4, 4),
    gemm_config(128, 256, 128, 8, 8, 3),
    gemm_config(256, 128, 128, 8, 8, 3),
    gemm_config(128, 128, 128, 8, 4, 4, True),
    gemm_config(128, 128, 128, 16, 8, 4),
]
SMOKE_SWEEP = [gemm_config(32, 64, 128, 2), gemm_config(16, 32, 64, 1, swap_ab=True)]


def _label(cfg: LaunchConfig) -> str:
    return (f"{cfg.block_m}/{cfg.block_n}/{cfg.block_k}/{cfg.group_m}/{cfg.num_warps}/"
            f"{cfg.num_stages}{'/swap' if cfg.swap_ab else ''}"
            f"{'/pre' if cfg.fp8_prescale else ''}")


def median_us(fn: Callable[[], object], iters: int, flush: torch.Tensor) -> float:
    """Median microseconds of ``fn()`` after two warm-up calls: CUDA events around each call
    with ``flush`` (larger than L2) written before it; wall clock off CUDA."""
    fn()
    fn()
    if not flush.is_cuda:
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(1e6 * (time.perf_counter() - start))
        return statistics.median(times)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        flush.zero_()
        torch.cuda._sleep(200_000)  # the host enqueues the call while the GPU is busy
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return 1000.0 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _weight(pieces: Sequence[int], k: int, dev: str):
    """fp8 weight, its block scales (one grid per piece) and row -> scale-row map."""
    from sglang.srt.layers.quantization.fp8_utils import block_index

    parts = [block_quantize(torch.randn(n, k, device=dev) / k ** 0.5) for n in pieces]
    return (torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]),
            block_index(pieces, 128, dev))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--shapes", nargs="*", default=list(FLASH_SHAPES), choices=list(FLASH_SHAPES))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-sweep", action="store_true", help="time the default config only")
    p.add_argument("--scale", type=int, default=1,
                   help="divide N and M by this (smoke runs under the interpreter)")
    args = p.parse_args()
    dev, dt = kernel_bench_device("bench_fp8_gemm")
    on_cuda = dev == "cuda"
    torch.manual_seed(0)
    flush = flush_buffer(dev)
    sweep = [] if args.no_sweep else (SWEEP if on_cuda else SMOKE_SWEEP)
    # the w8a8 sweep: per-block product scaling only (pre-scaled tiles need 16-bit x)
    w8a8_sweep = list(sweep)
    sweep = [c._replace(fp8_prescale=pre) for c in sweep for pre in (False, True)]
    from sglang.srt.layers.quantization.fp8_utils import dequantize_indexed

    name_dev = torch.cuda.get_device_name() if on_cuda else "CPU (Triton interpreter)"
    print(f"{name_dev}, {dt}, L2 flushed before each call, median of {args.iters}; config = "
          "BLOCK_M/BLOCK_N/BLOCK_K/GROUP_M/num_warps/num_stages[/swap][/pre: pre-scaled "
          "weight tiles]\n")
    print("| shape | N x K | M | fp8 gemm default | prescaled, default tiles | best swept "
          "per-block (config) | best swept prescaled (config) | dequant + F.linear "
          "| Triton dequant + F.linear | bf16 F.linear | w8a8: quant + gemm, default tiles "
          "| w8a8: quant alone | w8a8: quant + best swept gemm (config) | w8a8: quant + "
          "library scaled_mm | default / F.linear | w8a8 / F.linear |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    totals: Dict[int, List[float]] = {}
    for name in args.shapes:
        pieces, k, layers = FLASH_SHAPES[name]
        pieces = [max(1, n // args.scale) for n in pieces]
        w, scale, rows = _weight(pieces, k, dev)
        groups = row_groups(pieces)
        off_grid = weight_only_groups(w, scale, groups, dt)
        n = w.shape[0]
        cols = torch.arange(k, device=dev) // 128
        w16 = dequantize_indexed(w, scale, rows, cols, dt)
        for i, m in enumerate(max(1, r // args.scale) for r in args.rows):
            x = torch.randn(m, k, device=dev, dtype=dt)
            cfg = launch_config(m, n, k)
            pre_cfg = cfg._replace(fp8_prescale=True)
            if i == 0:
                ref = block_fp8_gemm_reference(x, w, scale, rows)
                for c in (cfg, pre_cfg):
                    got = block_fp8_gemm(x, w, scale, rows, config=c)
                    err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
                    if err > (1e-2 if dt == torch.bfloat16 else 1e-4):
                        raise SystemExit(f"{name}: block_fp8_gemm ({_label(c)}) differs from "
                                         f"the reference (max rel. err {err:.2e})")
                # w8a8 against the fp32 reference on the same quantised activations
                q, q_scale = per_token_group_quant_fp8(x)
                got = block_fp8_linear(x, w, scale, rows, fp8_activations=True)
                ref = block_fp8_gemm_reference(q, w, scale, rows, x_scale=q_scale,
                                               out_dtype=torch.float32)
                err = float((got.float() - ref).abs().max() / ref.abs().max())
                if err > (1e-2 if dt == torch.bfloat16 else 1e-4):
                    raise SystemExit(f"{name}: w8a8 block_fp8_gemm differs from the reference "
                                     f"(max rel. err {err:.2e})")
                # The library's product, checked once per group shape inside: each group
                # against w8a8 where the library took it, else against the weight-only path.
                got = blockwise_linear(x, w, scale, groups)
                weight_only = block_fp8_gemm_reference(x, w, scale, rows).float()
                for r0, r1, _ in groups:
                    lib = library_status(x.device, r1 - r0, k, dt)
                    want = (ref if lib else weight_only)[:, r0:r1]
                    err = float((got[:, r0:r1].float() - want).abs().max() / want.abs().max())
                    if err > (1e-2 if dt == torch.bfloat16 else 1e-4):
                        raise SystemExit(f"{name}: blockwise_linear rows {r0}:{r1} differ from "
                                         f"the reference (max rel. err {err:.2e})")
            flops = 2.0 * m * n * k

            def fmt(us: float) -> str:
                return f"{us:.1f} µs {flops / us / 1e6:.0f} TF/s"

            t_def = median_us(lambda: block_fp8_gemm(x, w, scale, rows, config=cfg), args.iters,
                              flush)
            t_pre = median_us(lambda: block_fp8_gemm(x, w, scale, rows, config=pre_cfg),
                              args.iters, flush)
            # The best swept config of each inner loop, from the default tiles' times.
            best = {False: (t_def, cfg), True: (t_pre, pre_cfg)}
            for c in sweep:
                c = c._replace(block_n=min(c.block_n, max(16, 1 << (n - 1).bit_length())))
                try:
                    t = median_us(lambda: block_fp8_gemm(x, w, scale, rows, config=c),
                                  args.iters, flush)
                except Exception as exc:  # e.g. a config whose stages exceed shared memory
                    print(f"<!-- {name} M={m} {_label(c)}: {type(exc).__name__} -->")
                    continue
                if t < best[c.fp8_prescale][0]:
                    best[c.fp8_prescale] = (t, c)
            t_deq = median_us(lambda: F.linear(x, dequantize_indexed(w, scale, rows, cols, dt)),
                              args.iters, flush)
            t_tdq = median_us(lambda: F.linear(x, block_fp8_dequantize(w, scale, rows, dt)),
                              args.iters, flush)
            t_lin = median_us(lambda: F.linear(x, w16), args.iters, flush)
            # w8a8: the engine's call (quantisation + fused fp8 GEMM, default tiles), the
            # quantisation alone, and the sweep's GEMMs on pre-quantised activations
            t_w8 = median_us(lambda: block_fp8_linear(x, w, scale, rows, fp8_activations=True),
                             args.iters, flush)
            t_quant = median_us(lambda: per_token_group_quant_fp8(x), args.iters, flush)
            q, q_scale = per_token_group_quant_fp8(x)
            best_w8 = (median_us(lambda: block_fp8_gemm(q, w, scale, rows, config=cfg,
                                                        x_scale=q_scale, out_dtype=dt),
                                 args.iters, flush), cfg)
            for c in w8a8_sweep:
                c = c._replace(block_n=min(c.block_n, max(16, 1 << (n - 1).bit_length())))
                try:
                    t = median_us(lambda: block_fp8_gemm(q, w, scale, rows, config=c,
                                                         x_scale=q_scale, out_dtype=dt),
                                  args.iters, flush)
                except Exception as exc:  # e.g. a config whose stages exceed shared memory
                    print(f"<!-- {name} M={m} w8a8 {_label(c)}: {type(exc).__name__} -->")
                    continue
                if t < best_w8[0]:
                    best_w8 = (t, c)
            t_w8_best = t_quant + best_w8[0]
            t_lib = median_us(lambda: blockwise_linear(x, w, scale, groups, dequantized=off_grid),
                              args.iters, flush)
            eligible = [g for g in groups if scaled_mm_eligible(g[1] - g[0], k)]
            took = bool(eligible) and all(library_status(x.device, g[1] - g[0], k, dt)
                                          for g in eligible)
            times = (t_def, t_pre, best[False][0], best[True][0], t_deq, t_tdq, t_lin, t_w8,
                     t_quant, t_w8_best, t_lib)
            tot = totals.setdefault(m, [0.0] * len(times))
            for j, t in enumerate(times):
                tot[j] += layers * t
            print(f"| {name} | {n}x{k} | {m} | {fmt(t_def)} | {fmt(t_pre)} | "
                  + " | ".join(f"{fmt(t)} ({_label(c)})" for t, c in (best[False], best[True]))
                  + f" | {fmt(t_deq)} | {fmt(t_tdq)} | {fmt(t_lin)} | {fmt(t_w8)} | "
                  f"{t_quant:.1f} µs | {fmt(t_w8_best)} ({_label(best_w8[1])}) | "
                  f"{fmt(t_lib)} ({'lib' if took else 'deq'}) | "
                  f"{t_def / t_lin:.2f} | {t_w8 / t_lin:.2f} |")
    print("\nThe model's dense projections for one prefill of M tokens (each shape times its "
          "layers):\n")
    print("| M | fp8 gemm default | prescaled, default tiles | best swept per-block | best swept "
          "prescaled | dequant + F.linear | Triton dequant + F.linear | bf16 F.linear | w8a8: "
          "quant + gemm | w8a8: quant alone | w8a8: quant + best swept gemm | w8a8: quant + "
          "library scaled_mm |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m, tot in totals.items():
        print(f"| {m} | " + " | ".join(f"{t / 1000:.2f} ms" for t in tot) + " |")
    from sgl_kernel import fp8_scaled_mm

    # Whether the library's out= wrote a group into its column slice in place (else the
    # layer copies each group's product there): per (N, K) group shape checked.
    print("\nlibrary writes column slices in place: " + (", ".join(
        f"{n}x{k}: {'yes' if ok else 'no'}" for (_, n, k, _), ok in
        sorted(fp8_scaled_mm._SLICE_OUT.items(), key=lambda kv: kv[0][1:3])) or "not checked"))


if __name__ == "__main__":
    main()
