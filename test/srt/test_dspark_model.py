"""The DSpark draft model (models/dspark.py) against the plain reference
(train/reference_dspark.py): cached fixed-shape backbone, Markov loop (greedy and sampled),
confidence head; the context cache; config parsing and refusals (configs/dspark.py); checkpoint
loading in the published layouts and its errors."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_test_utils import refuse_host_reads
from sglang.srt.configs.bailing_moe_v3 import BailingMoeV3Config, ConfigError
from sglang.srt.configs.dspark import (
    DSparkDraftConfig,
    default_target_layer_ids,
    find_dspark_draft,
)
from sglang.srt.mem_cache.dspark_context_cache import DSparkContextCache
from sglang.srt.model_loader import CheckpointError
from sglang.srt.models.dspark import (
    DSparkDraftModel,
    LingDSparkModel,
    Qwen3DSparkModel,
    load_dspark_draft,
)
from sglang.srt.models.registry import get_model_class
from sglang.test.random_checkpoint import tiny_config
from sglang.test.random_dspark_checkpoint import (
    bundled_target_config,
    randomize_for_tests,
    tiny_dspark_config,
    write_random_dspark_checkpoint,
)
from sglang.train.reference_dspark import ReferenceDSparkDraft

TARGET_RAW = tiny_config()  # hidden 64, vocab 512, 6 layers
TARGET = BailingMoeV3Config.from_dict(TARGET_RAW)
ATOL = 2e-5


def draft_raw(**overrides):
    return tiny_dspark_config(TARGET_RAW, **overrides)


def shared_tensors(seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    v, d = TARGET.vocab_size, TARGET.hidden_size
    return torch.randn(v, d, generator=gen), torch.randn(v, d, generator=gen) * d ** -0.5


@pytest.fixture(scope="module")
def pair():
    """(reference, serving model) with the same random weights and shared embed / head."""
    raw = draft_raw()
    ref = ReferenceDSparkDraft(raw, seed=0)
    randomize_for_tests(ref, 0)
    model = DSparkDraftModel(DSparkDraftConfig.from_dict(raw, TARGET), dtype=torch.float32)
    model.load_weights(ref.state_dict().items())
    embed, head = shared_tensors()
    model.set_embed_and_head(embed, head)
    return ref.eval(), model.eval(), embed, head


# Requests: (slot, ctx_len, anchor id); one batch row is padding (slot -1, ctx_len 0).
REQUESTS = [(2, 5, 17), (0, 9, 301), (1, 1, 4)]


def build_cache(model, feats, num_slots=3, max_context=16, stale_slot=2):
    """Write each request's context in two chunks (prefill, then a round), interleaved with
    padding rows, plus stale rows past a request's ctx_len (e.g. a former occupant's)."""
    cache = model.new_context_cache(num_slots, max_context)
    m_d = model.config.context_input_size
    gen = torch.Generator().manual_seed(11)
    stale = torch.randn(3, m_d, generator=gen) * 5
    ctx_len = {s: n for s, n, _ in REQUESTS}
    model.write_context(stale, torch.arange(3) + ctx_len[stale_slot],
                        torch.full((3,), stale_slot), cache)
    for part in (0, 1):
        rows, pos, slots = [], [], []
        for slot, n, _ in REQUESTS:
            cut = n // 2 if n > 1 else 0
            lo, hi = (0, cut) if part == 0 else (cut, n)
            rows.append(feats[slot][lo:hi])
            pos.append(torch.arange(lo, hi))
            slots.append(torch.full((hi - lo,), slot))
            rows.append(torch.randn(2, m_d, generator=gen))  # padding rows
            pos.append(torch.tensor([0, 7]))
            slots.append(torch.tensor([-1, -1]))
        model.write_context(torch.cat(rows), torch.cat(pos), torch.cat(slots), cache)
    return cache


def batch_inputs():
    slots = torch.tensor([s for s, _, _ in REQUESTS] + [-1])
    ctx = torch.tensor([n for _, n, _ in REQUESTS] + [0])
    anchors = torch.tensor([a for _, _, a in REQUESTS] + [0])
    return anchors, ctx.clone(), slots, ctx


def make_feats(model, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return {s: torch.randn(n, model.config.context_input_size, generator=gen)
            for s, n, _ in REQUESTS}


# --------------------------------------------------------------------------- backbone
def test_cached_block_matches_reference(pair):
    ref, model, embed, head = pair
    feats = make_feats(model)
    cache = build_cache(model, feats)
    anchors, pos, slots, ctx = batch_inputs()
    with torch.no_grad():
        h, logits = model.forward_block(anchors, pos, cache, slots, ctx, ctx_width=12)
        g = model.gamma
        assert h.shape == (4, g, TARGET.hidden_size) and logits.shape == (4, g, TARGET.vocab_size)
        for b, (slot, n, anchor) in enumerate(REQUESTS):
            rh, rl = ref.draft_block(feats[slot], anchor, n, embed, head)
            torch.testing.assert_close(h[b], rh, atol=ATOL, rtol=0)
            torch.testing.assert_close(logits[b], rl, atol=ATOL, rtol=0)
        assert torch.isfinite(h[3]).all() and torch.isfinite(logits[3]).all()
        # The padding row does not disturb the others, and the full width gives the same result.
        h_full, _ = model.forward_block(anchors[:3], pos[:3], cache, slots[:3], ctx[:3])
        torch.testing.assert_close(h_full, h[:3], atol=ATOL, rtol=0)


def test_block_is_non_causal_and_anchor_slot_predicts(pair):
    _, model, _, _ = pair
    cache = build_cache(model, make_feats(model))
    anchors, pos, slots, ctx = batch_inputs()
    with torch.no_grad():
        h, logits = model.forward_block(anchors, pos, cache, slots, ctx)
        # The anchor's slot is a prediction slot: gamma logits rows, row 0 from the anchor.
        assert logits.shape[1] == model.gamma
        other = anchors.clone()
        other[0] = 99
        h2, logits2 = model.forward_block(other, pos, cache, slots, ctx)
        assert not torch.allclose(logits2[0, 0], logits[0, 0])
        torch.testing.assert_close(h2[1:], h[1:])
        # Changing the later slots' input (the mask token) changes slot 0's output.
        saved = model.config.mask_token_id
        try:
            model.config.mask_token_id = 7
            h3, _ = model.forward_block(anchors, pos, cache, slots, ctx)
        finally:
            model.config.mask_token_id = saved
        assert (h3[:3, 0] - h[:3, 0]).abs().max() > 1e-3


def test_context_rows_past_ctx_len_are_masked(pair):
    _, model, _, _ = pair
    feats = make_feats(model)
    clean = build_cache(model, feats, stale_slot=1)
    dirty = build_cache(model, feats, stale_slot=2)
    anchors, pos, slots, ctx = batch_inputs()
    with torch.no_grad():
        a, _ = model.forward_block(anchors, pos, clean, slots, ctx)
        b, _ = model.forward_block(anchors, pos, dirty, slots, ctx)
        torch.testing.assert_close(a, b)
        # ...whereas seeing one more row (the stale one) changes the output.
        c, _ = model.forward_block(anchors, pos, dirty, slots, ctx + torch.tensor([1, 0, 0, 0]))
        assert (c[0] - b[0]).abs().max() > 1e-4


def test_forward_paths_never_read_device_values(pair, monkeypatch):
    _, model, _, _ = pair
    calls = []
    for name in ("write_context", "propose"):
        refuse_host_reads(monkeypatch, model, name, calls)
    feats = make_feats(model)
    cache = build_cache(model, feats)
    anchors, pos, slots, ctx = batch_inputs()
    with torch.no_grad():
        model.propose(anchors, pos, cache, slots, ctx, ctx_width=12,
                      temperatures=torch.tensor([0.0, 0.7, 1.0, 1.0]))
        model.propose(anchors, pos, cache, slots, ctx)
    assert len(calls) == 3 + 2  # build_cache writes three times (stale rows, two chunks)


# --------------------------------------------------------------------------- Markov head
def test_markov_greedy_is_argmax_of_corrected_logits(pair):
    ref, model, embed, head = pair
    feats = make_feats(model)
    cache = build_cache(model, feats)
    anchors, pos, slots, ctx = batch_inputs()
    with torch.no_grad():
        _, base = model.forward_block(anchors, pos, cache, slots, ctx)
        draft = model.markov_draft(base, anchors)
        assert draft.probs is None and draft.tokens.shape == (4, model.gamma)
        torch.testing.assert_close(draft.tokens, draft.logits.argmax(-1))
        torch.testing.assert_close(draft.logits, base + ref.markov_bias(draft.prev_tokens),
                                   atol=ATOL, rtol=0)
        assert (draft.logits.argmax(-1) != base.argmax(-1)).any()  # the bias matters
        for b, (slot, n, anchor) in enumerate(REQUESTS):
            _, rl = ref.draft_block(feats[slot], anchor, n, embed, head)
            tokens, rows = ref.markov_greedy(rl, anchor)
            torch.testing.assert_close(draft.tokens[b], tokens)
            torch.testing.assert_close(draft.logits[b], rows, atol=ATOL, rtol=0)


def test_markov_sampling_draws_from_tempered_corrected_softmax(pair):
    _, model, _, _ = pair
    n, g, t = 2048, model.gamma, 0.8
    gen = torch.Generator().manual_seed(2)
    base = (torch.randn(1, g, TARGET.vocab_size, generator=gen) * 2).expand(n, g, -1)
    anchors = torch.full((n,), 42)
    # A regular grid of uniforms at slot 0: token frequencies equal the probabilities within 1/n.
    u = torch.rand(n, g, generator=gen)
    u[:, 0] = (torch.arange(n) + 0.5) / n
    with torch.no_grad():
        draft = model.markov_draft(base, anchors, temperatures=torch.full((n,), t), uniforms=u)
        expected0 = torch.softmax((base[0, 0] + model.markov_bias(anchors[:1])[0]) / t, -1)
        freq = torch.bincount(draft.tokens[:, 0], minlength=TARGET.vocab_size).float() / n
        assert (freq - expected0).abs().max() <= 1.0 / n + 1e-6
        # Every later slot uses the token sampled before it, and q is that slot's softmax.
        torch.testing.assert_close(draft.logits, base + model.markov_bias(draft.prev_tokens))
        torch.testing.assert_close(draft.probs, torch.softmax(draft.logits / t, -1))
        # Inverse CDF with the given uniforms at every slot.
        cdf = draft.probs.cumsum(-1)
        lower = torch.where(draft.tokens > 0, cdf.gather(-1, (draft.tokens - 1).clamp(min=0)
                                                         .unsqueeze(-1)).squeeze(-1), 0.0)
        upper = cdf.gather(-1, draft.tokens.unsqueeze(-1)).squeeze(-1)
        assert ((lower <= u + 1e-6) & (u <= upper + 1e-6)).all()


def test_markov_sampling_generator_and_greedy_rows(pair):
    _, model, _, _ = pair
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(3, model.gamma, TARGET.vocab_size, generator=gen)
    anchors = torch.tensor([1, 2, 3])
    temps = torch.tensor([0.0, 1.0, 1.5])
    with torch.no_grad():
        a = model.markov_draft(base, anchors, temps, generator=torch.Generator().manual_seed(9))
        b = model.markov_draft(base, anchors, temps, generator=torch.Generator().manual_seed(9))
        greedy = model.markov_draft(base, anchors)
    torch.testing.assert_close(a.tokens, b.tokens)
    torch.testing.assert_close(a.tokens[0], greedy.tokens[0])  # T = 0 row is greedy...
    one_hot = torch.nn.functional.one_hot(greedy.tokens[0], TARGET.vocab_size).float()
    torch.testing.assert_close(a.probs[0], one_hot)  # ...and its q is the one-hot it drew from
    calls = []

    def pick(k, logits):
        calls.append(k)
        return torch.full((3,), 5 + k), None

    picked = model.markov_draft(base, anchors, pick=pick)
    assert calls == list(range(model.gamma))
    assert picked.prev_tokens[:, 1:].tolist() == [[5 + k for k in range(model.gamma - 1)]] * 3
    with pytest.raises(ValueError, match="uniforms must be"):
        model.markov_draft(base, anchors, temps, uniforms=torch.rand(3, 1))


# --------------------------------------------------------------------------- confidence head
def test_confidence_head_matches_reference_and_uses_bias(pair):
    ref, model, _, _ = pair
    gen = torch.Generator().manual_seed(6)
    h = torch.randn(2, model.gamma, TARGET.hidden_size, generator=gen)
    prev = torch.randint(0, TARGET.vocab_size, (2, model.gamma), generator=gen)
    with torch.no_grad():
        logits = model.confidence(h, prev)
        assert logits.shape == (2, model.gamma)
        torch.testing.assert_close(logits, ref.confidence_logits(h, prev), atol=ATOL, rtol=0)
        bias = model.confidence_head.proj.bias
        bias.add_(1.25)
        try:
            torch.testing.assert_close(model.confidence(h, prev), logits + 1.25)
        finally:
            bias.sub_(1.25)
        # The Markov feature of the previous token enters the logit.
        other = prev.clone()
        other[:, 0] = (other[:, 0] + 1) % TARGET.vocab_size
        assert (model.confidence(h, other)[:, 0] - logits[:, 0]).abs().min() > 0


def test_propose_composes_the_pieces(pair):
    _, model, _, _ = pair
    cache = build_cache(model, make_feats(model))
    anchors, pos, slots, ctx = batch_inputs()
    with torch.no_grad():
        p = model.propose(anchors, pos, cache, slots, ctx)
        h, base = model.forward_block(anchors, pos, cache, slots, ctx)
        d = model.markov_draft(base, anchors)
        torch.testing.assert_close(p.draft.tokens, d.tokens)
        torch.testing.assert_close(p.confidence_logits, model.confidence(h, d.prev_tokens))
        torch.testing.assert_close(d.prev_tokens[:, 0], anchors)


def test_draft_without_confidence_head():
    raw = draft_raw(enable_confidence_head=False)
    ref = ReferenceDSparkDraft(raw)
    model = DSparkDraftModel(DSparkDraftConfig.from_dict(raw, TARGET))
    assert not any(n.startswith("confidence_head") for n in model.checkpoint_spec())
    model.load_weights(ref.state_dict().items())
    model.set_embed_and_head(*shared_tensors())
    cache = model.new_context_cache(1, 4)
    one = torch.ones(1, dtype=torch.long)
    assert model.propose(one, one, cache, one * 0, one).confidence_logits is None
    with pytest.raises(RuntimeError, match="no confidence head"):
        model.confidence(torch.zeros(1, 4, 64), torch.zeros(1, 4, dtype=torch.long))


def test_shape_errors(pair):
    _, model, _, _ = pair
    with pytest.raises(ValueError, match="set_embed_and_head: embed"):
        model.set_embed_and_head(torch.zeros(10, 64), torch.zeros(512, 64))
    with pytest.raises(ValueError, match=r"target_hidden must be \[T, 128\]"):
        model.project_context(torch.zeros(3, 64))
    cache = model.new_context_cache(1, 4)
    with pytest.raises(ValueError, match="ctx_width 5"):
        model.forward_block(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                            cache, torch.zeros(1, dtype=torch.long),
                            torch.zeros(1, dtype=torch.long), ctx_width=5)
    with pytest.raises(RuntimeError, match="set_embed_and_head was not called"):
        DSparkDraftModel(model.config).embed(torch.zeros(1, dtype=torch.long))


# --------------------------------------------------------------------------- config
def test_default_target_layer_ids_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert default_target_layer_ids(36, 1) == [18]
    with pytest.raises(ConfigError, match="set target_layer_ids"):
        default_target_layer_ids(3, 2)


@pytest.mark.parametrize("layout", ["deepspec", "dflash", "dspark_config", "prefixed"])
def test_config_layouts_parse_alike(layout):
    cfg = DSparkDraftConfig.from_dict(draft_raw(layout=layout), TARGET)
    assert (cfg.gamma, cfg.markov_rank, cfg.mask_token_id, cfg.target_layer_ids) == (
        4, 16, 511, [1, 3])
    assert cfg.context_input_size == 128 and cfg.confidence_input_size == 80


def test_config_defaults_and_overrides():
    raw = draft_raw()
    for key in ("block_size", "markov_rank", "markov_head_type", "target_layer_ids"):
        raw.pop(key)
    cfg = DSparkDraftConfig.from_dict(raw, TARGET)
    assert (cfg.gamma, cfg.markov_rank, cfg.markov_head_type) == (7, 256, "vanilla")
    assert cfg.target_layer_ids == [1, 3]  # DFlash's rule, one per draft layer
    assert DSparkDraftConfig.from_dict(raw, TARGET, block_size=5).gamma == 5
    # The prefixed target-config spelling wins over the others.
    both = draft_raw(dspark_block_size=6)
    assert DSparkDraftConfig.from_dict(both, TARGET).gamma == 6
    assert DSparkDraftConfig.from_dict(cfg.to_dict(), TARGET) == cfg


REFUSALS = [
    ({"markov_rank": 0}, "markov_rank must be > 0 for DSPARK"),
    ({"markov_head_type": "gated"}, "markov_head_type 'gated' is not supported yet"),
    ({"markov_head_type": "rnn"}, "markov_head_type 'rnn' is not supported yet"),
    ({"markov_head_type": "lstm"}, "markov_head_type 'lstm' is unknown"),
    ({"target_layer_ids": [1, 5]}, r"target_layer_ids\[1\] = 5 is the final layer"),
    ({"target_layer_ids": [9]}, r"target_layer_ids\[0\] = 9 is past the last layer"),
    ({"target_layer_ids": [-1]}, r"target_layer_ids\[0\] is -1, .*embedding output"),
    ({"target_layer_ids": [-2]}, r"target_layer_ids\[0\] must be >= 0"),
    ({"target_layer_ids": []}, "target_layer_ids must be a non-empty list"),
    ({"hidden_size": 32}, "draft hidden_size 32 must equal the target's hidden_size 64"),
    ({"vocab_size": 1024, "mask_token_id": 3}, "draft vocab_size 1024 must equal"),
    ({"num_target_layers": 8}, "num_target_layers 8"),
    ({"mask_token_id": None}, "no mask_token_id"),
    ({"mask_token_id": 512}, "mask_token_id 512 is outside the vocabulary"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "is not a DSpark draft"),
    ({"speculators_model_type": "dspark"}, "speculators slot convention"),
    ({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"layer_types": ["sliding_attention"] * 2}, "layer_types"),
    ({"hidden_size": None}, "missing required field.*hidden_size"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads 3"),
    ({"block_size": 0}, "block_size must be >= 1"),
    ({"enable_confidence_head": "yes"}, "enable_confidence_head must be true or false"),
    ({"dflash_config": [1]}, "dflash_config must be a JSON object"),
]


@pytest.mark.parametrize("overrides,message", REFUSALS)
def test_config_refusals_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        DSparkDraftConfig.from_dict(draft_raw(**overrides), TARGET)


def test_random_draft_for_the_bundled_target(tmp_path):
    target = BailingMoeV3Config.from_dict(bundled_target_config())
    path = write_random_dspark_checkpoint(str(tmp_path / "d"))  # default: the bundled target
    model = load_dspark_draft(path, target, dtype=torch.float32, device="cpu")
    assert (model.config.hidden_size, model.config.vocab_size) == (target.hidden_size,
                                                                   target.vocab_size)
    assert model.markov_head.markov_w1.weight.abs().sum() > 0


# --------------------------------------------------------------------------- checkpoints
def reference_logits(path, anchors=(17, 301)):
    """Base logits of the reference loaded from ``path`` and of load_dspark_draft(path)."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    ref = ReferenceDSparkDraft(raw, init=False)
    ref.load_state_dict({k: v for k, v in load_file(os.path.join(path, "model.safetensors"))
                         .items() if k in ref.state_dict()})
    model = load_dspark_draft(path, TARGET, dtype=torch.float32, device="cpu")
    embed, head = shared_tensors()
    model.set_embed_and_head(embed, head)
    feats = torch.randn(6, model.config.context_input_size, generator=torch.Generator()
                        .manual_seed(1))
    cache = model.new_context_cache(2, 8)
    model.write_context(feats, torch.tensor([0, 1, 2, 0, 1, 2]), torch.tensor([0, 0, 0, 1, 1, 1]),
                        cache)
    with torch.no_grad():
        _, logits = model.forward_block(torch.tensor(anchors), torch.tensor([3, 3]), cache,
                                        torch.tensor([0, 1]), torch.tensor([3, 3]))
        expected = [ref.draft_block(feats[3 * b:3 * b + 3], a, 3, embed, head)[1]
                    for b, a in enumerate(anchors)]
    return model, logits, torch.stack(expected)


def test_load_standalone_checkpoint_with_embedding_copies(tmp_path):
    embed, head = shared_tensors(seed=8)  # copies as DeepSpec stores them; skipped on load
    path = write_random_dspark_checkpoint(str(tmp_path / "draft"), draft_raw(), seed=1,
                                          extra_tensors={"embed_tokens.weight": embed,
                                                         "lm_head.weight": head})
    model, logits, expected = reference_logits(find_dspark_draft(None, path))
    assert isinstance(model, LingDSparkModel)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def write_target_with_subfolder(root, draft_config):
    target = root / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET_RAW))
    write_random_dspark_checkpoint(str(target / "dspark"), draft_config, seed=2)
    return str(target)


def test_load_from_dspark_subfolder_of_the_target(tmp_path):
    target = write_target_with_subfolder(tmp_path, draft_raw(
        architectures=["Qwen3DSparkModel"], layout="dflash"))
    for draft_path in (None, target):  # implicit, or --speculative-draft-model-path = target
        path = find_dspark_draft(target, draft_path)
        assert path == os.path.join(target, "dspark")
    model, logits, expected = reference_logits(path)
    assert isinstance(model, Qwen3DSparkModel)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_find_dspark_draft_errors(tmp_path):
    with pytest.raises(ConfigError, match="is not a folder"):
        find_dspark_draft(None, str(tmp_path / "nowhere"))
    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET_RAW))
    with pytest.raises(ConfigError, match="no DSpark draft config found"):
        find_dspark_draft(str(target), None)
    (target / "config.json").write_text(json.dumps(dict(TARGET_RAW, dspark_block_size=5)))
    with pytest.raises(ConfigError, match="bundled in the target checkpoint.*dspark_block_size"):
        find_dspark_draft(str(target), str(target))
    with pytest.raises(ConfigError, match="pass --speculative-draft-model-path"):
        find_dspark_draft(None, None)


def edit_checkpoint(path, drop=None, add=None, reshape=None):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    if drop:
        tensors.pop(drop)
    if add:
        tensors[add] = torch.zeros(2)
    if reshape:
        tensors[reshape] = torch.zeros(3, 5)
    save_file(tensors, file)


@pytest.mark.parametrize("edit,message", [
    ({"drop": "layers.1.self_attn.k_norm.weight"},
     r"missing tensor: layers\.1\.self_attn\.k_norm\.weight"),
    ({"add": "markov_head.joint_proj.weight"}, r"unexpected tensor: markov_head\.joint_proj"),
    ({"reshape": "confidence_head.proj.weight"},
     r"shape mismatch: confidence_head\.proj\.weight expected \[1, 80\], found \[3, 5\]"),
])
def test_malformed_checkpoints_are_refused_by_name(tmp_path, edit, message):
    path = write_random_dspark_checkpoint(str(tmp_path / "d"), draft_raw())
    edit_checkpoint(path, **edit)
    with pytest.raises(CheckpointError, match=message):
        load_dspark_draft(path, TARGET, dtype=torch.float32, device="cpu")


def test_load_weights_names_and_errors(pair):
    ref, _, _, _ = pair
    model = DSparkDraftModel(DSparkDraftConfig.from_dict(draft_raw(), TARGET))
    state = ref.state_dict()
    prefixed = [(f"model.{k}", v) for k, v in state.items()]
    prefixed.append(("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8)))
    assert model.load_weights(prefixed) == set(model.checkpoint_spec())
    torch.testing.assert_close(model.fc.weight, state["fc.weight"])
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): norm\.weight"):
        model.load_weights([(k, v) for k, v in state.items() if k != "norm.weight"])
    with pytest.raises(ValueError, match="unexpected checkpoint tensor 'extra.weight'"):
        model.load_weights([("extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"markov_head\.markov_w2\.weight: expected \d+ rows, "
                                         r"got shape \(2, 2\)"):
        model.load_weights([("markov_head.markov_w2.weight", torch.zeros(2, 2))], strict=False)


def test_dummy_load_and_registry(tmp_path):
    path = str(tmp_path / "d")
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(draft_raw(), f)
    model = load_dspark_draft(path, TARGET, dtype=torch.float32, device="cpu",
                              load_format="dummy", block_size=3)
    assert model.gamma == 3 and torch.isfinite(model.fc.weight).all()
    for name, cls in (("LingDSparkModel", LingDSparkModel), ("Qwen3DSparkModel",
                      Qwen3DSparkModel), ("DSparkDraftModel", DSparkDraftModel)):
        assert get_model_class(name, is_draft=True) is cls


def test_context_cache_rows_sink_and_bounds():
    cache = DSparkContextCache(num_layers=1, num_slots=2, max_context=3, num_kv_heads=1,
                               head_dim=2, dtype=torch.float32)
    k = torch.arange(6, dtype=torch.float32).view(3, 1, 2) + 1
    cache.write(0, torch.tensor([1, -1, 0]), torch.tensor([2, 9, 0]), k, -k)
    ck, cv = cache.read(0, torch.tensor([0, 1, -1]), 3)
    assert ck.shape == (3, 3, 1, 2)
    torch.testing.assert_close(ck[0, 0], k[2])
    torch.testing.assert_close(cv[1, 2], -k[0])
    torch.testing.assert_close(ck[2, 0], k[1])  # the padding row went to the sink
    assert ck[:2].abs().sum() == k[0].abs().sum() + k[2].abs().sum()  # nothing else written
    assert cache.nbytes == 2 * 3 * 3 * 2 * 4
    with pytest.raises(IndexError):
        cache.write(0, torch.tensor([0]), torch.tensor([3]), k[:1], k[:1])
    with pytest.raises(ValueError, match="max_context must be >= 1"):
        DSparkContextCache(1, 1, 0, 1, 2, torch.float32)
