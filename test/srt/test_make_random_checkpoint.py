"""scripts/make_random_checkpoint.py: random checkpoints in the published layout load in the
engine (fp32 and block fp8, target and MTP draft), the Flash preset's tensor list matches
docs/model.md §2, and the command line refuses bad arguments with a message naming the problem.

CPU only; the whole module takes about 30 s.
"""
from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from types import ModuleType
from typing import Dict, List, Set, Tuple

import pytest
import torch
from safetensors import safe_open

from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.srt.layers.quantization.fp8_utils import FP8_DTYPE
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_loader import SafetensorsCheckpoint, build_model, match_checkpoint
from sglang.test.runner_utils import draft_runner_on, greedy_logits
from sglang.test.script_loader import load_script

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO_ROOT, "scripts", "make_random_checkpoint.py")
TINY = str(BUNDLED_MODEL_DIR)
PROMPT = [3, 141, 59, 265, 358, 97, 93, 238, 46, 264]
SCALE = "_scale_inv"
# Flash with its real per-tensor widths (hidden 2560, 32 heads, MLA 512/128/64/128, experts of
# 768) but 2 layers (one KDA, one MLA), 8 experts and a 2048-token vocabulary: small enough to
# write, load and run on a CPU in seconds.
NARROW_FLASH = {"num_hidden_layers": 2, "layer_group_size": 2, "first_k_dense_replace": 1,
                "num_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
                "vocab_size": 2048}


def _load_script() -> ModuleType:
    return load_script(SCRIPT)


TOOL = _load_script()


def _make(out: str, *args: str) -> str:
    assert TOOL.main([out, *args]) == 0
    return out


def _headers(path: str) -> Dict[str, List[str]]:
    """Shard file -> the tensor names its safetensors header lists."""
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as h:
                out[f] = list(h.keys())
    return out


def _tensor(path: str, name: str) -> torch.Tensor:
    with open(os.path.join(path, TOOL.INDEX_NAME)) as f:
        shard = json.load(f)["weight_map"][name]
    with safe_open(os.path.join(path, shard), framework="pt") as h:
        return h.get_tensor(name)


def _check_index(path: str) -> Tuple[Dict[str, str], int]:
    """The index names exactly the tensors of the shards, each in its shard, and its total_size
    is their data size; returns the weight map and the shard count."""
    with open(os.path.join(path, TOOL.INDEX_NAME)) as f:
        index = json.load(f)
    headers = _headers(path)
    where = {name: f for f, names in headers.items() for name in names}
    assert sum(len(v) for v in headers.values()) == len(where)  # no name in two shards
    assert index["weight_map"] == where
    total = 0
    for f, names in headers.items():
        with safe_open(os.path.join(path, f), framework="pt") as h:
            for n in names:
                t = h.get_slice(n)
                size = {"F32": 4, "BF16": 2, "F8_E4M3": 1}[t.get_dtype()]
                total += size * math.prod(t.get_shape())
    assert index["metadata"]["total_size"] == total
    n = len(headers)
    assert sorted(headers) == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    return index["weight_map"], n


def _check_engine_consumes_everything(path: str) -> None:
    """Target and draft (when the config has an MTP layer) built from the folder's config: the
    loader matches every tensor each expects (no missing, unexpected or mis-shaped name:
    match_checkpoint raises on any), and together they consume every stored tensor, the scale
    of an fp8 tensor the engine keeps unquantized (MLA's kv_b_proj) being folded into it."""
    cfg = ModelConfig.from_path(path)
    quantized = cfg.quantization_config is not None
    consumed: Set[str] = set()
    has_mtp = cfg.hf_config.num_nextn_predict_layers > 0
    for is_draft in (False, True) if has_mtp else (False,):
        model = build_model(cfg, dtype=torch.float32, device="meta", is_draft=is_draft)
        with SafetensorsCheckpoint(path) as ckpt:
            matched = [n for n, _ in match_checkpoint(model, ckpt, quantized)]
        assert sorted(matched) == sorted(model.checkpoint_spec())
        consumed |= set(matched)
    stored = {n for names in _headers(path).values() for n in names}
    folded = {n + SCALE for n in consumed if n + SCALE in stored and n + SCALE not in consumed}
    assert stored == consumed | folded
    assert all(n.endswith("kv_b_proj.weight" + SCALE) for n in folded)


def _runners(path: str) -> Tuple[ModelRunner, ModelRunner]:
    cfg = ModelConfig.from_path(path)
    target = ModelRunner(cfg, device="cpu", dtype=torch.float32, max_running_requests=2,
                         max_total_tokens=128, draft_extra_mla_layers=True)
    return target, draft_runner_on(target, cfg)


@torch.no_grad()
def _check_forwards(target: ModelRunner, draft: ModelRunner, ids: List[int]) -> None:
    """Greedy prefill + decode of the target, then one MTP draft extend: finite, non-constant."""
    prefill, decode = greedy_logits(target, ids, 3)
    vocab = target.model_config.vocab_size
    assert prefill.shape == (len(ids), vocab) and decode.shape == (3, vocab)
    assert torch.isfinite(prefill).all() and torch.isfinite(decode).all()
    assert prefill.std() > 0.1
    target.req_to_token_pool.clear()
    target.token_to_kv_pool_allocator.clear()
    req = target.req_to_token_pool.alloc(1)[0]
    target.kda_state_pool.clear_slots([req])
    x = torch.tensor(ids, dtype=torch.int64)
    loc = target.token_to_kv_pool_allocator.alloc(len(ids))
    target.req_to_token_pool.write(req, 0, loc)
    out = target.forward(ForwardBatch.for_extend(x, [req], [0], [len(ids)], loc,
                                                 capture_hidden_mode=CaptureHiddenMode.FULL))
    draft_ids = torch.cat([x[1:], out.next_token_logits.argmax(-1)])
    fb = ForwardBatch.for_extend(draft_ids, [req], [0], [len(ids)], loc,
                                 forward_mode=ForwardMode.DRAFT_EXTEND)
    d = draft.forward(fb, hidden_states=out.hidden_states)
    assert d.next_token_logits.shape == (1, vocab)
    assert torch.isfinite(d.next_token_logits).all()


# --------------------------------------------------------------------------- fp32, tiny model
@pytest.fixture(scope="module")
def fp32_ckpt(tmp_path_factory) -> str:
    return _make(str(tmp_path_factory.mktemp("fp32") / "ckpt"), "--model-path", TINY,
                 "--dtype", "float32", "--shard-size-gb", "0.02", "--seed", "3")


def test_fp32_checkpoint_layout(fp32_ckpt, capsys):
    weight_map, shards = _check_index(fp32_ckpt)
    assert shards >= 2
    files = set(os.listdir(fp32_ckpt))
    assert {"config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= files
    raw = json.load(open(os.path.join(fp32_ckpt, "config.json")))
    src = json.load(open(os.path.join(TINY, "config.json")))
    assert raw["torch_dtype"] == raw["dtype"] == "float32"
    assert "quantization_config" not in raw
    assert {k: v for k, v in raw.items() if k not in ("torch_dtype", "dtype")} == \
        {k: v for k, v in src.items() if k != "torch_dtype"}
    # The MTP layer is in the same files, under model.layers.<num_hidden_layers>.
    mtp = f"model.layers.{src['num_hidden_layers']}."
    assert f"{mtp}eh_proj.weight" in weight_map and f"{mtp}final_layernorm.weight" in weight_map
    # fp32 vectors the engine holds in fp32 stay fp32; all else is the chosen dtype.
    assert _tensor(fp32_ckpt, "model.layers.1.mlp.gate.expert_bias").dtype == torch.float32
    _check_engine_consumes_everything(fp32_ckpt)


def test_fp32_checkpoint_loads_and_runs(fp32_ckpt):
    target, draft = _runners(fp32_ckpt)
    m = target.model
    assert torch.equal(m.model.word_embeddings.weight,
                       _tensor(fp32_ckpt, "model.word_embeddings.weight"))
    assert torch.equal(m.lm_head.weight, _tensor(fp32_ckpt, "lm_head.weight"))
    experts = m.model.layers[1].mlp.experts
    i = experts.intermediate_size
    p = "model.layers.1.mlp.experts.5."
    assert torch.equal(experts.w13_weight[5, :i], _tensor(fp32_ckpt, p + "gate_proj.weight"))
    assert torch.equal(experts.w13_weight[5, i:], _tensor(fp32_ckpt, p + "up_proj.weight"))
    assert torch.equal(experts.w2_weight[5], _tensor(fp32_ckpt, p + "down_proj.weight"))
    attn = m.model.layers[0].attention
    assert torch.equal(attn.A_log, _tensor(fp32_ckpt, "model.layers.0.attention.A_log"))
    assert torch.equal(draft.model.model.eh_proj.weight,
                       _tensor(fp32_ckpt, "model.layers.6.eh_proj.weight"))
    # Values as the dummy loader draws them: unit norms, N(0, 1/in) matrices.
    assert torch.equal(m.model.norm.weight, torch.ones_like(m.model.norm.weight))
    w = _tensor(fp32_ckpt, "model.layers.0.attention.o_proj.weight")
    assert abs(w.std().item() * w.shape[1] ** 0.5 - 1) < 0.05
    _check_forwards(target, draft, PROMPT)


def test_values_do_not_depend_on_sharding(fp32_ckpt, tmp_path):
    """Each tensor is seeded by its name: other shard sizes give the same tensors, another seed
    other values."""
    one = _make(str(tmp_path / "one"), "--model-path", TINY, "--dtype", "float32", "--seed", "3",
                "--no-tokenizer")
    assert _check_index(one)[1] == 1
    assert not any(f.startswith("tokenizer") for f in os.listdir(one))
    names = ["model.word_embeddings.weight", "model.layers.3.mlp.experts.0.down_proj.weight",
             "model.layers.6.mlp.gate.weight"]
    for n in names:
        assert torch.equal(_tensor(one, n), _tensor(fp32_ckpt, n))
    other = _make(str(tmp_path / "other"), "--model-path", TINY, "--dtype", "float32",
                  "--seed", "4", "--no-tokenizer")
    assert not torch.equal(_tensor(other, names[0]), _tensor(fp32_ckpt, names[0]))


def test_shards_are_streamed(tmp_path, monkeypatch):
    """Each tensor is in its file before the next one is drawn, so host memory holds one tensor
    at a time, not a shard."""
    out = str(tmp_path / "s")
    shard = os.path.join(out, "model-00001-of-00001.safetensors")
    seen: List[Tuple[int, int]] = []  # (file size when a unit is drawn, the unit's bytes)
    draw = TOOL.draw_unit

    def spy(unit, device, seed):
        seen.append((os.path.getsize(shard), unit.nbytes))
        return draw(unit, device, seed)

    monkeypatch.setattr(TOOL, "draw_unit", spy)
    _make(out, "--model-path", TINY, "--no-tokenizer")
    assert len(seen) > 100
    before = 0
    for size, nbytes in seen:
        # Everything drawn before is on disk, up to what Python's write buffer holds.
        assert size >= before - io.DEFAULT_BUFFER_SIZE
        before += nbytes


# --------------------------------------------------------------------------- block fp8
@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory) -> str:
    return _make(str(tmp_path_factory.mktemp("fp8") / "ckpt"), "--model-path", TINY,
                 "--dtype", "float32", "--quantization", "fp8", "--shard-size-gb", "0.01")


def test_fp8_checkpoint_layout(fp8_ckpt):
    weight_map, shards = _check_index(fp8_ckpt)
    assert shards >= 2
    raw = json.load(open(os.path.join(fp8_ckpt, "config.json")))
    assert raw["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3",
                                          "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    cfg = ModelConfig.from_path(fp8_ckpt)
    engine_fp8: Set[str] = set()
    for is_draft in (False, True):
        model = build_model(cfg, dtype=torch.float32, device="meta", is_draft=is_draft)
        engine_fp8 |= {n for n, s in model.weight_slots().items() if s.param.dtype == FP8_DTYPE}
    fp8_names: Set[str] = set()
    for name in weight_map:
        if name.endswith(SCALE):
            continue
        t = _tensor(fp8_ckpt, name)
        if t.dtype == FP8_DTYPE:
            fp8_names.add(name)
            s = _tensor(fp8_ckpt, name + SCALE)
            assert s.dtype == torch.float32
            assert tuple(s.shape) == (math.ceil(t.shape[0] / 128), math.ceil(t.shape[1] / 128))
            assert (s > 0).all()
        else:
            assert name + SCALE not in weight_map
            assert t.dtype == torch.float32
    # What the engine quantises, plus kv_b_proj (fp8 in published checkpoints; dequantised at
    # load because the engine splits it into w_kc / w_vc).
    kv_b = {n for n in weight_map if n.endswith("attention.kv_b_proj.weight")}
    assert kv_b and fp8_names == engine_fp8 | kv_b
    for kept in ("model.word_embeddings.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.1.mlp.gate.weight", "model.layers.0.attention.q_conv1d.weight",
                 "model.layers.6.enorm.weight"):
        assert kept in weight_map and kept not in fp8_names
    assert "model.layers.1.mlp.experts.0.up_proj.weight" in fp8_names
    assert "model.layers.6.eh_proj.weight" in fp8_names
    _check_engine_consumes_everything(fp8_ckpt)


def test_fp8_checkpoint_loads_and_runs(fp8_ckpt):
    target, draft = _runners(fp8_ckpt)
    assert target.model.quant_config.is_checkpoint_fp8_serialized
    assert draft.model.quant_config.is_checkpoint_fp8_serialized
    experts = target.model.model.layers[2].mlp.experts
    assert experts.w13_weight.dtype == FP8_DTYPE
    p = "model.layers.2.mlp.experts.7."
    i = experts.intermediate_size
    got = experts.w13_weight[7, i:].view(torch.uint8)
    assert torch.equal(got, _tensor(fp8_ckpt, p + "up_proj.weight").view(torch.uint8))
    scale = _tensor(fp8_ckpt, p + "up_proj.weight" + SCALE)
    rows = scale.shape[0]  # gate's block rows, then up's (one grid per piece)
    assert torch.equal(experts.w13_weight_scale_inv[7, rows:], scale)
    _check_forwards(target, draft, PROMPT)


# --------------------------------------------------------------------------- the Flash preset
def _flash_plan(fp8: bool) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """name -> (shape, stored dtype) of the full Flash checkpoint the tool would write."""
    raw = TOOL.output_config(TOOL.load_raw_config("ling-3.0-flash"), "bfloat16",
                             "fp8" if fp8 else None, False)
    return {t.name: (t.shape, t.dtype) for u in TOOL.plan_tensors(raw, "bfloat16", True)
            for t in u.tensors}


def test_flash_tensor_list_matches_the_engine_and_docs():
    """Full Flash (42 layers + MTP), written nowhere: the plan is the engine's checkpoint spec
    of target and draft, with the shapes of docs/model.md §2, and its size the parameter count
    of §7 (127.5 B with the MTP layer)."""
    flash = ModelConfig.from_path("ling-3.0-flash")
    want: Dict[str, Tuple[int, ...]] = {}
    for is_draft in (False, True):
        want.update(build_model(flash, dtype=torch.bfloat16, device="meta",
                                is_draft=is_draft).checkpoint_spec())
    plan = _flash_plan(fp8=False)
    assert {n: s for n, (s, _) in plan.items()} == want
    params = sum(math.prod(s) for s, _ in plan.values())
    assert 127.4e9 < params < 127.6e9
    docs = {  # docs/model.md §2.1-2.2
        "model.word_embeddings.weight": (157184, 2560),
        "lm_head.weight": (157184, 2560),
        "model.layers.0.attention.q_proj.weight": (4096, 2560),  # KDA
        "model.layers.0.attention.q_conv1d.weight": (4096, 1, 4),
        "model.layers.0.attention.b_proj.weight": (32, 2560),
        "model.layers.0.attention.A_log": (32,),
        "model.layers.0.attention.dt_bias": (4096,),
        "model.layers.0.attention.o_norm.weight": (128,),
        "model.layers.0.attention.o_proj.weight": (2560, 4096),
        "model.layers.0.mlp.gate_proj.weight": (6144, 2560),
        "model.layers.5.attention.q_proj.weight": (6144, 2560),  # MLA
        "model.layers.5.attention.kv_a_proj_with_mqa.weight": (576, 2560),
        "model.layers.5.attention.kv_b_proj.weight": (8192, 512),
        "model.layers.5.attention.g_proj.weight": (32, 2560),
        "model.layers.5.attention.dense.weight": (2560, 4096),
        "model.layers.2.mlp.gate.weight": (512, 2560),
        "model.layers.2.mlp.gate.expert_bias": (512,),
        "model.layers.41.mlp.experts.511.down_proj.weight": (2560, 768),
        "model.layers.41.mlp.shared_experts.up_proj.weight": (768, 2560),
        "model.layers.42.eh_proj.weight": (2560, 5120),
        "model.layers.42.enorm.weight": (2560,),
        "model.layers.42.final_layernorm.weight": (2560,),
        "model.layers.42.mlp.experts.0.gate_proj.weight": (768, 2560),
    }
    for name, shape in docs.items():
        assert plan[name][0] == shape, name
    assert not any(n.startswith("model.layers.43.") for n in plan)
    fp8 = _flash_plan(fp8=True)
    assert fp8["model.layers.41.mlp.experts.511.down_proj.weight"] == ((2560, 768),
                                                                        "float8_e4m3fn")
    assert fp8["model.layers.41.mlp.experts.511.down_proj.weight" + SCALE] == ((20, 6), "float32")
    assert fp8["model.layers.5.attention.kv_b_proj.weight" + SCALE] == ((64, 4), "float32")
    assert fp8["model.layers.0.attention.b_proj.weight" + SCALE] == ((1, 20), "float32")
    assert fp8["lm_head.weight"] == ((157184, 2560), "bfloat16")
    assert fp8["model.layers.2.mlp.gate.weight"] == ((512, 2560), "bfloat16")
    assert fp8["model.layers.2.mlp.gate.expert_bias"] == ((512,), "float32")
    # ~1 byte a parameter plus bf16 embeddings / LM head and fp32 scales: docs' 119.7 GiB with
    # the MTP layer (counted in memory, where kv_b_proj is bf16) to within 1 %.
    nbytes = sum(TOOL.StoredTensor(n, s, d).nbytes for n, (s, d) in fp8.items())
    assert abs(nbytes / 2 ** 30 - 119.7) < 1.2


@pytest.mark.slow  # a 2560-wide fp8 checkpoint written, loaded and run
def test_narrowed_flash_writes_loads_and_runs(tmp_path):
    out = _make(str(tmp_path / "flash"), "--json-model-override-args", json.dumps(NARROW_FLASH),
                "--quantization", "fp8", "--shard-size-gb", "0.1", "--no-tokenizer")
    _, shards = _check_index(out)
    assert shards >= 2
    raw = json.load(open(os.path.join(out, "config.json")))
    assert raw["hidden_size"] == 2560 and raw["torch_dtype"] == "bfloat16"
    assert _tensor(out, "model.layers.2.eh_proj.weight").shape == (2560, 5120)
    _check_engine_consumes_everything(out)
    target, draft = _runners(out)
    assert target.model_config.hf_config.layer_types == ["linear_attention", "full_attention"]
    _check_forwards(target, draft, [3, 5, 100, 2000, 7, 1500])


def test_no_mtp_writes_no_mtp_layer(tmp_path, capsys):
    out = _make(str(tmp_path / "nomtp"), "--model-path", TINY, "--no-mtp", "--no-tokenizer")
    weight_map, _ = _check_index(out)
    assert not any(n.startswith("model.layers.6.") for n in weight_map)
    assert json.load(open(os.path.join(out, "config.json")))["num_nextn_predict_layers"] == 0
    _check_engine_consumes_everything(out)
    printed = capsys.readouterr().out
    assert "without an MTP layer" in printed and "NEXTN" not in printed


def test_summary_and_dry_run(tmp_path, capsys):
    out = str(tmp_path / "dry")
    assert TOOL.main([out, "--model-path", TINY, "--dry-run"]) == 0
    assert not os.path.exists(out)
    printed = capsys.readouterr().out
    assert f"would write {out}: " in printed and "shard(s)" in printed
    assert f"python -m sglang.launch_server --model-path {out}" in printed
    assert "--speculative-algorithm NEXTN" in printed


def test_bundled_tokenizer_fits_the_flash_vocabulary():
    """--help's claim: the bundled tokenizer's ids are all below Flash's vocab_size."""
    n = TOOL.tokenizer_vocab_size(TINY)
    assert n == ModelConfig.from_path(TINY).vocab_size == 8192
    assert n <= ModelConfig.from_path("ling-3.0-flash").vocab_size
    help_text = TOOL.build_parser().format_help()
    assert "below Flash's vocab_size" in " ".join(help_text.split())


# --------------------------------------------------------------------------- CLI errors
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("case", ["non_empty", "unknown_model", "bad_json", "bad_override",
                                  "unknown_dtype", "big_tokenizer", "bad_shard_size"])
def test_cli_errors(case, tmp_path):
    out = str(tmp_path / "out")
    args = {
        "non_empty": [out],
        "unknown_model": [out, "--model-path", str(tmp_path / "no-such-model")],
        "bad_json": [out, "--json-model-override-args", "{num_hidden_layers: 4"],
        "bad_override": [out, "--json-model-override-args", '{"num_experts_per_tok": 1000}'],
        "unknown_dtype": [out, "--dtype", "float8"],
        "big_tokenizer": [out, "--model-path", TINY,
                          "--json-model-override-args", '{"vocab_size": 4096}'],
        "bad_shard_size": [out, "--shard-size-gb", "0"],
    }[case]
    if case == "non_empty":
        os.makedirs(out)
        open(os.path.join(out, "notes.txt"), "w").close()
    proc = _cli(*args)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("make_random_checkpoint.py: error: ")
    expected = {
        "non_empty": "exists and is not empty; pass --overwrite",
        "unknown_model": "no-such-model' is neither a folder with a config.json nor a preset",
        "bad_json": "--json-model-override-args is not valid JSON",
        "bad_override": "num_experts_per_tok must be <= num_experts",
        "unknown_dtype": "argument --dtype: invalid choice: 'float8'",
        "big_tokenizer": "has token ids up to 8191 but the config's vocab_size is 4096",
        "bad_shard_size": "--shard-size-gb must be positive",
    }[case]
    assert expected in err, err
    # Nothing was written (the non-empty folder keeps only its own file).
    if case == "non_empty":
        assert os.listdir(out) == ["notes.txt"]
    else:
        assert not os.path.exists(out)


def test_overwrite_replaces_old_shards(tmp_path):
    out = _make(str(tmp_path / "o"), "--model-path", TINY, "--shard-size-gb", "0.005",
                "--no-tokenizer")
    many = _check_index(out)[1]
    open(os.path.join(out, "notes.txt"), "w").close()
    _make(out, "--model-path", TINY, "--overwrite", "--no-tokenizer")
    assert many > 1 and _check_index(out)[1] == 1  # no stale shard of the first run is left
    assert "notes.txt" in os.listdir(out)
