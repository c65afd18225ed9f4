"""The Ling-3.0-flash DSpark draft preset (``--speculative-draft-model-path
ling-3.0-flash-dspark --load-format dummy``), on CPU.

* The preset parses against the ``ling-3.0-flash`` target preset with the published shape, and
  the draft built from it on the meta device (no memory) has the expected tensors and count.
* Resolution and refusals: the preset is a draft (never a ``--model-path``), it loads only with
  dummy weights (the refusal names ``--load-format dummy``), and the target preset with DSPARK and
  no draft says to use it.
* Shrunk end to end: the bundled target with a dummy draft from a preset-like config (the
  Flash preset's fields, widths shrunk to the bundled model), found by preset name through
  the scheduler, greedy DSPARK == greedy plain decoding with the same dummy weights; once as
  loaded (nearly every draft rejected) and once with test_dspark_worker's oracle Markov head
  (most drafts accepted: multi-token commits).
"""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest
import torch

from engine_test_utils import make_scheduler, sampling, submit_staggered, take_token_ids
from sglang.srt.configs import model_config as mc
from sglang.srt.configs.bailing_moe_v3 import ConfigError
from sglang.srt.configs.dspark import (
    DSparkDraftConfig,
    dspark_preset_for_target,
    find_dspark_draft,
    is_dspark_preset,
    list_dspark_presets,
)
from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig, list_presets
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.models.dspark import DSparkDraftModel, load_dspark_draft
from sglang.srt.rounds.dspark.worker import DSparkWorker
from sglang.srt.server_args import ServerArgs
from test_dspark_worker import install_oracle

PRESET = "ling-3.0-flash-dspark"
TARGET_PRESET = "ling-3.0-flash"
HIDDEN, VOCAB, LAYERS, HEADS, HEAD_DIM, MLP, RANK = 2560, 157184, 5, 32, 128, 6144, 256

pytestmark = pytest.mark.usefixtures("two_torch_threads")


@pytest.fixture(scope="module")
def flash() -> ModelConfig:
    return ModelConfig.from_path(TARGET_PRESET)


# ------------------------------------------------------------------------------- the preset
def test_preset_parses_against_the_flash_target_with_the_published_shape(flash):
    assert is_dspark_preset(PRESET) and PRESET in list_dspark_presets()
    path = find_dspark_draft(flash.model_path, PRESET)
    assert path == PRESET
    cfg = DSparkDraftConfig.from_path(path, flash.hf_config)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.intermediate_size, cfg.markov_rank) == (HIDDEN, LAYERS, HEADS, MLP, RANK)
    assert cfg.hidden_size == flash.hf_config.hidden_size
    assert cfg.vocab_size == flash.hf_config.vocab_size == VOCAB
    assert (cfg.num_key_value_heads, cfg.head_dim) == (HEADS, HEAD_DIM)
    assert cfg.target_layer_ids == [1, 11, 23, 29, 35]
    assert cfg.gamma == 15  # published "block 16": anchor + 15 drafts, a verify window of 16
    assert cfg.enable_confidence_head and cfg.confidence_head_with_markov
    assert cfg.markov_head_type == "vanilla" and 0 <= cfg.mask_token_id < VOCAB
    assert DSparkDraftConfig.from_path(path, flash.hf_config, block_size=7).gamma == 7


def _expected_shapes() -> Dict[str, tuple]:
    """Every tensor of the published layout at the preset's shape."""
    q, kv = HEADS * HEAD_DIM, HEADS * HEAD_DIM
    out: Dict[str, tuple] = {}
    for i in range(LAYERS):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (HIDDEN,),
                    p + "post_attention_layernorm.weight": (HIDDEN,),
                    p + "self_attn.q_proj.weight": (q, HIDDEN),
                    p + "self_attn.k_proj.weight": (kv, HIDDEN),
                    p + "self_attn.v_proj.weight": (kv, HIDDEN),
                    p + "self_attn.o_proj.weight": (HIDDEN, q),
                    p + "self_attn.q_norm.weight": (HEAD_DIM,),
                    p + "self_attn.k_norm.weight": (HEAD_DIM,),
                    p + "mlp.gate_proj.weight": (MLP, HIDDEN),
                    p + "mlp.up_proj.weight": (MLP, HIDDEN),
                    p + "mlp.down_proj.weight": (HIDDEN, MLP)})
    out.update({"norm.weight": (HIDDEN,), "fc.weight": (HIDDEN, 5 * HIDDEN),
                "hidden_norm.weight": (HIDDEN,),
                "markov_head.markov_w1.weight": (VOCAB, RANK),
                "markov_head.markov_w2.weight": (VOCAB, RANK),
                "confidence_head.proj.weight": (1, HIDDEN + RANK),
                "confidence_head.proj.bias": (1,)})
    return out


def test_meta_build_has_the_expected_tensors_and_count(flash):
    cfg = DSparkDraftConfig.from_path(PRESET, flash.hf_config)
    with torch.device("meta"):
        model = DSparkDraftModel(cfg, dtype=torch.bfloat16)
    got = {name: tuple(p.shape) for name, p in model.named_parameters()}
    want = _expected_shapes()
    assert got == want
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(torch.Size(s).numel() for s in want.values())
    # Per layer 4 x 2560 x 4096 attention + 3 x 2560 x 6144 SwiGLU; plus fc, the Markov pair.
    assert 550e6 < count < 570e6, count
    assert all(p.device.type == "meta" for p in model.parameters())
    # The server's memory plan counts the same weights (block 7: a verify window of 8).
    req = DSparkWorker.requirements(
        SimpleNamespace(speculative_draft_model_path=PRESET, speculative_dspark_block_size=7),
        flash)
    assert req.draft_weight_elems == count and req.kda_scratch_depth == 8
    assert req.draft_elems_per_kv_slot == 2 * LAYERS * HEADS * HEAD_DIM


# ------------------------------------------------------------------------------- refusals
def test_preset_needs_dummy_weights(flash):
    with pytest.raises(ValueError, match="--load-format dummy") as info:
        ServerArgs(model_path=TARGET_PRESET, load_format="auto", device="cpu",
                   speculative_algorithm="DSPARK", speculative_draft_model_path=PRESET)
    assert PRESET in str(info.value)
    with pytest.raises(ValueError, match="--load-format dummy"):
        load_dspark_draft(PRESET, flash.hf_config, dtype=torch.float32, device="meta",
                          load_format="auto")
    # With dummy weights the arguments are accepted.
    args = ServerArgs(model_path=TARGET_PRESET, load_format="dummy", device="cpu",
                      speculative_algorithm="DSPARK", speculative_draft_model_path=PRESET)
    assert args.speculative_draft_model_path == PRESET


def test_target_preset_without_a_draft_points_at_the_draft_preset():
    assert dspark_preset_for_target(TARGET_PRESET) == PRESET
    with pytest.raises(ValueError, match=f"--speculative-draft-model-path {PRESET}"):
        ServerArgs(model_path=TARGET_PRESET, load_format="dummy", device="cpu",
                   speculative_algorithm="DSPARK")


def test_draft_preset_is_not_a_target():
    assert PRESET not in list_presets() and TARGET_PRESET in list_presets()
    with pytest.raises(ConfigError, match="--speculative-draft-model-path"):
        ModelConfig.from_path(PRESET)
    with pytest.raises(ConfigError, match="is not a folder"):
        find_dspark_draft(None, "no-such-draft-preset")


# ------------------------------------------------------------------------------- shrunk e2e
SHRUNK = "tiny-flash-dspark"
GEN = 20


def shrunk_preset(target: Dict[str, Any]) -> Dict[str, Any]:
    """The Flash draft preset's fields with the widths of ``target`` (the bundled model) and
    the rest shrunk to run in seconds: same layout, KV heads = heads as in the preset, Markov
    head (rank 64: room for the oracle's token pairs) and confidence head on."""
    with open(mc.PRESET_DIR / f"{PRESET}.json") as f:
        raw = json.load(f)
    layers = int(target["num_hidden_layers"])
    raw.update(hidden_size=target["hidden_size"], vocab_size=target["vocab_size"],
               num_hidden_layers=2, layer_types=["full_attention"] * 2, num_attention_heads=4,
               num_key_value_heads=4, head_dim=16, intermediate_size=96, markov_rank=64,
               block_size=7, num_target_layers=layers, target_layer_ids=[1, layers - 3],
               mask_token_id=target["vocab_size"] - 1,
               max_position_embeddings=target["max_position_embeddings"])
    return raw


@pytest.fixture
def presets(tmp_path, monkeypatch):
    """A presets folder holding the shrunk draft preset (besides the shipped ones)."""
    with open(BUNDLED_MODEL_DIR / "config.json") as f:
        target = json.load(f)
    for p in mc.PRESET_DIR.glob("*.json"):
        (tmp_path / p.name).write_text(p.read_text())
    (tmp_path / f"{SHRUNK}.json").write_text(json.dumps(shrunk_preset(target)))
    monkeypatch.setattr(mc, "PRESET_DIR", tmp_path)
    return tmp_path


def _greedy_ids(sched, prompts: List[List[int]], vocab: int) -> Dict[str, List[int]]:
    reqs = [TokenizedGenerateReqInput(f"r{i}", None, list(p),
                                      sampling(vocab, max_new_tokens=GEN, temperature=0,
                                               ignore_eos=True))
            for i, p in enumerate(prompts)]
    submit_staggered(sched, reqs, stagger=2)
    return take_token_ids(sched)


def test_shrunk_preset_draft_is_lossless_through_the_scheduler(presets):
    """Bundled target, dummy weights for both (the target's initialiser), the draft found by
    its preset name: greedy DSPARK == greedy plain at batch 1 and at batch 2 staggered."""
    kw = dict(load_format="dummy", max_total_tokens=2048, max_running_requests=4)
    plain = make_scheduler(str(BUNDLED_MODEL_DIR), **kw)
    vocab = plain.vocab_size
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (24, 17)]
    ref = _greedy_ids(plain, prompts, vocab)
    spec = make_scheduler(str(BUNDLED_MODEL_DIR), speculative_algorithm="DSPARK",
                          speculative_draft_model_path=SHRUNK, **kw)
    worker = spec.draft_worker
    assert worker.setup.draft_path == SHRUNK and worker.gamma == 7
    assert worker.draft.config.num_key_value_heads == worker.draft.config.num_attention_heads
    assert _greedy_ids(spec, prompts[:1], vocab) == {"r0": ref["r0"]}
    assert _greedy_ids(spec, prompts, vocab) == ref
    assert all(len(v) == GEN for v in ref.values())
    assert spec.get_internal_state()["avg_spec_accept_length"] >= 1.0
    # The dummy draft accepts next to nothing; the oracle Markov head makes rounds commit
    # several tokens, so windows of every accept length are committed and written as context.
    install_oracle(worker, [p[-1:] + ref[f"r{i}"] for i, p in enumerate(prompts)])
    spec.flush_cache()
    assert _greedy_ids(spec, prompts, vocab) == ref
    assert spec.get_internal_state()["avg_spec_accept_length"] > 2.0
