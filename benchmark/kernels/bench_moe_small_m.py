"""Cold-L2 A/B of the routed-expert MoE at decode / NEXTN-verify sizes on one Ling-3.0-flash layer:
torch-native gather + bmm (the reference) vs the Triton grouped mat-vec (``--moe-runner-backend
triton``), same inputs, same process.

    python benchmark/kernels/bench_moe_small_m.py [--tokens 1 4 6 24] [--iters 50]

Each timed call is preceded by a write of a buffer larger than L2, so the 8 experts' weights per
token (about 94 MB per layer for Flash in bf16) come from HBM as in the real model, where every
other layer's weights pass through L2 between two calls of one layer. Times are CUDA-event means.
Also prints each path's relative error against an fp32 computation of the same routed sum.
"""
from __future__ import annotations

import argparse

import torch

from cold_l2 import cold_time_us, flush_buffer  # benchmark/kernels/cold_l2.py
from sglang.srt.layers.moe.fused_moe_native import fused_moe_gather
from sglang.srt.layers.moe.fused_moe_triton import fused_moe_small_m

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 6, 24])
    p.add_argument("--experts", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--limit", type=float, default=0.0, help="SwiGLU clamp (0 = off)")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_small_m needs CUDA")
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    e, h, i, k = args.experts, args.hidden, args.intermediate, args.topk
    w13 = (torch.randn(e, 2 * i, h, device=dev) / h ** 0.5).to(dt)
    w2 = (torch.randn(e, h, i, device=dev) / i ** 0.5).to(dt)
    flush = flush_buffer(dev)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    print(f"{torch.cuda.get_device_name()}, E={e} H={h} I={i} top-{k}, bf16, cold L2, "
          f"{args.iters} iters")
    print("| tokens | pairs | native gather (us) | triton grouped GEMV (us) | speedup "
          "| triton GB/s (distinct experts) | rel. err native / triton |")
    print("|---|---|---|---|---|---|---|")
    for t in args.tokens:
        x = torch.randn(t, h, device=dev).to(dt)
        ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
        wts = torch.rand(t, k, device=dev)
        # fp32 truth over just the selected experts (ids remapped into that subset).
        uniq, local = ids.unique(return_inverse=True)
        exact = fused_moe_gather(x.float(), w13[uniq].float(), w2[uniq].float(), wts,
                                 local.view_as(ids), args.limit)
        native = lambda: fused_moe_gather(x, w13, w2, wts, ids, args.limit)  # noqa: E731
        triton_ = lambda: fused_moe_small_m(x, w13, w2, wts, ids, args.limit)  # noqa: E731
        t_nat = cold_time_us(native, args.iters, flush)
        t_tri = cold_time_us(triton_, args.iters, flush)
        gbps = int(uniq.numel()) * expert_bytes / (t_tri * 1e-6) / 1e9

        def rel(y: torch.Tensor) -> float:
            return float((y.float() - exact).norm() / exact.norm())

        err = f"{rel(native()):.2e} / {rel(triton_()):.2e}"
        print(f"| {t} | {t * k} | {t_nat:.1f} | {t_tri:.1f} | {t_nat / t_tri:.2f}x | {gbps:.0f} "
              f"| {err} |")


if __name__ == "__main__":
    main()
