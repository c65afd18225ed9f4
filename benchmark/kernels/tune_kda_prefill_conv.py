"""Cold-L2 sweep of ``sgl_kernel.kda_prefill_conv``'s tile (tokens x channels) and warps on a
Ling-3.0-flash KDA layer's prefill: the short conv + SiLU over the ``[q | k | v]`` columns of
the fused projection output (3 x 32 heads x 128 = 12288 channels, width 4), one request.

    python benchmark/kernels/tune_kda_prefill_conv.py [--tokens 1024 8192] \\
        [--block-t 16 32 64 128] [--block-c 64 128 256 512] [--num-warps 2 4 8] [--iters 20] \\
        [--l2norm-head-dim 128]

Why: the 42-layer fp8 prefill census on the H200 (docs/performance.md, "Prefill census")
spent 39.3 ms of an 8192-token prefill in this kernel, 1.1 ms per layer, about ten times what
its bytes take at the HBM's bandwidth. Each configuration is checked bit for bit against the
default tile's outputs and window (the conv sums its taps in a fixed order, so every tile
should round alike) and within a tolerance against the torch reference, then timed with L2
flushed before each call; the table gives the bandwidth over the bytes the conv must move
(x read, y written, the window) and the speed-up over the default. Without CUDA
(``TRITON_INTERPRET=1``, fp32, narrowed channels) it is only a smoke run.
"""
from __future__ import annotations

import argparse
from typing import List, Tuple

import torch
import triton

from cold_l2 import cold_time_us, flush_buffer, kernel_bench_device  # benchmark/kernels/cold_l2.py
from sgl_kernel import kda_prefill_conv as conv_module
from sglang.srt.layers.attention.kda_ops import causal_conv1d


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--block-t", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--block-c", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--num-warps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--channels", type=int, default=3 * 32 * 128,
                   help="conv channels (q | k | v of 32 heads of 128)")
    p.add_argument("--row-width", type=int, default=5 * 32 * 128,
                   help="width of the fused projection output the channels are a view of")
    p.add_argument("--conv-width", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--l2norm-head-dim", type=int, default=None,
                   help="sweep the launch that also L2-normalises each head of this many "
                        "channels (the q and k planes of the fla prefill: 128)")
    args = p.parse_args()
    if args.row_width < args.channels:
        p.error(f"--row-width {args.row_width} must hold --channels {args.channels}")
    dev, dtype = kernel_bench_device("tune_kda_prefill_conv")
    flush = flush_buffer(dev)
    c, kw = args.channels, args.conv_width
    norm_d = args.l2norm_head_dim

    def tile(bt: int, bc: int, warps: int) -> Tuple[int, int, int]:
        """A tile as the kernel launches it (powers of two, at least K-1 tokens tall, whole
        heads when they are normalised)."""
        return (triton.next_power_of_2(max(bt, kw - 1)),
                max(triton.next_power_of_2(bc), norm_d or 1), warps)

    if norm_d:
        default = tile(conv_module._BLOCK_T, norm_d, conv_module._NORM_WARPS)
    else:
        default = tile(conv_module._BLOCK_T, min(conv_module._BLOCK_C, c), conv_module._NUM_WARPS)
    configs = sorted({tile(bt, bc, w) for w in args.num_warps for bt in args.block_t
                      for bc in args.block_c} | {default})
    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU (Triton interpreter)"
    print(f"{name}: KDA prefill conv, {c} channels (views of rows of {args.row_width}), width "
          f"{kw}, {dtype}, heads' L2 norm {norm_d or 'off'}, cold L2, {args.iters} iters; "
          f"default tile T/C/warps "
          f"{default[0]}/{default[1]}/{default[2]}")
    gen = torch.Generator().manual_seed(0)
    weight = (0.5 * torch.randn(c, kw, generator=gen)).to(dev, dtype)
    summary: List[str] = []
    for t in args.tokens:
        x = torch.randn(t, args.row_width, generator=gen).to(dev, dtype)[:, :c]
        window0 = torch.randn(c, kw - 1, generator=gen).to(dev, dtype)
        ref_y, ref_window = causal_conv1d(x, weight, window0.clone())
        if norm_d:  # fla's formula per head on the rounded conv output
            heads = ref_y.float().view(t, -1, norm_d)
            ref_y = (heads / torch.sqrt((heads * heads).sum(-1, keepdim=True) + 1e-6)
                     ).view_as(ref_y).to(dtype)
        moved = (2 * t * c + 2 * c * (kw - 1)) * x.element_size() + weight.numel() * 4

        def run(bt: int, bc: int, warps: int) -> Tuple[torch.Tensor, torch.Tensor]:
            window = window0.clone()
            y = conv_module.kda_prefill_conv(x, weight, window, block_t=bt, block_c=bc,
                                             num_warps=warps, l2norm_head_dim=norm_d)
            return y, window

        first = run(*default)
        err = float((first[0].float() - ref_y.float()).norm() / ref_y.float().norm())
        if err > 1e-2 or not torch.allclose(first[1].float(), ref_window.float()):
            raise SystemExit(f"{t} tokens: the default tile is off the reference (rel. {err:.2e})")
        rows = []
        for bt, bc, warps in configs:  # the default tile is always among them
            window = window0.clone()
            try:
                y, w = run(bt, bc, warps)
            except Exception as exc:  # a tile the compiler rejects (out of resources)
                print(f"  {t} tokens T/C/warps {bt}/{bc}/{warps}: {type(exc).__name__}")
                continue
            same = torch.equal(y, first[0]) and torch.equal(w, first[1])

            def call(bt=bt, bc=bc, warps=warps, window=window) -> None:
                # The window is overwritten in place: reset so each call convolves alike.
                window.copy_(window0)
                conv_module.kda_prefill_conv(x, weight, window, block_t=bt, block_c=bc,
                                             num_warps=warps, l2norm_head_dim=norm_d)

            rows.append((cold_time_us(call, args.iters, flush), bt, bc, warps, same))
        rows.sort()
        cur = [r for r in rows if r[1:4] == default]
        best = rows[0]
        cells = "; ".join(f"{bt}/{bc}/{w} {us:.1f}{'' if same else ' (bits differ)'}"
                          for us, bt, bc, w, same in rows[:6])
        line = (f"| {t} | {best[1]}/{best[2]}/{best[3]} {best[0]:.1f} µs "
                f"({moved / best[0] / 1e3:.0f} GB/s) | "
                + (f"{cur[0][0]:.1f} µs ({cur[0][0] / best[0]:.2f}x)" if cur else "failed")
                + f" | {all(r[4] for r in rows)} | {cells} |")
        print(line)
        summary.append(line)
    print("\n| tokens | best T/C/warps | default (vs best) | bit-equal across tiles | "
          "fastest six (T/C/warps µs) |\n|---|---|---|---|---|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
