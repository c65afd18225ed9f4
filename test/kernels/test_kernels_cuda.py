"""Production-dtype checks of the kernels whose own test files have no ``@pytest.mark.gpu``
comparison against their plain reference: ``small_m_gemm``, ``grouped_gemv`` (its GPU test
runs bf16 at a reduced width without fp8; here Ling's expert shapes, bf16 and block fp8),
``kda_conv``, ``kda_recurrent``, ``mla_rope``, ``moe_combine``, ``moe_router``, ``rmsnorm``,
``round_prep`` and ``gated_act``.

Every test body runs on two targets (:data:`TARGETS`):

* ``cuda`` (``@pytest.mark.gpu``): compiled Triton, the model dtype bf16 (block-fp8 weights
  where the kernel takes them), Ling-3.0-flash's shapes read from the shipped preset
  (``sglang.srt.configs.presets/ling-3.0-flash.json``);
* ``cpu-interpreter``: Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by
  ``test/conftest.py`` without CUDA), fp32 activations (the interpreter has no bf16; fp8
  weights still run), tiny shapes of the same structure.

So the body that will run on the H200 is the body that runs here: only :class:`Target`'s
sizes, dtype and tolerances differ. Tolerances (why these numbers):

* ``rel``: max |kernel - reference| / max |reference| for GEMM-like outputs. Both sides
  accumulate in fp32 in different orders and round once to the output dtype. In bf16 they can
  then land on neighbouring values: one bf16 ulp is at most ``2^-7`` of the element, so of
  max |reference| (7.8e-3) -> 1e-2. In fp32 only the summation order differs: ~1e-6 at these
  K, 1e-5 leaves margin.
* ``elem``: element-wise ``rtol`` for outputs rounded once from fp32 values that can differ in
  their last fp32 bit (a norm's sum of squares, a conv's tap sum in another order): one output
  ulp, ``2^-7`` in bf16; fp32 1e-5 as the kernels' own interpreter tests use.
* ``state``: fp32 recurrent states (never rounded to bf16): different fp32 summation orders
  over K = 128 and libdevice's vs torch's ``exp`` / ``sigmoid`` (a few ulps) through a short
  chain, ~1e-6 measured in the interpreter; 1e-4 on the GPU for margin, 1e-5 in fp32 here.

Kernels documented bit-equal to their reference (``mla_rope``, ``moe_combine``, the residual
add of ``rmsnorm``, the copies of ``kda_conv``'s windows, ``round_prep``) are compared with
``torch.equal``.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch

from sglang.test.kernel_shapes import TINY_KERNEL_DIMS, KernelDims, flash_kernel_dims

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Target:
    """Where and how one test body runs: device, activation dtype, sizes and tolerances."""

    name: str
    device: str
    dtype: torch.dtype

    @property
    def dims(self) -> KernelDims:
        return flash_kernel_dims() if self.device == "cuda" else TINY_KERNEL_DIMS

    @property
    def decode_rows(self) -> Tuple[int, ...]:
        """Decode and verify batches (tokens): batch-1 decode, a NEXTN verify (3 drafts + 1),
        DSpark's 16-wide verify; fewer under the interpreter."""
        return (1, 4, 16) if self.device == "cuda" else (1, 3)

    @property
    def prefill_rows(self) -> int:
        return 2048 if self.device == "cuda" else 9

    @property
    def rel(self) -> float:
        return 1e-2 if self.dtype == torch.bfloat16 else 1e-5

    @property
    def elem(self) -> dict:
        if self.dtype == torch.bfloat16:
            return dict(rtol=2 ** -7, atol=1e-5)
        return dict(rtol=1e-5, atol=1e-5)

    @property
    def state(self) -> dict:
        tol = 1e-4 if self.device == "cuda" else 1e-5
        return dict(rtol=tol, atol=tol)

    def gen(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def randn(self, *shape: int, gen: torch.Generator, scale: float = 1.0,
              dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Normal values times ``scale`` in ``dtype`` (default the target's), drawn in fp32 on
        the device (so the CUDA case never builds a Ling-sized tensor on the host)."""
        x = torch.randn(*shape, generator=gen, device=self.device)
        return (x * scale).to(dtype or self.dtype)

    def rand(self, *shape: int, gen: torch.Generator) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, device=self.device)


TARGETS = [
    pytest.param(Target("cpu-interpreter", "cpu", torch.float32), id="cpu-interpreter",
                 marks=pytest.mark.skipif(not INTERPRETED, reason="the CPU case runs in Triton's "
                                          "interpreter (TRITON_INTERPRET=1, test/conftest.py "
                                          "sets it without CUDA)")),
    pytest.param(Target("cuda", "cuda", torch.bfloat16), id="cuda",
                 marks=[pytest.mark.gpu,
                        pytest.mark.skipif(INTERPRETED and torch.cuda.is_available(),
                                           reason="the CUDA case needs compiled Triton "
                                           "(TRITON_INTERPRET unset)")]),
]


@pytest.fixture(params=TARGETS)
def target(request) -> Target:
    return request.param


@pytest.fixture(autouse=True)
def _full_precision_fp32_matmuls():
    """The references' fp32 matmuls in full precision: another test of the same session may
    have allowed TF32 (``sglang.train`` does), whose 2^-11 products would exceed ``state``."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(prev)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (the ``rel`` tolerance's measure)."""
    ref = ref.float()
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _fp8_weight(target: Target, shape: Tuple[int, ...], gen: torch.Generator,
                split: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """A random block-fp8 weight ``(q e4m3 [.., N, K], scale fp32)`` in the checkpoints'
    layout (:mod:`sgl_kernel.fp8_blocks`, ``split``: two grids). Kernel and reference read the
    same ``q`` and ``scale``, so random e4m3 values and scales are as good a test as a quantised
    weight and need no Ling-sized fp32 quantisation pass; the scales keep ``q * scale`` near
    ``randn / sqrt(K)``."""
    from sgl_kernel.fp8_blocks import QBLOCK, scale_rows

    *lead, n, k = shape
    q = target.randn(*shape, gen=gen, dtype=torch.float32).to(torch.float8_e4m3fn)
    grid = (*lead, scale_rows(n, split), -(-k // QBLOCK))
    scale = (0.5 + target.rand(*grid, gen=gen)) / math.sqrt(k)
    return q, scale


def _fp8_pieces(target: Target, pieces: Tuple[int, ...], k: int, gen: torch.Generator):
    """A fused weight of ``pieces`` (KDA's q|k|v|b|f|g), each on its own block grid, with its
    row -> scale-row map (``fp8_utils.block_index``, as the engine's loader builds it)."""
    from sglang.srt.layers.quantization.fp8_utils import block_index

    parts = [_fp8_weight(target, (n, k), gen) for n in pieces]
    rows = block_index(list(pieces), 128).to(target.device)
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]), rows


# --------------------------------------------------------------------------------------------
# Dense projections of decode / verify
# --------------------------------------------------------------------------------------------
def test_small_m_gemm_projections(target):
    """The decode projections at 1..16 rows: KDA's fused q|k|v|b|f|g in block fp8 (pieces on
    their own grids), KDA's o_proj in block fp8 with the gated-RMSNorm prologue, MLA's q in the
    model dtype, the fp32 router gate on model-dtype activations (fp32 logits) and the LM head.
    Each within ``rel`` of :func:`small_m_gemm_reference`, and row 0 bit-equal whether it is
    computed alone or beside the others (the batch invariance NEXTN's losslessness needs)."""
    from sgl_kernel.small_m_gemm import GatedNormPrologue, small_m_gemm, small_m_gemm_reference

    d, gen = target.dims, target.gen(1)
    hd = d.heads * d.head_dim
    m = max(target.decode_rows)
    x = target.randn(m, d.hidden, gen=gen)
    w_qkv, s_qkv, rows_qkv = _fp8_pieces(target, (hd, hd, hd, d.heads, hd, hd), d.hidden, gen)
    w_o, s_o = _fp8_weight(target, (d.hidden, hd), gen)
    o_in, o_gate = target.randn(m, hd, gen=gen), target.randn(m, hd, gen=gen)
    o_norm = 1.0 + target.randn(d.head_dim, gen=gen, scale=0.1)
    w_q = target.randn(d.heads * (d.qk_nope + d.qk_rope), d.hidden, gen=gen,
                       scale=d.hidden ** -0.5)
    w_router = target.randn(d.experts, d.hidden, gen=gen, scale=d.hidden ** -0.5,
                            dtype=torch.float32)
    w_head = target.randn(d.vocab, d.hidden, gen=gen, scale=d.hidden ** -0.5)

    cases = {
        "kda qkvbfg fp8": lambda r: (x[:r], w_qkv, dict(w_scale=s_qkv, w_scale_rows=rows_qkv)),
        "kda o_proj fp8 + gated norm": lambda r: (o_in[:r], w_o, dict(
            w_scale=s_o, gated_norm=GatedNormPrologue(o_gate[:r], o_norm, d.eps, d.head_dim,
                                                      "sigmoid"))),
        "mla q": lambda r: (x[:r], w_q, {}),
        "router gate fp32": lambda r: (x[:r], w_router, dict(out_dtype=torch.float32)),
        "lm_head": lambda r: (x[:r], w_head, {}),
    }
    for name, args in cases.items():
        xs, w, kw = args(m)
        got = small_m_gemm(xs, w, **kw)
        assert got.dtype == kw.get("out_dtype", target.dtype), name
        assert _rel(got, small_m_gemm_reference(xs, w, **kw)) < target.rel, name
        x1, w1, kw1 = args(1)
        assert torch.equal(small_m_gemm(x1, w1, **kw1), got[:1]), name


def test_grouped_gemv_moe_experts(target):
    """One MoE layer at decode / verify sizes: the routed experts' up-projection with the
    clamped SwiGLU epilogue and the shared expert riding in the same launch, then the
    down-projection, with the model-dtype weights and with block-fp8 weights (Ling's 512
    experts of 768 x 2560 on CUDA). Each launch within ``rel`` of
    :func:`grouped_gemv_reference` on the same inputs."""
    from sgl_kernel.grouped_gemv import grouped_gemv, grouped_gemv_reference

    d, gen = target.dims, target.gen(2)
    e, h, i, k = d.experts, d.hidden, d.moe_inter, d.topk
    t = target.decode_rows[1]  # a NEXTN verify's tokens: several pairs per expert row block
    x = target.randn(t, h, gen=gen, scale=2.0)  # x 2: gates past the clamp occur
    ids = target.rand(t, e, gen=gen).argsort(-1)[:, :k].reshape(-1)  # k distinct experts
    for fp8 in (False, True):
        if fp8:
            w13, s13 = _fp8_weight(target, (e, 2 * i, h), gen, split=i)
            w13s, s13s = _fp8_weight(target, (2 * i, h), gen, split=i)
            w2, s2 = _fp8_weight(target, (e, h, i), gen)
            w2s, s2s = _fp8_weight(target, (h, i), gen)
        else:
            w13 = target.randn(e, 2 * i, h, gen=gen, scale=h ** -0.5)
            w13s = target.randn(2 * i, h, gen=gen, scale=h ** -0.5)
            w2 = target.randn(e, h, i, gen=gen, scale=i ** -0.5)
            w2s = target.randn(h, i, gen=gen, scale=i ** -0.5)
            s13 = s13s = s2 = s2s = None
        up = dict(rows_per_x=k, swiglu_limit=d.expert_limit, extra_w=w13s,
                  extra_limit=d.shared_limit, w_scale=s13, extra_w_scale=s13s)
        act = grouped_gemv(x, w13, ids, **up)
        assert act.shape == (t * k + t, i)
        assert _rel(act, grouped_gemv_reference(x, w13, ids, **up)) < target.rel, fp8
        # The down-projection on the kernel's own activations: each launch checked alone.
        down = dict(extra_w=w2s, extra_x=act[t * k:], w_scale=s2, extra_w_scale=s2s)
        y = grouped_gemv(act[:t * k], w2, ids, **down)
        assert _rel(y, grouped_gemv_reference(act[:t * k], w2, ids, **down)) < target.rel, fp8


# --------------------------------------------------------------------------------------------
# KDA decode and verify
# --------------------------------------------------------------------------------------------
def _kda_split(y: torch.Tensor, heads: int, head_dim: int):
    """The backend's head split of a conv output ``[T, 3HD]``: fp32 q, k (L2-normalised), v."""
    from sglang.srt.layers.attention.kda_ops import l2norm

    qc, kc, vc = y.float().view(y.shape[0], 3, heads, head_dim).unbind(1)
    return l2norm(qc), l2norm(kc), vc


def test_kda_conv_decode_and_verify(target):
    """KDA's short conv + head split for two requests in a 4-slot pool, model-dtype inputs,
    window and pool (Ling: 3 x 32 heads x 128 channels, width 4): a decode (pool slot updated)
    against ``kda_ops.causal_conv1d_update``, then a NEXTN verify chain (windows staged, pool
    only read) against ``causal_conv1d_chain``; q, k, v within one output ulp (``elem``), the
    windows bit-equal (copies)."""
    from sgl_kernel.kda_conv import kda_conv_qkv
    from sglang.srt.layers.attention.kda_ops import causal_conv1d_chain, causal_conv1d_update

    d, gen = target.dims, target.gen(3)
    h, hd, kw, b, slots_n = d.heads, d.head_dim, d.conv_kernel, 2, 4
    c = 3 * h * hd
    weight = target.randn(c, kw, gen=gen, scale=0.5)
    pool = target.randn(slots_n, c, kw - 1, gen=gen)
    slots = torch.tensor([3, 1], device=target.device)

    mixed = target.randn(b, 1, c, gen=gen)
    got_pool = pool.clone()
    got = kda_conv_qkv(mixed, weight, got_pool, slots, h, hd)
    y, window = causal_conv1d_update(mixed[:, 0], weight, pool[slots])
    for a, r in zip(got, _kda_split(y, h, hd)):
        torch.testing.assert_close(a[:, 0], r, **target.elem)
    assert torch.equal(got_pool[slots], window)
    assert torch.equal(got_pool[[0, 2]], pool[[0, 2]])

    n = d.verify_chain
    mixed = target.randn(b, n, c, gen=gen)
    staged = torch.zeros(slots_n, n, c, kw - 1, dtype=pool.dtype, device=target.device)
    got_pool = pool.clone()
    got = kda_conv_qkv(mixed, weight, got_pool, slots, h, hd, staged=staged)
    y, windows = causal_conv1d_chain(mixed, weight, pool[slots])
    for a, r in zip(got, _kda_split(y.reshape(b * n, c), h, hd)):
        torch.testing.assert_close(a, r.view(b, n, h, hd), **target.elem)
    assert torch.equal(got_pool, pool)
    assert torch.equal(staged[slots], windows)


def test_kda_recurrent_decode_and_verify(target):
    """The gated delta rule at Ling's KDA head (32 heads, K = V = 128) as the backend calls it:
    fp32 q, k, v, the raw gate / beta projections as model-dtype views of a fused projection
    output with ``gate_params`` (fp32 A_log, dt_bias, the safe gate's bound), output in the
    model dtype; a decode (state written back) and a NEXTN verify (states staged) against
    :func:`kda_recurrent_reference`: outputs within ``rel``, fp32 states within ``state``."""
    from sgl_kernel.kda_recurrent import kda_recurrent_reference, kda_recurrent_update
    from sglang.srt.layers.attention.kda_ops import l2norm

    d, gen = target.dims, target.gen(4)
    h, dk, b, slots_n = d.heads, d.head_dim, 2, 4
    hk = h * dk
    a_log = torch.log(1.0 + 15.0 * target.rand(h, gen=gen))  # the loader's A_log in [0, ln 16]
    dt_bias = 0.2 * target.rand(hk, gen=gen) - 0.1
    params = (a_log, dt_bias, d.lower_bound)
    pool = target.randn(slots_n, h, dk, dk, gen=gen, scale=0.5, dtype=torch.float32)
    slots = torch.tensor([2, 0], device=target.device)
    for n in (1, d.verify_chain):
        q, k = (l2norm(target.randn(b, n, h, dk, gen=gen, dtype=torch.float32)) for _ in "qk")
        v = target.randn(b, n, h, dk, gen=gen, dtype=torch.float32)
        fused = target.randn(b * n, hk + h + 8, gen=gen)  # [f | b | more columns]
        f, beta = fused[:, :hk].view(b, n, h, dk), fused[:, hk:hk + h].view(b, n, h)
        results = []
        for fn in (kda_recurrent_update, kda_recurrent_reference):
            p = pool.clone()
            staged = None if n == 1 else torch.zeros(slots_n, n, h, dk, dk, device=target.device)
            out = torch.empty(b, n, h, dk, dtype=target.dtype, device=target.device)
            fn(q, k, v, f, beta, dk ** -0.5, p, slots, out, staged=staged, gate_params=params)
            results.append((out, p, staged))
        (out, p, staged), (out_ref, p_ref, staged_ref) = results
        assert _rel(out, out_ref) < target.rel, n
        torch.testing.assert_close(p, p_ref, **target.state)
        if staged is not None:
            assert torch.equal(p, pool)  # verify never writes the persistent state
            torch.testing.assert_close(staged, staged_ref, **target.state)


# --------------------------------------------------------------------------------------------
# MLA, MoE routing and combine, norms, round preparation
# --------------------------------------------------------------------------------------------
def test_mla_rope_assembly(target):
    """MLA's q ``[T, 32, 512 + 64]`` and k ``[T, 512 + 64]`` with Ling's interleaved RoPE
    (theta 6e6) at decode, verify and prefill sizes, from strided views as the layer passes
    them: bit-equal to RotaryEmbedding then the concatenations (``mla_rope_reference``)."""
    from sgl_kernel.mla_rope import mla_rope_assemble, mla_rope_reference
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    d, gen = target.dims, target.gen(5)
    h, r, dr = d.heads, d.kv_lora_rank, d.qk_rope
    neox = not d.rope_interleave
    rope = RotaryEmbedding(dr, dr, d.context, d.rope_theta, is_neox_style=neox)
    table = rope.cos_sin_cache(torch.device(target.device))
    for t in (*target.decode_rows, target.prefill_rows):
        positions = (target.rand(t, gen=gen) * d.context).long()
        q_latent = target.randn(h, t, r, gen=gen).transpose(0, 1)  # the absorbed bmm's layout
        q_rope = target.randn(t, h, d.qk_nope + dr, gen=gen)[..., d.qk_nope:]
        kv_a = target.randn(t, r + dr, gen=gen)  # kv_a_proj's output: [latent | k_rope]
        latent, k_rope = kv_a[:, :r], kv_a[:, r:]
        q, k = mla_rope_assemble(positions, table, q_latent, q_rope, latent, k_rope, neox)
        q_ref, k_ref = mla_rope_reference(positions, rope, q_latent, q_rope, latent, k_rope)
        assert q.dtype == q_ref.dtype == target.dtype
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref), t


def test_moe_combine(target):
    """The routed experts' rows (top-8 per token) weighted and summed, plus the shared expert's
    row that rides after them, at decode, verify and prefill sizes of Ling's hidden width:
    bit-equal to :func:`moe_combine_reference` with and without the shared row."""
    from sgl_kernel.moe_combine import moe_combine, moe_combine_reference

    d, gen = target.dims, target.gen(6)
    for t in (*target.decode_rows, target.prefill_rows):
        y = target.randn(t * d.topk + t, d.hidden, gen=gen)
        weights = target.rand(t, d.topk, gen=gen)
        weights = weights / weights.sum(-1, keepdim=True) * d.routed_scale  # as the router's
        for shared in (None, y[t * d.topk:]):
            got = moe_combine(y, weights, shared)
            assert got.dtype == target.dtype
            assert torch.equal(got, moe_combine_reference(y, weights, shared)), t


def test_moe_router(target):
    """Ling's router (512 experts in 8 groups, 4 kept, top-8, sigmoid + bias, renormalised, x
    2.5) on fp32 logits at decode, verify and prefill sizes against ``select_experts``.

    A token whose k-th and (k+1)-th biased scores are within the two sides' ulp-level
    ``sigmoid`` differences may pick either (``torch.topk`` and the kernel's argmax agree on
    exact ties only): every token's chosen scores must match the reference's as a sorted set
    (to 1e-5), the ids must be equal on all but 1 % of tokens, and the weights equal (fp32,
    ``rtol`` 1e-5: a few ulps of two sigmoid implementations) wherever the ids are."""
    from sgl_kernel.moe_router import moe_router_topk
    from sglang.srt.layers.moe.topk import select_experts

    d, gen = target.dims, target.gen(7)
    bias = target.randn(d.experts, gen=gen, scale=0.3, dtype=torch.float32)
    for t in (*target.decode_rows, target.prefill_rows):
        logits = target.randn(t, d.experts, gen=gen, scale=2.0, dtype=torch.float32)
        args = (d.topk, bias, d.groups, d.topk_group, True, d.routed_scale)
        weights, ids = moe_router_topk(logits, *args)
        ref = select_experts(logits, *args)
        scores = torch.sigmoid(logits) + bias
        torch.testing.assert_close(scores.gather(1, ids).sort(-1).values,
                                   scores.gather(1, ref.topk_ids).sort(-1).values,
                                   rtol=0, atol=1e-5)
        same = (ids == ref.topk_ids).all(-1)
        assert int((~same).sum()) <= t // 100, t
        torch.testing.assert_close(weights[same], ref.topk_weights[same], rtol=1e-5, atol=1e-6)


def test_rmsnorm_model_norms(target):
    """The model's norms at decode, verify and prefill sizes, weights in the model dtype: the
    layer norm fused with its residual add (hidden width), MLA's kv_a norm on a strided latent
    slice, and KDA's gated output norm (per 128-wide head, sigmoid gate), each within one
    output ulp of ``layernorm.rms_norm`` / ``gated_rms_norm``; the residual sum bit-equal."""
    from sgl_kernel.rmsnorm import rmsnorm
    from sglang.srt.layers.layernorm import gated_rms_norm, rms_norm

    d, gen = target.dims, target.gen(8)
    w = 1.0 + target.randn(d.hidden, gen=gen, scale=0.1)
    w_kv = 1.0 + target.randn(d.kv_lora_rank, gen=gen, scale=0.1)
    w_o = 1.0 + target.randn(d.head_dim, gen=gen, scale=0.1)
    for t in (*target.decode_rows, target.prefill_rows):
        x, res = (target.randn(t, d.hidden, gen=gen, scale=3.0) for _ in "xr")
        out, new_res = rmsnorm(x, w, d.eps, residual=res)
        assert torch.equal(new_res, x + res)
        torch.testing.assert_close(out, rms_norm(x + res, w, d.eps), **target.elem)
        latent = target.randn(t, d.kv_lora_rank + d.qk_rope, gen=gen)[:, :d.kv_lora_rank]
        torch.testing.assert_close(rmsnorm(latent, w_kv, d.eps), rms_norm(latent, w_kv, d.eps),
                                   **target.elem)
        o, gate = (target.randn(t, d.heads, d.head_dim, gen=gen) for _ in "og")
        torch.testing.assert_close(rmsnorm(o, w_o, d.eps, gate=gate, activation="sigmoid"),
                                   gated_rms_norm(o, gate, w_o, d.eps, "sigmoid"), **target.elem)


def test_round_prep_index_chain(target):
    """A round's index chain at batch 1 (decode, NEXTN verify, DSpark's 16-wide verify) and
    at 4 requests, on the engine's tables (an int32 request->token map 8 K wide on CUDA, int64
    lengths, tokens and KV locations): bit-equal to :func:`assign_round_cache_locs_ref`,
    the map included."""
    from sgl_kernel.round_prep import assign_round_cache_locs, assign_round_cache_locs_ref

    d, gen = target.dims, target.gen(9)
    reqs, cap = 8, d.context
    for b, n in ((1, 1), (1, d.verify_chain), (1, max(target.decode_rows)), (4, d.verify_chain)):
        r2t = (target.rand(reqs + 1, cap, gen=gen) * 1e6).to(torch.int32)
        seq_lens = (target.rand(reqs + 1, gen=gen) * (cap - n)).long()
        seq_lens[0] = 0  # the padding slot
        tokens = (target.rand(reqs + 1, gen=gen) * d.vocab).long()
        slots = (target.rand(reqs, gen=gen).argsort()[:b] + 1).contiguous()
        loc = (target.rand(b, n, gen=gen) * 1e6).long()
        ref_map = r2t.clone()
        prefix_ref, tokens_ref = assign_round_cache_locs_ref(ref_map, seq_lens, slots, loc,
                                                             tokens)
        prefix, toks = assign_round_cache_locs(r2t, seq_lens, slots, loc, tokens)
        assert torch.equal(prefix, prefix_ref) and torch.equal(toks, tokens_ref), (b, n)
        assert torch.equal(r2t, ref_map), (b, n)


def test_flash_sizes_come_from_the_preset():
    """The CUDA cases' sizes (read here on CPU too, so a broken reader fails before a GPU run)."""
    from sglang.srt.configs.model_config import load_raw_config

    d, c = flash_kernel_dims(), load_raw_config("ling-3.0-flash")
    assert (d.hidden, d.heads, d.experts, d.vocab) == (
        c["hidden_size"], c["num_attention_heads"], c["num_experts"], c["vocab_size"])
    assert d.verify_chain >= 2 and d.context <= c["max_position_embeddings"]


def test_gated_act(target):
    """The dense MLP's SwiGLU at its width (with and without the routed experts' largest
    clamp) and MLA's sigmoid head gate on the absorbed form's head-major output, at decode,
    verify and prefill sizes: within one output ulp of their references (``elem``: the
    kernel's sigmoid and torch's round their last fp32 bit apart)."""
    from sgl_kernel.gated_act import (sigmoid_head_gate, sigmoid_head_gate_reference,
                                      silu_and_mul, silu_and_mul_reference)

    d, gen = target.dims, target.gen(12)
    for t in (*target.decode_rows, target.prefill_rows):
        x = target.randn(t, 2 * d.dense_inter, gen=gen, scale=3.0)
        for limit in (0.0, d.expert_limit):
            got = silu_and_mul(x, limit)
            assert got.dtype == target.dtype
            torch.testing.assert_close(got, silu_and_mul_reference(x, limit), **target.elem)
        o = target.randn(d.heads, t, d.v_head_dim, gen=gen).transpose(0, 1)
        g = target.randn(t, d.heads, gen=gen, scale=4.0)
        got = sigmoid_head_gate(o, g)
        assert got.dtype == target.dtype and got.is_contiguous()
        torch.testing.assert_close(got, sigmoid_head_gate_reference(o, g), **target.elem)
