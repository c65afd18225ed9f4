"""MLA absorbed attention (mla_ops) and the torch-native MLA backend over the real pools."""
from __future__ import annotations

import math

import pytest
import torch

from sglang.srt.layers.attention import mla_ops
from sglang.srt.layers.attention.attention_registry import create_attn_backend
from sglang.srt.layers.attention.mla_ops import mla_absorbed_attention, mla_decode_attention
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

H, R, DR, DN, DV = 4, 16, 8, 8, 8  # heads, kv_lora_rank, rope, nope, v head dims
DK = R + DR
SCALE = 1.0 / math.sqrt(DN + DR)
TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def naive_attention(q_nope, q_rope, c, k_rope, w_kvb, q_start):
    """Per-head MLA as in docs/model.md §4.1: k_h = [c W_UK[h]^T ; k_rope], v_h = c W_UV[h]^T."""
    s, t = c.shape[0], q_nope.shape[0]
    w = w_kvb.view(H, DN + DV, R)
    out = torch.empty(t, H, DV)
    for h in range(H):
        k_h = torch.cat([c @ w[h, :DN].t(), k_rope], dim=-1)  # [S, DN+DR]
        v_h = c @ w[h, DN:].t()  # [S, DV]
        q_h = torch.cat([q_nope[:, h], q_rope[:, h]], dim=-1)  # [T, DN+DR]
        scores = q_h @ k_h.t() * SCALE
        mask = torch.arange(s).view(1, -1) > (q_start + torch.arange(t)).view(-1, 1)
        out[:, h] = torch.softmax(scores.masked_fill(mask, float("-inf")), -1) @ v_h
    return out


def absorb(q_nope, q_rope, w_kvb):
    """q_abs = [W_UK[h]^T q_nope_h ; q_rope_h] per head -> [T, H, R + DR]."""
    w_uk = w_kvb.view(H, DN + DV, R)[:, :DN]  # [H, DN, R]
    return torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope], dim=-1)


def unabsorb(latent, w_kvb):
    """o_h = W_UV[h] latent_h -> [T, H, DV]."""
    w_uv = w_kvb.view(H, DN + DV, R)[:, DN:]
    return torch.einsum("thr,hvr->thv", latent, w_uv)


def random_mla(t, s, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, H, DN, generator=gen), torch.randn(t, H, DR, generator=gen),
            torch.randn(s, R, generator=gen), torch.randn(s, DR, generator=gen),
            torch.randn(H * (DN + DV), R, generator=gen) * 0.3)


# ---------------------------------------------------------------------------------------------
# mla_ops
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t,s", [(1, 1), (1, 9), (6, 6), (5, 13)])
def test_absorbed_equals_naive(t, s):
    q_nope, q_rope, c, k_rope, w_kvb = random_mla(t, s, seed=t * 100 + s)
    q_start = s - t
    ref = naive_attention(q_nope, q_rope, c, k_rope, w_kvb, q_start)
    latent = mla_absorbed_attention(absorb(q_nope, q_rope, w_kvb), torch.cat([c, k_rope], -1), R,
                                    SCALE, q_start)
    assert latent.shape == (t, H, R)
    assert rel_err(unabsorb(latent, w_kvb), ref) < TOL


def test_blocking_does_not_change_result(monkeypatch):
    q = torch.randn(37, H, DK)
    kv = torch.randn(45, DK)
    full = mla_absorbed_attention(q, kv, R, SCALE, 8)
    # A budget that fits only ~2 queries' scores forces many blocks.
    monkeypatch.setattr(mla_ops, "SCORE_BLOCK_BYTES", 4 * H * 45 * 2)
    assert torch.allclose(mla_absorbed_attention(q, kv, R, SCALE, 8), full, atol=1e-6)


def test_half_precision_inputs():
    q = torch.randn(9, H, DK)
    kv = torch.randn(12, DK)
    ref = mla_absorbed_attention(q, kv, R, SCALE, 3)
    for dtype in (torch.bfloat16, torch.float16):
        out = mla_absorbed_attention(q.to(dtype), kv.to(dtype), R, SCALE, 3)
        assert out.dtype == dtype and rel_err(out, ref) < 3e-2


def test_decode_attention_equals_per_request():
    lens = torch.tensor([1, 7, 4])
    q = torch.randn(3, H, DK)
    kv = torch.randn(3, 7, DK)
    out = mla_decode_attention(q, kv, lens, R, SCALE)
    for b, n in enumerate(lens.tolist()):
        ref = mla_absorbed_attention(q[b:b + 1], kv[b, :n], R, SCALE, n - 1)
        assert torch.allclose(out[b:b + 1], ref, atol=1e-6)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="cache rows"):
        mla_absorbed_attention(torch.randn(4, H, DK), torch.randn(5, DK), R, SCALE, 2)
    with pytest.raises(ValueError, match="expected q"):
        mla_absorbed_attention(torch.randn(4, H, DK), torch.randn(5, DK + 1), R, SCALE, 0)


# ---------------------------------------------------------------------------------------------
# Backend through the pools
# ---------------------------------------------------------------------------------------------
class Harness:
    """An MLA layer over real ReqToTokenPool / TokenToKVPoolAllocator / MLATokenToKVPool."""

    def __init__(self, size: int = 64):
        self.layer = RadixAttention(layer_id=5, num_heads=H, kv_lora_rank=R, qk_rope_head_dim=DR,
                                    scaling=SCALE)
        self.req_pool = ReqToTokenPool(4, 128, "cpu")
        self.alloc = TokenToKVPoolAllocator(size, "cpu")
        self.kv_pool = MLATokenToKVPool(size, [5, 11], R, DR, torch.float32, "cpu")
        self.backend = create_attn_backend("torch_native")
        self.lens = {}

    def new_request(self) -> int:
        slot = self.req_pool.alloc(1)[0]
        self.lens[slot] = 0
        return slot

    def _locs(self, slots, counts):
        """Allocate slots for the new tokens and record them in req_to_token (the scheduler's job)."""
        locs = []
        for slot, n in zip(slots, counts):
            loc = self.alloc.alloc(n)
            self.req_pool.write(slot, self.lens[slot], loc)
            self.lens[slot] += n
            locs.append(loc)
        return torch.cat(locs)

    def _run(self, fb, q, k, save):
        fb.attn_backend = self.backend
        self.backend.init_forward_metadata(fb)
        return self.layer(q, k, fb, save_kv_cache=save)

    def extend(self, slots, qs, ks, save=True):
        prefix = [self.lens[s] for s in slots]
        counts = [q.shape[0] for q in qs]
        locs = self._locs(slots, counts)
        fb = ForwardBatch.for_extend(torch.zeros(sum(counts), dtype=torch.int64), slots, prefix,
                                     counts, locs, req_to_token_pool=self.req_pool,
                                     token_to_kv_pool=self.kv_pool)
        return self._run(fb, torch.cat(qs), torch.cat(ks), save)

    def decode(self, slots, q, k, save=True):
        locs = self._locs(slots, [1] * len(slots))
        seq_lens = torch.tensor([self.lens[s] for s in slots])
        fb = ForwardBatch.for_decode(torch.zeros(len(slots), dtype=torch.int64), torch.tensor(slots),
                                     seq_lens, locs, req_to_token_pool=self.req_pool,
                                     token_to_kv_pool=self.kv_pool)
        return self._run(fb, q, k, save)


def sequence(t, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, H, DK, generator=gen), torch.randn(t, DK, generator=gen)


def test_backend_extend_equals_ops():
    q, k = sequence(10, seed=1)
    h = Harness()
    out = h.extend([h.new_request()], [q], [k])
    assert out.shape == (10, H, R)
    assert torch.allclose(out, mla_absorbed_attention(q, k, R, SCALE, 0), atol=1e-6)


def test_prefill_chunks_and_decode_equal_one_shot():
    t = 15
    q, k = sequence(t, seed=2)
    ref = mla_absorbed_attention(q, k, R, SCALE, 0)
    h = Harness()
    slot = h.new_request()
    outs = [h.extend([slot], [q[:6]], [k[:6]]), h.extend([slot], [q[6:11]], [k[6:11]])]
    for i in range(11, t):
        outs.append(h.decode([slot], q[i:i + 1], k[i:i + 1]))
    assert rel_err(torch.cat(outs), ref) < TOL
    # Every token's row landed in the cache at its recorded slot.
    rows = h.kv_pool.get_kv_buffer(5)[h.req_pool.req_to_token[slot, :t].long()]
    assert torch.equal(rows, k) and h.kv_pool.get_kv_buffer(11).abs().sum() == 0


def test_ragged_batch_equals_alone():
    prompts = [sequence(n, seed=10 + n) for n in (1, 9, 4)]
    steps = [sequence(1, seed=40 + i) for i in range(3)]
    refs = []
    for (q, k), (qd, kd) in zip(prompts, steps):
        refs.append(mla_absorbed_attention(torch.cat([q, qd]), torch.cat([k, kd]), R, SCALE, 0))
    h = Harness()
    slots = [h.new_request() for _ in prompts]
    # Give request 1 a cached prefix first so the batch mixes prefix lengths.
    first = h.extend([slots[1]], [prompts[1][0][:5]], [prompts[1][1][:5]])
    out = h.extend(slots, [prompts[0][0], prompts[1][0][5:], prompts[2][0]],
                   [prompts[0][1], prompts[1][1][5:], prompts[2][1]])
    dec = h.decode(slots, torch.cat([s[0] for s in steps]), torch.cat([s[1] for s in steps]))
    got = [torch.cat([out[0:1], dec[0:1]]), torch.cat([first, out[1:5], dec[1:2]]),
           torch.cat([out[5:9], dec[2:3]])]
    for g, r in zip(got, refs):
        assert rel_err(g, r) < TOL


@pytest.mark.parametrize("decode", [False, True])
def test_without_saving_kv_cache(decode):
    """save_kv_cache=False: the new token is still attended to, but the cache is not written."""
    q, k = sequence(5, seed=3)
    ref = mla_absorbed_attention(q, k, R, SCALE, 0)
    h = Harness()
    slot = h.new_request()
    h.extend([slot], [q[:4]], [k[:4]])
    if decode:
        out = h.decode([slot], q[4:5], k[4:5], save=False)
    else:
        out = h.extend([slot], [q[4:5]], [k[4:5]], save=False)
    assert rel_err(out, ref[4:5]) < TOL
    assert h.kv_pool.get_kv_buffer(5)[h.req_pool.req_to_token[slot, 4].long()].abs().sum() == 0


def test_backend_rejects_bad_shapes():
    h = Harness()
    slot = h.new_request()
    q, k = sequence(3, seed=4)
    with pytest.raises(ValueError, match="k must be"):
        h.extend([slot], [q], [k[:, :R]])


@pytest.mark.parametrize("bound", [None, 12, 40])
def test_chain_verify_batched_equals_per_request(bound):
    """TARGET_VERIFY / chain DRAFT_EXTEND without host lengths (the NEXTN round): one batched
    masked attention over a padded gather of width ``seq_lens_upper_bound`` (None: read from the
    device) equals each request's causal attention over its prefix and its N chain tokens."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.rounds.chain import build_verify_forward_batch

    n, prefixes = 3, (1, 9, 4)  # longest sequence 9 + 3 = 12
    seqs = [sequence(p + n, seed=60 + p) for p in prefixes]
    h = Harness()
    slots = [h.new_request() for _ in prefixes]
    for slot, p, (q, k) in zip(slots, prefixes, seqs):
        h.extend([slot], [q[:p]], [k[:p]])
    loc = h._locs(slots, [n] * len(slots)).view(len(slots), n)
    for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND):
        fb = build_verify_forward_batch(
            torch.zeros(len(slots), n, dtype=torch.int64), torch.tensor(slots),
            torch.tensor(prefixes), loc, req_to_token_pool=h.req_pool, token_to_kv_pool=h.kv_pool,
            seq_lens_upper_bound=bound)
        fb.forward_mode = mode
        assert fb.extend_seq_lens_cpu is None
        out = h._run(fb, torch.cat([q[p:] for p, (q, _) in zip(prefixes, seqs)]),
                     torch.cat([k[p:] for p, (_, k) in zip(prefixes, seqs)]), save=False)
        for i, (p, (q, k)) in enumerate(zip(prefixes, seqs)):
            ref = mla_absorbed_attention(q, k, R, SCALE, 0)[p:]
            assert rel_err(out[i * n:(i + 1) * n], ref) < TOL, (mode, i)
