"""Tests of the plain-PyTorch reference BailingMoeV3 (sglang.train.reference) against
docs/model.md."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from sglang.test.random_checkpoint import randomize_for_tests, tiny_config, write_random_checkpoint
from sglang.train.reference import ReferenceBailingMoeV3
from sglang.train.reference_kda import kda_chunked, kda_gate, kda_recurrent, l2_normalize
from sglang.train.reference_mla import rope_interleaved
from sglang.train.reference_moe import MoE, grouped_topk


def _model(seed: int = 0, **overrides) -> ReferenceBailingMoeV3:
    model = ReferenceBailingMoeV3(tiny_config(**overrides), seed=seed)
    randomize_for_tests(model, seed)
    return model.eval()


def _ids(b: int = 2, t: int = 21, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (b, t), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------------------- KDA core
def _kda_inputs(b=2, t=45, h=3, dk=8, dv=6, seed=0):
    g_ = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(b, t, h, dk, generator=g_))
    k = l2_normalize(torch.randn(b, t, h, dk, generator=g_))
    v = torch.randn(b, t, h, dv, generator=g_)
    # Gates span the whole safe range (-5, 0): strong decay overflows naive exp(-G) in chunks.
    g = -5.0 * torch.rand(b, t, h, dk, generator=g_)
    beta = torch.rand(b, t, h, generator=g_)
    s0 = torch.randn(b, h, dk, dv, generator=g_)
    return q, k, v, g, beta, s0


def test_recurrence_matches_matrix_form_fp64():
    """§3.2: S_t = (I - b k k^T) diag(exp g) S_{t-1} + b k v^T, o_t = s S_t^T q_t."""
    q, k, v, g, beta, s0 = (x.double() for x in _kda_inputs(b=1, t=9, h=1))
    o, s_fin = kda_recurrent(q, k, v, g, beta, 0.3, s0)
    s = s0[0, 0].clone()
    eye = torch.eye(k.shape[-1], dtype=torch.float64)
    for t in range(q.shape[1]):
        kt, bt = k[0, t, 0], beta[0, t, 0]
        s = (eye - bt * torch.outer(kt, kt)) @ torch.diag(g[0, t, 0].exp()) @ s \
            + bt * torch.outer(kt, v[0, t, 0])
        torch.testing.assert_close(o[0, t, 0], 0.3 * s.T @ q[0, t, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s_fin[0, 0], s, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk", [8, 16, 32])
def test_chunked_kda_matches_recurrent(chunk):
    q, k, v, g, beta, s0 = _kda_inputs()
    o_r, s_r = kda_recurrent(q, k, v, g, beta, 0.35, s0)
    o_c, s_c = kda_chunked(q, k, v, g, beta, 0.35, chunk, s0)
    assert _rel(o_c, o_r) < 1e-5 and _rel(s_c, s_r) < 1e-5


def test_safe_gate_formula():
    """§3.1 step 6: g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)); Kimi form without safe gate."""
    f = torch.randn(2, 5, 3, 4)
    a_log, dt = torch.randn(3), torch.randn(12)
    u = f + dt.view(3, 4)
    a = a_log.exp().view(3, 1)
    torch.testing.assert_close(kda_gate(f, a_log, dt, -5.0, True), -5.0 * torch.sigmoid(a * u))
    torch.testing.assert_close(kda_gate(f, a_log, dt, -5.0, False), -a * F.softplus(u))


# ---------------------------------------------------------------------------- MLA / RoPE / MoE
def test_rope_is_interleaved_and_relative():
    x = torch.randn(4, 8)
    pos = torch.tensor([0, 1, 5, 9])
    y = rope_interleaved(x, pos, 10000.0)
    torch.testing.assert_close(y[0], x[0])  # position 0 is the identity
    # channels (0, 1) rotate with frequency 1 (i = 0): angle = pos.
    c, s = torch.cos(torch.tensor(5.0)), torch.sin(torch.tensor(5.0))
    torch.testing.assert_close(y[2, :2], torch.stack([x[2, 0] * c - x[2, 1] * s,
                                                      x[2, 0] * s + x[2, 1] * c]))
    # a q.k product depends on the position difference only
    q, k = torch.randn(8), torch.randn(8)
    d1 = rope_interleaved(q[None], torch.tensor([7]), 1e4) @ rope_interleaved(
        k[None], torch.tensor([3]), 1e4).T
    d2 = rope_interleaved(q[None], torch.tensor([14]), 1e4) @ rope_interleaved(
        k[None], torch.tensor([10]), 1e4).T
    torch.testing.assert_close(d1, d2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_mla_naive_equals_absorbed_form(q_lora_rank):
    """§4.3: the latent-cache (absorbed) MQA form gives the same attention output as §4.1."""
    model = _model(q_lora_rank=q_lora_rank)
    attn = model.model.layers[2].attention
    x = torch.randn(1, 11, 64)
    ref = attn(x)
    h, dn, dr, dv, r = 2, 16, 8, 16, 32
    pos = torch.arange(11)
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))) if q_lora_rank else attn.q_proj(x)
    q = q.view(11, h, dn + dr)
    c, k_rope = attn.kv_a_proj_with_mqa(x)[0].split([r, dr], -1)
    c = attn.kv_a_layernorm(c)
    k_rope = rope_interleaved(k_rope, pos, attn.rope_theta)
    q_rope = rope_interleaved(q[..., dn:].transpose(0, 1), pos, attn.rope_theta)  # [h, T, dr]
    w = attn.kv_b_proj.weight.view(h, dn + dv, r)
    w_uk, w_uv = w[:, :dn], w[:, dn:]
    q_abs = torch.einsum("thn,hnr->htr", q[..., :dn], w_uk)
    scores = (q_abs @ c.T + q_rope @ k_rope.T) * (dn + dr) ** -0.5
    scores = scores.masked_fill(~torch.ones(11, 11, dtype=torch.bool).tril(), float("-inf"))
    lat = scores.softmax(-1) @ c  # [h, T, r]
    o = torch.einsum("htr,hvr->thv", lat, w_uv) * torch.sigmoid(attn.g_proj(x)[0]).unsqueeze(-1)
    torch.testing.assert_close(attn.dense(o.reshape(1, 11, h * dv)), ref, rtol=1e-5, atol=1e-5)


def test_grouped_topk_by_hand():
    # 8 experts, 4 groups of 2, keep 2 groups, top-2.
    logits = torch.tensor([[3.0, -3.0, 0.5, 0.4, 2.0, 1.9, 1.0, 2.5]])
    p = torch.sigmoid(logits)[0]  # .95 .05 | .62 .60 | .88 .87 | .73 .92
    # no bias: group scores 1.0 | 1.22 | 1.75 | 1.66 -> keep {4,5}, {6,7}; expert 0 (the best
    # single score) is excluded with its group; top-2 = {7, 4}
    w, ids = grouped_topk(logits, None, 2, 4, 2, True, 2.5)
    assert sorted(ids[0].tolist()) == [4, 7]
    torch.testing.assert_close(w[0].sum(), torch.tensor(2.5))
    # a bias of -0.9 on expert 7 drops group {6,7} (0.73 + 0.02) -> keep {2,3}, {4,5}: top-2 {4, 5};
    # the weights come from the un-biased scores
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.9])
    w, ids = grouped_topk(logits, bias, 2, 4, 2, True, 2.5)
    assert ids[0].tolist() == [4, 5]
    torch.testing.assert_close(w[0], p[[4, 5]] / p[[4, 5]].sum() * 2.5)
    # without renormalisation the raw sigmoid scores are scaled
    w, ids = grouped_topk(logits, bias, 2, 4, 2, False, 2.5)
    torch.testing.assert_close(w[0], p[[4, 5]] * 2.5)


def test_moe_matches_dense_per_token_loop():
    model = _model()
    moe: MoE = model.model.layers[3].mlp
    x = torch.randn(2, 7, 64)
    y = moe(x)
    flat = x.reshape(-1, 64)
    logits = flat @ moe.gate.weight.T
    w, ids = grouped_topk(logits, moe.gate.expert_bias, 2, 4, 2, True, 2.5)
    rows = []
    for n in range(flat.shape[0]):
        acc = moe.shared_experts(flat[n])
        for j in range(2):
            acc = acc + w[n, j] * moe.experts[int(ids[n, j])](flat[n])
        rows.append(acc)
    torch.testing.assert_close(y.reshape(-1, 64), torch.stack(rows), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- whole model
@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_recurrent_and_chunked_model_agree(q_lora_rank):
    model = _model(q_lora_rank=q_lora_rank)
    ids = _ids(t=37)
    model.kda_mode = "recurrent"
    ref, _ = model(ids)
    for chunk in (8, 32):
        model.kda_mode, model.kda_chunk_size = "chunk", chunk
        out, _ = model(ids)
        assert _rel(out, ref) < 1e-5


def test_save_load_roundtrip_fp32_sharded(tmp_path):
    model = _model()
    ids = _ids()
    logits, hidden = model(ids)
    one = model.save_pretrained(str(tmp_path / "one"), dtype=torch.float32)
    many = model.save_pretrained(str(tmp_path / "many"), dtype=torch.float32,
                                 max_shard_bytes=200_000)
    assert os.path.exists(os.path.join(one, "model.safetensors"))
    shards = [f for f in os.listdir(many) if f.endswith(".safetensors")]
    assert len(shards) > 1
    index = json.load(open(os.path.join(many, "model.safetensors.index.json")))
    sd = model.state_dict()
    assert set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in sd.values())
    gen = json.load(open(os.path.join(many, "generation_config.json")))
    assert gen == {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
    for path in (one, many):
        loaded = ReferenceBailingMoeV3.from_pretrained(path).eval()
        out, hid = loaded(ids)
        assert torch.equal(out, logits) and torch.equal(hid, hidden)
        torch.testing.assert_close(loaded.mtp_forward(hid, ids)[0], model.mtp_forward(hid, ids)[0],
                                   rtol=0, atol=0)


def test_bf16_save_then_fp32_load_is_close(tmp_path):
    from safetensors.torch import load_file

    model = _model()
    path = model.save_pretrained(str(tmp_path / "bf16"))  # default dtype bf16
    stored = load_file(os.path.join(path, "model.safetensors"))
    assert stored["model.layers.1.mlp.gate.expert_bias"].dtype == torch.float32
    assert stored["lm_head.weight"].dtype == torch.bfloat16
    assert json.load(open(os.path.join(path, "config.json")))["torch_dtype"] == "bfloat16"
    loaded = ReferenceBailingMoeV3.from_pretrained(path, dtype=torch.float32)
    assert loaded.lm_head.weight.dtype == torch.float32
    ids = _ids()
    a, b = loaded(ids)[0], model(ids)[0]
    # bf16 rounding can flip a routing decision here and there: compare on average.
    assert ((a - b).abs().mean() / b.abs().mean()).item() < 0.05


def test_expert_bias_stays_fp32_when_cast():
    model = _model().to(torch.bfloat16)
    bias = model.model.layers[1].mlp.gate.expert_bias
    assert bias.dtype == torch.float32 and model.lm_head.weight.dtype == torch.bfloat16
    logits, _ = model(_ids())
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_from_pretrained_errors_and_bias_alias(tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(FileNotFoundError, match="config.json"):
        ReferenceBailingMoeV3.from_pretrained(str(tmp_path))
    path = write_random_checkpoint(str(tmp_path / "ck"))
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    sd["model.layers.1.mlp.gate.e_score_correction_bias"] = sd.pop(
        "model.layers.1.mlp.gate.expert_bias")
    save_file(sd, f)
    loaded = ReferenceBailingMoeV3.from_pretrained(path)  # alias accepted
    torch.testing.assert_close(loaded.model.layers[1].mlp.gate.expert_bias,
                               sd["model.layers.1.mlp.gate.e_score_correction_bias"])
    del sd["lm_head.weight"]
    save_file(sd, f)
    with pytest.raises(ValueError, match="lm_head.weight"):
        ReferenceBailingMoeV3.from_pretrained(path)


def test_random_checkpoint_shards_and_layout(tmp_path):
    path = write_random_checkpoint(str(tmp_path / "ck"), tiny_config(q_lora_rank=16),
                                   max_shard_bytes=300_000)
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    model = ReferenceBailingMoeV3.from_pretrained(path)
    sd = model.state_dict()
    assert sd["model.layers.2.attention.q_b_proj.weight"].shape == (2 * 24, 16)
    assert sd["model.layers.0.attention.q_proj.weight"].shape == (32, 64)  # KDA q_proj
    assert sd["model.layers.0.attention.q_conv1d.weight"].shape == (32, 1, 4)
    assert sd["model.layers.6.eh_proj.weight"].shape == (64, 128)  # MTP layer
    assert "model.layers.0.mlp.gate_proj.weight" in sd  # dense first layer
    assert "model.layers.6.mlp.experts.7.down_proj.weight" in sd
    logits, hidden = model(_ids())
    assert 0.3 < hidden.std().item() < 3.0 and torch.isfinite(logits).all()


def test_causality():
    model = _model()
    ids = _ids(t=30)
    ids2 = ids.clone()
    ids2[:, 17:] = _ids(t=13, seed=5)
    a, _ = model(ids)
    b, _ = model(ids2)
    torch.testing.assert_close(a[:, :17], b[:, :17], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[:, 17:], b[:, 17:])


def test_mtp_forward_shapes_and_pairing():
    model = _model()
    ids = _ids(t=13)
    logits, hidden = model(ids)
    next_ids = ids.roll(-1, dims=1)
    mtp_logits, mtp_hidden = model.mtp_forward(hidden, next_ids)
    assert mtp_logits.shape == (2, 13, 512) and mtp_hidden.shape == (2, 13, 64)
    assert mtp_logits.dtype == torch.float32
    # position t only sees (hidden, next_ids) at positions <= t
    changed = next_ids.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 512
    other, _ = model.mtp_forward(hidden, changed)
    torch.testing.assert_close(other[:, :9], mtp_logits[:, :9], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(other[:, 9], mtp_logits[:, 9])
    with pytest.raises(ValueError, match="no MTP layer"):
        _model(num_nextn_predict_layers=0).mtp_forward(hidden, next_ids)


def test_gradients_reach_every_used_parameter():
    model = _model().train()
    ids = _ids(t=16)
    model.pop_expert_counts()
    logits, hidden = model(ids)
    mtp_logits, _ = model.mtp_forward(hidden, ids.roll(-1, dims=1))
    (logits.square().mean() + mtp_logits.square().mean()).backward()
    counts = model.pop_expert_counts()
    assert set(counts) == {1, 2, 3, 4, 5, 6}
    assert all(int(c.sum()) == 2 * 16 * 2 for c in counts.values())
    for name, p in model.named_parameters():
        parts = name.split(".")
        if ".experts." in name and counts[int(parts[2])][int(parts[5])] == 0:
            assert p.grad is None, name  # an expert no token was routed to
            continue
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(b.grad is None for b in model.buffers())


def test_expert_bias_update_direction():
    model = _model()
    counts = {1: torch.tensor([10, 0, 0, 0, 0, 0, 0, 6])}
    before = model.model.layers[1].mlp.gate.expert_bias.clone()
    model.update_expert_bias(counts, rate=0.01)
    delta = model.model.layers[1].mlp.gate.expert_bias - before
    assert delta[0] < 0 and delta[7] < 0 and (delta[1:7] > 0).all()


def test_swiglu_clamp_bites():
    cfg = tiny_config()
    model = _model()
    unclamped = ReferenceBailingMoeV3(tiny_config(expert_swiglu_limit_list=[0.0] * 6,
                                                  share_expert_swiglu_limit_list=[0.0] * 6),
                                      init=False)
    unclamped.load_state_dict(model.state_dict())
    ids = _ids()
    a, b = model(ids)[0], unclamped(ids)[0]
    assert (a - b).abs().max() > 1e-2
    # MTP layer is never clamped, even when a list is longer than num_hidden_layers
    long_cfg = dict(cfg, expert_swiglu_limit_list=[0.5] * 7, share_expert_swiglu_limit_list=[0.5] * 7)
    mtp = ReferenceBailingMoeV3(long_cfg).mtp_layer
    assert mtp.mlp.shared_experts.limit == 0.0
    assert all(e.limit == 0.0 for e in mtp.mlp.experts)
    assert model.model.layers[3].mlp.experts[0].limit == 0.6
    assert model.model.layers[2].mlp.shared_experts.limit == 0.5


def test_bad_input_errors():
    with pytest.raises(ValueError, match="kda_mode"):
        ReferenceBailingMoeV3(tiny_config(), kda_mode="fast")
    with pytest.raises(ValueError, match="rope_scaling"):
        ReferenceBailingMoeV3(tiny_config(rope_scaling={"type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        _model()(torch.zeros(5, dtype=torch.long))


def test_bf16_autocast_training_step():
    """The training setting: fp32 master weights, bf16 autocast; the fp32 islands keep it close."""
    model = _model().train()
    ids = _ids(t=16)
    ref, _ = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, hidden = model(ids)
        mtp_logits, _ = model.mtp_forward(hidden, ids.roll(-1, dims=1))
    loss = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, dims=1).flatten())
    loss.backward()
    assert logits.dtype == torch.float32 and torch.isfinite(loss)
    assert ((logits - ref).abs().mean() / ref.abs().mean()).item() < 0.1
    assert model.model.layers[0].attention.A_log.grad is not None


@pytest.mark.gpu
def test_fla_chunk_kda_matches_chunked_on_cuda():
    pytest.importorskip("fla")
    model = _model().cuda()
    ids = _ids(t=70).cuda()
    model.kda_mode = "chunk"
    ref, _ = model(ids)
    model.kda_mode = "fla"
    out, _ = model(ids)
    assert _rel(out, ref) < 1e-3
