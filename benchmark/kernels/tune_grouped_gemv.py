"""Cold-L2 sweep of ``sgl_kernel.grouped_gemv`` launch configs on Ling-3.0-flash's MoE shapes.

    python benchmark/kernels/tune_grouped_gemv.py [--tokens 1] [--check-tokens 4 6] [--iters 30]

For each projection (the up-projection with its SwiGLU epilogue, ``W13 [E, 2I, H]``; the
down-projection, ``W2 [E, H, I]``), with the shared expert as one more pair per token, every
(BLOCK_N, BLOCK_K, num_warps, num_stages) is timed on ``--tokens`` tokens x top-k pairs with L2 flushed before each call (every layer's experts come
from HBM in the real model), checked against the fp32 reference, and ranked; the best few and the
current default are then timed at ``--check-tokens`` (NEXTN verify sizes). Bandwidth counts the
distinct experts' bytes. A config is chosen per projection shape only, never per pair count: the
blocks fix the summation order, and verify and decode must round alike.

Without CUDA (``TRITON_INTERPRET=1``, fp32, wall-clock times) it is only a smoke run of the script.
"""
from __future__ import annotations

import argparse
import itertools
from typing import List, NamedTuple, Optional

import torch

from cold_l2 import cold_time_us, flush_buffer, kernel_bench_device  # benchmark/kernels/cold_l2.py
from sgl_kernel.fp8_blocks import block_quantize
from sgl_kernel.grouped_gemv import grouped_gemv, grouped_gemv_reference


class Config(NamedTuple):
    """One launch config of ``grouped_gemv`` (``None`` = the kernel's default)."""

    block_n: Optional[int]
    block_k: Optional[int]
    num_warps: Optional[int]
    num_stages: Optional[int]

    def label(self) -> str:
        """``BLOCK_N/BLOCK_K/num_warps/num_stages``, or ``default``."""
        return "default" if self == DEFAULT else "/".join(str(v) for v in self)


DEFAULT = Config(None, None, None, None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--check-tokens", type=int, nargs="*", default=[4, 6])
    p.add_argument("--experts", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--block-n", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--block-k", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--num-stages", type=int, nargs="+", default=[1, 3])
    p.add_argument("--no-shared", action="store_true",
                   help="routed pairs only (default: the shared expert rides as one more pair "
                        "per token, as the model runs it)")
    p.add_argument("--fp8", action="store_true",
                   help="block-fp8 experts (float8_e4m3fn + 128x128 scales, gate and up on "
                        "their own grids)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--top", type=int, default=5, help="configs re-timed at --check-tokens")
    args = p.parse_args()
    dev, dt = kernel_bench_device("tune_grouped_gemv")
    on_cuda = dev == "cuda"
    torch.manual_seed(0)
    e, h, i, k = args.experts, args.hidden, args.intermediate, args.topk
    flush = flush_buffer(dev)
    name_dev = torch.cuda.get_device_name() if on_cuda else "CPU (Triton interpreter)"
    shapes = {  # name -> (weights, input width, SwiGLU limit or None)
        "up+SwiGLU": ((torch.randn(e, 2 * i, h, device=dev) / h ** 0.5).to(dt), h, 0.0),
        "down": ((torch.randn(e, h, i, device=dev) / i ** 0.5).to(dt), i, None),
    }
    grid = [Config(*c) for c in itertools.product(args.block_n, args.block_k, args.num_warps,
                                                  args.num_stages)]
    print(f"{name_dev}, E={e} H={h} I={i} top-{k}, {dt}"
          f"{' (block-fp8 experts)' if args.fp8 else ''}, cold L2, "
          f"{args.iters} iters; config = BLOCK_N/BLOCK_K/num_warps/num_stages")
    for name, (w, width, limit) in shapes.items():
        split = w.shape[1] // 2 if limit is not None else None
        w_scale = shared_scale = None
        if args.fp8:
            w, w_scale = block_quantize(w, split)
        shared_w = None if args.no_shared else w[-1].clone()
        if args.fp8 and shared_w is not None:
            shared_scale = w_scale[-1].clone()

        def case(tokens: int):
            x = torch.randn(tokens, width, device=dev).to(dt)
            ids = torch.stack([torch.randperm(e - 1, device=dev)[:k]
                               for _ in range(tokens)]).view(-1)
            ref = grouped_gemv_reference(x.float(), w if args.fp8 else w.float(), ids, k,
                                         swiglu_limit=limit, extra_w=shared_w if args.fp8 or
                                         shared_w is None else shared_w.float(),
                                         w_scale=w_scale, extra_w_scale=shared_scale)
            experts = int(ids.unique().numel()) + (shared_w is not None)
            per_expert = w[0].numel() * w.element_size() + (
                0 if w_scale is None else w_scale[0].numel() * 4)
            nbytes = experts * per_expert
            return x, ids, ref, nbytes

        def run(cfg: Config, x, ids):
            return lambda: grouped_gemv(x, w, ids, rows_per_x=k, swiglu_limit=limit,
                                        block_n=cfg.block_n, block_k=cfg.block_k,
                                        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                        extra_w=shared_w, w_scale=w_scale,
                                        extra_w_scale=shared_scale)

        x, ids, ref, nbytes = case(args.tokens)
        rows: List[tuple] = []
        for cfg in [DEFAULT] + grid:
            try:
                out = run(cfg, x, ids)()
            except Exception as exc:  # a config the compiler rejects (e.g. out of resources)
                print(f"  {name} {cfg.label()}: {type(exc).__name__}")
                continue
            err = float((out.float() - ref).norm() / ref.norm())
            if err > 1e-2:
                raise SystemExit(f"{name} {cfg.label()}: rel. error {err:.2e} vs fp32 reference")
            rows.append((cold_time_us(run(cfg, x, ids), args.iters, flush), cfg, err))
        rows.sort(key=lambda r: r[0])
        default_us = next(t for t, c, _ in rows if c == DEFAULT)
        print(f"\n### {name}: W {tuple(w.shape)}, {args.tokens} token(s)\n")
        print("| config | us | GB/s | vs default | rel. err |\n|---|---|---|---|---|")
        shown = rows[:args.top] + [r for r in rows[args.top:] if r[1] == DEFAULT]
        for t, cfg, err in shown:
            print(f"| {cfg.label()} | {t:.1f} | {nbytes / t / 1e3:.0f} | {default_us / t:.2f}x "
                  f"| {err:.1e} |")
        for tokens in args.check_tokens:
            xc, idc, _, nb = case(tokens)
            cells = [f"{c.label()} {cold_time_us(run(c, xc, idc), args.iters, flush):.1f}"
                     for _, c, _ in shown]
            print(f"\n{tokens} tokens ({tokens * k} pairs, {nb / 1e6:.0f} MB), us: "
                  + "; ".join(cells))


if __name__ == "__main__":
    main()
