"""KDA reference math (kda_ops) and the torch-native KDA backend over the real state pool."""
from __future__ import annotations

import os

import pytest
import torch

from sglang.srt.layers.attention import fla_kda
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, create_attn_backend
from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
from sglang.srt.layers.attention.kda_ops import (
    causal_conv1d,
    causal_conv1d_update,
    kda_chunked,
    kda_gate,
    kda_recurrent,
    l2norm,
)
from sglang.srt.layers.attention.torch_native_backend import TorchNativeKDABackend
from sglang.srt.layers.radix_attention import RadixLinearAttention
from sglang.srt.mem_cache.memory_pool import KDAStatePool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

H, D, KERNEL = 2, 8, 4
C = H * D
REL_TOL = 1e-5  # chunked vs recurrent, fp32: max |diff| / max |reference|


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def random_inputs(t: int, h: int = H, d: int = D, lower_bound: float = -5.0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(t, h, d, generator=gen))
    k = l2norm(torch.randn(t, h, d, generator=gen))
    v = torch.randn(t, h, d, generator=gen)
    g = kda_gate(torch.randn(t, h, d, generator=gen), torch.randn(h, generator=gen) * 0.5,
                 torch.randn(h * d, generator=gen), lower_bound)
    beta = torch.rand(t, h, generator=gen)
    return q, k, v, g, beta


# ---------------------------------------------------------------------------------------------
# kda_ops
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [1, 5, 63, 64, 65, 150])
def test_chunked_equals_recurrent(t):
    q, k, v, g, beta = random_inputs(t, seed=t)
    s0 = torch.randn(H, D, D, generator=torch.Generator().manual_seed(99))
    o_r, s_r, all_r = kda_recurrent(q, k, v, g, beta, 0.35, s0, return_all_states=True)
    o_c, s_c, all_c = kda_chunked(q, k, v, g, beta, 0.35, s0, return_all_states=True)
    assert rel_err(o_c, o_r) < REL_TOL
    assert rel_err(s_c, s_r) < REL_TOL
    assert rel_err(all_c, all_r) < REL_TOL
    assert torch.equal(all_r[-1], s_r)
    # Smaller chunks give the same answer too.
    o_16, s_16 = kda_chunked(q, k, v, g, beta, 0.35, s0, chunk_size=16)
    assert rel_err(o_16, o_r) < REL_TOL and rel_err(s_16, s_r) < REL_TOL


def test_recurrent_matches_delta_rule_by_hand():
    """One head, two tokens, written out with explicit matrices (docs/model.md §3.2)."""
    q, k, v, g, beta = random_inputs(2, h=1, d=3, seed=5)
    S = torch.zeros(3, 3)
    outs = []
    for i in range(2):
        S = torch.diag(g[i, 0].exp()) @ S
        S = S + beta[i, 0] * torch.outer(k[i, 0], v[i, 0] - S.t() @ k[i, 0])
        outs.append(S.t() @ (0.5 * q[i, 0]))
    o, s = kda_recurrent(q, k, v, g, beta, 0.5)
    assert torch.allclose(o[:, 0], torch.stack(outs), atol=1e-6)
    assert torch.allclose(s[0], S, atol=1e-6)


def test_chunked_stays_finite_near_lower_bound():
    """g close to -5 for 200 tokens: cumulative decay within a chunk reaches about -320."""
    q, k, v, _, beta = random_inputs(200, seed=3)
    g = torch.full((200, H, D), -4.99)
    s0 = torch.randn(H, D, D)
    o_c, s_c = kda_chunked(q, k, v, g, beta, D ** -0.5, s0)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, D ** -0.5, s0)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert rel_err(o_c, o_r) < REL_TOL and rel_err(s_c, s_r) < REL_TOL


def test_gate_forms():
    # Seeded: with an unlucky global RNG state sigmoid saturates to exactly 1.0 in fp32 and g
    # hits the lower bound, which made this test order-dependent.
    torch.manual_seed(0)
    f = torch.randn(7, H, D)
    a_log, dt_bias = torch.randn(H), torch.randn(H * D)
    g = kda_gate(f, a_log, dt_bias, -5.0)
    expect = -5.0 * torch.sigmoid(a_log.exp().view(H, 1) * (f + dt_bias.view(H, D)))
    assert g.dtype == torch.float32 and torch.allclose(g, expect)
    assert (g < 0).all() and (g > -5).all()
    g2 = kda_gate(f, a_log, dt_bias, None)
    expect2 = -a_log.exp().view(H, 1) * torch.nn.functional.softplus(f + dt_bias.view(H, D))
    assert torch.allclose(g2, expect2) and (g2 <= 0).all()


def test_l2norm():
    x = torch.randn(4, 3, 5)
    y = l2norm(x)
    assert torch.allclose(y, x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))


def test_conv_matches_conv1d_and_chunks():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(11, 6, generator=gen)
    w = torch.randn(6, KERNEL, generator=gen)
    y, state = causal_conv1d(x, w)
    # nn.functional.conv1d cross-correlation with left padding K-1 is the definition.
    ref = torch.nn.functional.conv1d(x.t().unsqueeze(0), w.unsqueeze(1), padding=KERNEL - 1,
                                     groups=6)[0, :, :11].t()
    assert torch.allclose(y, torch.nn.functional.silu(ref), atol=1e-6)
    assert torch.equal(state, x[-(KERNEL - 1):].t())
    # Pieces shorter than K-1 with the carried window give the one-shot result.
    pieces, st = [], None
    for a, b in [(0, 1), (1, 3), (3, 8), (8, 11)]:
        yp, st = causal_conv1d(x[a:b], w, st)
        pieces.append(yp)
    assert torch.allclose(torch.cat(pieces), y, atol=1e-6) and torch.equal(st, state)
    # Batched single-step update agrees with the per-sequence form.
    y_step, st_step = causal_conv1d_update(x[8:9], w, causal_conv1d(x[:8], w)[1].unsqueeze(0))
    assert torch.allclose(y_step, y[8:9], atol=1e-6)
    assert torch.equal(st_step[0], causal_conv1d(x[:9], w)[1])


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d(torch.randn(3, 4), torch.randn(4, KERNEL), torch.zeros(4, 2))
    q, k, v, g, beta = random_inputs(3)
    with pytest.raises(ValueError, match="initial_state"):
        kda_chunked(q, k, v, g, beta, 1.0, torch.zeros(H, D, D + 1))
    with pytest.raises(ValueError, match="beta"):
        kda_recurrent(q, k, v, g, beta[:, :1], 1.0)


# ---------------------------------------------------------------------------------------------
# Backend through the pools
# ---------------------------------------------------------------------------------------------
class Harness:
    """A KDA layer over a real KDAStatePool / ReqToTokenPool, driven through ForwardBatch."""

    def __init__(self, backend=None, size: int = 4, device: str = "cpu", head_dim: int = D):
        gen = torch.Generator().manual_seed(0)
        self.device = device
        self.layer = RadixLinearAttention(layer_id=3, num_heads=H, head_dim=head_dim,
                                          conv_kernel=KERNEL)
        self.layer.conv_weight.data.copy_(
            torch.randn(3 * H * head_dim, KERNEL, generator=gen) * 0.5)
        self.layer.to(device)
        self.req_pool = ReqToTokenPool(size, 512, device)
        self.state_pool = KDAStatePool(size, [1, 3], H, head_dim, head_dim, KERNEL, torch.float32,
                                       device)
        self.backend = backend or create_attn_backend("torch_native")

    def new_request(self) -> int:
        slot = self.req_pool.alloc(1)[0]
        self.state_pool.clear_slots([slot])
        return slot

    def _run(self, fb, q, k, v, g, beta):
        fb.attn_backend = self.backend
        self.backend.init_forward_metadata(fb)
        return self.layer(q, k, v, g, beta, fb)

    def extend(self, slots, prefix_lens, tensors, mode=ForwardMode.EXTEND):
        q, k, v, g, beta = tensors
        lens = [t.shape[0] for t in q]
        cat = [torch.cat(x).to(self.device) for x in (q, k, v, g, beta)]
        t = sum(lens)
        fb = ForwardBatch.for_extend(torch.zeros(t, dtype=torch.int64, device=self.device), slots,
                                     prefix_lens, lens,
                                     torch.arange(1, t + 1), forward_mode=mode,
                                     req_to_token_pool=self.req_pool, kda_state_pool=self.state_pool)
        return self._run(fb, *cat)

    def decode(self, slots, seq_lens, q, k, v, g, beta):
        b, dev = len(slots), self.device
        fb = ForwardBatch.for_decode(torch.zeros(b, dtype=torch.int64, device=dev),
                                     torch.tensor(slots, device=dev), torch.tensor(seq_lens, device=dev),
                                     torch.arange(1, b + 1, device=dev),
                                     req_to_token_pool=self.req_pool, kda_state_pool=self.state_pool)
        return self._run(fb, *(x.to(dev) for x in (q, k, v, g, beta)))

    def states(self, slot):
        return (self.state_pool.get_conv_state(3)[slot].clone(),
                self.state_pool.get_ssm_state(3)[slot].clone())


def projections(t: int, seed: int):
    """Pre-conv q, k, v [T, H*D] plus g [T, H, D] and beta [T, H] as a model would pass them."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, C, generator=gen) for _ in range(3))
    g = kda_gate(torch.randn(t, H, D, generator=gen), torch.zeros(H), torch.randn(C, generator=gen), -5.0)
    beta = torch.rand(t, H, generator=gen)
    return q, k, v, g, beta


def rows(tensors, a, b):
    return tuple(x[a:b] for x in tensors)


def test_backend_matches_ops_one_shot():
    """The backend = conv + split + l2norm + recurrence written with kda_ops directly."""
    h = Harness()
    slot = h.new_request()
    x = projections(30, seed=1)
    out = h.extend([slot], [0], tuple([a] for a in x))
    y, window = causal_conv1d(torch.cat(x[:3], -1), h.layer.conv_weight)
    qc, kc, vc = y.view(30, 3, H, D).unbind(1)
    o, s = kda_recurrent(l2norm(qc), l2norm(kc), vc, x[3], x[4], D ** -0.5)
    assert rel_err(out, o) < REL_TOL
    conv, ssm = h.states(slot)
    assert torch.equal(conv, window) and rel_err(ssm, s) < REL_TOL
    assert h.state_pool.get_ssm_state(1).abs().sum() == 0  # other layer untouched


def test_split_extend_and_decode_match_one_shot():
    t, first = 40, 23
    x = projections(t, seed=2)
    one = Harness()
    s1 = one.new_request()
    out_full = one.extend([s1], [0], tuple([a] for a in x))
    ref_state = one.states(s1)

    two = Harness()
    s2 = two.new_request()
    out_a = two.extend([s2], [0], tuple([a] for a in rows(x, 0, first)))
    out_b = two.extend([s2], [first], tuple([a] for a in rows(x, first, t)))
    assert rel_err(torch.cat([out_a, out_b]), out_full) < REL_TOL
    for got, ref in zip(two.states(s2), ref_state):
        assert rel_err(got, ref) < REL_TOL

    dec = Harness()
    s3 = dec.new_request()
    outs = [dec.extend([s3], [0], tuple([a] for a in rows(x, 0, first)))]
    for i in range(first, t):
        outs.append(dec.decode([s3], [i + 1], *rows(x, i, i + 1)))
    assert rel_err(torch.cat(outs), out_full) < REL_TOL
    for got, ref in zip(dec.states(s3), ref_state):
        assert rel_err(got, ref) < REL_TOL


def test_ragged_batch_equals_alone():
    """Three requests of different lengths in one extend and one decode == each run alone."""
    lens = [3, 70, 17]
    prompts = [projections(n, seed=10 + i) for i, n in enumerate(lens)]
    steps = [projections(1, seed=50 + i) for i in range(3)]
    alone_out, alone_state = [], []
    for x, step, n in zip(prompts, steps, lens):
        h = Harness()
        slot = h.new_request()
        out = h.extend([slot], [0], tuple([a] for a in x))
        alone_out.append(torch.cat([out, h.decode([slot], [n + 1], *step)]))
        alone_state.append(h.states(slot))

    h = Harness()
    slots = [h.new_request() for _ in lens]
    out = h.extend(slots, [0, 0, 0], tuple(list(parts) for parts in zip(*prompts)))
    dec = h.decode(slots, [n + 1 for n in lens], *(torch.cat(p) for p in zip(*steps)))
    start = 0
    for i, n in enumerate(lens):
        got = torch.cat([out[start:start + n], dec[i:i + 1]])
        assert rel_err(got, alone_out[i]) < REL_TOL
        for a, b in zip(h.states(slots[i]), alone_state[i]):
            assert rel_err(a, b) < REL_TOL
        start += n


def test_target_verify_raises_without_mutation():
    h = Harness()
    slot = h.new_request()
    x = projections(5, seed=4)
    h.extend([slot], [0], tuple([a] for a in rows(x, 0, 3)))
    before = h.states(slot)
    with pytest.raises(ValueError, match="target-verify"):
        h.extend([slot], [3], tuple([a] for a in rows(x, 3, 5)), mode=ForwardMode.TARGET_VERIFY)
    for a, b in zip(h.states(slot), before):
        assert torch.equal(a, b)


def test_backend_rejects_bad_inputs():
    h = Harness()
    slot = h.new_request()
    q, k, v, g, beta = projections(4, seed=6)
    with pytest.raises(ValueError, match="g must be"):
        h.extend([slot], [0], ([q], [k], [v], [g[:, :1]], [beta]))
    with pytest.raises(ValueError, match="kda_prefill_impl"):
        TorchNativeKDABackend(kda_prefill_impl="cuda")


def test_registry():
    assert set(ATTENTION_BACKENDS) == {"torch_native", "triton"}
    for name in ATTENTION_BACKENDS:
        backend = create_attn_backend(name)
        assert isinstance(backend, HybridLinearAttnBackend) and backend.needs_cpu_seq_lens is False
    assert create_attn_backend("torch_native").linear_attn_backend.kda_prefill_impl == "torch"
    assert create_attn_backend("triton").linear_attn_backend.kda_prefill_impl == "auto"
    with pytest.raises(ValueError, match="torch_native, triton"):
        create_attn_backend("flashinfer")


def test_hybrid_routes_by_kind():
    class Layer:
        kind, layer_id = "gdn", 0

    with pytest.raises(ValueError, match="'gdn'"):
        create_attn_backend("torch_native")._route(Layer())


# ---------------------------------------------------------------------------------------------
# fla-core (GPU only)
# ---------------------------------------------------------------------------------------------
FLA_TOL = 2e-2  # bf16 fla vs fp32 torch math on the same bf16 inputs: max |diff| / max |ref|


@pytest.mark.gpu
def test_fla_chunk_kda_matches_torch_bf16():
    if not fla_kda.is_available():
        pytest.skip("fla-core not installed")
    dev, h, d = "cuda", 4, 64
    lens = [1, 37, 200]
    q, k, v, g, beta = random_inputs(sum(lens), h=h, d=d, seed=7)
    q, k, v = (x.to(dev, torch.bfloat16) for x in (q, k, v))
    g, beta = g.to(dev), beta.to(dev)
    s0 = torch.randn(len(lens), h, d, d, device=dev) * 0.1
    o, final = fla_kda.chunk_kda_varlen(q, k, v, g, beta, d ** -0.5, s0, lens)
    start = 0
    for i, n in enumerate(lens):
        sl = slice(start, start + n)
        o_ref, s_ref = kda_chunked(q[sl], k[sl], v[sl], g[sl], beta[sl], d ** -0.5, s0[i])
        assert rel_err(o[sl], o_ref) < FLA_TOL
        assert rel_err(final[i], s_ref) < FLA_TOL
        start += n


@pytest.mark.gpu
def test_backend_fla_prefill_matches_torch_on_cuda():
    if not fla_kda.is_available():
        pytest.skip("fla-core not installed")
    x = projections(90, seed=8)
    outs, finals = [], []
    for impl in ("torch", "fla"):
        h = Harness(backend=TorchNativeKDABackend(impl), device="cuda")
        slot = h.new_request()
        outs.append(h.extend([slot], [0], tuple([a] for a in x)))
        finals.append(h.states(slot)[1])
    assert rel_err(outs[1], outs[0]) < FLA_TOL and rel_err(finals[1], finals[0]) < FLA_TOL


def test_contiguous_by_words_copies_the_same_bytes():
    """The copy fla's inputs get: a column block of the fused projection (as [T, H, D] and as
    [T, H]) moved as 8-byte words, layouts the int64 view refuses (a 2-byte offset, a
    transposed last dim) by ``contiguous()``; a contiguous tensor is returned as it is."""
    full = torch.randn(7, 20512, generator=torch.Generator().manual_seed(3)).bfloat16()
    cases = [full[:, 12320:12320 + 4096].reshape(7, 32, 128),  # the gate f (aligned)
             full[:, 12288:12320],  # beta's columns
             full[:, 3:131],  # a 2-byte offset: no int64 view
             full[:, :64].t(),  # last dim strided: no int64 view
             torch.randn(5, 10)[:, 2:6]]  # fp32, 8-byte aligned
    for t in cases:
        got = fla_kda.contiguous_by_words(t)
        assert got.is_contiguous() and got.dtype == t.dtype and torch.equal(got, t)
        assert got.data_ptr() != t.data_ptr()
    same = full[:2]
    assert fla_kda.contiguous_by_words(same) is same


def test_fla_varlen_offsets_and_slots():
    v = fla_kda.fla_varlen([3, 1, 5], [7, 2, 4], torch.device("cpu"))
    assert v.lens == (3, 1, 5)
    assert v.cu_seqlens.tolist() == v.cu_seqlens_cpu.tolist() == [0, 3, 4, 9]
    assert v.slots.tolist() == [7, 2, 4] and v.slots.dtype == torch.int64
    assert v.host_slots == (7, 2, 4)
    with pytest.raises(ValueError, match="2 lengths for 1 slots"):
        fla_kda.fla_varlen([1, 2], [0], torch.device("cpu"))


def test_backend_builds_the_fla_varlen_once_per_forward():
    """Every KDA layer of one forward gets the same FlaVarlen objects (fla keys its chunk-index
    cache by tensor identity); the next forward gets new ones."""
    backend = TorchNativeKDABackend("torch")
    lay_a, lay_b = (extend_layout_stub(), extend_layout_stub())
    reqs = [(2, 0, 5), (0, 5, 3)]
    first = backend._fla_varlen(lay_a, reqs, torch.device("cpu"))
    assert backend._fla_varlen(lay_a, reqs, torch.device("cpu")) is first
    second = backend._fla_varlen(lay_b, reqs, torch.device("cpu"))
    assert second is not first and second.cu_seqlens.tolist() == [0, 5, 8]
    assert second.slots.tolist() == [2, 0]


def extend_layout_stub():
    from sglang.srt.layers.attention.extend_layout import ExtendLayout

    return ExtendLayout([2, 0], [0, 0], [5, 3], [0, 5])


@pytest.mark.gpu
def test_fla_prefill_second_layer_does_not_sync_on_cuda():
    """After the first KDA layer of a forward, a layer's fla prefill makes no host sync: the
    varlen tensors are reused, so fla's chunk index comes from its cache."""
    if not fla_kda.is_available():
        pytest.skip("fla-core not installed")
    h = Harness(backend=TorchNativeKDABackend("fla"), device="cuda")
    other = RadixLinearAttention(layer_id=1, num_heads=H, head_dim=D, conv_kernel=KERNEL)
    other.conv_weight.data.copy_(h.layer.conv_weight.data.cpu())
    other.to("cuda")
    slots = [h.new_request(), h.new_request()]
    x = projections(150, seed=11)
    q, k, v, g, beta = (a.to("cuda") for a in x)
    fb = ForwardBatch.for_extend(torch.zeros(150, dtype=torch.int64, device="cuda"), slots, [0, 0],
                                 [100, 50], torch.arange(1, 151), forward_mode=ForwardMode.EXTEND,
                                 req_to_token_pool=h.req_pool, kda_state_pool=h.state_pool)
    fb.attn_backend = h.backend
    h.backend.init_forward_metadata(fb)
    first = h.layer(q, k, v, g, beta, fb)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = other(q, k, v, g, beta, fb)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first, second)  # same weights, same inputs, fresh states in both pools


def raw_gate_inputs(seed: int, d: int, t: int = 123):
    """q, k, v, f ``[T, H*d]``, b ``[T, H]`` and the gate parameters of a raw-gate KDA call."""
    gen = torch.Generator().manual_seed(seed)
    c = H * d
    q, k, v, f = (torch.randn(t, c, generator=gen) for _ in range(4))
    b = torch.randn(t, H, generator=gen)
    return q, k, v, f, b, torch.randn(H, generator=gen) * 0.5, torch.randn(c, generator=gen)


def extend_two_requests_with_raw_gate(h: "Harness", inputs):
    """Two requests of 123 rows of ``inputs`` (:func:`raw_gate_inputs`) on ``h``: the second
    first extends 20 tokens alone, then 33 more beside the first's 70, the gate given as its
    raw inputs (``KDAGate``). Returns the outputs of both extends and the two slots."""
    from sglang.srt.layers.attention.kda_ops import KDAGate

    q, k, v, f, b, a_log, dt_bias = (x.to(h.device) for x in inputs)
    slots = [h.new_request(), h.new_request()]
    outs = []
    for batch_slots, prefix, pieces in (([slots[1]], [0], [slice(0, 20)]),
                                        (slots, [0, 20], [slice(20, 90), slice(90, 123)])):
        rows_ = torch.cat([torch.arange(p.start, p.stop) for p in pieces]).to(h.device)
        n = rows_.numel()
        fb = ForwardBatch.for_extend(torch.zeros(n, dtype=torch.int64, device=h.device),
                                     batch_slots, prefix, [p.stop - p.start for p in pieces],
                                     torch.arange(1, n + 1), req_to_token_pool=h.req_pool,
                                     kda_state_pool=h.state_pool)
        fb.attn_backend = h.backend
        h.backend.init_forward_metadata(fb)
        gate = KDAGate(f[rows_], b[rows_], a_log, dt_bias, -5.0)
        outs.append(h.layer(q[rows_], k[rows_], v[rows_], None, None, fb, gate=gate))
    return torch.cat(outs), slots


@pytest.mark.gpu
def test_backend_fla_prefill_forms_the_raw_gate_in_kernel_on_cuda():
    """The model's call on the fla path: raw gate inputs (KDAGate) and unnormalised q / k go to
    fla, which forms the decay, beta and the L2 norm inside its kernels; two requests of one
    batch (one behind a prefix) against the torch path. Heads of 32 channels: fla's kernel
    for the in-kernel gate takes no head narrower than 16 (a tensor-core product's K)."""
    if not fla_kda.is_available():
        pytest.skip("fla-core not installed")
    inputs = raw_gate_inputs(seed=11, d=32)
    results = []
    for impl in ("torch", "fla"):
        h = Harness(backend=TorchNativeKDABackend(impl), device="cuda", head_dim=32)
        out, slots = extend_two_requests_with_raw_gate(h, inputs)
        results.append((out, *(h.states(s)[1] for s in slots)))
    for got, ref in zip(results[1], results[0]):
        assert rel_err(got, ref) < FLA_TOL


# The Triton decode kernels on this file's CPU tensors: only under the interpreter.
needs_interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="needs TRITON_INTERPRET=1 (test/conftest.py sets it on CPU)")


@needs_interp
def test_fla_prefill_path_normalises_q_k_once_on_cpu(monkeypatch):
    """The fla prefill path's wiring on the CPU, with fla's ``chunk_kda`` replaced by the torch
    chunked recurrence (which L2-normalises q / k only when asked to): the conv launches of the
    q and k planes normalise each head, so the backend asks fla not to
    (``l2norm_in_kernel=False``), and with the raw gate inputs two requests of one batch (one
    behind a prefix) give the torch prefill's outputs and states."""
    from sglang.srt.layers.attention.kda_ops import KDAGate

    calls = []

    def torch_chunk_kda(q, k, v, g, beta, scale, initial_state, seq_lens, *, cu_seqlens=None,
                        cu_seqlens_cpu=None, l2norm_in_kernel=False, gate_params=None,
                        captured=False):
        calls.append(l2norm_in_kernel)
        t, h, d = q.shape
        q, k = q.float(), k.float()
        if l2norm_in_kernel:
            q, k = l2norm(q), l2norm(k)
        if gate_params is not None:  # fla forms the gate from its raw inputs
            gate = KDAGate(g.reshape(t, h * d), beta, *gate_params)
            g, beta = gate.decay(h, d), gate.beta()
        bounds = cu_seqlens_cpu.tolist()
        outs, finals = [], []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            o, final = kda_chunked(q[a:b], k[a:b], v[a:b].float(), g[a:b].float(),
                                   beta[a:b].float(), scale, initial_state=initial_state[i])
            outs.append(o)
            finals.append(final)
        return torch.cat(outs).to(v.dtype), torch.stack(finals)

    monkeypatch.setattr(fla_kda, "chunk_kda_varlen", torch_chunk_kda)
    inputs = raw_gate_inputs(seed=12, d=16)
    results = []
    for impl in ("torch", "auto"):
        backend = TorchNativeKDABackend(impl, recurrent_impl="triton")
        if impl == "auto":  # fla's path on the CPU (the conv kernel runs in the interpreter)
            monkeypatch.setattr(backend, "_use_fla", lambda x: True)
        h = Harness(backend=backend, head_dim=16)
        out, slots = extend_two_requests_with_raw_gate(h, inputs)
        results.append((out, *(x for s in slots for x in h.states(s))))
    assert calls == [False, False]  # once per extend, q / k normalised by the conv launch
    for got, ref in zip(results[1], results[0]):
        assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("decode_backend", ["torch_native", pytest.param("triton", marks=needs_interp)])
def test_raw_gate_inputs_and_qkv_views_equal_the_formed_gate(decode_backend):
    """The model's call: q, k, v as column views of one projection output (no concatenation
    needed) and the gate as its raw inputs (``KDAGate``), formed by the backend: extend then
    decode equal passing ``g`` / ``beta`` formed by ``kda_gate``, bit for bit."""
    from sglang.srt.layers.attention.kda_ops import KDAGate
    from sglang.srt.layers.attention.torch_native_kda import _qkv_columns

    gen = torch.Generator().manual_seed(9)
    t = 12
    fused = torch.randn(t, 3 * C + H + C, generator=gen)
    q, k, v, b, f = torch.split(fused, [C, C, C, H, C], dim=-1)
    a_log, dt_bias = torch.randn(H, generator=gen), torch.randn(C, generator=gen)
    mixed = _qkv_columns(q, k, v)
    assert mixed.data_ptr() == fused.data_ptr() and torch.equal(mixed, fused[:, :3 * C])
    assert _qkv_columns(q.clone(), k, v).data_ptr() != fused.data_ptr()  # not adjacent: a copy
    g = KDAGate(f, b, a_log, dt_bias, -5.0).decay(H, D)
    assert torch.equal(g, kda_gate(f.reshape(t, H, D), a_log, dt_bias, -5.0))

    outs = {}
    for form in ("raw", "formed"):
        backend = create_attn_backend("torch_native", linear_attn_decode_backend=decode_backend)
        h = Harness(backend if form == "raw" else None)
        slot = h.new_request()

        def call(fb, rows):
            fb.attn_backend = h.backend
            h.backend.init_forward_metadata(fb)
            if form == "raw":
                return h.layer(q[rows], k[rows], v[rows], None, None, fb,
                               gate=KDAGate(f[rows], b[rows], a_log, dt_bias, -5.0))
            # Formed over the same rows the raw call gets: torch's CPU exp / log round the
            # last bit by vector length on some CPUs, so a slice of the whole-tensor gate may not.
            formed = KDAGate(f[rows], b[rows], a_log, dt_bias, -5.0)
            return h.layer(q[rows], k[rows], v[rows], formed.decay(H, D), formed.beta(), fb)

        first = 9
        fb = ForwardBatch.for_extend(torch.zeros(first, dtype=torch.int64), [slot], [0], [first],
                                     torch.arange(1, first + 1), req_to_token_pool=h.req_pool,
                                     kda_state_pool=h.state_pool)
        res = [call(fb, slice(0, first))]
        for i in range(first, t):
            fb = ForwardBatch.for_decode(torch.zeros(1, dtype=torch.int64), torch.tensor([slot]),
                                         torch.tensor([i + 1]), torch.arange(1, 2),
                                         req_to_token_pool=h.req_pool,
                                         kda_state_pool=h.state_pool)
            res.append(call(fb, slice(i, i + 1)))
        outs[form] = (torch.cat(res), *h.states(slot))
    for got, ref in zip(outs["raw"], outs["formed"]):
        if decode_backend == "torch_native":
            assert torch.equal(got, ref)
        else:
            assert rel_err(got, ref) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or TRITON_INTERPRET=1 (test/conftest.py)")
def test_conv_qkv_planes_equal_the_one_launch_conv():
    """The fla prefill's conv as three launches (q, k, v planes, each contiguous) gives the
    values (q and k then L2-normalised per head) and new windows of the one launch over
    ``[T, 3C]``, for two requests of a batch whose rows are views of a wider projection
    output."""
    from types import SimpleNamespace

    from sgl_kernel.kda_prefill_conv import kda_prefill_conv

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(7)
    c, kw, t = 32, 4, 23
    proj = torch.randn(t, 3 * c + 10, generator=gen).to(dev)  # q | k | v | other columns
    mixed = proj[:, :3 * c]
    head_dim = 16
    layer = SimpleNamespace(conv_weight=torch.randn(3 * c, kw, generator=gen).to(dev),
                            head_dim=head_dim)
    pool = torch.randn(3, 3 * c, kw - 1, generator=gen).to(dev)
    reqs = [(2, 0, 2), (0, 2, t - 2)]  # (slot, start, tokens): one shorter than the window
    want_pool = pool.clone()
    want = torch.empty(t, 3 * c, device=dev)
    for slot, start, n in reqs:
        kda_prefill_conv(mixed[start:start + n], layer.conv_weight, want_pool[slot],
                         out=want[start:start + n])
    planes = TorchNativeKDABackend._conv_qkv_planes(kda_prefill_conv, mixed, layer, pool, reqs)
    assert planes.shape == (3, t, c) and planes.is_contiguous()
    want = want.view(t, 3, c).transpose(0, 1)
    assert torch.equal(planes[2], want[2])
    # q and k: each head L2-normalised in the launch (fla's formula), for fla without its own.
    normed = l2norm(want[:2].reshape(2, t, c // head_dim, head_dim)).view(2, t, c)
    torch.testing.assert_close(planes[:2], normed, rtol=1e-5, atol=1e-6)
    assert torch.equal(pool, want_pool)
