"""KDA stage-then-commit through the real pools and the torch-native backend.

A TARGET_VERIFY over N chain tokens must leave the persistent state untouched and stage exactly
the states N decode steps would produce; ``commit_after_verify`` with ragged accept lengths must
give the state of decoding just the accepted tokens; and decoding on from there must match.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import pytest
import torch

from sglang.srt.layers.attention.attention_registry import create_attn_backend
from sglang.srt.layers.attention.kda_ops import kda_gate
from sglang.srt.layers.radix_attention import RadixLinearAttention
from sglang.srt.mem_cache.memory_pool import KDAStatePool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.rounds.chain import build_verify_forward_batch, last_accepted_index

H, D, KERNEL = 2, 8, 4
C = H * D
N = 4  # chain width
LAYERS = (1, 3)
TOL = 1e-5  # max |diff| / max |ref|, fp32; verify and decode run the same batched step

Inputs = Tuple[torch.Tensor, ...]  # q, k, v [T, C], g [T, H, D], beta [T, H]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def projections(t: int, seed: int) -> Dict[int, Inputs]:
    """Per KDA layer, pre-conv q, k, v and g, beta for ``t`` tokens, as a model passes them."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for lid in LAYERS:
        q, k, v = (torch.randn(t, C, generator=gen) for _ in range(3))
        g = kda_gate(torch.randn(t, H, D, generator=gen), torch.zeros(H),
                     torch.randn(C, generator=gen), -5.0)
        out[lid] = (q, k, v, g, torch.rand(t, H, generator=gen))
    return out


def cat(parts: Sequence[Dict[int, Inputs]]) -> Dict[int, Inputs]:
    """Concatenate per-request inputs request-major."""
    return {lid: tuple(torch.cat([p[lid][i] for p in parts]) for i in range(5)) for lid in LAYERS}


def rows(x: Dict[int, Inputs], idx) -> Dict[int, Inputs]:
    return {lid: tuple(t[idx] for t in x[lid]) for lid in LAYERS}


class Model:
    """Two KDA layers over one real KDAStatePool / ReqToTokenPool and the hybrid backend."""

    def __init__(self, spec_num_draft_tokens: int = 0, size: int = 6):
        gen = torch.Generator().manual_seed(0)
        self.layers = {}
        for lid in LAYERS:
            layer = RadixLinearAttention(layer_id=lid, num_heads=H, head_dim=D, conv_kernel=KERNEL)
            layer.conv_weight.data.copy_(torch.randn(3 * C, KERNEL, generator=gen) * 0.5)
            self.layers[lid] = layer
        self.req_pool = ReqToTokenPool(size, 256, "cpu")
        self.pool = KDAStatePool(size, list(LAYERS), H, D, D, KERNEL, torch.float32, "cpu",
                                 spec_num_draft_tokens=spec_num_draft_tokens)
        self.backend = create_attn_backend("torch_native")

    def new_request(self) -> int:
        slot = self.req_pool.alloc(1)[0]
        self.pool.clear_slots([slot])
        return slot

    def run(self, fb: ForwardBatch, x: Dict[int, Inputs]) -> Dict[int, torch.Tensor]:
        fb.req_to_token_pool, fb.kda_state_pool, fb.attn_backend = self.req_pool, self.pool, self.backend
        self.backend.init_forward_metadata(fb)
        return {lid: self.layers[lid](*x[lid], fb) for lid in LAYERS}

    def extend(self, slots: List[int], prompts: List[Dict[int, Inputs]]):
        lens = [p[LAYERS[0]][0].shape[0] for p in prompts]
        t = sum(lens)
        fb = ForwardBatch.for_extend(torch.zeros(t, dtype=torch.int64), slots, [0] * len(slots), lens,
                                     torch.arange(1, t + 1))
        return self.run(fb, cat(prompts))

    def decode(self, slots: List[int], seq_lens: List[int], x: Dict[int, Inputs]):
        b = len(slots)
        fb = ForwardBatch.for_decode(torch.zeros(b, dtype=torch.int64), torch.tensor(slots),
                                     torch.tensor(seq_lens), torch.arange(1, b + 1))
        return self.run(fb, x)

    def verify(self, slots: List[int], prefix_lens: List[int], x: Dict[int, Inputs], n: int = N):
        """TARGET_VERIFY batch built from device tensors only, as the NEXTN worker builds it."""
        b = len(slots)
        fb = build_verify_forward_batch(torch.zeros(b, n, dtype=torch.int64), torch.tensor(slots),
                                        torch.tensor(prefix_lens), torch.arange(1, b * n + 1))
        return self.run(fb, x)

    def state(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.pool.conv_state.clone(), self.pool.ssm_state.clone()


PROMPT_LENS = [3, 9, 5]
BYSTANDER_LEN = 6


def prefilled(spec: int) -> Tuple[Model, List[int], int]:
    """Three requests prefilled (in one ragged extend) plus a bystander that is never verified."""
    m = Model(spec_num_draft_tokens=spec)
    slots = [m.new_request() for _ in PROMPT_LENS]
    bystander = m.new_request()
    m.extend(slots + [bystander], [projections(n, seed=10 + i)
                                   for i, n in enumerate(PROMPT_LENS + [BYSTANDER_LEN])])
    return m, slots, bystander


def chain_inputs() -> Tuple[List[Dict[int, Inputs]], Dict[int, Inputs]]:
    """Per request the N chain tokens' inputs, and the verify batch: the three requests plus a
    padded fourth row (slot 0, zero inputs), request-major."""
    chains = [projections(N, seed=40 + i) for i in range(len(PROMPT_LENS))]
    pad = {lid: tuple(torch.zeros_like(t) for t in chains[0][lid]) for lid in LAYERS}
    return chains, cat(chains + [pad])


def decode_reference(accept: Sequence[int]):
    """A model without scratch that decodes, per request, the first accept[i] chain tokens;
    returns it, its slots, per-step states {(request, step): state} and per-step outputs."""
    ref, slots, _ = prefilled(spec=0)
    chains, _ = chain_inputs()
    staged, outs = {}, {}
    for step in range(max(accept)):
        live = [i for i in range(len(slots)) if step < accept[i]]
        x = cat([rows(chains[i], slice(step, step + 1)) for i in live])
        o = ref.decode([slots[i] for i in live], [PROMPT_LENS[i] + step + 1 for i in live], x)
        for j, i in enumerate(live):
            li = [ref.pool.layer_index(lid) for lid in LAYERS]
            staged[(i, step)] = (ref.pool.conv_state[li, slots[i]].clone(),
                                 ref.pool.ssm_state[li, slots[i]].clone())
            outs[(i, step)] = {lid: o[lid][j] for lid in LAYERS}
    return ref, slots, staged, outs


def test_verify_stages_decode_states_without_touching_persistent_state():
    m, slots, _ = prefilled(spec=N)
    before = m.state()
    _, x = chain_inputs()
    out = m.verify(slots + [0], PROMPT_LENS + [0], x)
    after = m.state()
    # Persistent state of every slot except the padding slot 0 is bit-for-bit unchanged.
    assert torch.equal(after[0][:, 1:], before[0][:, 1:]) and torch.equal(after[1][:, 1:], before[1][:, 1:])

    _, _, staged, ref_out = decode_reference([N] * len(slots))
    for i, slot in enumerate(slots):
        for step in range(N):
            conv_ref, ssm_ref = staged[(i, step)]
            conv = m.pool.intermediate_conv[:, slot, step]
            ssm = m.pool.intermediate_ssm[:, slot, step]
            assert rel_err(conv, conv_ref) < TOL and rel_err(ssm, ssm_ref) < TOL, (i, step)
            for lid in LAYERS:
                assert rel_err(out[lid][i * N + step], ref_out[(i, step)][lid]) < TOL
        # The last staged window holds the last K-1 chain inputs of q | k | v.
        for lid in LAYERS:
            q, k, v = projections(N, seed=40 + i)[lid][:3]
            window = m.pool.get_intermediate_conv(lid)[slot, N - 1]
            assert torch.equal(window, torch.cat([q, k, v], -1)[-(KERNEL - 1):].t())


@pytest.mark.parametrize("accept", [(1, 4, 2), (4, 1, 3), (2, 2, 2)])
def test_commit_equals_decoding_the_accepted_tokens_then_decode_on(accept):
    m, slots, bystander = prefilled(spec=N)
    by_before = (m.pool.conv_state[:, bystander].clone(), m.pool.ssm_state[:, bystander].clone())
    _, x = chain_inputs()
    m.verify(slots + [0], PROMPT_LENS + [0], x)
    accept_len = torch.tensor(list(accept) + [3])  # the padded row's value is arbitrary
    m.pool.commit_after_verify(torch.tensor(slots + [0]), last_accepted_index(accept_len))

    ref, ref_slots, _, _ = decode_reference(accept)
    assert ref_slots == slots
    for slot in slots:
        assert rel_err(m.pool.conv_state[:, slot], ref.pool.conv_state[:, slot]) < TOL
        assert rel_err(m.pool.ssm_state[:, slot], ref.pool.ssm_state[:, slot]) < TOL
    assert torch.equal(m.pool.conv_state[:, bystander], by_before[0])
    assert torch.equal(m.pool.ssm_state[:, bystander], by_before[1])

    # Decode on from the committed state: same outputs and states as the reference.
    lens = [p + a for p, a in zip(PROMPT_LENS, accept)]
    for step in range(3):
        x = projections(len(slots), seed=90 + step)
        lens = [n + 1 for n in lens]
        o, o_ref = m.decode(slots, lens, x), ref.decode(slots, lens, x)
        for lid in LAYERS:
            assert rel_err(o[lid], o_ref[lid]) < TOL
    assert rel_err(m.pool.ssm_state[:, slots], ref.pool.ssm_state[:, slots]) < TOL
    assert rel_err(m.pool.conv_state[:, slots], ref.pool.conv_state[:, slots]) < TOL


def test_second_round_after_commit():
    """Verify -> commit -> verify again (shorter chain than the scratch) -> commit: equals
    decoding the accepted tokens of both rounds."""
    m, slots, _ = prefilled(spec=N)
    ref, _, _, _ = decode_reference([2, 3, 1])
    _, x = chain_inputs()
    m.verify(slots + [0], PROMPT_LENS + [0], x)
    m.pool.commit_after_verify(torch.tensor(slots + [0]), torch.tensor([1, 2, 0, 0]))
    x2 = [projections(2, seed=70 + i) for i in range(len(slots))]
    m.verify(slots, [0, 0, 0], cat(x2), n=2)
    m.pool.commit_after_verify(torch.tensor(slots), torch.tensor([1, 0, 1]))
    lens = [p + a for p, a in zip(PROMPT_LENS, [2, 3, 1])]
    for step, live in enumerate([[0, 1, 2], [0, 2]]):
        ref.decode([slots[i] for i in live], [lens[i] + step + 1 for i in live],
                   cat([rows(x2[i], slice(step, step + 1)) for i in live]))
    assert rel_err(m.pool.ssm_state[:, slots], ref.pool.ssm_state[:, slots]) < TOL
    assert rel_err(m.pool.conv_state[:, slots], ref.pool.conv_state[:, slots]) < TOL


def test_pool_scratch_shapes_and_api():
    pool = KDAStatePool(3, [0, 2, 5], H, D, D, KERNEL, torch.float32, "cpu", spec_num_draft_tokens=N)
    assert tuple(pool.intermediate_ssm.shape) == (3, 4, N, H, D, D)
    assert tuple(pool.intermediate_conv.shape) == (3, 4, N, 3 * C, KERNEL - 1)
    assert pool.intermediate_ssm.dtype == torch.float32
    assert tuple(pool.get_intermediate_ssm(5).shape) == (4, N, H, D, D)
    assert pool.spec_bytes_per_slot() == N * pool.bytes_per_slot()
    plain = KDAStatePool(3, [0], H, D, D, KERNEL, torch.float32, "cpu")
    assert not plain.has_spec_scratch and plain.spec_bytes_per_slot() == 0
    with pytest.raises(ValueError, match="spec_num_draft_tokens"):
        plain.commit_after_verify(torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(ValueError, match="spec_num_draft_tokens"):
        KDAStatePool(3, [0], H, D, D, KERNEL, torch.float32, "cpu", spec_num_draft_tokens=-1)
    with pytest.raises(ValueError, match=r"\[B\]"):
        pool.commit_after_verify(torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.raises(ValueError, match="integer"):
        pool.commit_after_verify(torch.tensor([1]), torch.tensor([0.0]))
    # Commit copies one position per slot, for every layer, and leaves other slots alone.
    pool.intermediate_ssm.normal_()
    pool.intermediate_conv.normal_()
    pool.commit_after_verify(torch.tensor([2, 1]), torch.tensor([3, 0]))
    assert torch.equal(pool.ssm_state[:, 2], pool.intermediate_ssm[:, 2, 3])
    assert torch.equal(pool.ssm_state[:, 1], pool.intermediate_ssm[:, 1, 0])
    assert torch.equal(pool.conv_state[:, 1], pool.intermediate_conv[:, 1, 0])
    assert pool.ssm_state[:, 3].abs().sum() == 0 and pool.conv_state[:, 3].abs().sum() == 0


def test_verify_errors():
    plain, slots, _ = prefilled(spec=0)
    _, x = chain_inputs()
    with pytest.raises(ValueError, match="target-verify.*spec_num_draft_tokens"):
        plain.verify(slots + [0], PROMPT_LENS + [0], x)

    m, slots, _ = prefilled(spec=2)
    with pytest.raises(ValueError, match="spec_num_draft_tokens=2"):
        m.verify(slots + [0], PROMPT_LENS + [0], x)  # chains of 4 > scratch of 2
    # Ragged chains (T not a multiple of B) are refused.
    fb = ForwardBatch.for_extend(torch.zeros(5, dtype=torch.int64), slots[:2], [3, 9], [2, 3],
                                 torch.arange(1, 6), forward_mode=ForwardMode.TARGET_VERIFY)
    with pytest.raises(ValueError, match="same number of chain tokens"):
        m.run(fb, rows(x, slice(0, 5)))
    # KDA layers never run a draft extend.
    fb = ForwardBatch.for_extend(torch.zeros(2, dtype=torch.int64), slots[:1], [3], [2],
                                 torch.arange(1, 3), forward_mode=ForwardMode.DRAFT_EXTEND)
    before = m.state()
    with pytest.raises(ValueError, match="DRAFT_EXTEND"):
        m.run(fb, rows(x, slice(0, 2)))
    assert all(torch.equal(a, b) for a, b in zip(m.state(), before))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_chain_equals_step_by_step_updates(dtype):
    """The verify's all-positions short conv does each position's arithmetic exactly as the
    one-step decode update (bit for bit), so verify and decode round alike."""
    from sglang.srt.layers.attention.kda_ops import causal_conv1d_chain, causal_conv1d_update

    gen = torch.Generator().manual_seed(7)
    b, n, c = 3, 5, 24
    x = torch.randn(b, n, c, generator=gen).to(dtype)
    weight = torch.randn(c, KERNEL, generator=gen).to(dtype)
    window = torch.randn(b, c, KERNEL - 1, generator=gen).to(dtype)
    y, windows = causal_conv1d_chain(x, weight, window)
    for i in range(n):
        y_i, window = causal_conv1d_update(x[:, i], weight, window)
        assert torch.equal(y[:, i], y_i) and torch.equal(windows[:, i], window), i
