"""Sampling: parameter validation, batched state, the sampler's math and seeded reproducibility."""
from __future__ import annotations

import math

import pytest
import torch

from sglang.srt.layers.sampler import (
    Sampler,
    apply_penalties,
    compute_input_token_logprobs,
    sampling_filter_mask,
    seeded_uniform,
)
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import TOP_K_ALL, SamplingParams

V = 32


def make_info(params, outputs=None, prompts=None, vocab=V, eos=None):
    params = [p.normalize() for p in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[] for _ in params]
    return SamplingBatchInfo.from_reqs(params, outputs, vocab, prompt_ids=prompts, eos_token_ids=eos)


# ---------------------------------------------------------------- SamplingParams
def test_defaults_match_sglang():
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.min_new_tokens, p.n, p.ignore_eos, p.skip_special_tokens) == (0, 1, False, True)
    assert p.spaces_between_special_tokens and not p.no_stop_trim
    assert p.sampling_seed is None and p.logit_bias is None
    p.verify(V)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"n": 0}, "n must be"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [V]}, "stop_token_ids"),
        ({"logit_bias": {"999": 1.0}}, "logit_bias"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"logit_bias": {"3": "big"}}, "logit_bias"),
        ({"sampling_seed": -1}, "sampling_seed"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"json_schema": "{}"}, "json_schema is not supported"),
        ({"regex": "a+"}, "regex is not supported"),
        ({"ebnf": "root ::= 'a'"}, "ebnf is not supported"),
    ],
)
def test_verify_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs).verify(V)
    assert key in str(e.value)


def test_from_dict_rejects_unknown_keys_and_maps_null_to_default():
    with pytest.raises(ValueError, match="'temprature'"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(ValueError, match="stop_strs"):  # derived fields are not request keys
        SamplingParams.from_dict({"stop_strs": ["x"]})
    p = SamplingParams.from_dict({"temperature": None, "max_new_tokens": 8, "top_k": 5})
    assert p.temperature == 1.0 and p.max_new_tokens == 8 and p.top_k == 5
    assert SamplingParams.from_dict(None) == SamplingParams()
    with pytest.raises(ValueError, match="sampling_params"):
        SamplingParams.from_dict([1])


class _Tok:
    def encode(self, s, add_special_tokens=False):
        return s.split()


def test_normalize_greedy_topk_stop_and_bias():
    p = SamplingParams(temperature=0.0, top_k=7, stop="a b c", stop_token_ids=[1, 2],
                       logit_bias={"4": 1.5}).normalize(_Tok())
    assert p.is_greedy and p.top_k == 1 and p.temperature == 1.0
    assert p.stop_strs == ["a b c"] and p.stop_str_max_len == 3
    assert p.stop_token_ids == {1, 2} and p.logit_bias == {4: 1.5}
    q = SamplingParams(top_k=-1, stop=["xy", "abcd"]).normalize()
    assert q.top_k == TOP_K_ALL and q.stop_str_max_len == 4 and not q.is_greedy
    assert q.normalize().top_k == TOP_K_ALL  # idempotent
    q.verify(V)  # the normalized form is valid too
    assert SamplingParams(temperature=0).is_greedy


# ---------------------------------------------------------------- greedy and filters
def test_greedy_is_argmax_all_greedy_and_mixed():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    info = make_info([SamplingParams(temperature=0) for _ in range(4)])
    assert info.is_all_greedy
    out = Sampler()(logits, info)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    mixed = make_info([SamplingParams(temperature=0), SamplingParams(temperature=1.0),
                       SamplingParams(top_k=1, temperature=0.8), SamplingParams(temperature=2.0)])
    assert not mixed.is_all_greedy
    for _ in range(5):
        ids = Sampler()(logits, mixed).next_token_ids
        assert ids[0] == logits[0].argmax() and ids[2] == logits[2].argmax()


def test_padded_vocab_columns_are_ignored():
    logits = torch.zeros(2, V + 8)
    logits[:, V:] = 100.0  # padding columns of a padded lm_head
    logits[:, 5] = 1.0
    out = Sampler()(logits, make_info([SamplingParams(temperature=0)] * 2))
    assert out.next_token_ids.tolist() == [5, 5]


def test_top_k_mask():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    removed = sampling_filter_mask(logits, torch.tensor([2, 5]), torch.ones(2), torch.zeros(2),
                                   need_top_k=True, need_top_p=False, need_min_p=False)
    assert removed[0].tolist() == [True, False, True, False, True]
    assert not removed[1].any()


def test_top_p_mask():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]])
    logits = probs.log()
    removed = sampling_filter_mask(logits, torch.full((2,), 4), torch.tensor([0.75, 0.45]),
                                   torch.zeros(2), need_top_k=False, need_top_p=True, need_min_p=False)
    # row 0: mass before 0.15 is 0.8 > 0.75 -> keep {0.5, 0.3}; row 1: keep {0.5} only
    assert removed[0].tolist() == [False, False, True, True]
    assert removed[1].tolist() == [True, True, True, False]
    keep_all = sampling_filter_mask(logits, torch.full((2,), 4), torch.ones(2), torch.zeros(2),
                                    need_top_k=False, need_top_p=True, need_min_p=False)
    assert not keep_all.any()


def test_min_p_mask_and_intersection():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    removed = sampling_filter_mask(probs.log(), torch.tensor([4]), torch.ones(1), torch.tensor([0.2]),
                                   need_top_k=False, need_top_p=False, need_min_p=True)
    assert removed[0].tolist() == [False, False, False, True]  # 0.05 < 0.2 * 0.5
    both = sampling_filter_mask(probs.log(), torch.tensor([2]), torch.ones(1), torch.tensor([0.2]))
    assert both[0].tolist() == [False, False, True, True]


def test_sampled_tokens_respect_top_k():
    torch.manual_seed(1)
    logits = torch.randn(1, V).repeat(512, 1)
    info = make_info([SamplingParams(temperature=1.5, top_k=3)] * 512)
    ids = Sampler(torch.Generator().manual_seed(0))(logits, info).next_token_ids
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(ids.tolist()) == allowed  # all three appear in 512 draws, nothing else


# ---------------------------------------------------------------- penalties
def test_repetition_penalty_hf_style():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    info = make_info([SamplingParams(repetition_penalty=2.0)], outputs=[[1]], prompts=[[0]], vocab=4)
    out = apply_penalties(logits.clone(), info)
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0]]  # seen: positive / 2, negative * 2


def test_frequency_and_presence_penalties():
    logits = torch.zeros(1, 5)
    info = make_info([SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)],
                     outputs=[[3, 3, 2]], prompts=[[4, 4]], vocab=5)
    out = apply_penalties(logits.clone(), info)
    # token 3: 2 * 0.5 + 0.25; token 2: 0.5 + 0.25; prompt tokens are not penalized
    assert torch.allclose(out, torch.tensor([[0.0, 0.0, -0.75, -1.25, 0.0]]))
    info.append_tokens(torch.tensor([2]))
    out = apply_penalties(logits.clone(), info)
    assert torch.allclose(out, torch.tensor([[0.0, 0.0, -1.25, -1.25, 0.0]]))
    assert info.steps.tolist() == [4]


def test_logit_bias_and_min_new_tokens():
    logits = torch.zeros(2, 6)
    info = make_info([SamplingParams(logit_bias={"1": 3.0}, min_new_tokens=2, stop_token_ids=[4]),
                      SamplingParams(min_new_tokens=2, ignore_eos=True)], vocab=6, eos=[0])
    out = apply_penalties(logits.clone(), info)
    assert out[0].tolist() == [-math.inf, 3.0, 0.0, 0.0, -math.inf, 0.0]
    assert out[1].tolist() == [0.0] * 6  # ignore_eos: EOS not masked
    info.append_tokens(torch.tensor([[2, 3], [2, 3]]))  # two tokens each -> min reached
    out = apply_penalties(logits.clone(), info)
    assert out[0].tolist() == [0.0, 3.0, 0.0, 0.0, 0.0, 0.0]
    greedy = make_info([SamplingParams(temperature=0, logit_bias={"5": 1.0})], vocab=6)
    assert Sampler()(torch.zeros(1, 6), greedy).next_token_ids.tolist() == [5]


def test_append_tokens_with_valid_mask_and_duplicates():
    info = make_info([SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5)],
                     outputs=[[]], prompts=[[]], vocab=6)
    info.append_tokens(torch.tensor([[3, 3, 5]]), valid=torch.tensor([[True, False, False]]))
    assert info.output_counts[0].tolist() == [0, 0, 0, 1, 0, 0]
    assert info.seen_mask[0].tolist() == [False, False, False, True, False, False]
    assert info.steps.tolist() == [1]


def test_repetition_penalty_needs_prompt_ids():
    with pytest.raises(ValueError, match="prompt"):
        SamplingBatchInfo.from_reqs([SamplingParams(repetition_penalty=1.1)], [[]], V)


# ---------------------------------------------------------------- seeded reproducibility
def _draws(info, logits, steps):
    sampler, seq = Sampler(), []
    for _ in range(steps):
        ids = sampler(logits, info).next_token_ids
        seq.append(ids)
        info.append_tokens(ids)
    return torch.stack(seq, dim=1)


def test_seeded_draws_do_not_depend_on_batch_composition():
    torch.manual_seed(2)
    row = torch.randn(1, V)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, sampling_seed=1234)
    alone = _draws(make_info([seeded]), row, 12)[0]
    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, sampling_seed=99)]
    torch.manual_seed(77)  # different global RNG state for the unseeded neighbours
    batch = make_info([others[0], others[1], SamplingParams(**{**seeded.to_dict(), "top_k": -1}),
                       others[2]])
    logits = torch.cat([torch.randn(2, V), row, torch.randn(1, V)])
    assert torch.equal(_draws(batch, logits, 12)[2], alone)


def test_seeded_draws_continue_from_history_length():
    torch.manual_seed(3)
    row = torch.randn(1, V)
    p = SamplingParams(temperature=1.0, sampling_seed=5)
    full = _draws(make_info([p]), row, 6)[0]
    resumed = _draws(make_info([p], outputs=[full[:3].tolist()]), row, 3)[0]
    assert torch.equal(resumed, full[3:])  # step = number of tokens generated so far


def test_different_seeds_give_different_sequences():
    row = torch.zeros(1, V)  # uniform distribution: any two seeds should disagree somewhere
    seqs = [_draws(make_info([SamplingParams(sampling_seed=s)]), row, 16)[0] for s in range(4)]
    for seq in seqs:  # the step counter feeds the noise: a sequence is not one token repeated
        assert len(set(seq.tolist())) > 4
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.equal(seqs[i], seqs[j])


def test_seeded_uniform_properties():
    lanes = torch.arange(1000)
    u = seeded_uniform(torch.tensor([7, 8, 7]), torch.tensor([0, 0, 1]), lanes)
    assert u.shape == (3, 1000) and (u > 0).all() and (u < 1).all()
    assert torch.equal(u[0], seeded_uniform(torch.tensor([7]), torch.tensor([0]), lanes)[0])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    big = seeded_uniform(torch.tensor([2**62 + 1]), torch.tensor([0]), lanes)
    assert (big > 0).all() and (big < 1).all()


# ---------------------------------------------------------------- distribution
N_DRAWS = 20000
# Each frequency has standard deviation <= sqrt(0.25 / 20000) = 0.0035; 0.015 is > 4 sigma.
FREQ_TOL = 0.015


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_softmax(seeded):
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.25, 1.5]])
    temp = 0.7
    params = [SamplingParams(temperature=temp, sampling_seed=i if seeded else None)
              for i in range(N_DRAWS)]
    info = make_info(params, vocab=8)
    ids = Sampler(torch.Generator().manual_seed(0))(logits.repeat(N_DRAWS, 1), info).next_token_ids
    freq = torch.bincount(ids, minlength=8).float() / N_DRAWS
    expected = torch.softmax(logits[0] / temp, dim=-1)
    assert (freq - expected).abs().max() < FREQ_TOL


def test_top_k_sampling_renormalizes_over_kept_tokens():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.25, 1.5]])
    info = make_info([SamplingParams(top_k=3)] * N_DRAWS, vocab=8)
    ids = Sampler(torch.Generator().manual_seed(1))(logits.repeat(N_DRAWS, 1), info).next_token_ids
    freq = torch.bincount(ids, minlength=8).float() / N_DRAWS
    kept = torch.tensor([0, 4, 7])
    expected = torch.zeros(8)
    expected[kept] = torch.softmax(logits[0, kept], dim=-1)
    assert (freq - expected).abs().max() < FREQ_TOL


# ---------------------------------------------------------------- logprobs
def test_output_logprobs_of_the_sampling_distribution():
    """As upstream by default: log_softmax(penalised logits / temperature), greedy rows at T=1."""
    torch.manual_seed(4)
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0.5, repetition_penalty=1.5), SamplingParams(temperature=0),
              SamplingParams(top_k=4, logit_bias={"0": 5.0})]
    info = make_info(params, outputs=[[1], [], []], prompts=[[2], [], []])
    out = Sampler()(logits, info, return_logprob=True, top_logprobs_nums=[2, 0, 5])
    expected = logits.clone()
    # row 0: repetition penalty 1.5 on tokens {1, 2} (HF style), then temperature 0.5
    for t in (1, 2):
        v = expected[0, t]
        expected[0, t] = v / 1.5 if v > 0 else v * 1.5
    expected[0] /= 0.5
    expected[2, 0] += 5.0  # row 2: logit bias; top-k does not change the log-probabilities
    raw = torch.log_softmax(expected, dim=-1)
    assert torch.allclose(out.next_token_logprobs, raw.gather(1, out.next_token_ids[:, None])[:, 0])
    ref_val, ref_idx = raw.topk(5, dim=-1)
    assert torch.equal(out.top_logprobs_idx, ref_idx) and torch.allclose(out.top_logprobs_val, ref_val)
    assert Sampler()(logits, info).next_token_logprobs is None


def test_original_logprob_env_returns_raw_log_softmax(monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    torch.manual_seed(5)
    logits = torch.randn(2, V)
    info = make_info([SamplingParams(temperature=0.3), SamplingParams(temperature=0)])
    out = Sampler()(logits, info, return_logprob=True)
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.next_token_logprobs, raw.gather(1, out.next_token_ids[:, None])[:, 0])


def test_input_token_logprobs():
    torch.manual_seed(5)
    ids = [3, 7, 1, 9, 4, 2]
    logits = torch.randn(len(ids), V)
    lp = torch.log_softmax(logits, dim=-1)
    res = compute_input_token_logprobs(logits, ids, logprob_start_len=0, top_logprobs_num=2)
    assert res.token_ids == ids and res.token_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(res.token_logprobs[i] - float(lp[i - 1, ids[i]])) < 1e-6
    assert res.top_logprobs[0] is None and res.top_logprobs[1][0][1] == int(lp[0].argmax())
    # only positions >= 3, from logits rows that start at position 2
    part = compute_input_token_logprobs(logits[2:], ids, logprob_start_len=3, logits_start=2)
    assert part.token_ids == ids[3:] and part.token_logprobs == res.token_logprobs[3:]
    assert compute_input_token_logprobs(logits, ids, logprob_start_len=len(ids)).token_logprobs == []
    with pytest.raises(ValueError, match="logprob_start_len"):
        compute_input_token_logprobs(logits, ids, logprob_start_len=7)
    with pytest.raises(ValueError, match="logits rows"):
        compute_input_token_logprobs(logits[3:], ids, logprob_start_len=1, logits_start=3)


# ---------------------------------------------------------------- batch bookkeeping
def test_filter_and_merge_keep_rows_consistent():
    torch.manual_seed(6)
    a = make_info([SamplingParams(sampling_seed=1), SamplingParams(frequency_penalty=1.0)],
                  outputs=[[], [4, 4]])
    b = make_info([SamplingParams(temperature=0)])
    merged = a.merge(b)
    assert merged.batch_size == 3 and not merged.is_all_greedy and merged.has_frequency_presence
    assert merged.output_counts[2].sum() == 0 and merged.output_counts[1, 4] == 2
    assert merged.greedy_mask.tolist() == [False, False, True]
    kept = merged.filter([2, 0])
    assert kept.batch_size == 2 and kept.seeds.tolist() == [0, 1] and kept.steps.tolist() == [0, 0]
    logits = torch.randn(2, V)
    ref = Sampler()(logits[1:], make_info([SamplingParams(sampling_seed=1)])).next_token_ids
    ids = Sampler()(logits, kept).next_token_ids
    assert ids[0] == logits[0].argmax() and ids[1] == ref[0]
    with pytest.raises(ValueError, match="vocab"):
        a.merge(make_info([SamplingParams()], vocab=V + 1))


def test_bad_logits_shape_is_reported():
    info = make_info([SamplingParams()])
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, V), info)
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler()(torch.zeros(1, V - 1), info)
