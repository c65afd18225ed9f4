"""Cold-L2 kernel-vs-reference timings of the sgl_kernel kernels that had no cold-L2
microbenchmark of their own: ``kda_conv``, ``kda_prefill_conv``, ``mla_rope``, ``moe_combine``,
``moe_router``, ``rmsnorm``, ``round_prep``, ``gated_act``, ``moe_align`` and ``moe_grouped_gemm`` (whose tuning sweep times
CUDA-graph replays without the L2 flush), and ``kda_recurrent`` (whose tile sweep times no
reference), at Ling-3.0-flash's shapes (read from the shipped preset), decode / verify sizes
(1..16 tokens) and, where a kernel runs there, prefill sizes.

    python benchmark/kernels/bench_cold_l2_kernels.py [--kernels rmsnorm mla_rope ...] \\
        [--decode-rows 1 4 16] [--prefill-rows 1024 8192] [--iters 50] \\
        [--out benchmark/results/cold_l2_kernels.jsonl]
    python benchmark/kernels/bench_cold_l2_kernels.py --device cpu --tiny  # smoke run

Every row times the kernel and its plain reference (the torch code the engine runs without the
kernel, named in the ``reference`` column) on the same inputs with a buffer larger than L2
written before each call (``cold_l2.cold_time_us``): in the model every other layer's weights
and activations pass through L2 between two calls of one layer. Before timing, the first call
of each is compared (``max_rel_err``: max |kernel - reference| / max |reference| over the
outputs, in-place state included). ``kernel_gbps`` counts the bytes the kernel must move at
least (inputs read, outputs written). Kernel and reference each keep their own copy of any
state they update in place (pools, windows, the request->token map).

One markdown table is printed and one JSON line per row is written to ``--out`` (replaced).
``--device cpu --tiny`` runs tiny shapes of the same structure in Triton's CPU interpreter
(fp32, wall-clock times): a smoke run of the script, its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from sglang.test.kernel_shapes import TINY_KERNEL_DIMS, KernelDims, flash_kernel_dims

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cold_l2, beside this file
from cold_l2 import cold_time_us, flush_buffer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "benchmark" / "results" / "cold_l2_kernels.jsonl"


@dataclass(frozen=True)
class Env:
    """Device, dtype, sizes and the row counts of one run."""

    device: str
    dtype: torch.dtype
    dims: KernelDims
    decode_rows: Tuple[int, ...]
    prefill_rows: Tuple[int, ...]
    gen: torch.Generator

    def randn(self, *shape: int, scale: float = 1.0,
              dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Normal values times ``scale``, drawn in fp32 on the device, in ``dtype`` (default the
        run's)."""
        x = torch.randn(*shape, generator=self.gen, device=self.device)
        return (x * scale).to(dtype or self.dtype)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.gen, device=self.device)


Outputs = Sequence[torch.Tensor]


class Case(NamedTuple):
    """One table row: the kernel call and its reference on the same inputs, and the bytes the
    kernel must move."""

    kernel: str
    case: str
    rows: int
    run_kernel: Callable[[], Outputs]
    run_reference: Callable[[], Outputs]
    reference: str
    bytes: int


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def max_rel_err(got: Outputs, ref: Outputs) -> float:
    """max over the outputs of max |got - ref| / max |ref| (outputs of any shape compared in
    element order: a kernel's ``[B, N, H, D]`` against a reference's ``[B * N, H, D]``)."""
    worst = 0.0
    for a, b in zip(got, ref, strict=True):
        a, b = a.reshape(-1).double(), b.reshape(-1).double()
        if b.numel():
            worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)))
    return worst


# --------------------------------------------------------------------------------------------
# One builder per kernel: yields its rows (inputs built lazily, one row alive at a time)
# --------------------------------------------------------------------------------------------
def bench_rmsnorm(env: Env) -> Iterator[Case]:
    """The layer norm fused with its residual add (hidden width) and KDA's gated output norm
    (per 128-wide head, sigmoid gate), against ``layernorm.rms_norm`` / ``gated_rms_norm``."""
    from sgl_kernel.rmsnorm import rmsnorm, tile_rows
    from sglang.srt.layers.layernorm import gated_rms_norm, rms_norm

    d = env.dims
    w = 1.0 + env.randn(d.hidden, scale=0.1)
    w_o = 1.0 + env.randn(d.head_dim, scale=0.1)
    for t in env.decode_rows + env.prefill_rows:
        x, res = env.randn(t, d.hidden, scale=3.0), env.randn(t, d.hidden, scale=3.0)

        def reference(x=x, res=res) -> Outputs:
            h = x + res
            return rms_norm(h, w, d.eps), h

        yield Case("rmsnorm", "residual add + norm", t,
                   lambda x=x, res=res: rmsnorm(x, w, d.eps, residual=res), reference,
                   "layernorm.rms_norm(x + residual)", 4 * nbytes(x) + nbytes(w))
        o, gate = env.randn(t, d.heads, d.head_dim), env.randn(t, d.heads, d.head_dim)
        yield Case("rmsnorm", "gated o_norm (sigmoid)", t,
                   lambda o=o, gate=gate: (rmsnorm(o, w_o, d.eps, gate=gate,
                                                   activation="sigmoid"),),
                   lambda o=o, gate=gate: (gated_rms_norm(o, gate, w_o, d.eps, "sigmoid"),),
                   "layernorm.gated_rms_norm", 3 * nbytes(o) + nbytes(w_o))
        if tile_rows(t * d.heads, d.head_dim) > 1:  # the same launch, one row per program
            yield Case("rmsnorm", "gated o_norm (sigmoid), one row per program", t,
                       lambda o=o, gate=gate: (_one_row_per_program(
                           lambda: rmsnorm(o, w_o, d.eps, gate=gate, activation="sigmoid")),),
                       lambda o=o, gate=gate: (gated_rms_norm(o, gate, w_o, d.eps, "sigmoid"),),
                       "layernorm.gated_rms_norm", 3 * nbytes(o) + nbytes(w_o))


def _one_row_per_program(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``fn()`` with ``sgl_kernel.rmsnorm`` held to one row per program at any row count (the
    launch before multi-row programs), for an A/B row."""
    from sgl_kernel import rmsnorm as module

    saved, module.TILE_MIN_ROWS = module.TILE_MIN_ROWS, 1 << 62
    try:
        return fn()
    finally:
        module.TILE_MIN_ROWS = saved


def bench_mla_rope(env: Env) -> Iterator[Case]:
    """MLA's q ``[T, H, R + r]`` and k ``[T, R + r]`` with RoPE at each token's position, from
    strided views as the layer passes them, against RotaryEmbedding then two concatenations."""
    from sgl_kernel.mla_rope import mla_rope_assemble, mla_rope_reference
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    d = env.dims
    h, r, dr = d.heads, d.kv_lora_rank, d.qk_rope
    neox = not d.rope_interleave
    rope = RotaryEmbedding(dr, dr, d.context, d.rope_theta, is_neox_style=neox)
    table = rope.cos_sin_cache(torch.device(env.device))
    for t in env.decode_rows + env.prefill_rows:
        positions = (env.rand(t) * d.context).long()
        q_latent = env.randn(h, t, r).transpose(0, 1)  # the absorbed bmm's [H, T, R] output
        q_rope = env.randn(t, h, d.qk_nope + dr)[..., d.qk_nope:]
        kv_a = env.randn(t, r + dr)
        latent, k_rope = kv_a[:, :r], kv_a[:, r:]
        args = (q_latent, q_rope, latent, k_rope)
        moved = 2 * nbytes(*args) + t * dr * 4 + nbytes(positions)  # read, written; the table
        yield Case("mla_rope", "q, k assembly + RoPE", t,
                   lambda p=positions, a=args: mla_rope_assemble(p, table, *a, neox),
                   lambda p=positions, a=args: mla_rope_reference(p, rope, *a),
                   "mla_rope.mla_rope_reference (RotaryEmbedding + cat)", moved)


def bench_moe_combine(env: Env) -> Iterator[Case]:
    """The top-k experts' rows weighted and summed plus the shared expert's row, against
    :func:`moe_combine_reference` (the torch-native MoE's combine order)."""
    from sgl_kernel.moe_combine import moe_combine, moe_combine_reference

    d = env.dims
    for t in env.decode_rows + env.prefill_rows:
        y = env.randn(t * d.topk + t, d.hidden)  # the shared expert's rows after the routed
        weights = env.rand(t, d.topk)
        shared = y[t * d.topk:]
        yield Case("moe_combine", "top-k + shared", t,
                   lambda y=y, w=weights, s=shared: (moe_combine(y, w, s),),
                   lambda y=y, w=weights, s=shared: (moe_combine_reference(y, w, s),),
                   "moe_combine.moe_combine_reference", nbytes(y, weights) + nbytes(shared))


def bench_gated_act(env: Env) -> Iterator[Case]:
    """The dense MLP's SwiGLU (the routed experts' largest clamp) and MLA's sigmoid head gate
    on the absorbed form's head-major output, against the torch forms the layers run without
    the kernels (``sglang.srt.layers.activation``)."""
    from sgl_kernel.gated_act import sigmoid_head_gate, silu_and_mul
    from sglang.srt.layers.activation import SigmoidHeadGate
    from sglang.srt.layers.activation import silu_and_mul as silu_and_mul_torch

    d, torch_gate = env.dims, SigmoidHeadGate()
    for t in env.decode_rows + env.prefill_rows:
        x = env.randn(t, 2 * d.dense_inter)
        yield Case("gated_act", "dense SwiGLU + clamp", t,
                   lambda x=x: (silu_and_mul(x, d.expert_limit),),
                   lambda x=x: (silu_and_mul_torch(x, d.expert_limit),),
                   "activation.silu_and_mul", nbytes(x) * 3 // 2)
        o = env.randn(d.heads, t, d.v_head_dim).transpose(0, 1)
        g = env.randn(t, d.heads)
        yield Case("gated_act", "MLA sigmoid head gate", t,
                   lambda o=o, g=g: (sigmoid_head_gate(o, g),),
                   lambda o=o, g=g: (torch_gate(o, g),),
                   "activation.SigmoidHeadGate (torch form)", 2 * nbytes(o) + nbytes(g))


def bench_moe_router(env: Env) -> Iterator[Case]:
    """Sigmoid + bias, group-limited top-k and renormalised weights from fp32 logits, against
    ``moe.topk.select_experts``."""
    from sgl_kernel.moe_router import moe_router_topk
    from sglang.srt.layers.moe.topk import select_experts

    d = env.dims
    bias = env.randn(d.experts, scale=0.3, dtype=torch.float32)
    for t in env.decode_rows + env.prefill_rows:
        logits = env.randn(t, d.experts, scale=2.0, dtype=torch.float32)
        args = (d.topk, bias, d.groups, d.topk_group, True, d.routed_scale)

        def reference(logits=logits) -> Outputs:
            out = select_experts(logits, *args)
            return out.topk_weights, out.topk_ids

        yield Case("moe_router", f"{d.experts} experts, {d.groups} groups, top-{d.topk}", t,
                   lambda logits=logits: moe_router_topk(logits, *args), reference,
                   "moe.topk.select_experts", nbytes(logits, bias) + t * d.topk * (4 + 8))


def bench_round_prep(env: Env) -> Iterator[Case]:
    """A round's index chain at batch 1 (decode, NEXTN verify, the widest verify), against
    :func:`assign_round_cache_locs_ref` (the torch ops the round workers use without it)."""
    from sgl_kernel.round_prep import assign_round_cache_locs, assign_round_cache_locs_ref

    d = env.dims
    reqs = 8
    for n in sorted({1, d.verify_chain, max(env.decode_rows)}):
        r2t = (env.rand(reqs + 1, d.context) * 1e6).to(torch.int32)
        seq_lens = (env.rand(reqs + 1) * (d.context - n)).long()
        tokens = (env.rand(reqs + 1) * 1e5).long()
        slots = torch.tensor([3], device=env.device)
        loc = (env.rand(1, n) * 1e6).long()
        maps = (r2t, r2t.clone())  # kernel's, reference's
        yield Case("round_prep", "batch 1", n,
                   lambda m=maps[0], s=seq_lens, tk=tokens, sl=slots, lc=loc:
                   (*assign_round_cache_locs(m, s, sl, lc, tk), m),
                   lambda m=maps[1], s=seq_lens, tk=tokens, sl=slots, lc=loc:
                   (*assign_round_cache_locs_ref(m, s, sl, lc, tk), m),
                   "round_prep.assign_round_cache_locs_ref", 2 * 8 + n * (8 + 4) + 8)


def _kda_split(y: torch.Tensor, heads: int, head_dim: int) -> Outputs:
    """The backend's head split of a conv output: fp32 q, k (L2-normalised) and v."""
    from sglang.srt.layers.attention.kda_ops import l2norm

    qc, kc, vc = y.float().view(y.shape[0], 3, heads, head_dim).unbind(1)
    return l2norm(qc), l2norm(kc), vc


def bench_kda_conv(env: Env) -> Iterator[Case]:
    """KDA's short conv + head split at batch 1: the decode (pool slot updated) against
    ``kda_ops.causal_conv1d_update`` + the pool write + the split, and verify chains (windows
    staged) against ``causal_conv1d_chain`` + the staging write + the split."""
    from sgl_kernel.kda_conv import kda_conv_qkv
    from sglang.srt.layers.attention.kda_ops import causal_conv1d_chain, causal_conv1d_update

    d = env.dims
    h, hd, kw = d.heads, d.head_dim, d.conv_kernel
    c, slots_n = 3 * h * hd, 4
    weight = env.randn(c, kw, scale=0.5)
    slots = torch.tensor([2], device=env.device)
    for n in sorted({1, d.verify_chain, max(env.decode_rows)}):
        mixed = env.randn(1, n, c)
        pool = env.randn(slots_n, c, kw - 1)
        pools = (pool, pool.clone())
        # x and the weight read, the window read and written once (decode) or per position
        # (verify), fp32 q, k, v written.
        moved = nbytes(mixed, weight) + (1 + n) * c * (kw - 1) * pool.element_size() \
            + 3 * n * c * 4
        if n == 1:
            def kernel(m=mixed, p=pools[0]) -> Outputs:
                return (*kda_conv_qkv(m, weight, p, slots, h, hd), p)

            def reference(m=mixed, p=pools[1]) -> Outputs:
                y, window = causal_conv1d_update(m[:, 0], weight, p[slots])
                p.index_copy_(0, slots, window.to(p.dtype))
                return (*_kda_split(y, h, hd), p)

            yield Case("kda_conv", "decode", n, kernel, reference,
                       "kda_ops.causal_conv1d_update + pool write + split", moved)
            continue
        staged = tuple(torch.zeros(slots_n, n, c, kw - 1, dtype=pool.dtype, device=env.device)
                       for _ in "kr")

        def kernel(m=mixed, p=pools[0], st=staged[0]) -> Outputs:
            return (*kda_conv_qkv(m, weight, p, slots, h, hd, staged=st), st)

        def reference(m=mixed, p=pools[1], st=staged[1], n=n) -> Outputs:
            y, windows = causal_conv1d_chain(m, weight, p[slots])
            st[:, :n].index_copy_(0, slots, windows)
            return (*_kda_split(y.reshape(n, c), h, hd), st)

        yield Case("kda_conv", "verify chain", n, kernel, reference,
                   "kda_ops.causal_conv1d_chain + staging write + split", moved)


def bench_kda_recurrent(env: Env) -> Iterator[Case]:
    """The gated delta rule at batch 1 as the backend calls it (fp32 q, k, v; the raw gate and
    beta projections as model-dtype views with the layer's gate parameters): the decode (state
    in place) and verify chains (states staged), against :func:`kda_recurrent_reference` (the
    torch step per position). ``tune_kda_recurrent.py`` sweeps the tiles but times no
    reference."""
    from sgl_kernel.kda_recurrent import kda_recurrent_reference, kda_recurrent_update
    from sglang.srt.layers.attention.kda_ops import l2norm

    d = env.dims
    h, dk, slots_n = d.heads, d.head_dim, 4
    hk = h * dk
    params = (torch.log(1.0 + 15.0 * env.rand(h)), 0.2 * env.rand(hk) - 0.1, d.lower_bound)
    slots = torch.tensor([1], device=env.device)
    for n in sorted({1, d.verify_chain, max(env.decode_rows)}):
        q, k = (l2norm(env.randn(1, n, h, dk, dtype=torch.float32)) for _ in "qk")
        v = env.randn(1, n, h, dk, dtype=torch.float32)
        fused = env.randn(n, hk + h)  # the [f | b] columns of the fused projection output
        f, beta = fused[:, :hk].view(1, n, h, dk), fused[:, hk:].view(1, n, h)
        pool = env.randn(slots_n, h, dk, dk, scale=0.5, dtype=torch.float32)
        state = h * dk * dk * 4
        # inputs read; the state read once and written once (decode) or per position
        # (verify); the output written in the model dtype
        moved = nbytes(q, k, v, f, beta) + state * (1 + n) \
            + n * hk * torch.empty(0, dtype=env.dtype).element_size()

        def make(fn: Callable, n: int = n, q=q, k=k, v=v, f=f, beta=beta, pool=pool
                 ) -> Callable[[], Outputs]:
            p = pool.clone()
            staged = None if n == 1 else torch.zeros(slots_n, n, h, dk, dk, device=env.device)
            out = torch.empty(1, n, h, dk, dtype=env.dtype, device=env.device)

            def run() -> Outputs:
                fn(q, k, v, f, beta, dk ** -0.5, p, slots, out, staged=staged,
                   gate_params=params)
                return out, (p if staged is None else staged)
            return run

        yield Case("kda_recurrent", "decode" if n == 1 else "verify chain", n,
                   make(kda_recurrent_update), make(kda_recurrent_reference),
                   "kda_recurrent.kda_recurrent_reference", moved)


def bench_kda_prefill_conv(env: Env) -> Iterator[Case]:
    """KDA's short conv + SiLU over one request's prefill (window written back in place), from
    the q|k|v columns of a wider fused projection output, against ``kda_ops.causal_conv1d``
    + the window copy."""
    from sgl_kernel.kda_prefill_conv import kda_prefill_conv
    from sglang.srt.layers.attention.kda_ops import causal_conv1d

    d = env.dims
    c, kw = 3 * d.heads * d.head_dim, d.conv_kernel
    weight = env.randn(c, kw, scale=0.5)
    for t in env.prefill_rows:
        x = env.randn(t, c + 2 * d.heads * d.head_dim)[:, :c]  # [q|k|v] of [q|k|v|f|g ...]
        pool = env.randn(2, c, kw - 1)
        pools = (pool, pool.clone())

        def reference(x=x, p=pools[1]) -> Outputs:
            y, window = causal_conv1d(x, weight, p[1])
            p[1].copy_(window)
            return y, p

        yield Case("kda_prefill_conv", "one request", t,
                   lambda x=x, p=pools[0]: (kda_prefill_conv(x, weight, p[1]), p), reference,
                   "kda_ops.causal_conv1d + window copy",
                   2 * nbytes(x) + nbytes(weight) + 2 * c * (kw - 1) * pool.element_size())
        # The q plane as the fla prefill runs it: the heads' L2 norm in the conv's launch,
        # against the plain conv followed by the separate norm launch fla would make.
        cq = d.heads * d.head_dim
        xq, wq, l2 = x[:, :cq], weight[:cq], _l2norm_launch(env.device)

        yield Case("kda_prefill_conv", "q plane + heads' L2 norm", t,
                   lambda xq=xq, p=pools[0]: (kda_prefill_conv(
                       xq, wq, p[0][:cq], l2norm_head_dim=d.head_dim),),
                   lambda xq=xq, p=pools[1]: (l2(kda_prefill_conv(xq, wq, p[0][:cq]),
                                                 d.head_dim),),
                   f"kda_prefill_conv + {l2.__doc__}",
                   2 * nbytes(xq) + nbytes(wq) + 2 * cq * (kw - 1) * pool.element_size())


def _l2norm_launch(device: str) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """The per-head L2 norm fla's ``chunk_kda`` launches when asked to normalise q / k itself
    (``fla.modules.norm.l2norm.l2norm_fwd``; ``kda_ops.l2norm`` on the CPU or where fla is
    not installed)."""
    try:
        if device == "cpu":  # fla's kernels need a GPU driver at import
            raise ImportError("fla needs CUDA")
        from fla.modules.norm.l2norm import l2norm_fwd
    except ImportError:
        from sglang.srt.layers.attention.kda_ops import l2norm

        def torch_norm(y: torch.Tensor, head_dim: int) -> torch.Tensor:
            """kda_ops.l2norm"""
            return l2norm(y.view(y.shape[0], -1, head_dim)).view_as(y)
        return torch_norm

    def fla_norm(y: torch.Tensor, head_dim: int) -> torch.Tensor:
        """fla's l2norm_fwd"""
        return l2norm_fwd(y.view(y.shape[0], -1, head_dim))[0].view_as(y)
    return fla_norm


def _expert_loop(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor],
                 groups: List[Tuple[int, torch.Tensor]], rows_per_x: int, swiglu: bool,
                 limit: float, pairs: int) -> torch.Tensor:
    """The per-expert torch loop the engine's native MoE runs (a library GEMM per expert in the
    model dtype, block-fp8 experts dequantised to it first, SwiGLU through ``silu_and_mul``),
    written here because :func:`moe_grouped_gemm_reference` gathers one weight copy per pair
    (hundreds of GB at prefill sizes). ``groups``: each used expert's pair ids, computed once
    outside the timed call (the torch path would also pay for that)."""
    from sgl_kernel.fp8_blocks import block_dequantize
    from sglang.srt.layers.activation import silu_and_mul

    n = w.shape[1]
    out = torch.empty(pairs, n // 2 if swiglu else n, dtype=x.dtype, device=x.device)
    for e, ids in groups:
        we = w[e] if scale is None else block_dequantize(w[e], scale[e], x.dtype,
                                                         n // 2 if swiglu else None)
        h = torch.nn.functional.linear(x[ids // rows_per_x], we)
        out[ids] = silu_and_mul(h, limit) if swiglu else h
    return out


def bench_moe_grouped_gemm(env: Env) -> Iterator[Case]:
    """The prefill MoE GEMMs of one layer (all experts, top-k routes): the up-projection with
    its clamped SwiGLU and the down-projection, model-dtype and block-fp8 experts, with the
    engine's tiles (``launch_config``) and alignment computed once outside the timed call,
    against the per-expert torch loop (:func:`_expert_loop`)."""
    from sgl_kernel.moe_grouped_gemm import launch_config, moe_align, moe_grouped_gemm

    d = env.dims
    e, hid, inter, k = d.experts, d.hidden, d.moe_inter, d.topk
    for fp8 in (False, True):
        if fp8:
            w13, s13 = _fp8_weight(env, (e, 2 * inter, hid), split=inter)
            w2, s2 = _fp8_weight(env, (e, hid, inter))
        else:
            w13, s13 = env.randn(e, 2 * inter, hid, scale=hid ** -0.5), None
            w2, s2 = env.randn(e, hid, inter, scale=inter ** -0.5), None
        for t in env.prefill_rows:
            ids = env.rand(t, e).argsort(-1)[:, :k]
            flat = ids.reshape(-1)
            order = flat.argsort(stable=True)
            counts = torch.bincount(flat, minlength=e).tolist()  # setup only: a host read
            groups = [(ex, part) for ex, part in enumerate(order.split(counts)) if part.numel()]
            used = len(groups)
            x = env.randn(t, hid, scale=2.0)
            for proj, w, s, rows_per_x, swiglu in (("up + SwiGLU", w13, s13, k, True),
                                                   ("down", w2, s2, 1, False)):
                inp = x if swiglu else env.randn(t * k, inter)
                cfg = launch_config(e, w.shape[1], w.shape[2], t * k, fp8,
                                    torch.device(env.device), swiglu)
                align = moe_align(ids, e, cfg.block_m)
                weight_bytes = used * w[0].numel() * w.element_size()
                out_cols = w.shape[1] // 2 if swiglu else w.shape[1]
                yield Case("moe_grouped_gemm", f"{proj} {'fp8' if fp8 else 'model dtype'}", t,
                           lambda inp=inp, w=w, s=s, al=align, r=rows_per_x, sw=swiglu, c=cfg:
                           (moe_grouped_gemm(inp, w, al, rows_per_x=r, swiglu=sw,
                                             swiglu_limit=d.expert_limit, w_scale=s,
                                             config=c),),
                           lambda inp=inp, w=w, s=s, g=groups, r=rows_per_x, sw=swiglu:
                           (_expert_loop(inp, w, s, g, r, sw, d.expert_limit, t * k),),
                           "per-expert F.linear loop (this file)",
                           weight_bytes + nbytes(inp) + t * k * out_cols * inp.element_size())


def bench_moe_align(env: Env) -> Iterator[Case]:
    """The grouped MoE GEMM's expert sort at prefill sizes (all experts, top-k routes), at the
    row block the engine's fp8 up-projection tile takes there: :func:`moe_align_triton` (three
    launches) against ``moe_align`` (the torch ops it replaces; the outputs must be equal, so
    ``max_rel_err`` is 0)."""
    from sgl_kernel.moe_align import moe_align_triton
    from sgl_kernel.moe_grouped_gemm import launch_config, moe_align

    d = env.dims
    e, k = d.experts, d.topk
    for t in env.prefill_rows:
        ids = env.rand(t, e).argsort(-1)[:, :k].to(torch.int32)
        block_m = launch_config(e, 2 * d.moe_inter, d.hidden, t * k, True,
                                torch.device(env.device), swiglu=True).block_m
        out = moe_align(ids, e, block_m)
        yield Case("moe_align", f"block_m {block_m}", t,
                   lambda ids=ids, b=block_m: moe_align_triton(ids, e, b)[:3],
                   lambda ids=ids, b=block_m: moe_align(ids, e, b)[:3],
                   "moe_align.moe_align",
                   nbytes(ids) + nbytes(out.sorted_pairs, out.block_expert, out.num_blocks))


def _fp8_weight(env: Env, shape: Tuple[int, ...], split: Optional[int] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random block-fp8 experts ``(q e4m3, fp32 scales)`` in the checkpoints' layout, built
    without a Ling-sized fp32 quantisation pass: kernel and reference read the same bits."""
    from sgl_kernel.fp8_blocks import QBLOCK, scale_rows

    *lead, n, k = shape
    q = env.randn(*shape, dtype=torch.float32).to(torch.float8_e4m3fn)
    scale = (0.5 + env.rand(*lead, scale_rows(n, split), -(-k // QBLOCK))) / k ** 0.5
    return q, scale


KERNELS: Dict[str, Callable[[Env], Iterator[Case]]] = {
    "gated_act": bench_gated_act,
    "kda_conv": bench_kda_conv,
    "kda_prefill_conv": bench_kda_prefill_conv,
    "kda_recurrent": bench_kda_recurrent,
    "mla_rope": bench_mla_rope,
    "moe_align": bench_moe_align,
    "moe_combine": bench_moe_combine,
    "moe_grouped_gemm": bench_moe_grouped_gemm,
    "moe_router": bench_moe_router,
    "rmsnorm": bench_rmsnorm,
    "round_prep": bench_round_prep,
}


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", nargs="+", choices=sorted(KERNELS), default=sorted(KERNELS))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: Triton's interpreter (needs --tiny), a smoke run")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the smoke run's)")
    p.add_argument("--decode-rows", type=int, nargs="+", default=None,
                   help="decode / verify tokens (default 1 4 16; tiny: 1 3)")
    p.add_argument("--prefill-rows", type=int, nargs="+", default=None,
                   help="prefill tokens (default 1024 8192; tiny: 8)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per row (50; tiny: 1)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON lines, one per row (replaced)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu runs Triton's interpreter: pass --tiny (Ling's shapes take hours)")
    return args


def main(argv: Optional[List[str]] = None) -> List[dict]:
    """Run the benchmark; returns the rows written (also for a caller in-process)."""
    args = _parse(argv)
    if args.device == "cpu":
        # Before sgl_kernel imports triton: the mode is fixed at triton's first import.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ["TRITON_INTERPRET"] != "1":
            raise SystemExit("--device cpu needs TRITON_INTERPRET=1 (Triton's interpreter)")
    elif not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("bench_cold_l2_kernels needs CUDA with compiled Triton "
                         "(or --device cpu --tiny for a smoke run)")
    dims = TINY_KERNEL_DIMS if args.tiny else flash_kernel_dims()
    env = Env(device=args.device,
              dtype=torch.bfloat16 if args.device == "cuda" else torch.float32, dims=dims,
              decode_rows=tuple(args.decode_rows or ((1, 3) if args.tiny else (1, 4, 16))),
              prefill_rows=tuple(args.prefill_rows or ((8,) if args.tiny else (1024, 8192))),
              gen=torch.Generator(device=args.device).manual_seed(args.seed))
    iters = args.iters or (1 if args.tiny else 50)
    flush = flush_buffer(args.device)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    dtype = str(env.dtype).replace("torch.", "")
    print(f"{gpu}, {dtype}, {'tiny' if args.tiny else 'Ling-3.0-flash'} shapes, cold L2, "
          f"{iters} iters (mean)")
    print("| kernel | case | rows | kernel (us) | reference (us) | speedup | kernel GB/s "
          "| max rel err | reference |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows: List[dict] = []
    for name in args.kernels:
        for case in KERNELS[name](env):
            err = max_rel_err(case.run_kernel(), case.run_reference())
            t_kernel = cold_time_us(case.run_kernel, iters, flush)
            t_ref = cold_time_us(case.run_reference, iters, flush)
            row = dict(kernel=case.kernel, case=case.case, rows=case.rows, device=args.device,
                       gpu=gpu, dtype=dtype, tiny=args.tiny, iters=iters,
                       kernel_us=round(t_kernel, 3), reference_us=round(t_ref, 3),
                       speedup=round(t_ref / t_kernel, 3), bytes=case.bytes,
                       kernel_gbps=round(case.bytes / (t_kernel * 1e3), 3),
                       max_rel_err=err, reference=case.reference)
            rows.append(row)
            print(f"| {row['kernel']} | {row['case']} | {row['rows']} | {t_kernel:.1f} "
                  f"| {t_ref:.1f} | {row['speedup']:.2f}x | {row['kernel_gbps']:.0f} "
                  f"| {err:.1e} | {row['reference']} |", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows to {out}")
    return rows


if __name__ == "__main__":
    main()
