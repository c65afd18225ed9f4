"""DSpark draft training (python -m sglang.train.dspark and its modules).

* every loss against a hand-computed tiny example; the acceptance-aware loss's value and
  gradient (sign and the analytic suffix-sum weights) on toy cases;
* the batched training pass over anchor blocks equals the plain reference draft block by block
  (context strictly before each anchor, teacher-forced Markov inputs, confidence logits);
* the target features (captured layers + final hidden) reproduce the runner's full logits;
* the offline evaluation on the serving model agrees with the teacher-forced count on greedy
  data; ECE and the verify walk on hand examples;
* the bundled draft (assets/tiny-bailing-v3/dspark) loads, is small, and accepts more than an
  untrained draft on a held-out greedy continuation;
* a smoke run of the whole command on a tiny random target (engine generation, features,
  training, saving, evaluation), its folder loading with load_dspark_draft, a re-run from the
  data cache and the refusal of a mismatched cache; (slow) the saved folder served by the DSPARK
  worker and the NEXTN comparison through the engine.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from engine_test_utils import write_checkpoint
from sglang.srt.configs.bailing_moe_v3 import BailingMoeV3Config
from sglang.srt.configs.dspark import DSparkDraftConfig
from sglang.srt.models.dspark import DSparkDraftModel, load_dspark_draft
from sglang.test.random_checkpoint import tiny_config
from sglang.test.random_dspark_checkpoint import randomize_for_tests, tiny_dspark_config
from sglang.train.dspark_blocks import (anchor_range, blocks_at, forward_blocks,
                                        sample_blocks, teacher_forced_outputs)
from sglang.train.dspark_data import (FeatureSequence, SamplingSetting, draw_prompts,
                                      parse_sampling_settings)
from sglang.train.dspark_eval import (_round_anchors, _walk, draft_sequence, evaluate_draft,
                                      expected_calibration_error)
from sglang.train.dspark_losses import (LossWeights, acceptance_loss, acceptance_probability,
                                        confidence_bce, decayed_cross_entropy, dspark_loss,
                                        expected_accept_length, l1_distance, position_weights,
                                        weighted_mean)
from sglang.train.reference_dspark import ReferenceDSparkDraft

TARGET_RAW = tiny_config()  # hidden 64, vocab 512, 6 layers
TARGET = BailingMoeV3Config.from_dict(TARGET_RAW)


# ============================================================================ losses
def test_position_weights_are_deepspec_decay():
    w = position_weights(7, 4.0)
    assert torch.allclose(w, torch.tensor([math.exp(-k / 4) for k in range(7)]))
    assert [round(float(x), 2) for x in w] == [1.0, 0.78, 0.61, 0.47, 0.37, 0.29, 0.22]
    with pytest.raises(ValueError, match="gamma"):
        position_weights(0)
    with pytest.raises(ValueError, match="decay"):
        position_weights(3, 0.0)


def test_weighted_mean_by_hand_and_no_valid_slot():
    values = torch.tensor([[1.0, 2.0, float("inf")]])
    valid = torch.tensor([[True, True, False]])
    w = position_weights(3, 4.0)
    expect = (1.0 + 2.0 * math.exp(-0.25)) / (1.0 + math.exp(-0.25))
    assert float(weighted_mean(values, valid, w)) == pytest.approx(expect, rel=1e-6)
    assert float(weighted_mean(values, torch.zeros_like(valid), w)) == 0.0  # no NaN


def test_decayed_cross_entropy_by_hand():
    # Two slots, V = 2: slot 0 logits (0, 0) -> CE ln 2; slot 1 logits (ln 3, 0), label 0 ->
    # p = 3/4, CE = ln(4/3). Weights 1 and e^-1/4.
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    labels = torch.tensor([[1, 0]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    w1 = math.exp(-0.25)
    expect = (math.log(2) + w1 * math.log(4 / 3)) / (1 + w1)
    got = decayed_cross_entropy(logits, labels, valid, position_weights(2, 4.0))
    assert float(got) == pytest.approx(expect, rel=1e-6)
    # An invalid slot does not count, whatever its label.
    valid[0, 1] = False
    got = decayed_cross_entropy(logits, labels, valid, position_weights(2, 4.0))
    assert float(got) == pytest.approx(math.log(2), rel=1e-6)


def test_l1_and_acceptance_probability_by_hand():
    p_d = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    p_t = torch.tensor([[1.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
    l1 = l1_distance(p_d, p_t)
    assert torch.allclose(l1, torch.tensor([1.0, 0.0]))
    # 1 - TV = sum(min(p_d, p_t)): the probability speculative sampling keeps the draft token.
    assert torch.allclose(acceptance_probability(l1), torch.minimum(p_d, p_t).sum(-1))
    with pytest.raises(ValueError, match="shape"):
        l1_distance(p_d, p_t[:, :2])


def test_confidence_bce_by_hand_and_label_detached():
    l1 = torch.tensor([[1.0, 0.4]], requires_grad=True)  # soft labels 0.5 and 0.8
    logits = torch.tensor([[0.0, math.log(4.0)]], requires_grad=True)  # sigmoid 0.5 and 0.8
    valid = torch.ones(1, 2, dtype=torch.bool)
    w1 = math.exp(-0.25)
    bce1 = -(0.8 * math.log(0.8) + 0.2 * math.log(0.2))
    expect = (math.log(2) + w1 * bce1) / (1 + w1)
    loss = confidence_bce(logits, l1, valid, position_weights(2, 4.0))
    assert float(loss.detach()) == pytest.approx(expect, rel=1e-6)
    loss.backward()
    assert l1.grad is None  # the head learns acceptance, it cannot move the draft
    # At sigmoid(logit) = label the BCE gradient is zero.
    assert torch.allclose(logits.grad, torch.zeros(1, 2), atol=1e-7)


def test_expected_accept_length_value_and_prefix():
    alpha = torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.0, 1.0]])
    valid = torch.ones(2, 3, dtype=torch.bool)
    assert torch.allclose(expected_accept_length(alpha, valid),
                          torch.tensor([0.5 + 0.25 + 0.125, 0.9]))
    valid[0, 2] = False  # the block ends after two slots
    assert float(expected_accept_length(alpha, valid)[0]) == pytest.approx(0.75)
    # loss = -mean over blocks / gamma
    assert float(acceptance_loss(alpha, valid)) == pytest.approx(-(0.75 + 0.9) / 2 / 3)
    assert float(acceptance_loss(alpha, torch.zeros_like(valid))) == 0.0


def test_acceptance_loss_gradient_is_suffix_sum_of_prefix_products():
    alpha = torch.tensor([[0.9, 0.5, 0.8]], requires_grad=True)
    valid = torch.ones(1, 3, dtype=torch.bool)
    expected_accept_length(alpha, valid).sum().backward()
    a1, a2, a3 = 0.9, 0.5, 0.8
    # dE/da_k = sum_{m >= k} prod_{j <= m, j != k} a_j: early slots weigh the most.
    expect = torch.tensor([[1 + a2 + a2 * a3, a1 + a1 * a3, a1 * a2]])
    assert torch.allclose(alpha.grad, expect)
    assert (alpha.grad > 0).all() and alpha.grad[0, 0] > alpha.grad[0, 1] > alpha.grad[0, 2]


def test_acceptance_loss_pulls_the_draft_towards_the_target():
    """Toy case: per slot two-token logits z; the target puts 0.9 on token 0. A gradient step
    on the acceptance loss moves every slot's probability of token 0 up (its sign), and the
    expected accepted length grows."""
    z = torch.zeros(1, 3, 2, requires_grad=True)  # draft uniform: alpha 0.6 per slot
    p_t = torch.tensor([0.9, 0.1]).expand(1, 3, 2)
    valid = torch.ones(1, 3, dtype=torch.bool)

    def loss_of(z):
        alpha = acceptance_probability(l1_distance(torch.softmax(z, -1), p_t))
        return acceptance_loss(alpha, valid), alpha

    loss, alpha = loss_of(z)
    assert torch.allclose(alpha, torch.full((1, 3), 0.6))
    assert float(loss.detach()) == pytest.approx(-(0.6 + 0.36 + 0.216) / 3, rel=1e-6)
    loss.backward()
    assert (z.grad[..., 0] < 0).all() and (z.grad[..., 1] > 0).all()
    with torch.no_grad():
        after, _ = loss_of(z - 0.5 * z.grad)
    assert float(after) < float(loss.detach())


def test_dspark_loss_combines_the_terms():
    gen = torch.Generator().manual_seed(0)
    draft = torch.randn(2, 3, 4, 11, generator=gen)
    target = torch.randn(2, 3, 4, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 3, 4), generator=gen)
    valid = torch.arange(4).view(1, 1, 4) < torch.randint(0, 5, (2, 3, 1), generator=gen)
    conf = torch.randn(2, 3, 4, generator=gen)
    weights = LossWeights(alpha_ce=0.1, alpha_tv=0.9, alpha_conf=1.0, alpha_accept=0.25)
    out = dspark_loss(draft, target, labels, valid, conf, weights)
    w = position_weights(4)
    l1 = l1_distance(draft.softmax(-1), target.softmax(-1))
    assert float(out["tv"]) == pytest.approx(float(weighted_mean(l1, valid, w)), rel=1e-5)
    total = 0.1 * out["ce"] + 0.9 * out["tv"] + out["conf"] + 0.25 * out["accept"]
    assert float(out["loss"]) == pytest.approx(float(total), rel=1e-6)
    alpha = acceptance_probability(l1)
    assert float(out["accept"]) == pytest.approx(float(acceptance_loss(alpha, valid)), rel=1e-6)
    assert out["alpha"].shape == (4,) and 1.0 <= float(out["tau"]) <= 5.0
    none = dspark_loss(draft, target, labels, valid, None, weights)
    assert float(none["conf"]) == 0.0


def test_loss_weights_refuse_bad_values():
    with pytest.raises(ValueError, match="alpha_accept"):
        LossWeights(alpha_accept=-1.0)
    with pytest.raises(ValueError, match="decay"):
        LossWeights(decay=0.0)


# ============================================================================ blocks
def _random_seqs(gen, d, m_d, vocab, shapes):
    return [FeatureSequence(torch.randint(3, vocab, (t,), generator=gen), p, "greedy",
                            torch.randn(t, m_d, generator=gen), torch.randn(t, d, generator=gen))
            for t, p in shapes]


@pytest.fixture(scope="module")
def draft_and_shared():
    raw = tiny_dspark_config(TARGET_RAW)
    ref = ReferenceDSparkDraft(raw, seed=0)
    randomize_for_tests(ref, 0)
    gen = torch.Generator().manual_seed(3)
    v, d = TARGET.vocab_size, TARGET.hidden_size
    embed = torch.randn(v, d, generator=gen)
    head = torch.randn(v, d, generator=gen) * d ** -0.5
    return raw, ref.eval(), embed, head


def test_blocks_layout_and_sampling(draft_and_shared):
    raw, ref, embed, head = draft_and_shared
    gen = torch.Generator().manual_seed(1)
    d, m_d = TARGET.hidden_size, ref.config.context_input_size
    seqs = _random_seqs(gen, d, m_d, TARGET.vocab_size, [(12, 4), (7, 2)])
    g = ref.config.gamma  # 4
    b = blocks_at(seqs, [[4, 9, 10], [5]], g)
    assert b.anchors.tolist() == [[4, 9, 10], [5, 0, 0]]
    assert b.valid.int().tolist() == [[[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]],
                                      [[1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]]
    assert b.labels[0, 0].tolist() == seqs[0].tokens[5:9].tolist()
    assert b.prev_tokens[0, 0].tolist() == seqs[0].tokens[4:8].tolist()  # teacher forcing
    assert torch.equal(b.target_hidden[0, 1, 1], seqs[0].final[10])  # state at anchor + k
    assert b.num_blocks == 4
    with pytest.raises(ValueError, match="no label"):
        blocks_at(seqs, [[11], [1]], g)
    assert anchor_range(4, 12) == (4, 11)
    s = sample_blocks(seqs, 100, g, torch.Generator().manual_seed(0))
    assert sorted(s.anchors[0].tolist()) == list(range(4, 11))  # every anchor, once
    assert (s.anchors[1][:4] >= 2).all() and s.valid[1, 4:].sum() == 0


def test_forward_blocks_equals_reference_per_block(draft_and_shared):
    raw, ref, embed, head = draft_and_shared
    gen = torch.Generator().manual_seed(2)
    d, m_d = TARGET.hidden_size, ref.config.context_input_size
    seqs = _random_seqs(gen, d, m_d, TARGET.vocab_size, [(21, 5), (14, 3)])
    anchors = [[5, 9, 17, 19], [3, 12]]
    b = blocks_at(seqs, anchors, ref.config.gamma)
    with torch.no_grad():
        h = forward_blocks(ref, b, embed)
        base = h @ head.t()
        logits, target, conf = teacher_forced_outputs(ref, b, embed, head)
        for i, s in enumerate(seqs):
            for j, p in enumerate(anchors[i]):
                # The reference sees only the context before the anchor.
                h_ref, base_ref = ref.draft_block(s.aux[:p], int(s.tokens[p]), p, embed, head)
                assert torch.allclose(h[i, j], h_ref, atol=2e-5), (i, p)
                assert torch.allclose(base[i, j], base_ref, atol=2e-5), (i, p)
                prev = b.prev_tokens[i, j]
                assert torch.allclose(logits[i, j], base_ref + ref.markov_bias(prev), atol=2e-5)
                assert torch.allclose(conf[i, j], ref.confidence_logits(h_ref, prev), atol=2e-5)
                assert torch.allclose(target[i, j], b.target_hidden[i, j] @ head.t(), atol=1e-5)


def test_training_step_reduces_the_loss(draft_and_shared):
    raw, _, embed, head = draft_and_shared
    draft = ReferenceDSparkDraft(raw, seed=1)
    gen = torch.Generator().manual_seed(5)
    seqs = _random_seqs(gen, TARGET.hidden_size, draft.config.context_input_size,
                        TARGET.vocab_size, [(16, 4), (16, 4)])
    batch = sample_blocks(seqs, 8, draft.config.gamma, gen)
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        logits, target, conf = teacher_forced_outputs(draft, batch, embed, head)
        out = dspark_loss(logits, target, batch.labels, batch.valid, conf, LossWeights())
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(float(out["loss"].detach()))
    assert losses[-1] < losses[0]


# ============================================================================ data
def test_sampling_settings():
    s = parse_sampling_settings(["greedy", "0.7:0.8", "1.0:0.95:20", "0.5"])
    assert [x.name for x in s] == ["greedy", "T0.7-p0.8", "T1-p0.95-k20", "T0.5-p1"]
    assert s[0].params(5, 1) == {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0.0}
    assert s[1].params(5, 7)["sampling_seed"] == 7 and s[1].params(5, 7)["top_p"] == 0.8
    for bad in ("hot", "0.7:0", "0.7:0.8:0", "1:1:1:1", "-1"):
        with pytest.raises(ValueError, match="sampling setting"):
            parse_sampling_settings([bad])
    with pytest.raises(ValueError, match="at least one"):
        parse_sampling_settings([])
    assert SamplingSetting(0.0).is_greedy


def test_draw_prompts_start_at_line_starts():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "\n": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("\n", "isolated")
    texts = ["a\nb\na\nb\n" * 5]
    gen = torch.Generator().manual_seed(0)
    prompts = draw_prompts(texts, tok, 6, 4, gen, min_len=2)
    assert len(prompts) == 6 and all(2 <= len(p) <= 4 for p in prompts)
    assert all(p[0] in (1, 2) for p in prompts)  # never a newline first
    with pytest.raises(ValueError, match="too short"):
        draw_prompts(["a"], tok, 2, 4, gen, min_len=3)


# ============================================================================ evaluation
def test_ece_and_walk_by_hand():
    pred = torch.tensor([0.1, 0.12, 0.9, 0.92])
    obs = torch.tensor([0.0, 1.0, 1.0, 1.0])
    # Bins: {0.1, 0.12} -> |0.11 - 0.5| and {0.9, 0.92} -> |0.91 - 1|, each half the mass.
    assert expected_calibration_error(pred, obs) == pytest.approx(0.5 * 0.39 + 0.5 * 0.09)
    assert math.isnan(expected_calibration_error(torch.zeros(0), torch.zeros(0)))
    # 6 tokens after the first generated one; anchor 0 accepts 2 -> commits 3, anchor 3 accepts
    # 5 but only 3 tokens remain -> commits 3: 6 tokens in 2 rounds.
    assert _walk(torch.tensor([2, 0, 0, 5, 0, 0]), 6) == (6, 2)
    assert _walk(torch.zeros(4, dtype=torch.long), 4) == (4, 4)
    assert _round_anchors(torch.tensor([2, 0, 0, 5, 0, 0]), 6) == [0, 3]
    assert _round_anchors(torch.tensor([0, 1, 0, 0]), 4) == [0, 1, 3]


def test_serving_eval_matches_teacher_forced_count_on_greedy_data(draft_and_shared, tmp_path):
    """On a sequence that is the target's own greedy output, the serving model's accepted
    counts (own drafts as Markov inputs) equal the teacher-forced argmax matches."""
    from sglang.train.dspark import periodic_eval

    raw, ref, embed, head = draft_and_shared
    gen = torch.Generator().manual_seed(7)
    t, p = 24, 5
    final = torch.randn(t, TARGET.hidden_size, generator=gen)
    tokens = torch.randint(3, TARGET.vocab_size, (t,), generator=gen)
    tokens[p + 1:] = (final @ head.t()).argmax(-1)[p:t - 1]  # greedy continuation
    aux = torch.randn(t, ref.config.context_input_size, generator=gen)
    seq = FeatureSequence(tokens, p, "greedy", aux, final)
    # Make the draft agree with the target often: its LM-head input is the target's state.
    path = str(tmp_path / "draft")
    ref.save_pretrained(path, dtype=torch.float32)
    model = load_dspark_draft(path, TARGET, dtype=torch.float32, device="cpu")
    model.set_embed_and_head(embed, head)
    ev = evaluate_draft(model, [seq], head)
    batch = blocks_at([seq], [list(range(p, t - 1))], ref.config.gamma)
    tf = periodic_eval(ref, batch, embed, head, LossWeights())
    assert ev["anchors"] == t - 1 - p
    assert ev["accept_length_all_anchors"] == pytest.approx(tf["accept_length"], abs=1e-6)
    assert 1.0 <= ev["accept_length"] <= ref.config.gamma + 1
    # The rounds' anchors are a subset of the anchors; the first one always starts a round.
    accepted = draft_sequence(model, seq, head)[0]
    starts = _round_anchors(accepted, accepted.numel())
    assert ev["verify_rounds"] == len(starts) and starts[0] == 0
    assert ev["round_anchor_slot1_accept"] == pytest.approx(
        float((accepted[starts] > 0).float().mean()))
    assert len(ev["ece"]) == ref.config.gamma and 0 <= ev["mean_ece"] <= 1


# ============================================================================ features
def test_features_reproduce_full_logits(tmp_path):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.train.dspark_data import TargetFeatureRunner

    path = write_checkpoint(str(tmp_path / "t"))
    fr = TargetFeatureRunner(path, [1, 3], max_batch_tokens=64, max_batch_seqs=2)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (9, 30, 40)]
    feats = fr.features(seqs)  # two groups: 9 + 30, then 40
    embed, head = fr.embed_and_head()
    runner = fr.runner
    for s, (aux, final) in zip(seqs, feats):
        assert aux.shape == (len(s), 2 * TARGET.hidden_size)
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()
        req = runner.req_to_token_pool.alloc(1)
        runner.kda_state_pool.clear_slots(req)
        loc = runner.token_to_kv_pool_allocator.alloc(len(s))
        runner.req_to_token_pool.write(req[0], 0, loc)
        out = runner.forward(ForwardBatch.for_extend(torch.tensor(s), req, [0], [len(s)], loc,
                                                     return_full_logits=True))
        assert torch.allclose(final @ head.t(), out.next_token_logits, atol=1e-4)
        assert torch.allclose(aux, out.aux_hidden_states, atol=1e-5)  # batching changes nothing
    with pytest.raises(ValueError, match="max_batch_tokens"):
        fr.features([[1] * 65])


# ============================================================================ the bundled draft
def _greedy_sequence(runner, prompt, n):
    """``prompt`` + ``n`` greedy tokens of the target on ``runner`` (prefill, then decodes)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    req = runner.req_to_token_pool.alloc(1)
    runner.kda_state_pool.clear_slots(req)
    loc = runner.token_to_kv_pool_allocator.alloc(len(prompt))
    runner.req_to_token_pool.write(req[0], 0, loc)
    out = runner.forward(ForwardBatch.for_extend(torch.tensor(prompt), req, [0], [len(prompt)],
                                                 loc))
    seq = list(prompt) + [int(out.next_token_logits.argmax(-1))]
    for _ in range(n - 1):
        loc = runner.token_to_kv_pool_allocator.alloc(1)
        runner.req_to_token_pool.write(req[0], len(seq) - 1, loc)
        out = runner.forward(ForwardBatch.for_decode(torch.tensor(seq[-1:]), torch.tensor(req),
                                                     torch.tensor([len(seq)]), loc))
        seq.append(int(out.next_token_logits.argmax(-1)))
    return seq


def test_bundled_draft_loads_small_and_trained():
    """assets/tiny-bailing-v3/dspark: the published layout, under the draft size limit, and a
    trained draft: on a held-out greedy continuation it beats an untrained draft's ~1 token per
    round."""
    from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR
    from sglang.train.dspark import SIZE_LIMIT_BYTES
    from sglang.train.data import HELD_OUT_FILES, stdlib_root
    from sglang.train.dspark_data import TargetFeatureRunner
    from sglang.train.tokenizer import load_tokenizer

    folder = BUNDLED_MODEL_DIR / "dspark"
    assert sum(f.stat().st_size for f in folder.iterdir()) <= SIZE_LIMIT_BYTES
    assert (folder / "README.md").is_file() and (folder / "train_log.json").is_file()
    fr = TargetFeatureRunner(str(BUNDLED_MODEL_DIR), [1, 3, 4], max_batch_tokens=256,
                             max_batch_seqs=1)
    model = load_dspark_draft(str(folder), fr.hf_config, dtype=torch.float32, device="cpu")
    assert model.gamma == 7 and model.config.target_layer_ids == [1, 3, 4]
    assert model.config.markov_rank == 64 and model.has_confidence_head
    tok = load_tokenizer(BUNDLED_MODEL_DIR)
    texts = [(stdlib_root() / f).read_text(encoding="utf-8") for f in HELD_OUT_FILES]
    prompt = draw_prompts(texts, tok, 3, 48, torch.Generator().manual_seed(0))[-1]
    seq = _greedy_sequence(fr.runner, prompt, 80)
    (aux, final), = fr.features([seq])
    embed, head = fr.embed_and_head()
    model.set_embed_and_head(embed, head)
    ev = evaluate_draft(model, [FeatureSequence(torch.tensor(seq), len(prompt), "greedy", aux,
                                                final)], head)
    assert ev["accept_length"] > 1.3, ev  # 2.14 for the bundled draft (3 layers, 2026-12-05)
    assert ev["slot_accept"][0] > 0.2


# ============================================================================ the command
TINY_ARGS = ["--num-draft-layers", "1", "--num-heads", "2", "--num-kv-heads", "1",
             "--head-dim", "16", "--intermediate-size", "32", "--block-size", "3",
             "--markov-rank", "4", "--sampling", "greedy", "1.0:0.9",
             "--prompts-per-setting", "2", "--eval-prompts", "2", "--prompt-len", "8",
             "--max-new-tokens", "10", "--steps", "3", "--batch-seqs", "2",
             "--anchors-per-seq", "4", "--max-train-files", "4", "--eval-interval", "2",
             "--num-threads", "1"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, one_thread_children):
    """One run of the whole command on a tiny random target (engine generation included);
    spawned schedulers run one thread each for the module (``one_thread_children``)."""
    from sglang.train.dspark import main

    root = tmp_path_factory.mktemp("dspark_cmd")
    target = write_checkpoint(str(root / "target"), with_tokenizer=True)
    out, cache = root / "draft", str(root / "cache.pt")
    log = main(["--target-path", target, "--output-dir", str(out), "--data-cache", cache]
               + TINY_ARGS)
    return root, target, out, cache, log


def test_command_smoke_run_and_folder_loads(smoke_run):
    root, target, out, cache, log = smoke_run
    for name in ("config.json", "model.safetensors", "train_log.json", "README.md"):
        assert (out / name).is_file(), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LingDSparkModel"] and cfg["block_size"] == 3
    assert cfg["markov_rank"] == 4 and cfg["torch_dtype"] == "bfloat16"
    parsed = DSparkDraftConfig.from_path(str(out), TARGET)
    assert parsed.target_layer_ids == [3] and parsed.mask_token_id == 2
    model = load_dspark_draft(str(out), TARGET, dtype=torch.float32, device="cpu")
    assert isinstance(model, DSparkDraftModel) and model.gamma == 3
    saved = json.loads((out / "train_log.json").read_text())
    assert saved["train"]["num_steps"] == 3 and len(saved["train"]["loss"]) == 3
    assert saved["data"]["train_generated_tokens"] == 2 * 2 * 10
    ev = log["eval"]
    assert ev["sequences"] == 2 and 1.0 <= ev["accept_length"] <= 4.0
    assert 0 <= ev["mean_ece"] <= 1 and len(ev["slot_accept"]) == 3
    assert "accept length" in (out / "README.md").read_text()
    assert os.path.getsize(cache) > 0


def test_command_rerun_from_cache_and_mismatch(smoke_run):
    from sglang.train.dspark import main

    root, target, out, cache, log = smoke_run
    # A re-run reads the cache (no engine) and trains the same way; a changed data setting is
    # refused by name.
    again = main(["--target-path", target, "--output-dir", str(root / "again"),
                  "--data-cache", cache] + TINY_ARGS)
    assert again["data"]["loaded"] is True
    assert again["train"]["loss"] == pytest.approx(log["train"]["loss"], rel=1e-5)
    # --train-seed reseeds the training alone: the same cache, other losses.
    other = main(["--target-path", target, "--output-dir", str(root / "other"),
                  "--data-cache", cache, "--train-seed", "5"] + TINY_ARGS)
    assert other["data"]["loaded"] is True
    assert other["train"]["loss"][0] != pytest.approx(log["train"]["loss"][0], rel=1e-5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        main(["--target-path", target, "--output-dir", str(root / "bad"),
              "--data-cache", cache] + TINY_ARGS + ["--max-new-tokens", "11"])


def test_eval_command_scores_saved_drafts_on_the_cache(smoke_run, tmp_path, capsys):
    """``python -m sglang.train.dspark_eval``: a saved draft scored on the cache's held-out
    sequences gets the training run's own evaluation; a cache of another target is refused."""
    from sglang.train.dspark_eval import main

    root, target, out, cache, log = smoke_run
    result = tmp_path / "scores.jsonl"
    [row] = main(["--target-path", target, "--data-cache", cache, str(out),
                  "--result-filename", str(result)])
    assert row["accept_length"] == pytest.approx(log["eval"]["accept_length"])
    assert row["slot_accept"] == pytest.approx(log["eval"]["slot_accept"])
    assert json.loads(result.read_text())["draft"] == str(out)
    assert f"{out}: accept length {row['accept_length']:.3f}" in capsys.readouterr().out
    from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR

    with pytest.raises(SystemExit):
        main(["--target-path", str(BUNDLED_MODEL_DIR), "--data-cache", cache, str(out)])
    assert "was made with target" in capsys.readouterr().err



@pytest.mark.slow  # two engine launches
def test_eval_command_serves_drafts_and_nextn(smoke_run, capsys):
    """``dspark_eval --served --compare-nextn 2``: the saved draft served through the engine
    (lossless, close to its offline walk) and NEXTN with 2 drafts on the same prompts."""
    from sglang.train.dspark_eval import main

    root, target, out, cache, log = smoke_run
    offline, nextn, served = main(["--target-path", target, "--data-cache", cache, str(out),
                                   "--served", "--compare-nextn", "2", "--num-threads", "1"])
    assert nextn["draft"] == "NEXTN-2" and nextn["speculative_num_steps"] == 2
    assert served["draft"] == str(out) and served["speculative_algorithm"] == "DSPARK"
    for row in (nextn, served):
        assert row["matches_plain_greedy"] == 1.0 and row["requests"] == 2
    assert served["accept_length"] == pytest.approx(offline["accept_length"], abs=0.1)
    assert f"{out} served: accept length" in capsys.readouterr().out

@pytest.mark.slow  # two more engine launches
def test_command_served_draft_and_nextn_comparison(smoke_run):
    from sglang.train.dspark import main

    root, target, out, cache, log = smoke_run
    ev = main(["--target-path", target, "--output-dir", str(root / "served"),
               "--data-cache", cache, "--compare-nextn", "2", "3", "--eval-served"]
              + TINY_ARGS)["eval"]
    # NEXTN at gamma (3, TINY_ARGS' block) under "nextn", at 2 drafts under "nextn2".
    assert ev["nextn"]["speculative_num_steps"] == 3 and ev["nextn2"]["speculative_num_steps"] == 2
    for key in ("nextn", "nextn2"):
        assert ev[key]["matches_plain_greedy"] == 1.0  # greedy NEXTN is lossless
        assert 1.0 <= ev[key]["accept_length"] <= ev[key]["speculative_num_steps"] + 1
    # The saved folder is served by the DSPARK worker: lossless, and the offline walk predicts
    # its accept length (both count committed tokens per verify round).
    assert ev["served"]["matches_plain_greedy"] == 1.0
    assert ev["served"]["accept_length"] == pytest.approx(ev["accept_length"], abs=0.1)
    readme = (root / "served" / "README.md").read_text()
    assert "2 chained drafts per round" in readme and "3 chained drafts per round" in readme


def test_command_refuses_bad_flags(tmp_path):
    from sglang.train.dspark import main

    target = write_checkpoint(str(tmp_path / "target"), with_tokenizer=True)
    base = ["--target-path", target, "--output-dir", str(tmp_path / "o")]
    with pytest.raises(SystemExit, match="--block-size"):
        main(base + ["--block-size", "0"])
    with pytest.raises(SystemExit, match="--compare-nextn"):
        main(base + ["--compare-nextn", "3", "0"])
    with pytest.raises(SystemExit, match="config.json"):
        main(["--target-path", str(tmp_path), "--output-dir", str(tmp_path / "o")])
    from sglang.srt.configs.bailing_moe_v3 import ConfigError

    with pytest.raises(ConfigError, match="target_layer_ids"):  # the final layer is refused
        main(base + ["--target-layer-ids", "5"])
