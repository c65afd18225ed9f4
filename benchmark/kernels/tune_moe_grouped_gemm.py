"""Sweep of ``sgl_kernel.moe_grouped_gemm`` tile configs on Ling-3.0-flash's expert shapes; writes
the per-GPU table that ``moe_grouped_gemm_configs.launch_config`` reads.

    python benchmark/kernels/tune_moe_grouped_gemm.py [--dtype bf16 fp8 w8a8] \\
        [--tokens 128 256 512 1024 2048 4096 8192] [--fp8-prescale 0 1] \\
        [--swiglu-interleave 0 1] [--output PATH] [--iters 20]

For each weight format (bf16, block fp8 on bf16 activations, and ``w8a8``: block fp8 on
activations quantised per token and 128-column group, ``sgl_kernel.fp8_act_quant``, quantised
once outside the timed launch), projection (the up-projection with its SwiGLU epilogue,
``W13 [E, 2I, H]``; the down-projection, ``W2 [E, H, I]``) and batch (``--tokens`` x top-k pairs,
uniform random routing over the E experts), every (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps,
num_stages) of the grid, for fp8 also each fp8 inner loop of ``--fp8-prescale`` (0: per-block
product scaling, 1: pre-scaled weight tiles; ``LaunchConfig.fp8_prescale``, both by default,
ignored for bf16), for the up-projection also each SwiGLU tile layout of
``--swiglu-interleave`` (0: a gate and an up accumulator, 1: gate and up rows alternating in
one tile; ``LaunchConfig.swiglu_interleave``, both by default), is checked against a per-expert fp32 torch reference and timed as a CUDA
graph replay of one launch (median of ``--iters`` replays, CUDA events; the experts' bytes, GBs
at Ling's size, are far beyond L2, so every call streams them from HBM). The fastest config of
every pair bucket goes into ``--output`` under ``torch.cuda.get_device_name()`` and
``moe_grouped_gemm_configs.config_key(E, N, K, dtype)``, merged into what the file already
holds (other GPUs, shapes, buckets stay); default: the table shipped in the package. A
markdown table of the winners against the fallback config (and, for fp8, the best time of each
inner loop) is printed.

``--shared-expert`` times the launches as the model runs them: one more expert (id E, its own
weight) that every token is routed to, its rows in the same launch (``shared_w``), so a bucket is
``tokens x (top-k + 1)`` pairs, and a config must fit the shared expert's code path too (with
TMA weight tiles its rows are a second launch, timed with the first).

Without CUDA (``TRITON_INTERPRET=1``, fp32, wall-clock times, pass tiny ``--experts`` /
``--hidden`` / ``--intermediate``) it is only a smoke run of the script.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from cold_l2 import capture_graph, kernel_bench_device  # benchmark/kernels/cold_l2.py
from sgl_kernel.fp8_act_quant import group_dequantize, per_token_group_quant_fp8
from sgl_kernel.fp8_blocks import block_dequantize, block_quantize
from sgl_kernel.moe_grouped_gemm import (LaunchConfig, moe_align, moe_grouped_gemm,
                                         weight_tma_applies)
from sgl_kernel.moe_grouped_gemm_configs import (CONFIG_PATH, config_fields, config_key,
                                                 fallback_config)


def label(cfg: LaunchConfig) -> str:
    """``BLOCK_M/BLOCK_N/BLOCK_K/GROUP_M/num_warps/num_stages``, ``/pre`` appended for
    pre-scaled fp8 weight tiles, ``/il`` for the interleaved SwiGLU tile, ``/tma`` for weight
    tiles through a TMA descriptor."""
    return "/".join(str(v) for v in (cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m,
                                     cfg.num_warps, cfg.num_stages)) + (
        "/pre" if cfg.fp8_prescale else "") + ("/il" if cfg.swiglu_interleave else "") + (
        "/tma" if cfg.weight_tma else "")


def reference(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor], ids: torch.Tensor,
              rows_per_x: int, swiglu: bool, limit: float,
              round_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """fp32 per-expert loop (a host sync per expert is fine here): ``[P, N_out]`` in fp32, with
    the kernel's roundings of gate and up to ``round_dtype`` (default x's dtype; w8a8 passes the
    dequantised activations in fp32 and the model dtype here) before the SwiGLU."""
    round_dtype = round_dtype or x.dtype
    flat = ids.reshape(-1)
    n = w.shape[1]
    out = torch.empty(flat.numel(), n // 2 if swiglu else n, device=x.device)
    for e in torch.unique(flat).tolist():
        pairs = torch.nonzero(flat == e).flatten()
        we = w[e].float() if scale is None else block_dequantize(
            w[e], scale[e], torch.float32, n // 2 if swiglu else None)
        h = x[pairs // rows_per_x].float() @ we.t()
        if swiglu:
            gate = h[:, :n // 2].to(round_dtype).float()
            up = h[:, n // 2:].to(round_dtype).float()
            act = torch.nn.functional.silu(gate)
            if limit > 0:
                act, up = act.clamp(max=limit), up.clamp(-limit, limit)
            h = act * up
        out[pairs] = h
    return out


def time_us(fn: Callable[[], object], iters: int, on_cuda: bool) -> float:
    """Median microseconds of ``fn()``: a CUDA graph of one call replayed ``iters`` times, each
    replay between CUDA events (no launch overhead); wall clock off CUDA (smoke runs)."""
    fn()
    if not on_cuda:
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return 1e6 * (time.perf_counter() - start) / iters
    graph = capture_graph(fn)
    graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    return 1000.0 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def save(path: str, device_name: str, winners: Dict[str, Dict[str, dict]]) -> None:
    """Merge ``winners`` (shape key -> pairs bucket -> config) into the JSON table at ``path``."""
    table: dict = {}
    if os.path.exists(path):
        with open(path) as f:
            table = json.load(f)
    shapes = table.setdefault(device_name, {})
    for key, buckets in winners.items():
        shapes.setdefault(key, {}).update(buckets)
        shapes[key] = dict(sorted(shapes[key].items(), key=lambda kv: int(kv[0])))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", nargs="+", choices=["bf16", "fp8", "w8a8"],
                   default=["bf16", "fp8"],
                   help="formats to sweep: bf16 or block-fp8 experts on bf16 activations, or "
                        "block-fp8 experts on fp8 activations (w8a8)")
    p.add_argument("--tokens", type=int, nargs="+",
                   default=[128, 256, 512, 1024, 2048, 4096, 8192],
                   help="tokens per batch; pairs = tokens x top-k are the table's buckets")
    p.add_argument("--proj", nargs="+", choices=["up", "down"], default=["up", "down"])
    p.add_argument("--experts", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--intermediate", type=int, default=768, help="per TP rank")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--limit", type=float, default=7.0, help="SwiGLU clamp of the up-projection")
    p.add_argument("--block-m", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--block-n", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--block-k", type=int, nargs="+", default=[64, 128])
    p.add_argument("--group-m", type=int, nargs="+", default=[1, 8])
    p.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--num-stages", type=int, nargs="+", default=[3, 4])
    p.add_argument("--fp8-prescale", type=int, nargs="+", choices=[0, 1], default=[0, 1],
                   help="fp8 inner loops to sweep: 0 per-block product scaling, 1 pre-scaled "
                        "weight tiles (ignored for bf16)")
    p.add_argument("--swiglu-interleave", type=int, nargs="+", choices=[0, 1], default=[0, 1],
                   help="SwiGLU tile layouts to sweep for the up-projection: 0 a gate and an up "
                        "accumulator, 1 gate and up rows alternating in one tile")
    p.add_argument("--weight-tma", type=int, nargs="+", choices=[0, 1], default=[0],
                   help="weight tiles by pointer loads (0) and/or TMA descriptors (1); "
                        "TMA only where the tile allows it (weight_tma_applies)")
    p.add_argument("--shared-expert", action="store_true",
                   help="fold a shared expert into every launch, as the model's MoE does")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--output", default=CONFIG_PATH,
                   help="JSON table to merge the winners into (default: the packaged table)")
    p.add_argument("--dry-run", action="store_true", help="print the table, write nothing")
    args = p.parse_args()

    dev, act_dtype = kernel_bench_device("tune_moe_grouped_gemm")
    on_cuda = dev == "cuda"
    device_name = torch.cuda.get_device_name() if on_cuda else "CPU (Triton interpreter)"
    e, h, i, k = args.experts, args.hidden, args.intermediate, args.topk
    grid = [LaunchConfig(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, block_m=bm,
                         group_m=gm)
            for bm, bn, bk, gm, nw, ns in itertools.product(
                args.block_m, args.block_n, args.block_k, args.group_m, args.num_warps,
                args.num_stages)]
    # fp8 sweeps each tile config with each inner loop asked for; bf16 has one loop.
    fp8_grid = [cfg._replace(fp8_prescale=bool(pre)) for cfg in grid
                for pre in sorted(set(args.fp8_prescale))]
    print(f"{device_name}, E={e} H={h} I={i} top-{k}, activations {act_dtype}, {len(grid)} "
          f"configs ({len(fp8_grid)} in fp8), median of {args.iters} graph replays; config = "
          f"BLOCK_M/BLOCK_N/BLOCK_K/GROUP_M/num_warps/num_stages[/pre: pre-scaled fp8 tiles]"
          f"[/il: interleaved SwiGLU][/tma: TMA weight tiles]")
    torch.manual_seed(0)
    winners: Dict[str, Dict[str, dict]] = {}
    rows: List[Tuple] = []
    for fmt in args.dtype:
        fp8 = fmt in ("fp8", "w8a8")
        act_fp8 = fmt == "w8a8"
        for proj in args.proj:
            swiglu = proj == "up"
            n, kk = (2 * i, h) if swiglu else (h, i)
            w = torch.randn(e, n, kk, device=dev) / kk ** 0.5
            scale = None
            if fp8:
                w, scale = block_quantize(w, i if swiglu else None)
            else:
                w = w.to(act_dtype)
            key = config_key(e, n, kk, fp8, act_fp8)
            shared: dict = {}
            w_ref, s_ref = w, scale  # with the shared expert as expert e (reference only)
            if args.shared_expert:
                sw = torch.randn(1, n, kk, device=dev) / kk ** 0.5
                if fp8:
                    sw, s_scale = block_quantize(sw, i if swiglu else None)
                    shared = dict(shared_w=sw[0], shared_scale=s_scale[0])
                    s_ref = torch.cat([scale, s_scale])
                else:
                    sw = sw.to(act_dtype)
                    shared = dict(shared_w=sw[0])
                if swiglu:
                    shared["shared_limit"] = args.limit
                w_ref = torch.cat([w, sw])
            n_experts = e + args.shared_expert
            for tokens in args.tokens:
                ids = torch.rand(tokens, e, device=dev).argsort(-1)[:, :k]
                if args.shared_expert:
                    ids = torch.cat([ids, ids.new_full((tokens, 1), e)], dim=1)
                per_token = ids.shape[1]
                pairs = tokens * per_token
                fallback = fallback_config(e, pairs, fp8)
                x = torch.randn(tokens if swiglu else pairs, kk, device=dev).to(act_dtype)
                rows_per_x = per_token if swiglu else 1
                xs = None
                if act_fp8:  # the kernel's input: e4m3 rows and their group scales
                    x, xs = per_token_group_quant_fp8(x)
                    ref = reference(group_dequantize(x, xs), w_ref, s_ref, ids, rows_per_x,
                                    swiglu, args.limit, act_dtype)
                else:
                    ref = reference(x, w_ref, s_ref, ids, rows_per_x, swiglu, args.limit)
                aligns = {}
                results = []
                # w8a8 has one inner loop (fp8_prescale does not apply).
                configs = fp8_grid if fp8 and not act_fp8 else grid
                if swiglu:  # each tile config in each SwiGLU layout asked for
                    configs = [c._replace(swiglu_interleave=bool(il)) for c in configs
                               for il in sorted(set(args.swiglu_interleave))]
                configs = [c._replace(weight_tma=bool(tma)) for c in configs
                           for tma in sorted(set(args.weight_tma))]
                configs = [c for c in configs if not c.weight_tma or weight_tma_applies(
                    c, swiglu, fp8 and not act_fp8, n // 2 if swiglu else n, w,
                    shared.get("shared_w"))]
                for cfg in [fallback] + [c for c in configs if c != fallback]:
                    if cfg.block_m not in aligns:
                        aligns[cfg.block_m] = moe_align(ids, n_experts, cfg.block_m)
                    out = torch.empty(pairs, ref.shape[1], dtype=act_dtype, device=dev)

                    def run(cfg=cfg, out=out):
                        return moe_grouped_gemm(x, w, aligns[cfg.block_m], rows_per_x=rows_per_x,
                                                swiglu=swiglu, swiglu_limit=args.limit,
                                                w_scale=scale, config=cfg, out=out,
                                                x_scale=xs, **shared)
                    try:
                        run()
                    except Exception as exc:  # out of shared memory / registers, bad fp8 tile
                        if cfg == fallback:
                            raise
                        print(f"  skip {fmt} {proj} {label(cfg)}: {type(exc).__name__}")
                        continue
                    err = float((out.float() - ref).abs().max() / ref.abs().max())
                    if err > 2e-2:
                        raise SystemExit(f"{fmt} {proj} {label(cfg)} at {pairs} pairs: rel. "
                                         f"error {err:.2e} vs the fp32 reference")
                    results.append((time_us(run, args.iters, on_cuda), cfg, err))
                    print(f"    {fmt} {proj} {pairs} pairs {label(cfg)}: {results[-1][0]:.1f} us",
                          flush=True)
                fallback_us = results[0][0]
                best_us, best, err = min(results, key=lambda r: r[0])
                winners.setdefault(key, {})[str(pairs)] = config_fields(best, fp8, swiglu)
                if not args.dry_run:  # after every bucket: a sweep stopped by a time limit keeps
                    save(args.output, device_name, winners)  # what it measured
                flops = 2 * pairs * n * kk
                # fp8: the best time of each inner loop, the comparison the sweep is for.
                schemes = ""
                if fp8 and not act_fp8:
                    per_scheme = [min((r[0] for r in results if r[1].fp8_prescale == pre),
                                      default=None) for pre in (False, True)]
                    schemes = " / ".join("-" if t is None else f"{t:.1f}" for t in per_scheme)
                rows.append((fmt, proj, key, pairs, label(best), best_us,
                             flops / best_us / 1e6, fallback_us, err, schemes))
                detail = f"; per-block / pre-scaled best {schemes} us" if schemes else ""
                print(f"  {fmt} {proj} {pairs} pairs: best {label(best)} {best_us:.1f} us "
                      f"(fallback {fallback_us:.1f} us{detail})", flush=True)

    print("\n| weights | proj | shape | pairs | best config | us | TFLOP/s | fallback us | "
          "speedup | rel. err | fp8 best us: per-block / pre-scaled |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    for fmt, proj, key, pairs, cfg, us, tflops, fb, err, schemes in rows:
        print(f"| {fmt} | {proj} | {key} | {pairs} | {cfg} | {us:.1f} | {tflops:.1f} | "
              f"{fb:.1f} | {fb / us:.2f}x | {err:.1e} | {schemes} |")
    if not args.dry_run:
        print(f"\nwrote {sum(len(b) for b in winners.values())} entries for {device_name!r} to "
              f"{args.output}")


if __name__ == "__main__":
    main()
