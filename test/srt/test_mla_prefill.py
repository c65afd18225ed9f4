"""MLA prefill in normal (decompressed) form against the absorbed form.

Three levels: the ops (``mla_expand_kv`` + ``mla_prefill_attention`` vs
``mla_absorbed_attention``), the torch-native backend over the real pools (ragged batches with and
without cached prefixes, the cache rows written), and the bundled model (prefill logits, greedy
decode after the prefill, chunked vs one-shot prefill). fp32 on CPU agrees to ``TOL``; the CUDA
test runs bf16 at about 1024 tokens against an fp32 reference.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import pytest
import torch

from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.srt.layers.attention.attention_registry import create_attn_backend
from sglang.srt.layers.attention.mla_ops import (
    mla_absorbed_attention,
    mla_expand_kv,
    mla_prefill_attention,
)
from sglang.srt.layers.attention.torch_native_backend import (
    MLA_NORMAL_FORM_MIN_TOKENS,
    TorchNativeMLABackend,
)
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import (
    MLATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

H, R, DR, DN, DV = 4, 16, 8, 8, 6  # heads, kv_lora_rank, rope, nope, v head dims (DV != DN)
DK = R + DR
SCALE = 1.0 / math.sqrt(DN + DR)
TOL = 1e-5  # fp32: the two forms differ only in summation order


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the reference's max abs value."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def weights(seed: int, h: int = H, r: int = R, dn: int = DN, dv: int = DV,
            dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Random ``w_kc [h, dn, r]`` and ``w_vc [h, r, dv]`` at unit-ish output scale."""
    g = torch.Generator().manual_seed(seed)
    w_kc = torch.randn(h, dn, r, generator=g) / r ** 0.5
    w_vc = torch.randn(h, r, dv, generator=g) / r ** 0.5
    return w_kc.to(device, dtype), w_vc.to(device, dtype)


def absorbed_reference(q_nope, q_rope, rows, w_kc, w_vc, scale, q_start):
    """The absorbed path's arithmetic: fold W_UK into q, attend over the rows, apply W_UV."""
    r = w_kc.shape[-1]
    q_lat = torch.einsum("thn,hnr->thr", q_nope, w_kc)
    o_lat = mla_absorbed_attention(torch.cat([q_lat, q_rope], -1), rows, r, scale, q_start)
    return torch.einsum("thr,hrv->thv", o_lat, w_vc)


def random_qkv(t: int, s: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q_nope [t, H, DN]``, ``q_rope [t, H, DR]``, cache rows ``[s, DK]``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, H, DN, generator=g), torch.randn(t, H, DR, generator=g),
            torch.randn(s, DK, generator=g))


# ---------------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t,prefix", [(1, 0), (7, 0), (5, 9), (1, 12), (33, 20)])
def test_prefill_attention_equals_absorbed(t, prefix):
    q_nope, q_rope, rows = random_qkv(t, prefix + t, seed=t * 31 + prefix)
    w_kc, w_vc = weights(seed=prefix)
    k, v = mla_expand_kv(rows, w_kc, w_vc)
    assert k.shape == (prefix + t, H, DN + DR) and v.shape == (prefix + t, H, DV)
    got = mla_prefill_attention(torch.cat([q_nope, q_rope], -1), k, v, SCALE, q_start=prefix)
    ref = absorbed_reference(q_nope, q_rope, rows, w_kc, w_vc, SCALE, prefix)
    assert got.shape == (t, H, DV)
    assert rel_err(got, ref) < TOL


def test_expand_kv_matches_per_head_definition():
    """k_h = [c W_UK[h]^T ‖ k_rope], v_h = c W_UV[h]^T (docs/model.md §4.1); zero padding."""
    _, _, rows = random_qkv(1, 11, seed=3)
    w_kc, w_vc = weights(seed=4)
    k, v = mla_expand_kv(rows, w_kc, w_vc)
    kp, vp = mla_expand_kv(rows, w_kc, w_vc, v_width=DN + DR)
    c, k_rope = rows[:, :R], rows[:, R:]
    for h in range(H):
        assert torch.allclose(k[:, h], torch.cat([c @ w_kc[h].t(), k_rope], -1), atol=1e-6)
        assert torch.allclose(v[:, h], c @ w_vc[h], atol=1e-6)
    assert torch.equal(kp, k) and torch.equal(vp[..., :DV], v)
    assert vp.shape[-1] == DN + DR and not vp[..., DV:].any()


def test_padded_values_give_the_same_output():
    q_nope, q_rope, rows = random_qkv(6, 10, seed=5)
    w_kc, w_vc = weights(seed=6)
    q = torch.cat([q_nope, q_rope], -1)
    k, v = mla_expand_kv(rows, w_kc, w_vc)
    _, vp = mla_expand_kv(rows, w_kc, w_vc, v_width=DN + DR)
    plain = mla_prefill_attention(q, k, v, SCALE, q_start=4)
    padded = mla_prefill_attention(q, k, vp, SCALE, q_start=4, v_dim=DV)
    assert padded.shape == plain.shape and rel_err(padded, plain) < TOL


def test_bad_shapes_raise():
    q = torch.randn(3, H, DN + DR)
    k, v = torch.randn(5, H, DN + DR), torch.randn(5, H, DV)
    with pytest.raises(ValueError, match="keys for 3 queries"):
        mla_prefill_attention(q, k, v, SCALE, q_start=1)
    with pytest.raises(ValueError, match="expected q"):
        mla_prefill_attention(q, k[:, :, :-1], v, SCALE, q_start=2)
    with pytest.raises(ValueError, match="do not agree"):
        w_kc, w_vc = weights(seed=0)
        mla_expand_kv(torch.randn(4, DK), w_kc, w_vc[:, 1:])


# ---------------------------------------------------------------------------------------------
# Backend over the real pools
# ---------------------------------------------------------------------------------------------
class Harness:
    """One MLA layer over real pools, driven by hand (the scheduler's bookkeeping included)."""

    def __init__(self, backend: TorchNativeMLABackend, size: int = 256):
        self.layer = RadixAttention(layer_id=3, num_heads=H, kv_lora_rank=R,
                                    qk_rope_head_dim=DR, scaling=SCALE)
        self.req_pool = ReqToTokenPool(6, 128, "cpu")
        self.alloc = TokenToKVPoolAllocator(size, "cpu")
        self.kv_pool = MLATokenToKVPool(size, [3], R, DR, torch.float32, "cpu")
        self.backend = backend
        self.lens = {}

    def new_request(self) -> int:
        slot = self.req_pool.alloc(1)[0]
        self.lens[slot] = 0
        return slot

    def extend(self, slots: List[int], qn: Sequence[torch.Tensor], qr: Sequence[torch.Tensor],
               rows: Sequence[torch.Tensor], w_kc, w_vc, save: bool = True) -> torch.Tensor:
        """One EXTEND batch through the model's call sequence (use_normal_form, then either
        form); returns head outputs ``[T, H, DV]``."""
        prefix = [self.lens[s] for s in slots]
        counts = [x.shape[0] for x in qn]
        locs = []
        for slot, n in zip(slots, counts):
            loc = self.alloc.alloc(n)
            self.req_pool.write(slot, self.lens[slot], loc)
            self.lens[slot] += n
            locs.append(loc)
        fb = ForwardBatch.for_extend(torch.zeros(sum(counts), dtype=torch.int64), slots, prefix,
                                     counts, torch.cat(locs), req_to_token_pool=self.req_pool,
                                     token_to_kv_pool=self.kv_pool, attn_backend=self.backend)
        self.backend.init_forward_metadata(fb)
        q_nope, q_rope, k = torch.cat(list(qn)), torch.cat(list(qr)), torch.cat(list(rows))
        if self.layer.use_normal_form(fb):
            return self.layer.forward_normal(torch.cat([q_nope, q_rope], -1), k, w_kc, w_vc, fb,
                                             save_kv_cache=save)
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_kc)
        o_lat = self.layer(torch.cat([q_lat, q_rope], -1), k, fb, save_kv_cache=save)
        return torch.einsum("thr,hrv->thv", o_lat, w_vc)

    def cache_rows(self, slot: int) -> torch.Tensor:
        return self.kv_pool.get_kv_buffer(3)[self.req_pool.req_to_token[slot, :self.lens[slot]]
                                             .long()]


def _ragged_run(backend: TorchNativeMLABackend, save: bool = True):
    """Request 0 gets a 7-token first chunk alone; then one batch: request 0's second chunk
    (prefix 7), a fresh 13-token request, a fresh 1-token request and a request that
    contributes no new tokens."""
    seqs = [random_qkv(n, n, seed=100 + n) for n in (19, 13, 1, 4)]
    w_kc, w_vc = weights(seed=9)
    h = Harness(backend)
    slots = [h.new_request() for _ in seqs]
    first = h.extend([slots[0]], [seqs[0][0][:7]], [seqs[0][1][:7]], [seqs[0][2][:7]],
                     w_kc, w_vc)
    h.extend([slots[3]], [seqs[3][0]], [seqs[3][1]], [seqs[3][2]], w_kc, w_vc)
    cuts = [slice(7, None), slice(None), slice(None), slice(0, 0)]
    out = h.extend(slots, [s[0][c] for s, c in zip(seqs, cuts)],
                   [s[1][c] for s, c in zip(seqs, cuts)], [s[2][c] for s, c in zip(seqs, cuts)],
                   w_kc, w_vc, save=save)
    return h, slots, seqs, (w_kc, w_vc), first, out


@pytest.mark.parametrize("save", [True, False])
def test_backend_ragged_batch_equals_absorbed(save):
    normal = _ragged_run(TorchNativeMLABackend(normal_form_min_tokens=1), save)
    absorbed = _ragged_run(TorchNativeMLABackend(normal_form_min_tokens=None), save)
    h, slots, seqs, (w_kc, w_vc), first, out = normal
    assert out.shape == (12 + 13 + 1, H, DV)
    assert rel_err(out, absorbed[5]) < TOL and rel_err(first, absorbed[4]) < TOL
    # Each request against its own one-shot absorbed attention.
    for i, got in ((0, torch.cat([first, out[:12]])), (1, out[12:25]), (2, out[25:26])):
        q_nope, q_rope, rows = seqs[i]
        ref = absorbed_reference(q_nope, q_rope, rows, w_kc, w_vc, SCALE, 0)
        assert rel_err(got, ref) < TOL, i
    # The cache holds exactly what the absorbed path writes (nothing, for save=False).
    for slot, other in zip(slots, absorbed[1]):
        assert torch.equal(h.cache_rows(slot), absorbed[0].cache_rows(other))
    if save:
        assert torch.equal(h.cache_rows(slots[1]), seqs[1][2])


def test_single_request_returns_the_attention_output_without_a_copy():
    """A batch of one request (a prefill, or a chunk after a cached prefix) returns SDPA's
    output as it is, a strided view (no copy into a new [T, H, v]), with the values of the
    absorbed form."""
    q_nope, q_rope, rows = random_qkv(11, 11, seed=41)
    w_kc, w_vc = weights(seed=42)
    outs = {}
    for name, threshold in (("normal", 1), ("absorbed", None)):
        h = Harness(TorchNativeMLABackend(normal_form_min_tokens=threshold))
        slot = h.new_request()
        first = h.extend([slot], [q_nope[:6]], [q_rope[:6]], [rows[:6]], w_kc, w_vc)
        second = h.extend([slot], [q_nope[6:]], [q_rope[6:]], [rows[6:]], w_kc, w_vc)
        outs[name] = (first, second)
    for got, ref in zip(outs["normal"], outs["absorbed"]):
        assert got.shape == ref.shape and not got.is_contiguous()  # SDPA's layout, uncopied
        assert rel_err(got, ref) < TOL


def test_normal_form_selection():
    """EXTEND of >= threshold tokens only; verify, draft extend, decode keep the absorbed form;
    the hybrid wrapper answers for its MLA backend."""
    hybrid = create_attn_backend("torch_native")
    assert hybrid.full_attn_backend.normal_form_min_tokens == MLA_NORMAL_FORM_MIN_TOKENS

    def batch(n: int, mode: ForwardMode = ForwardMode.EXTEND) -> ForwardBatch:
        return ForwardBatch.for_extend(torch.zeros(n, dtype=torch.int64), [0], [3], [n],
                                       torch.arange(n), forward_mode=mode)

    n = MLA_NORMAL_FORM_MIN_TOKENS
    assert hybrid.mla_normal_form(batch(n)) and not hybrid.mla_normal_form(batch(n - 1))
    for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND):
        assert not hybrid.mla_normal_form(batch(n, mode))
    dec = ForwardBatch.for_decode(torch.zeros(n, dtype=torch.int64), torch.arange(n),
                                  torch.full((n,), 5), torch.arange(n))
    assert not hybrid.mla_normal_form(dec)
    assert not TorchNativeMLABackend(normal_form_min_tokens=None).mla_normal_form(batch(n))
    fb = batch(n)
    fb.attn_backend = hybrid
    layer = RadixAttention(layer_id=0, num_heads=H, kv_lora_rank=R, qk_rope_head_dim=DR,
                           scaling=SCALE)
    assert layer.use_normal_form(fb)


# ---------------------------------------------------------------------------------------------
# The bundled model
# ---------------------------------------------------------------------------------------------
needs_bundled = pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "config.json").exists(),
                                   reason="bundled checkpoint not present")
PROMPT_LEN, DECODE_STEPS, CHUNK = 80, 3, 48
MODEL_TOL = 1e-5  # fp32 logits, relative to their max (seen: ~5e-7, summation order)


@pytest.fixture(scope="module")
def runner():
    from sglang.srt.model_executor.model_runner import ModelRunner

    return ModelRunner(ModelConfig.from_path(str(BUNDLED_MODEL_DIR)), device="cpu",
                       dtype=torch.float32, max_running_requests=4, max_total_tokens=512)


def _set_threshold(runner, n) -> None:
    runner.attn_backend.full_attn_backend.normal_form_min_tokens = n


def _prompt() -> List[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(2, 8000, (PROMPT_LEN,), generator=g).tolist()


def _new_request(runner) -> int:
    slot = runner.req_to_token_pool.alloc(1)[0]
    runner.kda_state_pool.clear_slots([slot])
    return slot


def _extend(runner, slot: int, ids: List[int], prefix: int) -> torch.Tensor:
    """One extend of ``ids`` after ``prefix`` cached tokens; logits of every new position."""
    loc = runner.token_to_kv_pool_allocator.alloc(len(ids))
    runner.req_to_token_pool.write(slot, prefix, loc)
    fb = ForwardBatch.for_extend(torch.tensor(ids, device=runner.device), [slot], [prefix],
                                 [len(ids)], loc, return_full_logits=True)
    return runner.forward(fb).next_token_logits


def _greedy(runner, slot: int, first: torch.Tensor, seq_len: int) -> Tuple[List[int], torch.Tensor]:
    tokens, logits, token = [], [], first.argmax(-1).view(1)
    for i in range(DECODE_STEPS):
        loc = runner.token_to_kv_pool_allocator.alloc(1)
        runner.req_to_token_pool.write(slot, seq_len + i, loc)
        fb = ForwardBatch.for_decode(token, torch.tensor([slot], device=runner.device),
                                     torch.tensor([seq_len + i + 1], device=runner.device), loc)
        tokens.append(int(token))
        logits.append(runner.forward(fb).next_token_logits)
        token = logits[-1].argmax(-1)
    return tokens, torch.cat(logits)


def _release(runner, slot: int, n: int) -> None:
    locs = runner.req_to_token_pool.req_to_token[slot, :n].clone()
    runner.token_to_kv_pool_allocator.free(locs)
    runner.req_to_token_pool.free(slot)


@needs_bundled
def test_bundled_model_prefill_and_decode_match_absorbed(runner, monkeypatch):
    from sglang.srt.layers.attention import torch_native_mla

    starts: List[int] = []  # q_start of every normal-form attention call

    def spy(q, k, v, scale, q_start, v_dim=None):
        starts.append(q_start)
        return mla_prefill_attention(q, k, v, scale, q_start, v_dim)

    monkeypatch.setattr(torch_native_mla, "mla_prefill_attention", spy)
    ids = _prompt()
    results = {}
    for name, threshold in (("absorbed", None), ("normal", 1), ("chunked", 1)):
        _set_threshold(runner, threshold)
        slot = _new_request(runner)
        if name == "chunked":  # the second chunk reads the first from the cache
            prefill = torch.cat([_extend(runner, slot, ids[:CHUNK], 0),
                                 _extend(runner, slot, ids[CHUNK:], CHUNK)])
        else:
            prefill = _extend(runner, slot, ids, 0)
        results[name] = (prefill,) + _greedy(runner, slot, prefill[-1], len(ids))
        _release(runner, slot, len(ids) + DECODE_STEPS)
    _set_threshold(runner, MLA_NORMAL_FORM_MIN_TOKENS)
    mla_layers = len(runner.model_config.hf_config.full_attention_layer_ids)
    # normal: one call per MLA layer; chunked: two, the second behind the cached first chunk.
    assert sorted(starts) == [0] * (2 * mla_layers) + [CHUNK] * mla_layers
    ref_prefill, ref_tokens, ref_decode = results["absorbed"]
    assert ref_prefill.shape[0] == PROMPT_LEN and ref_prefill.std() > 1e-2
    for name in ("normal", "chunked"):
        prefill, tokens, decode = results[name]
        assert rel_err(prefill, ref_prefill) < MODEL_TOL, name
        assert tokens == ref_tokens, name
        assert rel_err(decode, ref_decode) < MODEL_TOL, name


# ---------------------------------------------------------------------------------------------
# CUDA, bf16
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefix", [0, 384])
def test_cuda_bf16_normal_form_matches_absorbed(prefix):
    """Flash-like shapes (d_n 128, d_r 64, r 512, d_v 128) at 1024 new tokens: the normal form
    in bf16 (values padded to 192, SDPA's fused kernels) is as close to an fp32 reference as
    the absorbed form in bf16. Without a prefix the flash kernel alone must be able to run it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h, r, dr, dn, dv, t = 8, 512, 64, 128, 128, 1024
    s = prefix + t
    scale = (dn + dr) ** -0.5
    g = torch.Generator().manual_seed(0)
    q_nope, q_rope = torch.randn(t, h, dn, generator=g), torch.randn(t, h, dr, generator=g)
    rows = torch.cat([torch.randn(s, r, generator=g), torch.randn(s, dr, generator=g)], -1)
    w_kc, w_vc = weights(seed=1, h=h, r=r, dn=dn, dv=dv)
    w_kc = w_kc * 2  # sharper attention than unit scores give
    dev = torch.device("cuda")
    f32 = [x.to(dev) for x in (q_nope, q_rope, rows, w_kc, w_vc)]
    ref = absorbed_reference(*f32, scale, prefix)
    bf = [x.to(torch.bfloat16) for x in f32]
    absorbed = absorbed_reference(*bf, scale, prefix)
    k, v = mla_expand_kv(bf[2], bf[3], bf[4], v_width=dn + dr)
    q = torch.cat([bf[0], bf[1]], -1)
    normal = mla_prefill_attention(q, k, v, scale, q_start=prefix, v_dim=dv)
    assert normal.dtype == torch.bfloat16 and normal.shape == (t, h, dv)
    err_n, err_a = rel_err(normal, ref), rel_err(absorbed, ref)
    assert err_n < 2e-2 and err_n < 2 * err_a + 5e-3, (err_n, err_a)
    if prefix == 0:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            flash = mla_prefill_attention(q, k, v, scale, q_start=0, v_dim=dv)
        assert rel_err(flash, ref) < 2e-2
