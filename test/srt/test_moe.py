"""MoE router and block against per-token references written out here (model.md §5)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layer_test_utils import fake_tp
from sglang.srt.layers.moe import moe_layer
from sglang.srt.layers.moe.fused_moe_native import fused_moe, fused_moe_gather, fused_moe_loop
from sglang.srt.layers.moe.moe_layer import BailingMoE
from sglang.srt.layers.moe.topk import MoEGate, select_experts
from sglang.srt.model_loader.weight_utils import LazyWeight




# --------------------------------------------------------------------------------- router
def route_one_token(logits, bias, k, n_group, topk_group, renorm, scale):
    """Literal per-token transcription of model.md §5.1 with Python lists."""
    e = len(logits)
    p = [1.0 / (1.0 + pow(2.718281828459045, -float(z))) for z in logits]
    s = [p[i] + (float(bias[i]) if bias is not None else 0.0) for i in range(e)]
    per = e // n_group
    group_score = []
    for g in range(n_group):
        members = sorted(s[g * per:(g + 1) * per], reverse=True)
        group_score.append(sum(members[:2]))
    kept = sorted(range(n_group), key=lambda g: group_score[g], reverse=True)[:topk_group]
    eligible = [i for i in range(e) if i // per in kept]
    chosen = sorted(eligible, key=lambda i: s[i], reverse=True)[:k]
    w = [p[i] for i in chosen]
    if renorm:
        total = sum(w) + 1e-20
        w = [x / total for x in w]
    return chosen, [x * scale for x in w]


@pytest.mark.parametrize("n_group,topk_group,renorm,use_bias", [
    (4, 2, True, True), (4, 1, True, True), (1, 1, True, True), (4, 2, False, False),
    (4, 4, True, True),
])
def test_select_experts_matches_per_token_reference(n_group, topk_group, renorm, use_bias):
    torch.manual_seed(0)
    t, e, k = 9, 16, 3
    logits = torch.randn(t, e, dtype=torch.float64).float()
    bias = (0.5 * torch.randn(e)) if use_bias else None
    out = select_experts(logits, k, bias, n_group, topk_group, renorm, 2.5)
    assert out.topk_weights.dtype == torch.float32 and out.topk_ids.shape == (t, k)
    for i in range(t):
        ids, w = route_one_token(logits[i].tolist(), bias, k, n_group, topk_group, renorm, 2.5)
        assert out.topk_ids[i].tolist() == ids
        torch.testing.assert_close(out.topk_weights[i], torch.tensor(w), rtol=1e-5, atol=1e-6)


def test_bias_steers_selection_but_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    out = select_experts(logits, 2, bias, 1, 1, renormalize=False, routed_scaling_factor=1.0)
    assert out.topk_ids[0].tolist() == [3, 0]  # expert 3 chosen only thanks to its bias
    torch.testing.assert_close(out.topk_weights[0], torch.sigmoid(torch.tensor([-1.0, 2.0])))


def test_group_limit_excludes_strong_expert_in_weak_group():
    # Group 1 has the single best expert but a weak second; groups score by their top-2 sum.
    logits = torch.tensor([[1.0, 0.9, 3.0, -5.0, 0.8, 0.7, -4.0, -4.0]])
    out = select_experts(logits, 2, None, num_expert_group=4, topk_group=2, renormalize=True)
    assert sorted(out.topk_ids[0].tolist()) == [0, 1]


def test_moe_gate_fp32_and_bf16_router():
    torch.manual_seed(1)
    x = torch.randn(5, 8)
    w = torch.randn(6, 8)
    gate = MoEGate(8, 6, 2, 1, 1, True, 1.0, router_dtype="fp32", params_dtype=torch.bfloat16)
    gate.weight.weight_loader(gate.weight, LazyWeight.from_tensor("g", w.to(torch.bfloat16)))
    assert gate.weight.dtype == torch.float32 and gate.expert_bias.dtype == torch.float32
    torch.testing.assert_close(gate.router_logits(x.to(torch.bfloat16)),
                               x.to(torch.bfloat16).float() @ w.to(torch.bfloat16).float().t())
    gate16 = MoEGate(8, 6, 2, 1, 1, True, 1.0, router_dtype="bf16", params_dtype=torch.bfloat16)
    assert gate16.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        MoEGate(8, 6, 2, 1, 1, True, 1.0, router_dtype="fp8")


# --------------------------------------------------------------------------------- experts
E, H, I, IS, K = 8, 12, 10, 6, 3


def make_weights(seed=2):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "gate": r(E, H), "bias": 0.3 * r(E),
        "w1": [r(I, H) / H ** 0.5 for _ in range(E)], "w3": [r(I, H) / H ** 0.5 for _ in range(E)],
        "w2": [r(H, I) / I ** 0.5 for _ in range(E)],
        "sg": r(IS, H) / H ** 0.5, "su": r(IS, H) / H ** 0.5, "sd": r(H, IS) / IS ** 0.5,
    }


def build_block(w, limit=0.0, shared_limit=0.0):
    block = BailingMoE(H, E, K, I, IS, num_expert_group=4, topk_group=2, renormalize=True,
                       routed_scaling_factor=2.5, use_expert_bias=True, router_dtype="fp32",
                       expert_swiglu_limit=limit, shared_swiglu_limit=shared_limit)
    lw = LazyWeight.from_tensor
    block.gate.weight.weight_loader(block.gate.weight, lw("gate", w["gate"]))
    block.gate.expert_bias.weight_loader(block.gate.expert_bias, lw("bias", w["bias"]))
    ex = block.experts
    for e in range(E):
        for sid, key in (("w1", "w1"), ("w3", "w3")):
            ex.w13_weight.weight_loader(ex.w13_weight, lw(f"{key}{e}", w[key][e]), sid, e)
        ex.w2_weight.weight_loader(ex.w2_weight, lw(f"w2{e}", w["w2"][e]), "w2", e)
    se = block.shared_experts
    se.gate_up_proj.weight.weight_loader(se.gate_up_proj.weight, lw("sg", w["sg"]), 0)
    se.gate_up_proj.weight.weight_loader(se.gate_up_proj.weight, lw("su", w["su"]), 1)
    se.down_proj.weight.weight_loader(se.down_proj.weight, lw("sd", w["sd"]))
    return block


def swiglu_ref(gate, up, limit):
    a = F.silu(gate)
    if limit:
        a, up = torch.clamp(a, max=limit), torch.clamp(up, -limit, limit)
    return a * up


def block_ref(x, w, limit, shared_limit):
    """Per token: route, then sum each chosen expert's SwiGLU MLP, plus the unscaled shared one."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = (x[t] @ w["gate"].t()).tolist()
        ids, weights = route_one_token(logits, w["bias"], K, 4, 2, True, 2.5)
        for e, wt in zip(ids, weights):
            h = swiglu_ref(w["w1"][e] @ x[t], w["w3"][e] @ x[t], limit)
            out[t] += wt * (w["w2"][e] @ h)
        out[t] += w["sd"] @ swiglu_ref(w["sg"] @ x[t], w["su"] @ x[t], shared_limit)
    return out


@pytest.mark.parametrize("limit,shared_limit", [(0.0, 0.0), (0.4, 0.3)])
def test_moe_block_matches_per_token_loop(limit, shared_limit):
    w = make_weights()
    block = build_block(w, limit, shared_limit)
    x = 2.0 * torch.randn(7, H, generator=torch.Generator().manual_seed(3))
    expect = block_ref(x, w, limit, shared_limit)
    torch.testing.assert_close(block(x), expect, rtol=1e-5, atol=1e-5)
    if limit:
        # The clamp bites: the unclamped block gives a different answer on the same input.
        assert not torch.allclose(build_block(w)(x), expect, atol=1e-3)


def test_gather_path_equals_loop_path():
    w = make_weights()
    ex = build_block(w, limit=0.5).experts
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(4))
    out = select_experts(x @ w["gate"].t(), K, w["bias"], 4, 2, True, 2.5)
    args = (x, ex.w13_weight, ex.w2_weight, out.topk_weights, out.topk_ids, 0.5)
    gathered, looped = fused_moe_gather(*args), fused_moe_loop(*args)
    torch.testing.assert_close(gathered, looped, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_moe(*args, gather_max_pairs=0), looped)
    torch.testing.assert_close(fused_moe(*args, gather_max_pairs=10_000), gathered)
    with pytest.raises(ValueError):
        fused_moe_gather(x[:, :5], *args[1:])


def test_tensor_parallel_partials_sum_to_full(monkeypatch):
    monkeypatch.setattr(moe_layer, "tensor_model_parallel_all_reduce", lambda t: t)
    w = make_weights()
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(5))
    full = build_block(w, 0.4, 0.3)(x)
    total = torch.zeros_like(full)
    for rank in range(2):
        with fake_tp(rank, 2):
            block = build_block(w, 0.4, 0.3)
        assert block.experts.w13_weight.shape == (E, I, H)  # 2 * I/2 rows per expert
        torch.testing.assert_close(block.experts.w13_weight.data[3, : I // 2],
                                   w["w1"][3][rank * I // 2:(rank + 1) * I // 2])
        total += block(x)
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)


def test_expert_loader_rejects_bad_input():
    block = build_block(make_weights())
    ex = block.experts
    bad = LazyWeight.from_tensor("experts.0.gate_proj.weight", torch.randn(I + 1, H))
    with pytest.raises(ValueError, match="gate_proj"):
        ex.w13_weight.weight_loader(ex.w13_weight, bad, "w1", 0)
    good = LazyWeight.from_tensor("x", torch.randn(I, H))
    with pytest.raises(ValueError, match="expert id"):
        ex.w13_weight.weight_loader(ex.w13_weight, good, "w1", E)
    with pytest.raises(ValueError, match="shard_id"):
        ex.w13_weight.weight_loader(ex.w13_weight, good, "w4", 0)
