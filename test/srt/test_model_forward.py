"""BailingMoeV3 target + MTP layer end to end on a tiny config with every feature switched on.

KDA + MLA layers, q_lora_rank null and set, dense + MoE layers, SwiGLU clamps that bite, the MTP
layer; weights loaded from in-memory tensors by the names of ``checkpoint_spec()``; the real
pools and the torch_native attention backend. The invariant: prefill + decode steps give the
same logits as one full-sequence extend.
"""
from __future__ import annotations

import os
from typing import Dict

import pytest
import torch
import torch.multiprocessing as mp

from sglang.srt.configs.bailing_moe_v3 import BailingMoeV3Config
from sglang.srt.layers.attention.attention_registry import create_attn_backend
from sglang.srt.mem_cache.memory_pool import (
    KDAStatePool,
    MLATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
from sglang.srt.model_loader.weight_utils import LazyWeight
from sglang.srt.models.bailing_moe_v3 import BailingMoeV3ForCausalLM
from sglang.srt.models.bailing_moe_v3_nextn import BailingMoeForCausalLMNextN
from sglang.srt.models.registry import get_model_class

VOCAB = 97


def tiny_config(q_lora_rank=None, clamp=0.3) -> BailingMoeV3Config:
    """5 layers, groups of 2: KDA 0,2 and MLA 1,3,4 (tail); dense layer 0; MoE 1..4; MTP = 5."""
    return BailingMoeV3Config.from_dict(dict(
        architectures=["BailingMoeV3ForCausalLM"], hidden_size=32, num_hidden_layers=5,
        vocab_size=VOCAB, num_attention_heads=2, head_dim=8, layer_group_size=2,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        q_lora_rank=q_lora_rank, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
        intermediate_size=24, first_k_dense_replace=1, n_group=4, topk_group=2,
        num_shared_experts=1, moe_shared_expert_intermediate_size=12, routed_scaling_factor=2.5,
        expert_swiglu_limit_list=[0, 0, clamp, clamp, 0],
        share_expert_swiglu_limit_list=[0, clamp, 0, clamp, clamp],
        num_nextn_predict_layers=1, rope_theta=10000.0, max_position_embeddings=64,
    ))


def make_checkpoint(spec: Dict[str, tuple], seed: int = 0) -> Dict[str, torch.Tensor]:
    """Random tensors with sensible scales; a few stored in bf16 to exercise dtype conversion."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(spec.items()):
        if name.endswith("A_log"):
            t = torch.empty(shape).uniform_(1, 16, generator=g).log()
        elif name.endswith(("dt_bias", "expert_bias")):
            t = 0.1 * torch.randn(shape, generator=g)
        elif "norm" in name:
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        if name.endswith("mlp.gate.weight"):
            t = t.to(torch.bfloat16).float()  # value-exact, but stored bf16 below
            out[name] = t.to(torch.bfloat16)
            continue
        out[name] = t
    return out


def lazy(ckpt):
    return [(n, LazyWeight.from_tensor(n, t)) for n, t in ckpt.items()]


class Engine:
    """Just enough of a runner: pools, slot bookkeeping, forward batches."""

    def __init__(self, cfg, heads_local: int, device: str = "cpu"):
        self.device = torch.device(device)
        self.backend = create_attn_backend("torch_native")
        self.rtp = ReqToTokenPool(8, 64, device)
        self.alloc = TokenToKVPoolAllocator(256, device)
        self.kv = MLATokenToKVPool(256, cfg.full_attention_layer_ids + [cfg.mtp_layer_id],
                                   cfg.kv_lora_rank, cfg.qk_rope_head_dim, torch.float32, device)
        self.kda = KDAStatePool(8, cfg.kda_layer_ids, heads_local, cfg.head_dim, cfg.head_dim,
                                cfg.short_conv_kernel_size, torch.float32, device)
        self.pools = dict(req_to_token_pool=self.rtp, token_to_kv_pool=self.kv,
                          kda_state_pool=self.kda, attn_backend=self.backend)

    def new_request(self, n_tokens: int):
        slot = self.rtp.alloc(1)[0]
        self.kda.clear_slots([slot])
        locs = self.alloc.alloc(n_tokens)
        self.rtp.write(slot, 0, locs)
        return slot, locs

    def ids(self, values):
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def run(self, model, fb, **kw):
        self.backend.init_forward_metadata(fb)
        return model(fb.input_ids, fb.positions, fb, **kw)

    def decode(self, model, token: int, slot: int, seq_len: int, **kw):
        loc = self.alloc.alloc(1)
        self.rtp.write(slot, seq_len - 1, loc)
        fb = ForwardBatch.for_decode(self.ids([token]), self.ids([slot]), self.ids([seq_len]),
                                     loc, **self.pools)
        return self.run(model, fb, **kw)


def build(cfg, ckpt=None):
    model = BailingMoeV3ForCausalLM(cfg, torch.float32)
    draft = BailingMoeForCausalLMNextN(cfg, torch.float32)
    ckpt = ckpt or make_checkpoint({**model.checkpoint_spec(), **draft.checkpoint_spec()})
    assert model.load_weights(lazy(ckpt)) == set(model.checkpoint_spec())
    assert draft.load_weights(lazy(ckpt)) == set(draft.checkpoint_spec())
    draft.set_embed_and_head(*model.get_embed_and_head())
    return model, draft, ckpt


def prefill_then_decode(eng, model, prompt, steps):
    """Greedy: prefill, then ``steps`` decode steps. Returns (sequence, stacked logits)."""
    slot, locs = eng.new_request(len(prompt))
    fb = ForwardBatch.for_extend(eng.ids(prompt), [slot], [0], [len(prompt)], locs, **eng.pools)
    logits = [eng.run(model, fb).next_token_logits[0]]
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(logits[-1].argmax()))
        logits.append(eng.decode(model, seq[-1], slot, len(seq)).next_token_logits[0])
    return seq, torch.stack(logits)


def full_extend(eng, model, seq, capture=CaptureHiddenMode.FULL):
    slot, locs = eng.new_request(len(seq))
    fb = ForwardBatch.for_extend(eng.ids(seq), [slot], [0], [len(seq)], locs,
                                 return_full_logits=True, capture_hidden_mode=capture, **eng.pools)
    return eng.run(model, fb), slot, locs


def assert_rel_close(got, ref, rel=1e-5):
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err <= rel, f"relative error {err:.2e} > {rel:.0e}"


PROMPT = [5, 17, 42, 3, 88, 61, 9]


# ------------------------------------------------------------------------------ spec / names
def test_checkpoint_spec_names_and_shapes():
    cfg = tiny_config()
    model, draft = BailingMoeV3ForCausalLM(cfg), BailingMoeForCausalLMNextN(cfg)
    spec, dspec = model.checkpoint_spec(), draft.checkpoint_spec()
    assert spec["model.word_embeddings.weight"] == (VOCAB, 32)
    assert spec["lm_head.weight"] == (VOCAB, 32)
    assert spec["model.layers.0.attention.q_proj.weight"] == (16, 32)  # KDA: H * head_dim
    assert spec["model.layers.1.attention.q_proj.weight"] == (24, 32)  # MLA: H * (8 + 4)
    assert spec["model.layers.0.attention.q_conv1d.weight"] == (16, 1, 4)
    assert spec["model.layers.0.attention.b_proj.weight"] == (2, 32)
    assert spec["model.layers.0.attention.A_log"] == (2,)
    assert spec["model.layers.0.attention.o_norm.weight"] == (8,)
    assert spec["model.layers.1.attention.kv_b_proj.weight"] == (32, 16)
    assert spec["model.layers.1.attention.kv_a_proj_with_mqa.weight"] == (20, 32)
    assert spec["model.layers.1.attention.g_proj.weight"] == (2, 32)
    assert spec["model.layers.1.attention.dense.weight"] == (32, 16)
    assert spec["model.layers.0.mlp.gate_proj.weight"] == (24, 32)
    assert spec["model.layers.2.mlp.experts.7.down_proj.weight"] == (32, 12)
    assert spec["model.layers.2.mlp.gate.expert_bias"] == (8,)
    assert spec["model.layers.2.mlp.shared_experts.up_proj.weight"] == (12, 32)
    assert not any(n.startswith("model.layers.5.") for n in spec)
    assert all(n.startswith("model.layers.5.") for n in dspec)
    assert dspec["model.layers.5.eh_proj.weight"] == (32, 64)
    assert "model.layers.5.final_layernorm.weight" in dspec
    assert "model.layers.5.attention.kv_b_proj.weight" in dspec
    assert "model.layers.5.mlp.experts.0.gate_proj.weight" in dspec
    lora = BailingMoeV3ForCausalLM(tiny_config(q_lora_rank=6)).checkpoint_spec()
    assert lora["model.layers.1.attention.q_b_proj.weight"] == (24, 6)
    assert "model.layers.1.attention.q_proj.weight" not in lora
    # Names: aliases, ignorable tensors, the MTP split between target and draft.
    bias_alias = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert model.canonical_checkpoint_name(bias_alias) == "model.layers.2.mlp.gate.expert_bias"
    assert model.canonical_checkpoint_name("model.layers.1.attention.rotary_emb.inv_freq") is None
    assert model.canonical_checkpoint_name("model.layers.5.enorm.weight") is None
    assert draft.canonical_checkpoint_name("model.layers.5.enorm.weight") == \
        "model.layers.5.enorm.weight"
    assert draft.canonical_checkpoint_name("model.norm.weight") is None
    assert draft.canonical_checkpoint_name("model.layers.5.mlp.gate.e_score_correction_bias") \
        == "model.layers.5.mlp.gate.expert_bias"
    # The shared embedding / head are not parameters of the draft.
    assert not any("embed" in n or "lm_head" in n for n, _ in draft.named_parameters())


def test_registry():
    assert get_model_class("BailingMoeV3ForCausalLM") is BailingMoeV3ForCausalLM
    assert get_model_class("BailingMoeV3ForCausalLM", is_draft=True) is BailingMoeForCausalLMNextN
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        get_model_class("LlamaForCausalLM")


def test_load_errors_name_the_tensor():
    cfg = tiny_config()
    model = BailingMoeV3ForCausalLM(cfg)
    with pytest.raises(ValueError, match="model.layers.0.attention.bogus"):
        model.load_weights([("model.layers.0.attention.bogus",
                             LazyWeight.from_tensor("x", torch.zeros(1)))])
    name = "model.layers.1.attention.q_proj.weight"
    with pytest.raises(ValueError, match="q_proj"):
        model.load_weights([(name, LazyWeight.from_tensor(name, torch.zeros(16, 32)))])
    # Aliases and ignorable names pass through load_weights too.
    alias = "model.layers.2.mlp.gate.e_score_correction_bias"
    loaded = model.load_weights([(alias, LazyWeight.from_tensor(alias, torch.ones(8))),
                                 ("model.layers.5.enorm.weight",
                                  LazyWeight.from_tensor("e", torch.ones(32)))])
    assert loaded == {"model.layers.2.mlp.gate.expert_bias"}
    torch.testing.assert_close(model.model.layers[2].mlp.gate.expert_bias.data, torch.ones(8))


# ------------------------------------------------------------------------------ forward
@pytest.mark.parametrize("q_lora_rank", [None, 6])
def test_prefill_decode_equals_full_extend(q_lora_rank):
    torch.manual_seed(0)
    cfg = tiny_config(q_lora_rank)
    model, draft, _ = build(cfg)
    eng = Engine(cfg, cfg.num_attention_heads)
    seq, logits = prefill_then_decode(eng, model, PROMPT, steps=5)
    full, _, _ = full_extend(eng, model, seq)
    assert full.next_token_logits.shape == (len(seq), VOCAB)
    assert full.hidden_states.shape == (len(seq), cfg.hidden_size)
    assert_rel_close(logits, full.next_token_logits[len(PROMPT) - 1:])


def test_batched_extend_rows_and_chunked_prefix():
    cfg = tiny_config()
    model, _, _ = build(cfg)
    eng = Engine(cfg, cfg.num_attention_heads)
    a, b = PROMPT, [11, 12, 13, 14]
    ref_a, _, _ = full_extend(eng, model, a)
    ref_b, _, _ = full_extend(eng, model, b)
    (sa, la), (sb, lb) = eng.new_request(len(a)), eng.new_request(len(b))
    fb = ForwardBatch.for_extend(torch.tensor(a + b), [sa, sb], [0, 0], [len(a), len(b)],
                                 torch.cat([la, lb]), capture_hidden_mode=CaptureHiddenMode.LAST,
                                 **eng.pools)
    out = eng.run(model, fb)
    assert out.next_token_logits.shape == (2, VOCAB) and out.hidden_states.shape == (2, 32)
    assert_rel_close(out.next_token_logits[0], ref_a.next_token_logits[-1])
    assert_rel_close(out.next_token_logits[1], ref_b.next_token_logits[-1])
    torch.testing.assert_close(out.hidden_states[1], ref_b.hidden_states[-1], rtol=1e-5, atol=1e-5)
    # Chunked prefill: 4 tokens, then the remaining 3 on top of the cached prefix.
    slot, locs = eng.new_request(len(a))
    eng.run(model, ForwardBatch.for_extend(torch.tensor(a[:4]), [slot], [0], [4], locs[:4],
                                           **eng.pools))
    out = eng.run(model, ForwardBatch.for_extend(torch.tensor(a[4:]), [slot], [4], [3], locs[4:],
                                                 return_full_logits=True, **eng.pools))
    assert_rel_close(out.next_token_logits, ref_a.next_token_logits[4:])


def test_swiglu_clamp_changes_the_model():
    cfg = tiny_config(clamp=0.3)
    model, _, ckpt = build(cfg)
    plain, _, _ = build(tiny_config(clamp=0.0), ckpt)
    eng = Engine(cfg, cfg.num_attention_heads)
    out_clamped, _, _ = full_extend(eng, model, PROMPT)
    out_plain, _, _ = full_extend(eng, plain, PROMPT)
    assert not torch.allclose(out_clamped.next_token_logits, out_plain.next_token_logits,
                              atol=1e-3)


def test_nextn_on_target_hidden_states():
    cfg = tiny_config()
    model, draft, _ = build(cfg)
    eng = Engine(cfg, cfg.num_attention_heads)
    seq = PROMPT + [21, 34, 55]
    full, slot, locs = full_extend(eng, model, seq)
    h = full.hidden_states  # final-normed, [T, H]
    # Draft over the whole sequence: token t+1 paired with h_t (positions 0..T-2).
    n = len(seq) - 1
    fb = ForwardBatch.for_extend(torch.tensor(seq[1:]), [slot], [0], [n], locs[:n],
                                 return_full_logits=True, **eng.pools)
    ref = eng.run(draft, fb, hidden_states=h[:-1])
    assert ref.next_token_logits.shape == (n, VOCAB)
    assert ref.hidden_states.shape == (n, cfg.hidden_size)  # NULL capture -> FULL for a draft
    # Incremental: a prefix extend, then one-token decodes, reproduce the full draft logits.
    slot2, locs2 = eng.new_request(4)
    fb = ForwardBatch.for_extend(torch.tensor(seq[1:5]), [slot2], [0], [4], locs2, **eng.pools)
    got = [eng.run(draft, fb, hidden_states=h[:4]).next_token_logits[0]]
    for pos in range(4, n):
        out = eng.decode(draft, seq[pos + 1], slot2, pos + 1, hidden_states=h[pos:pos + 1])
        got.append(out.next_token_logits[0])
        torch.testing.assert_close(out.hidden_states[0], ref.hidden_states[pos],
                                   rtol=1e-5, atol=1e-5)
    assert_rel_close(torch.stack(got), ref.next_token_logits[3:])
    # The draft's hidden states differ from the target's (it is a real layer, not identity).
    assert not torch.allclose(ref.hidden_states, h[:-1], atol=1e-3)
    with pytest.raises(ValueError, match="hidden_states"):
        eng.run(draft, fb, hidden_states=h[:3])


# ------------------------------------------------------------------------------ TP = 2
def _tp_worker(rank: int, port: int, ckpt, seq, out_dir: str) -> None:
    from sglang.srt.distributed import destroy_distributed_environment, init_distributed_environment

    torch.set_num_threads(1)
    init_distributed_environment(2, rank, f"tcp://127.0.0.1:{port}", backend="gloo")
    try:
        cfg = tiny_config(q_lora_rank=6)
        model, draft, _ = build(cfg, ckpt)
        eng = Engine(cfg, cfg.num_attention_heads // 2)
        _, logits = prefill_then_decode(eng, model, seq[:len(PROMPT)], steps=3)
        full, slot, locs = full_extend(eng, model, seq)
        n = len(seq) - 1
        fb = ForwardBatch.for_extend(torch.tensor(seq[1:]), [slot], [0], [n], locs[:n],
                                     return_full_logits=True, **eng.pools)
        dlogits = eng.run(draft, fb, hidden_states=full.hidden_states[:-1]).next_token_logits
        torch.save({"decode": logits, "full": full.next_token_logits, "draft": dlogits},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_distributed_environment()


def test_tensor_parallel_2_matches_tp_1(tmp_path):
    from sglang.srt.distributed.parallel_state import free_port

    cfg = tiny_config(q_lora_rank=6)
    model, draft, ckpt = build(cfg)
    eng = Engine(cfg, cfg.num_attention_heads)
    seq, logits = prefill_then_decode(eng, model, PROMPT, steps=3)
    full, slot, locs = full_extend(eng, model, seq)
    n = len(seq) - 1
    fb = ForwardBatch.for_extend(torch.tensor(seq[1:]), [slot], [0], [n], locs[:n],
                                 return_full_logits=True, **eng.pools)
    dref = eng.run(draft, fb, hidden_states=full.hidden_states[:-1]).next_token_logits
    mp.start_processes(_tp_worker, args=(free_port(), ckpt, seq, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert_rel_close(got["decode"], logits)
        assert_rel_close(got["full"], full.next_token_logits)
        assert_rel_close(got["draft"], dref)


# ------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
def test_cuda_matches_cpu_and_is_self_consistent():
    cfg = tiny_config()
    model, _, _ = build(cfg)
    seq = PROMPT + [21, 34, 55, 89]
    cpu_full, _, _ = full_extend(Engine(cfg, 2), model, seq)
    model = model.to("cuda")
    eng = Engine(cfg, 2, "cuda")
    full, _, _ = full_extend(eng, model, seq)
    assert_rel_close(full.next_token_logits.cpu(), cpu_full.next_token_logits, rel=1e-4)
    own_seq, logits = prefill_then_decode(eng, model, PROMPT, steps=4)
    own_full, _, _ = full_extend(eng, model, own_seq)
    assert_rel_close(logits, own_full.next_token_logits[len(PROMPT) - 1:], rel=1e-4)
