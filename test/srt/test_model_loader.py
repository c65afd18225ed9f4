"""Checkpoint loading: lazy slices, single vs sharded files, TP slicing, error reports, aliases,
dtype conversion, and deterministic dummy weights (tiny config and a reduced-width preset)."""
from __future__ import annotations

import json
import os
import resource

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sglang.srt.configs.engine_defaults import AUTO_MAX_RUNNING_REQUESTS
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed import parallel_state as ps
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.model_runner import (
    ModelRunner,
    kda_bytes_per_slot,
    kv_bytes_per_token,
    kv_slots_from_memory,
    request_slots_from_memory,
)
from sglang.srt.model_loader import (
    CheckpointError,
    LazyWeight,
    build_model,
    get_model,
    init_dummy_weights,
    load_safetensors_weights,
    model_weight_bytes,
)
from sglang.test.random_checkpoint import tiny_config, write_random_checkpoint
from sglang.test.runner_utils import draft_runner_on

PROMPT = [5, 17, 99, 3, 250, 42, 7, 311, 8, 64]


# --------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """One fp32 single-file random checkpoint shared by the read-only tests."""
    return write_random_checkpoint(str(tmp_path_factory.mktemp("single")))


def make_runner(path, **kw):
    kw.setdefault("load_format", "auto")
    overrides = kw.pop("overrides", None)
    cfg = ModelConfig.from_path(path, overrides)
    return ModelRunner(cfg, device="cpu", dtype=kw.pop("dtype", torch.float32),
                       max_running_requests=2, max_total_tokens=kw.pop("max_total_tokens", 256),
                       **kw)


def prefill_logits(runner, ids=PROMPT):
    """Logits of every prompt position ``[T, V]`` for one fresh request."""
    req = runner.req_to_token_pool.alloc(1)[0]
    runner.kda_state_pool.clear_slots([req])
    input_ids = torch.tensor(ids, dtype=torch.int64, device=runner.device)
    loc = runner.token_to_kv_pool_allocator.alloc(len(ids))
    runner.req_to_token_pool.write(req, 0, loc)
    fb = ForwardBatch.for_extend(input_ids, [req], [0], [len(ids)], loc, return_full_logits=True)
    out = runner.forward(fb).next_token_logits
    runner.req_to_token_pool.free(req)
    runner.token_to_kv_pool_allocator.free(loc)
    return out


def copy_ckpt(src, dst):
    """Copy config.json + weights of a single-file checkpoint; returns (dst, tensors)."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = f.read()
    with open(os.path.join(dst, "config.json"), "w") as f:
        f.write(cfg)
    return dst, load_file(os.path.join(src, "model.safetensors"))


def rewrite(src, dst, edit):
    """A copy of checkpoint ``src`` whose tensors dict went through ``edit``."""
    dst, tensors = copy_ckpt(src, dst)
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def load_error(path) -> str:
    with pytest.raises(CheckpointError) as info:
        get_model(ModelConfig.from_path(path), dtype=torch.float32, device="cpu")
    return str(info.value)


# --------------------------------------------------------------------------- LazyWeight
def test_lazy_weight_reads_safetensors_slices(tmp_path):
    t = torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4)
    path = str(tmp_path / "x.safetensors")
    save_file({"w": t, "s": torch.tensor(3.5), "a": torch.arange(8.0).reshape(1, 1, 8, 1)}, path)
    with safe_open(path, framework="pt") as f:
        w = LazyWeight.from_safetensors_slice("w", f.get_slice("w"))
        assert w.shape == (2, 6, 4) and w.dtype == torch.float32 and w.nbytes == t.numel() * 4
        assert torch.equal(w.narrow(1, 2, 3), t[:, 2:5])
        assert w.bytes_read == 2 * 3 * 4 * 4  # only the slice was materialised
        assert torch.equal(w.narrow(-1, 1, 2), t[..., 1:3])
        assert torch.equal(w.load(), t)
        with pytest.raises(ValueError, match="out of range"):
            w.narrow(1, 4, 3)
        s = LazyWeight.from_safetensors_slice("s", f.get_slice("s"))
        assert s.load().item() == 3.5  # 0-d tensors load whole
        a = LazyWeight.from_safetensors_slice("a", f.get_slice("a")).reshape_to((8,))
        assert torch.equal(a.narrow(0, 4, 4), torch.arange(4.0, 8.0))
        with pytest.raises(ValueError, match="cannot view"):
            w.reshape_to((12, 4))


# --------------------------------------------------------------------------- files
def test_single_and_sharded_checkpoints_give_same_logits(ckpt, tmp_path):
    sharded = write_random_checkpoint(str(tmp_path / "sharded"), max_shard_bytes=100_000)
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 3
    a = prefill_logits(make_runner(ckpt))
    b = prefill_logits(make_runner(sharded))
    assert a.shape == (len(PROMPT), tiny_config()["vocab_size"])
    assert torch.isfinite(a).all() and a.std() > 1e-3
    assert torch.equal(a, b)


def test_tp_rank_reads_only_its_slice(ckpt, monkeypatch):
    """Rank 1 of 2 (no process group is needed to build and load) reads half of sharded tensors."""
    monkeypatch.setattr(ps, "_TP_RANK", 1)
    monkeypatch.setattr(ps, "_TP_SIZE", 2)
    model = build_model(ModelConfig.from_path(ckpt), dtype=torch.float32, device="cpu")
    seen = {}
    original = model.load_weights

    def spy(weights):
        weights = list(weights)
        seen.update(weights)
        return original(iter(weights))

    model.load_weights = spy
    read = load_safetensors_weights(model, ckpt)
    total = sum(w.nbytes for w in seen.values())
    assert read == sum(w.bytes_read for w in seen.values())
    assert read < 0.75 * total, (read, total)
    # MLA's input projections of layer 2 share one local weight [q | kv_a | g]: of the
    # column-parallel q_proj and g_proj exactly the second half was read, of the replicated
    # kv_a_proj_with_mqa all of it.
    files = load_file(os.path.join(ckpt, "model.safetensors"))
    local = dict(model.named_parameters())["model.layers.2.attention.fused_qkv_a_g_proj.weight"]
    row = 0
    for piece, split in (("q_proj", True), ("kv_a_proj_with_mqa", False), ("g_proj", True)):
        name = f"model.layers.2.attention.{piece}.weight"
        full = files[name]
        rows = full[full.shape[0] // 2:] if split else full
        assert seen[name].bytes_read == rows.nbytes, piece
        assert torch.equal(local[row:row + rows.shape[0]], rows), piece
        row += rows.shape[0]
    assert row == local.shape[0]


def test_missing_tensor_is_named(ckpt, tmp_path):
    name = "model.layers.1.attention.k_proj.weight"
    path = rewrite(ckpt, str(tmp_path / "c"), lambda t: t.pop(name))
    msg = load_error(path)
    assert f"missing tensor: {name}" in msg and "[32, 64]" in msg


def test_wrong_shape_is_named(ckpt, tmp_path):
    name = "model.layers.2.attention.kv_a_layernorm.weight"
    path = rewrite(ckpt, str(tmp_path / "c"), lambda t: t.update({name: torch.ones(31)}))
    msg = load_error(path)
    assert f"shape mismatch: {name} expected [32], found [31]" in msg


def test_unexpected_tensor_is_named(ckpt, tmp_path):
    name = "model.layers.0.attention.bogus.weight"
    path = rewrite(ckpt, str(tmp_path / "c"), lambda t: t.update({name: torch.ones(4, 4)}))
    msg = load_error(path)
    assert f"unexpected tensor: {name}" in msg


def test_every_problem_is_reported_at_once(ckpt, tmp_path):
    def edit(t):
        t.pop("lm_head.weight")
        t.pop("model.norm.weight")
        t["model.word_embeddings.weight"] = torch.zeros(3, 3)
        t["extra.weight"] = torch.zeros(2)

    msg = load_error(rewrite(ckpt, str(tmp_path / "c"), edit))
    for part in ("missing tensor: lm_head.weight", "missing tensor: model.norm.weight",
                 "shape mismatch: model.word_embeddings.weight", "unexpected tensor: extra.weight",
                 "(4 problem(s))"):
        assert part in msg, msg


def test_missing_shard_file_is_named(tmp_path):
    path = write_random_checkpoint(str(tmp_path / "sharded"), max_shard_bytes=100_000)
    os.remove(os.path.join(path, "model-00002-of-" + _num_shards(path) + ".safetensors"))
    msg = load_error(path)
    assert "model-00002-of-" in msg and "do not exist" in msg


def test_alias_duplicate_and_bad_index_are_named(ckpt, tmp_path):
    bias = "model.layers.1.mlp.gate.expert_bias"
    path = rewrite(ckpt, str(tmp_path / "dup"), lambda t: t.update(
        {bias.replace("expert_bias", "e_score_correction_bias"): t[bias].clone()}))
    msg = load_error(path)
    assert "duplicate tensor" in msg and bias in msg

    sharded = write_random_checkpoint(str(tmp_path / "sharded"), max_shard_bytes=100_000)
    index_path = os.path.join(sharded, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = files[0]  # lie about where a tensor lives
    with open(index_path, "w") as f:
        json.dump(index, f)
    assert f"index maps tensor model.norm.weight to {files[0]}" in load_error(sharded)


def _num_shards(path):
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        first = sorted(set(json.load(f)["weight_map"].values()))[0]
    return first.split("-of-")[1].split(".")[0]


def test_no_weights_and_preset_errors(tmp_path):
    path, _ = copy_ckpt(write_random_checkpoint(str(tmp_path / "a")), str(tmp_path / "b"))
    assert "no safetensors weights" in load_error(path)
    # dummy weights never touch the files
    get_model(ModelConfig.from_path(path), load_format="dummy", dtype=torch.float32, device="cpu")
    preset = ModelConfig.from_path("ling-3.0-flash")
    with pytest.raises(ValueError, match="--load-format dummy"):
        get_model(preset, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="unknown load_format"):
        get_model(ModelConfig.from_path(path), load_format="pt", dtype=torch.float32, device="cpu")


# --------------------------------------------------------------------------- names and dtypes
def test_e_score_correction_bias_alias(ckpt, tmp_path):
    def edit(t):
        for k in [k for k in t if k.endswith("mlp.gate.expert_bias")]:
            t[k.replace("expert_bias", "e_score_correction_bias")] = t.pop(k)

    path = rewrite(ckpt, str(tmp_path / "c"), edit)
    assert torch.equal(prefill_logits(make_runner(path)), prefill_logits(make_runner(ckpt)))


def test_bf16_checkpoint_loads_into_fp32(tmp_path):
    path = write_random_checkpoint(str(tmp_path / "bf16"), dtype=torch.bfloat16)
    stored = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.2.attention.dense.weight"
    assert stored[name].dtype == torch.bfloat16
    runner = make_runner(path)
    params = dict(runner.model.named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values())
    assert torch.equal(params[name], stored[name].float())
    assert torch.isfinite(prefill_logits(runner)).all()


# --------------------------------------------------------------------------- dummy weights
def test_dummy_weights_deterministic_and_finite(ckpt):
    cfg = ModelConfig.from_path(ckpt)
    a = get_model(cfg, load_format="dummy", dtype=torch.float32, device="cpu", seed=3)
    b = get_model(cfg, load_format="dummy", dtype=torch.float32, device="cpu", seed=3)
    c = get_model(cfg, load_format="dummy", dtype=torch.float32, device="cpu", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].dim() >= 2)
    for name, p in a.named_parameters():
        assert torch.isfinite(p).all(), name
        if p.dim() == 1 and "norm" in name and getattr(p, "dummy_init", None) is None:
            assert torch.all(p == 1), name
    logits = prefill_logits(make_runner(ckpt, load_format="dummy", random_seed=3))
    assert torch.isfinite(logits).all() and logits.abs().max() < 100


def test_dummy_default_rule():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(256, 400))
            self.post_norm = torch.nn.Parameter(torch.empty(8))
            self.bias = torch.nn.Parameter(torch.empty(8))
            self.custom = torch.nn.Parameter(torch.empty(4))
            self.custom.dummy_init = lambda t, g: t.fill_(7.0)

    m = M()
    init_dummy_weights(m, seed=0)
    assert abs(m.w.std().item() - 400 ** -0.5) < 0.1 * 400 ** -0.5
    assert torch.all(m.post_norm == 1) and torch.all(m.bias == 0) and torch.all(m.custom == 7)


def test_dummy_preset_reduced_width_stays_finite():
    """The real Ling-3.0-flash layout (12 layers: dense 0-1, MLA 5 and 11, 8 expert groups,
    real vocab) at reduced width: dummy weights keep every layer's activations finite."""
    overrides = {
        "num_hidden_layers": 12, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "num_experts": 32, "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 16,
        "intermediate_size": 64,
        # Exercise the late-layer SwiGLU clamps too (in the real model they start at layer 34).
        "expert_swiglu_limit_list": [0.0] * 8 + [4.0] * 4,
        "share_expert_swiglu_limit_list": [0.0] * 8 + [5.0] * 4,
    }
    runner = make_runner("ling-3.0-flash", overrides=overrides, load_format="dummy")
    cfg = runner.hf_config
    assert cfg.vocab_size == 157184 and cfg.full_attention_layer_ids == [5, 11]
    hidden = []
    hooks = [layer.register_forward_hook(lambda m, i, o: hidden.append(o))
             for layer in runner.model.model.layers]
    logits = prefill_logits(runner, [156891, 100, 2000, 50000, 7, 7, 7, 120000])
    for h in hooks:
        h.remove()
    assert len(hidden) == 12
    for i, out in enumerate(hidden):
        for t in (out if isinstance(out, tuple) else (out,)):
            if isinstance(t, torch.Tensor):
                assert torch.isfinite(t).all(), f"layer {i}"
                assert t.abs().max() < 1e4, f"layer {i}"
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.std().item() < 30, logits.std()


# --------------------------------------------------------------------------- runner pools
def test_runner_pools(ckpt):
    runner = make_runner(ckpt, draft_extra_mla_layers=True)
    cfg = runner.hf_config
    assert runner.max_total_num_tokens == 256
    assert runner.token_to_kv_pool.layer_ids == cfg.full_attention_layer_ids + [cfg.mtp_layer_id]
    assert runner.kda_state_pool.layer_ids == cfg.kda_layer_ids
    assert runner.req_to_token_pool.req_to_token.shape == (3, cfg.max_position_embeddings)
    # The sizing formulas agree with what the pools really allocate.
    assert kv_bytes_per_token(cfg, 3, torch.float32) == runner.token_to_kv_pool.bytes_per_token()
    assert kda_bytes_per_slot(cfg, len(cfg.kda_layer_ids), cfg.num_attention_heads,
                              torch.float32) == runner.kda_state_pool.bytes_per_slot()
    plain = make_runner(ckpt, context_length=128)
    assert plain.token_to_kv_pool.layer_ids == cfg.full_attention_layer_ids
    assert plain.req_to_token_pool.max_context_len == 128
    with pytest.raises(ValueError, match="context_length"):
        make_runner(ckpt, context_length=10 ** 6)


def test_real_preset_builds_on_target_device_only():
    """Every tensor of the full-size Ling-3.0-flash is allocated under the device context (checked
    on ``meta``: nothing is staged on the host), and the parameters hold exactly the elements
    of the checkpoint spec."""
    cfg = ModelConfig.from_path("ling-3.0-flash")
    for is_draft in (False, True):
        model = build_model(cfg, dtype=torch.bfloat16, device="meta", is_draft=is_draft)
        tensors = list(model.named_parameters()) + list(model.named_buffers())
        assert [n for n, t in tensors if t.device.type != "meta"] == []
        numel = sum(p.numel() for p in model.parameters())
        assert numel == sum(torch.Size(s).numel() for s in model.checkpoint_spec().values())
        assert numel > (100e9 if not is_draft else 2e9)


def test_draft_runner_shares_target_pools(ckpt):
    target = make_runner(ckpt, draft_extra_mla_layers=True)
    cfg = ModelConfig.from_path(ckpt)
    draft = draft_runner_on(target, cfg)
    assert draft.max_total_num_tokens == target.max_total_num_tokens

    req = target.req_to_token_pool.alloc(1)[0]
    target.kda_state_pool.clear_slots([req])
    ids = torch.tensor(PROMPT, dtype=torch.int64)
    loc = target.token_to_kv_pool_allocator.alloc(len(ids))
    target.req_to_token_pool.write(req, 0, loc)
    out = target.forward(ForwardBatch.for_extend(ids, [req], [0], [len(ids)], loc,
                                                 capture_hidden_mode=CaptureHiddenMode.FULL))
    nxt = out.next_token_logits.argmax(-1)
    # The MTP layer pairs token t+1 with the target's hidden state of token t.
    draft_ids = torch.cat([ids[1:], nxt])
    fb = ForwardBatch.for_extend(draft_ids, [req], [0], [len(ids)], loc,
                                 forward_mode=ForwardMode.DRAFT_EXTEND)
    d = draft.forward(fb, hidden_states=out.hidden_states)
    assert d.next_token_logits.shape == (1, cfg.vocab_size)
    assert torch.isfinite(d.next_token_logits).all()
    mtp_cache = target.token_to_kv_pool.get_kv_buffer(cfg.hf_config.mtp_layer_id)
    assert mtp_cache[loc].abs().sum(-1).gt(0).all()  # the draft wrote its KV into the shared pool
    with pytest.raises(ValueError, match="hidden_states"):
        draft.forward(fb)

    plain = make_runner(ckpt)
    with pytest.raises(ValueError, match="draft_extra_mla_layers"):
        ModelRunner(cfg, device="cpu", dtype=torch.float32, is_draft=True,
                    req_to_token_pool=plain.req_to_token_pool,
                    token_to_kv_pool_allocator=plain.token_to_kv_pool_allocator,
                    token_to_kv_pool=plain.token_to_kv_pool)


def test_kv_slots_from_memory():
    gib = 1 << 30
    kw = dict(total_bytes=100 * gib, fraction=0.5, req_map_bytes=gib, state_bytes=2 * gib,
              bytes_per_token=1024, free_bytes=60 * gib)
    # 50 GiB budget - 40 GiB weights - 3 GiB fixed = 7 GiB of 1 KiB tokens, minus the pad slot.
    assert kv_slots_from_memory(used_bytes=40 * gib, **kw) == 7 * gib // 1024 - 1
    assert kv_slots_from_memory(used_bytes=40 * gib, max_total_tokens=1000, **kw) == 1000
    with pytest.raises(ValueError, match="no memory is left for the KV cache"):
        kv_slots_from_memory(used_bytes=48 * gib, **kw)
    with pytest.raises(ValueError, match="free"):
        kv_slots_from_memory(used_bytes=10 * gib, **{**kw, "free_bytes": 5 * gib})


def test_request_slots_from_memory():
    gib, mib = 1 << 30, 1 << 20
    kw = dict(total_bytes=100 * gib, fraction=0.5, used_bytes=31 * gib, bytes_per_token=1024,
              min_kv_tokens=1 << 20, cap=10_000)
    # 19 GiB left: the states get 0.9 / 1.9 of it, ~9 GiB of 64 MiB slots, the pools' padding
    # slot among them.
    assert request_slots_from_memory(slot_bytes=64 * mib, **kw) == int(19 * gib * 0.9 / 1.9) // (
        64 * mib) - 1
    assert request_slots_from_memory(slot_bytes=64 * mib, **{**kw, "cap": 100}) == 100
    # The KV cache keeps room for one full-context request (18 GiB of 1 KiB tokens here, and the
    # KV pool's padding slot): under 1 GiB is left for 64 MiB slots plus a padding slot.
    assert request_slots_from_memory(slot_bytes=64 * mib,
                                     **{**kw, "min_kv_tokens": 18 * (1 << 20)}) == 14
    # Never fewer than one slot (the KV sizing then reports a budget too small), no state = cap.
    assert request_slots_from_memory(slot_bytes=64 * gib, **kw) == 1
    assert request_slots_from_memory(slot_bytes=0, **kw) == 10_000


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_runner_on_cuda_sizes_request_slots_from_memory(ckpt):
    cfg = ModelConfig.from_path(ckpt)
    runner = ModelRunner(cfg, device="cuda", dtype=torch.bfloat16, mem_fraction_static=0.5)
    # A tiny model: the cap, and a KV cache for every slot at the full context.
    assert runner.max_running_requests == AUTO_MAX_RUNNING_REQUESTS
    assert runner.req_to_token_pool.size == runner.kda_state_pool.size == AUTO_MAX_RUNNING_REQUESTS


@pytest.mark.gpu
def test_runner_on_cuda_sizes_pools_from_memory(ckpt):
    cfg = ModelConfig.from_path(ckpt)
    runner = ModelRunner(cfg, device="cuda", dtype=torch.bfloat16, mem_fraction_static=0.5,
                         max_total_tokens=4096, max_running_requests=2)
    assert runner.device == torch.device("cuda", 0)
    assert all(p.device == runner.device for p in runner.model.parameters())
    assert runner.max_total_num_tokens == 4096
    logits = prefill_logits(runner)
    assert logits.device == runner.device and torch.isfinite(logits).all()
    cpu = prefill_logits(make_runner(ckpt))
    # bf16 vs fp32: same greedy choice on most positions.
    assert (logits.cpu().argmax(-1) == cpu.argmax(-1)).float().mean() >= 0.7


@pytest.mark.gpu
@pytest.mark.slow
def test_real_width_12_layer_preset_dummy_on_cuda():
    """Ling-3.0-flash at real width, 12 layers (~60 GB bf16): built and filled on the GPU
    without staging weights in host memory; activations stay finite."""
    cfg = ModelConfig.from_path("ling-3.0-flash", {"num_hidden_layers": 12})
    runner = ModelRunner(cfg, device="cuda", dtype=torch.bfloat16, load_format="dummy",
                         mem_fraction_static=0.88, max_total_tokens=8192,
                         max_running_requests=2, context_length=4096)
    # ru_maxrss is in KiB on Linux: the host never held more than a few GB.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 16 * 1024 * 1024
    logits = prefill_logits(runner, list(range(1000, 1016)))
    assert torch.isfinite(logits).all() and 0.1 < logits.float().std().item() < 30


def test_cuda_kv_plan_is_capped_by_request_slots(monkeypatch, tmp_path):
    """On a big GPU a tiny model gets at most max_running_requests * context_len KV slots."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.model_runner import ModelRunner

    cfg = ModelConfig.from_path(write_random_checkpoint(str(tmp_path / "c"), tiny_config())).hf_config
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (140 << 30, 140 << 30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 << 20)
    fake = SimpleNamespace(hf_config=cfg, device=torch.device("cuda"), context_len=512,
                           max_running_requests=4, position_headroom=8, spec_num_draft_tokens=0,
                           dtype=torch.bfloat16, reserved_weight_bytes=0,
                           draft_bytes_per_kv_slot=0, draft_bytes_per_req_slot=0)
    plan = ModelRunner._plan_kv_tokens
    mla, kda = cfg.full_attention_layer_ids, cfg.kda_layer_ids
    assert plan(fake, mla, kda, cfg.num_attention_heads, None, 0.85) == 4 * (512 + 8)
    assert plan(fake, mla, kda, cfg.num_attention_heads, 1000, 0.85) == 1000
    # An explicit size is honoured past the default cap (it fits in memory here).
    assert plan(fake, mla, kda, cfg.num_attention_heads, 5000, 0.85) == 5000


def test_cuda_kv_plan_keeps_room_for_the_nextn_draft(monkeypatch):
    """The NEXTN draft's own weights load after the target's pools: the plan counts them as used
    (Ling-3.0-flash's MTP layer: ~5.7 GiB in bf16, from a meta-device build)."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.model_runner import ModelRunner

    flash = ModelConfig.from_path("ling-3.0-flash")
    draft = model_weight_bytes(flash, dtype=torch.bfloat16, is_draft=True)
    assert 5.5 * (1 << 30) < draft < 6 * (1 << 30)
    assert model_weight_bytes(flash, dtype=torch.bfloat16, is_draft=False) > 40 * draft
    cfg = flash.hf_config
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * gib, 100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 50 * gib)
    plan = ModelRunner._plan_kv_tokens
    mla, kda = cfg.full_attention_layer_ids, cfg.kda_layer_ids
    slots = {}
    for reserved in (0, draft):
        fake = SimpleNamespace(hf_config=cfg, device=torch.device("cuda"), context_len=1 << 20,
                               max_running_requests=4, position_headroom=8,
                               spec_num_draft_tokens=4, dtype=torch.bfloat16,
                               reserved_weight_bytes=reserved, draft_bytes_per_kv_slot=0,
                               draft_bytes_per_req_slot=0)
        slots[reserved] = plan(fake, mla, kda, cfg.num_attention_heads, None, 0.8)
    per_token = kv_bytes_per_token(cfg, len(mla), torch.bfloat16)
    assert slots[0] - slots[draft] in range(draft // per_token - 1, draft // per_token + 2)


def test_cuda_kv_plan_reserves_a_draft_store_per_kv_slot(monkeypatch, tmp_path):
    """A DSpark draft's context store (elements per target KV slot) shrinks the KV plan."""
    from types import SimpleNamespace

    cfg = ModelConfig.from_path(write_random_checkpoint(str(tmp_path / "c"), tiny_config())).hf_config
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 1 << 30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 << 20)
    mla, kda = cfg.full_attention_layer_ids, cfg.kda_layer_ids
    slots = []
    for extra in (0, 4096):
        fake = SimpleNamespace(hf_config=cfg, device=torch.device("cuda"), context_len=1 << 20,
                               max_running_requests=4, position_headroom=8,
                               spec_num_draft_tokens=4, dtype=torch.bfloat16,
                               reserved_weight_bytes=0, draft_bytes_per_kv_slot=extra,
                               draft_bytes_per_req_slot=0)
        slots.append(ModelRunner._plan_kv_tokens(fake, mla, kda, cfg.num_attention_heads,
                                                 None, 0.85))
    assert slots[1] < slots[0]
