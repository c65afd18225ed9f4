"""MoE router and block against per-token references written out here (docs/model.md §5)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layer_test_utils import fake_tp
from sglang.srt.layers.moe import moe_layer
from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR
from sglang.srt.layers.moe import fused_moe_native
from sglang.srt.layers.moe.fused_moe_native import (fused_moe, fused_moe_gather,
                                                    fused_moe_grouped_mm, fused_moe_loop,
                                                    grouped_mm_supported)
from sglang.srt.layers.moe.moe_layer import BailingMoE
from sglang.srt.layers.moe.topk import MoEGate, select_experts
from sglang.srt.model_loader.weight_utils import LazyWeight




# --------------------------------------------------------------------------------- router
def route_one_token(logits, bias, k, n_group, topk_group, renorm, scale):
    """Literal per-token transcription of docs/model.md §5.1 with Python lists."""
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


def _routed_inputs(t, e, h, i, k, dtype=torch.float32, device="cpu", seed=6):
    """Random stacked experts and a routing of ``t`` tokens to ``k`` distinct experts each."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g)
    return [a.to(device=device, dtype=dtype) if a.is_floating_point() else a.to(device)
            for a in (x, w13, w2, wts, ids)]


@pytest.mark.parametrize("t,limit", [(3, 0.0), (20, 0.5), (40, 0.0)])
def test_grouped_mm_path_equals_loop_path(t, limit):
    """Sorted pairs + torch._grouped_mm == the loop over experts (3 tokens x top-2 of 8 leaves
    experts without tokens: empty groups)."""
    x, w13, w2, wts, ids = _routed_inputs(t, 8, 16, 8, 2)
    assert grouped_mm_supported(x, w13, w2)
    grouped = fused_moe_grouped_mm(x, w13, w2, wts, ids, limit)
    torch.testing.assert_close(grouped, fused_moe_loop(x, w13, w2, wts, ids, limit),
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(fused_moe(x, w13, w2, wts, ids, limit, gather_max_pairs=0,
                                 grouped_mm=True), grouped)


def test_grouped_mm_falls_back_to_the_loop_where_torch_refuses():
    """Rows that are not 16-byte multiples (I = 10 fp32 = 40 bytes): the loop runs instead."""
    x, w13, w2, wts, ids = _routed_inputs(20, 8, 16, 10, 2)
    assert not grouped_mm_supported(x, w13, w2)
    assert not grouped_mm_supported(x.double(), w13.double(), w2.double())
    assert torch.equal(fused_moe(x, w13, w2, wts, ids, gather_max_pairs=0, grouped_mm=True),
                       fused_moe_loop(x, w13, w2, wts, ids))


@pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "config.json").exists(), reason="no bundled model")
def test_grouped_mm_choice_runs_the_bundled_model_alike(monkeypatch):
    """``KernelChoices(moe_grouped_mm=True)``: the bundled model's prefill (24 tokens x top-4 =
    96 pairs per MoE layer) goes through the grouped GEMMs and gives the loop's logits and
    greedy tokens."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.kernel_choices import KernelChoices
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.test.runner_utils import greedy_logits

    calls = []
    real = fused_moe_native.fused_moe_grouped_mm
    monkeypatch.setattr(fused_moe_native, "fused_moe_grouped_mm",
                        lambda *a: calls.append(1) or real(*a))
    results = {}
    for grouped_mm in (False, True):
        runner = ModelRunner(ModelConfig.from_path(str(BUNDLED_MODEL_DIR)), device="cpu",
                             dtype=torch.float32, max_running_requests=1, max_total_tokens=64,
                             kernel_choices=KernelChoices(moe_grouped_mm=grouped_mm))
        results[grouped_mm] = greedy_logits(runner, list(range(3, 27)), 3)
        cfg = runner.model_config.hf_config
        assert len(calls) == (cfg.num_hidden_layers - cfg.first_k_dense_replace
                              if grouped_mm else 0)
    for a, b in zip(results[False], results[True]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.gpu
def test_grouped_mm_on_cuda_bf16_matches_loop():
    """torch's CUDA grouped GEMM (bf16, sm90+) on Flash-width experts == the loop within bf16."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm needs sm90+ on CUDA")
    x, w13, w2, wts, ids = _routed_inputs(96, 64, 2560, 768, 8, torch.bfloat16, "cuda")
    assert grouped_mm_supported(x, w13, w2)
    exact = fused_moe_loop(x.float(), w13.float(), w2.float(), wts, ids)
    rel = lambda y: float((y.float() - exact).norm() / exact.norm())  # noqa: E731
    grouped, looped = (fused_moe_grouped_mm(x, w13, w2, wts, ids),
                       fused_moe_loop(x, w13, w2, wts, ids))
    assert rel(grouped) < 1.5 * rel(looped) + 1e-3, (rel(grouped), rel(looped))


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
