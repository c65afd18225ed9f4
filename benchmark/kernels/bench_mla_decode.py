"""Cold-L2 A/B of MLA decode / NEXTN-verify attention at Ling-3.0-flash's per-rank dims (latent
512 + rope 64, 32 heads): the torch reference (padded gather of the cache rows + batched masked
attention, what ``TorchNativeMLABackend`` runs) vs the Triton split-K kernel
(``sgl_kernel.mla_decode``, what ``--attention-backend triton`` runs), same inputs, same process.

    python benchmark/kernels/bench_mla_decode.py [--contexts 1024 8192] [--tokens 1 4] [--iters 50]
    python benchmark/kernels/bench_mla_decode.py --config 32 64 8 2  # BLOCK_N SPLIT_MIN warps stages
    python benchmark/kernels/bench_mla_decode.py --merge-block-v 512  # one merge program per row
    python benchmark/kernels/bench_mla_decode.py --block-h 32 --splits 128  # rows, key splits
    python benchmark/kernels/bench_mla_decode.py --smoke  # tiny dims (on CPU: Triton interpreter)

Each timed call is preceded by a write of a buffer larger than L2, so the cache rows come from
HBM as they do in the model (every other layer passes through L2 between two calls of one
layer). Times are CUDA-event means, eager and as a CUDA-graph replay of the Triton pair (the
replay also checks that the launches capture). The effective bandwidth counts the bytes of the
cache rows the attention must read: ``batch * context * (kv_lora_rank + rope) * element size``.
The sequence ends at ``context`` (the N query tokens sit at positions ``context - N .. context
- 1``). Also prints the max difference of the two paths relative to max |torch|.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cold_l2, beside this file
from cold_l2 import capture_graph, cold_time_us, flush_buffer  # noqa: E402


def _torch_path(q, kv, req_to_token, rpi, pos, v_dim, scale, heads):
    """The torch backend's arithmetic: gather each request's first ``max position + 1`` rows
    (the host-known width), mask each query row at its own position."""
    from sglang.srt.layers.attention.mla_ops import mla_decode_attention

    width = int(pos.max()) + 1  # host-known in the engine (seq_lens_upper_bound); read once here
    return lambda: mla_decode_attention(
        q, kv[req_to_token[rpi, :width].long()], (pos + 1).repeat_interleave(heads, dim=1),
        v_dim, scale)


def _override_config(mod, block_n: int, split_min: int, warps: int, stages: int) -> None:
    """Replace the kernel's fixed launch sizes for this run (tuning on the GPU host)."""
    if split_min % block_n:
        raise SystemExit(f"--config: SPLIT_MIN {split_min} must be a multiple of BLOCK_N {block_n}")
    base = mod._config

    def config(dk: int):
        return dataclasses.replace(base(dk), block_n=block_n, split_min=split_min,
                                   num_warps=warps, num_stages=stages)

    mod._config = config


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4], help="query tokens N")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--capacity", type=int, default=0,
                   help="req_to_token width (sets num_splits); default: the longest context")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--config", type=int, nargs=4,
                   metavar=("BLOCK_N", "SPLIT_MIN", "WARPS", "STAGES"),
                   help="override the kernel's launch sizes (GPU tuning)")
    p.add_argument("--block-h", type=int, default=0,
                   help="query rows per split program at every N (default: the kernel's "
                        "rule, 16 / 32 / 64 by the row count)")
    p.add_argument("--merge-block-v", type=int, default=0,
                   help="value channels per merge program (default: the kernel's; 512: one "
                        "program per query row, the merge before its V split)")
    p.add_argument("--splits", type=int, default=0,
                   help="key splits per request at every shape, in place of the kernel's rule "
                        "(above MAX_SPLITS too: the bound is raised for this run)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny dims, one iteration; on CPU in Triton's interpreter (a test runs it)")
    args = p.parse_args(argv)
    on_cuda = torch.cuda.is_available()
    if args.smoke:
        args.contexts, args.tokens, args.heads = [40, 70], [1, 2], 4
        args.kv_lora_rank, args.rope_dim, args.iters = 32, 16, 1
        if not on_cuda:
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before sgl_kernel imports triton
    elif not on_cuda:
        raise SystemExit("bench_mla_decode needs CUDA (or --smoke)")
    dev = "cuda" if on_cuda else "cpu"
    dt = torch.bfloat16 if on_cuda else torch.float32  # the interpreter has no bf16
    import sgl_kernel.mla_decode as mod

    if args.config:
        _override_config(mod, *args.config)
    if args.merge_block_v:
        base = mod._config
        mod._config = lambda dk: dataclasses.replace(base(dk), merge_block_v=args.merge_block_v)
    if args.block_h:  # every row count, in place of the kernel's rule
        mod._rows_per_program = lambda cfg, rows, batch_invariant=False: args.block_h
    if args.splits:  # the scratch is sized from the splits, the merge loops over them
        mod.MAX_SPLITS = max(mod.MAX_SPLITS, args.splits)
        mod.mla_decode_num_splits = lambda *shape, **kw: args.splits
    torch.manual_seed(0)
    b, heads, v = args.batch, args.heads, args.kv_lora_rank
    dk = v + args.rope_dim
    cap = args.capacity or max(args.contexts)
    scale = (128 + 64) ** -0.5  # Flash: qk_nope_head_dim 128 + qk_rope_head_dim 64
    # Scattered rows, as a pool hands them out over time; row 0 is the padding slot.
    kv = torch.randn(b * cap + 1, dk, device=dev).to(dt)
    req_to_token = (torch.randperm(b * cap, device=dev) + 1).view(b, cap).to(torch.int32)
    rpi = torch.arange(b, device=dev)
    flush = flush_buffer(dev)
    name = torch.cuda.get_device_name() if on_cuda else "CPU (Triton interpreter)"
    print(f"{name}, B={b} H={heads} Dk={v}+{args.rope_dim} {dt}, capacity {cap}, cold L2, "
          f"{args.iters} iters, launch sizes {mod._config(dk)}")
    print("| batch | context | N | splits | torch (us) | torch GB/s | triton (us) | triton GB/s "
          "| triton graph (us) | triton graph GB/s | speedup (graph) | max diff / max |torch| |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for ctx in args.contexts:
        if ctx > cap:
            raise SystemExit(f"context {ctx} exceeds the capacity {cap}")
        for n in args.tokens:
            pos = (ctx - n + torch.arange(n, device=dev)).clamp_min(0).expand(b, n).contiguous()
            q = torch.randn(b, n * heads, dk, device=dev).to(dt)
            splits = mod.mla_decode_num_splits(b, n * heads, cap, dk, dev)
            out = torch.empty(b, n * heads, v, device=dev, dtype=dt)
            scratch = torch.empty(mod.mla_decode_scratch_numel(b, n * heads, splits, v),
                                  device=dev)
            torch_fn = _torch_path(q, kv, req_to_token, rpi, pos, v, scale, heads)

            def triton_fn():
                return mod.mla_decode_fwd(q, kv, req_to_token, rpi, pos, v, scale, out=out,
                                          scratch=scratch)

            t_torch = cold_time_us(torch_fn, args.iters, flush)
            t_triton = cold_time_us(triton_fn, args.iters, flush)
            ref = torch_fn().float()
            diff = float((triton_fn().float() - ref).abs().max() / ref.abs().max())
            gbytes = b * ctx * dk * kv.element_size() / 1e9
            graph = "- | - | -"  # no CUDA graphs off CUDA
            if on_cuda:
                t_graph = cold_time_us(capture_graph(triton_fn).replay, args.iters, flush)
                graph = (f"{t_graph:.1f} | {gbytes / (t_graph * 1e-6):.0f} | "
                         f"{t_torch / t_graph:.2f}x")
            print(f"| {b} | {ctx} | {n} | {splits} | {t_torch:.1f} | "
                  f"{gbytes / (t_torch * 1e-6):.0f} | {t_triton:.1f} | "
                  f"{gbytes / (t_triton * 1e-6):.0f} | {graph} | {diff:.1e} |")


if __name__ == "__main__":
    main()
