"""The DSpark confidence scheduler (rounds/dspark/planner.py), its SPS table (rounds/dspark/sps.py) and the
STS calibration (rounds/dspark/sts.py).

Planner: the device form equals the host reference exactly on random jagged cases; hand-made
batch-1, tie, flat-table and capacity cases; prefix-order / top-K properties; and the paper's
App. A argument for the early stop (retrospective search lets a draft decide its own admission),
checked in closed form under the paper's verification rule and by sampling through our
verification. Tables: round trips, the lookup rule, errors naming file and field. STS: fitting
lowers the ECE of miscalibrated synthetic confidences.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine_test_utils import refuse_host_reads
from sglang.srt.rounds.dspark import planner as dspark_planner
from sglang.srt.rounds.dspark.planner import (
    DSparkPlanner,
    lagged_capacity,
    lagged_capacity_reference,
    plan_verify_lens,
    plan_verify_lens_reference,
    prefix_survival_reference,
    top_k_verify_lens,
    top_k_verify_lens_reference,
)
from sglang.srt.rounds.dspark.sps import SPSTable, SPSTableError
from sglang.srt.rounds.dspark.sts import (
    STSError,
    expected_calibration_error,
    fit_sts,
    load_sts_temperatures,
    observed_prefix_acceptance,
    prefix_survival,
    save_sts_temperatures,
)
from sglang.srt.rounds.dspark.verify import rejection_verify_block


def table(values, max_tokens=None) -> SPSTable:
    """SPS table with probes 1..len(values)."""
    return SPSTable.from_samples(list(enumerate(values, start=1)), max_tokens)


def survival(c) -> torch.Tensor:
    """Prefix survival from per-position confidences [R, g]."""
    return torch.tensor(c, dtype=torch.float64).cumprod(1)


# ------------------------------------------------------------------------------------------
# SPS table
# ------------------------------------------------------------------------------------------
def test_sps_lookup_rule_and_round_trip(tmp_path):
    t = SPSTable.from_dict({"sample_batch_tokens": [2, 4, 8], "sample_steps_per_sec":
                            [100, 90.5, 40], "max_batch_tokens": 10})
    # Floor to the largest probe <= B; the first value below the first probe; 0 past the max.
    expect = {0: 100.0, 1: 100.0, 2: 100.0, 3: 100.0, 4: 90.5, 7: 90.5, 8: 40.0, 10: 40.0,
              11: 0.0, 500: 0.0}
    assert {b: t.steps_per_sec(b) for b in expect} == expect
    assert t.dense() == [t.steps_per_sec(b) for b in range(12)]
    dense = t.as_tensor()
    assert dense.dtype == torch.float64 and dense.shape == (12,)
    path = tmp_path / "sps.json"
    t.save(path)
    assert SPSTable.load(path) == t
    assert json.loads(path.read_text())["sample_steps_per_sec"] == [100.0, 90.5, 40.0]
    flat = SPSTable.constant(6)
    assert flat.dense() == [1.0] * 7 + [0.0]
    # max_batch_tokens defaults to the last probe.
    assert SPSTable.from_dict({"sample_batch_tokens": [1, 3],
                               "sample_steps_per_sec": [2, 1]}).max_batch_tokens == 3


@pytest.mark.parametrize("data, match", [
    ([1, 2], "expected a JSON object"),
    ({"sample_steps_per_sec": [1.0]}, "missing field 'sample_batch_tokens'"),
    ({"sample_batch_tokens": [], "sample_steps_per_sec": []}, "'sample_batch_tokens' must be"),
    ({"sample_batch_tokens": [1, 2], "sample_steps_per_sec": [1.0]}, "has 2 entries"),
    ({"sample_batch_tokens": [1, 1], "sample_steps_per_sec": [1, 1]}, "strictly increasing"),
    ({"sample_batch_tokens": [0], "sample_steps_per_sec": [1]}, r"sample_batch_tokens\[0\]"),
    ({"sample_batch_tokens": [1, 2.5], "sample_steps_per_sec": [1, 1]},
     r"sample_batch_tokens\[1\]"),
    ({"sample_batch_tokens": [1, 2], "sample_steps_per_sec": [1, -3]},
     r"sample_steps_per_sec\[1\]"),
    ({"sample_batch_tokens": [1], "sample_steps_per_sec": [float("nan")]},
     r"sample_steps_per_sec\[0\]"),
    ({"sample_batch_tokens": [1], "sample_steps_per_sec": [True]}, r"sample_steps_per_sec\[0\]"),
    ({"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [1, 1], "max_batch_tokens": 4},
     "max_batch_tokens"),
    ({"bias_seconds": 0.01, "bs_probes": [1]}, "additive cost model"),
])
def test_sps_errors_name_the_field(tmp_path, data, match):
    path = tmp_path / "bad_sps.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SPSTableError, match=match) as info:
        SPSTable.load(path)
    assert str(path) in str(info.value)


def test_sps_file_errors(tmp_path):
    with pytest.raises(SPSTableError, match="file not found"):
        SPSTable.load(tmp_path / "missing.json")
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(SPSTableError, match="broken.json: not valid JSON"):
        SPSTable.load(bad)


# ------------------------------------------------------------------------------------------
# STS table and fitting
# ------------------------------------------------------------------------------------------
def test_sts_round_trip_and_errors(tmp_path):
    path = tmp_path / "sts.json"
    save_sts_temperatures(path, [1, 1.5, 2.25])
    assert load_sts_temperatures(path, gamma=3) == [1.0, 1.5, 2.25]
    assert json.loads(path.read_text()) == [1.0, 1.5, 2.25]
    with pytest.raises(STSError, match="has 3 temperatures, the draft's block size .* is 4"):
        load_sts_temperatures(path, gamma=4)
    for data, match in (([1.0, 0.0], r"entry \[1\]"), ([1.0, -2], r"entry \[1\]"),
                        (["1"], r"entry \[0\]"), ({"t": [1]}, "expected a non-empty JSON list"),
                        ([], "expected a non-empty JSON list")):
        path.write_text(json.dumps(data))
        with pytest.raises(STSError, match=match) as info:
            load_sts_temperatures(path)
        assert str(path) in str(info.value)
    with pytest.raises(STSError, match="file not found"):
        load_sts_temperatures(tmp_path / "nope.json")
    with pytest.raises(STSError, match="entry"):
        save_sts_temperatures(path, [1.0, float("inf")])


def test_prefix_survival_matches_reference():
    gen = torch.Generator().manual_seed(0)
    z = 3 * torch.randn(9, 5, generator=gen)
    temps = [0.5, 1.0, 2.0, 3.0, 0.7]
    for t in (None, temps):
        got = prefix_survival(z, None if t is None else torch.tensor(t, dtype=torch.float64))
        ref = prefix_survival_reference(z.numpy(), t)
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-13)
        assert got.dtype == torch.float64
        assert (got[:, 1:] <= got[:, :-1]).all()  # non-increasing along the block
    with pytest.raises(STSError, match="temperatures"):
        prefix_survival(z, torch.ones(4))


def test_observed_prefix_acceptance():
    labels, observed = observed_prefix_acceptance([0, 2, 3, 1], 3, verify_lens=[3, 2, 3, 1])
    assert labels.tolist() == [[False] * 3, [True, True, False], [True] * 3,
                               [True, False, False]]
    # Only verified positions count (row 1 verified 2 drafts, row 3 one).
    assert observed.tolist() == [[True] * 3, [True, True, False], [True] * 3,
                                 [True, False, False]]
    _, observed = observed_prefix_acceptance([0], 3, verify_lens=[1])
    assert observed.tolist() == [[True, False, False]]  # implied failures are not selected
    with pytest.raises(STSError, match="accepted_prefix_len"):
        observed_prefix_acceptance([3], 3, verify_lens=[2])
    with pytest.raises(STSError, match="verify_lens"):
        observed_prefix_acceptance([0], 3, verify_lens=[4])


def test_ece():
    p = torch.tensor([0.1, 0.1, 0.9, 0.9])
    assert float(expected_calibration_error(p, torch.tensor([0, 0, 1, 1]))) == pytest.approx(0.1)
    assert float(expected_calibration_error(torch.full((4,), 0.5), torch.tensor([0, 1, 0, 1]))
                 ) == pytest.approx(0.0)
    batched = expected_calibration_error(torch.stack([p, 1 - p]), torch.tensor([[0, 0, 1, 1]] * 2))
    assert batched.tolist() == pytest.approx([0.1, 0.9])


def synthetic_rounds(n: int, gamma: int, seed: int):
    """True conditional logits z, acceptance drawn from sigmoid(z) position by position."""
    gen = torch.Generator().manual_seed(seed)
    z = 1.2 + 1.5 * torch.randn(n, gamma, generator=gen, dtype=torch.float64)
    passed = torch.rand(n, gamma, generator=gen, dtype=torch.float64) < torch.sigmoid(z)
    accepted = passed.long().cumprod(1).sum(1)
    return z, accepted


def cumulative_ece(logits, accepted, temps):
    a = prefix_survival(logits, torch.tensor(temps, dtype=torch.float64))
    labels, _ = observed_prefix_acceptance(accepted, logits.shape[1])
    return [float(expected_calibration_error(a[:, k], labels[:, k])) for k in range(a.shape[1])]


def test_fit_sts_lowers_ece_of_miscalibrated_confidences():
    z, accepted = synthetic_rounds(20_000, 5, seed=1)
    scale = torch.tensor([3.0, 2.0, 2.5, 1.5, 4.0], dtype=torch.float64)
    reported = z * scale  # overconfident, differently at each position
    temps = fit_sts(reported, accepted)
    assert len(temps) == 5
    before = cumulative_ece(reported, accepted, [1.0] * 5)
    after = cumulative_ece(reported, accepted, temps)
    assert all(a < 0.25 * b for a, b in zip(after, before)), (before, after)
    assert max(after) < 0.02
    # The first temperature undoes the first position's scale (later ones compensate for the
    # product of earlier calibrated factors, so only the first is pinned down).
    assert temps[0] == pytest.approx(3.0, rel=0.15)
    coarse = torch.pow(10.0, torch.arange(-26, 27, dtype=torch.float64) / 20)
    # Calibrated confidences stay put: every temperature near 1.
    assert fit_sts(z, accepted, grid=coarse) == pytest.approx([1.0] * 5, rel=0.25)
    # Rounds with shorter verifies still fit (later positions see fewer observations).
    lens = torch.randint(0, 6, (20_000,), generator=torch.Generator().manual_seed(2))
    partial = fit_sts(reported, torch.minimum(accepted, lens), verify_lens=lens, grid=coarse)
    assert partial[0] == pytest.approx(3.0, rel=0.15)
    assert max(cumulative_ece(reported, accepted, partial)) < 0.03


def test_fit_sts_errors():
    with pytest.raises(STSError, match="confidence_logits"):
        fit_sts(torch.zeros(4), torch.zeros(4))
    with pytest.raises(STSError, match="rounds"):
        fit_sts(torch.zeros(4, 2), torch.zeros(3))
    with pytest.raises(STSError, match="finite"):
        fit_sts(torch.tensor([[float("nan")]]), torch.zeros(1))
    with pytest.raises(STSError, match="grid"):
        fit_sts(torch.zeros(4, 2), torch.zeros(4), grid=torch.tensor([1.0, -1.0]))


# ------------------------------------------------------------------------------------------
# Planner: device form == host reference
# ------------------------------------------------------------------------------------------
def random_case(rng: np.random.Generator):
    r, g = int(rng.integers(1, 7)), int(rng.integers(1, 6))
    z = rng.normal(1.0, 2.0, size=(r, g))
    if rng.random() < 0.3:
        z[rng.random(z.shape) < 0.3] = 50.0  # c == 1.0 exactly: ties inside a request
    if rng.random() < 0.3:
        z[int(rng.integers(r))] = z[0]  # identical requests: ties across requests
    a = prefix_survival_reference(z)
    probes = int(rng.integers(1, 12))
    sps = np.sort(rng.uniform(0.2, 1.0, size=probes))[::-1]  # mostly decreasing ...
    sps = sps * rng.uniform(0.9, 1.1, size=probes)  # ... with jags
    t = table(list(sps), int(rng.integers(probes, probes + r * (g + 1))))
    active = rng.random(r) < 0.8 if rng.random() < 0.5 else None
    max_lens = rng.integers(-1, g + 2, size=r) if rng.random() < 0.5 else None
    return a, t, active, max_lens


def as_torch(active, max_lens):
    return (None if active is None else torch.from_numpy(active),
            None if max_lens is None else torch.from_numpy(max_lens))


def test_device_form_equals_reference():
    rng = np.random.default_rng(0)
    distinct = set()
    for _ in range(400):
        a, t, active, max_lens = random_case(rng)
        act_t, max_t = as_torch(active, max_lens)
        at, dense = torch.from_numpy(a), t.as_tensor()
        lens = plan_verify_lens(at, dense, act_t, max_t)
        ref = plan_verify_lens_reference(a, t, active, max_lens)
        assert lens.tolist() == ref.tolist()
        cap = lagged_capacity(at, dense, act_t, max_t)
        assert int(cap) == lagged_capacity_reference(a, t, active, max_lens)
        for k in (0, 1, int(cap), a.size + 3):
            top = top_k_verify_lens(at, k, act_t, max_t, t.max_batch_tokens)
            assert top.tolist() == top_k_verify_lens_reference(
                a, k, active, max_lens, t.max_batch_tokens).tolist()
        assert top_k_verify_lens(at, cap, act_t, max_t).tolist() == \
            top_k_verify_lens_reference(a, int(cap), active, max_lens).tolist()
        distinct.add(tuple(ref.tolist()))
    assert len(distinct) > 50  # the cases exercise many different plans


def test_planner_end_to_end_from_logits(tmp_path):
    """DSparkPlanner (files -> STS -> survival -> plan) equals the reference chain."""
    sps_path, sts_path = tmp_path / "sps.json", tmp_path / "sts.json"
    t = table([1.0, 0.97, 0.95, 0.9, 0.7, 0.69, 0.5, 0.45, 0.3], 12)
    t.save(sps_path)
    temps = [1.0, 1.3, 1.6, 2.0]
    save_sts_temperatures(sts_path, temps)
    planner = DSparkPlanner(4, SPSTable.load(str(sps_path)),
                            load_sts_temperatures(str(sts_path), 4))
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        z = 2 * torch.randn(3, 4, generator=gen) + 1
        a = prefix_survival_reference(z.numpy(), temps)
        assert planner.plan(z).tolist() == plan_verify_lens_reference(a, t).tolist()
        k = planner.capacity(z)
        assert int(k) == lagged_capacity_reference(a, t)
        assert planner.plan_top_k(z, k).tolist() == top_k_verify_lens_reference(
            a, int(k), max_batch_tokens=12).tolist()
    with pytest.raises(ValueError, match="gamma=4"):
        planner.plan(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="STS temperatures"):
        DSparkPlanner(3, t, [1.0, 1.0])


# ------------------------------------------------------------------------------------------
# Planner: hand-made cases and properties
# ------------------------------------------------------------------------------------------
def test_batch_one():
    # Theta_0 = 1 * 1.0; + a1: 1.8 * 0.9 = 1.62 (kept); + a2: 2.28 * 0.5 = 1.14 (stop).
    t = table([1.0, 0.9, 0.5, 0.5])
    a = survival([[0.8, 0.6, 0.9]])
    assert plan_verify_lens(a, t.as_tensor()).tolist() == [1]
    # Unconstrained: Theta_3 = (1 + .8 + .48 + .432) * 0.5 = 1.356 < 1.62 -> also 1.
    assert int(lagged_capacity(a, t.as_tensor())) == 1
    # A flat table verifies the whole block; a table too small for one anchor verifies none.
    assert plan_verify_lens(a, SPSTable.constant(8).as_tensor()).tolist() == [3]
    assert plan_verify_lens(a, table([1.0], 1).as_tensor()).tolist() == [0]
    # Verify length capped per request.
    flat = SPSTable.constant(8).as_tensor()
    assert plan_verify_lens(a, flat, max_lens=torch.tensor([2])).tolist() == [2]
    assert plan_verify_lens(a, flat, active=torch.tensor([False])).tolist() == [0]


def test_ties_keep_request_then_position_order():
    t = SPSTable.constant(64)
    a = survival([[1.0, 1.0, 0.5], [1.0, 1.0, 0.5], [0.9, 1.0, 1.0]])
    # Values: r0 = r1 = [1, 1, .5], r2 = [.9, .9, .9]. Top-3: r0's two 1.0s, then r1's first.
    assert top_k_verify_lens(a, 3).tolist() == [2, 1, 0]
    assert top_k_verify_lens(a, 5).tolist() == [2, 2, 1]
    assert top_k_verify_lens(a, 8).tolist() == [3, 2, 3]
    assert top_k_verify_lens(a, 100).tolist() == [3, 3, 3]
    assert plan_verify_lens(a, t.as_tensor()).tolist() == [3, 3, 3]


def test_top_k_properties():
    rng = np.random.default_rng(1)
    for _ in range(50):
        a, _, active, max_lens = random_case(rng)
        act_t, max_t = as_torch(active, max_lens)
        at = torch.from_numpy(a)
        r, g = a.shape
        caps = np.full(r, g) if max_lens is None else np.clip(max_lens, 0, g)
        if active is not None:
            caps = np.where(active, caps, 0)
        prev = np.zeros(r, dtype=np.int64)
        for k in range(a.size + 2):
            lens = top_k_verify_lens(at, k, act_t, max_t).numpy()
            assert (lens >= prev).all()  # monotone in the budget
            assert lens.sum() == min(k, caps.sum()) and (lens <= caps).all()
            # The admitted set is the k best: no admitted value below a valid rejected one.
            admitted = np.arange(g)[None, :] < lens[:, None]
            valid = np.arange(g)[None, :] < caps[:, None]
            if admitted.any() and (valid & ~admitted).any():
                assert a[admitted].min() >= a[valid & ~admitted].max()
            prev = lens


def test_capacity_at_least_early_stop_and_equal_when_unimodal():
    rng = np.random.default_rng(2)
    for _ in range(100):
        a, t, active, max_lens = random_case(rng)
        act_t, max_t = as_torch(active, max_lens)
        at = torch.from_numpy(a)
        early = plan_verify_lens(at, t.as_tensor(), act_t, max_t).sum()
        assert int(lagged_capacity(at, t.as_tensor(), act_t, max_t)) >= int(early)
        # Linear SPS decay: tau is concave and SPS decreasing -> Theta is unimodal along the
        # sorted walk, so the early stop is the global optimum.
        r, g = a.shape
        linear = table([1.0 - 0.02 * i for i in range(r * (g + 1))])
        early = plan_verify_lens(at, linear.as_tensor(), act_t, max_t).sum()
        assert int(lagged_capacity(at, linear.as_tensor(), act_t, max_t)) == int(early)


def test_no_host_reads(monkeypatch):
    calls = []
    for name in ("plan_verify_lens", "lagged_capacity", "top_k_verify_lens"):
        refuse_host_reads(monkeypatch, dspark_planner, name, calls)
    a = survival([[0.9, 0.8], [0.7, 0.7], [0.5, 0.4]])
    dense = table([1.0, 0.9, 0.8, 0.6, 0.5]).as_tensor()
    active = torch.tensor([True, True, False])
    max_lens = torch.tensor([1, 2, 2])
    dspark_planner.plan_verify_lens(a, dense, active, max_lens)
    k = dspark_planner.lagged_capacity(a, dense, active, max_lens)
    dspark_planner.top_k_verify_lens(a, k, active, max_lens, max_batch_tokens=5)
    assert len(calls) == 3


def test_bad_planner_inputs():
    a = survival([[0.9, 0.8]])
    dense = SPSTable.constant(4).as_tensor()
    with pytest.raises(ValueError, match="prefix survival"):
        plan_verify_lens(a[0], dense)
    with pytest.raises(ValueError, match="active"):
        plan_verify_lens(a, dense, active=torch.tensor([1]))
    with pytest.raises(ValueError, match="max_lens"):
        plan_verify_lens(a, dense, max_lens=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="sps_dense"):
        lagged_capacity(a, dense[:1])


# ------------------------------------------------------------------------------------------
# Why the early stop: the paper's App. A
# ------------------------------------------------------------------------------------------
def retrospective_lens(a: np.ndarray, sps: SPSTable) -> np.ndarray:
    """A search that looks past the first non-improving candidate: the unconstrained best
    prefix of the *current* candidates."""
    return top_k_verify_lens_reference(a, lagged_capacity_reference(a, sps))


def paper_first_token(p, q, lens_by_draft):
    """Closed-form distribution of the first committed token under the paper's verification
    (no draft verified -> sample the target; else accept x with min(1, p/q), residual
    otherwise) when the verify length is ``lens_by_draft[x]`` for first draft ``x``."""
    p, q = np.asarray(p), np.asarray(q)
    residual = np.maximum(p - q, 0)
    residual = residual / residual.sum()
    out = np.zeros_like(p)
    for x, qx in enumerate(q):
        if lens_by_draft[x] == 0:
            out += qx * p
        else:
            keep = min(1.0, p[x] / qx)
            out[x] += qx * keep
            out += qx * (1 - keep) * residual
    return out


def test_app_a_counterexample_closed_form():
    """Target (0.7, 0.3), draft (0.5, 0.5), a_1 = 0.8, SPS(1, 2, 3) = (1.0, 0.5, 0.45); the
    second confidence depends on the first draft (Markov feature): c_2 = 1 after token A,
    0.1 after B. Early stop never verifies (Theta_1 = 0.9 < 1); the retrospective search
    verifies both drafts exactly when x_1 = A, which lifts P(A) from 0.7 to 0.85."""
    sps = table([1.0, 0.5, 0.45])
    c2 = {0: 1.0, 1: 0.1}
    early, retro = {}, {}
    for x1 in (0, 1):
        a = np.array([[0.8, 0.8 * c2[x1]]])
        early[x1] = int(plan_verify_lens_reference(a, sps)[0])
        retro[x1] = int(retrospective_lens(a, sps)[0])
        assert early[x1] == int(plan_verify_lens(torch.from_numpy(a), sps.as_tensor())[0])
    assert early == {0: 0, 1: 0}  # independent of the draft it would admit
    assert retro == {0: 2, 1: 0}  # x_1 decides whether x_1 is verified
    np.testing.assert_allclose(paper_first_token([0.7, 0.3], [0.5, 0.5], early), [0.7, 0.3])
    np.testing.assert_allclose(paper_first_token([0.7, 0.3], [0.5, 0.5], retro), [0.85, 0.15])


def test_app_a_one_step_deeper_through_our_verification():
    """Our verification draws the token at the cap by a rejection step on the next draft, so
    the two-draft example above stays exact; one draft deeper it does not. gamma = 3, target
    (0.7, 0.3) and draft (0.5, 0.5) at every position, c = (0.8, 0.5, c_3(x_2)) with c_3 = 1
    after A and 0.01 after B, SPS(1..4) = (1, 0.5, 0.45, 0.45): early stop verifies nothing,
    the retrospective search verifies all three drafts iff x_2 = A. The second committed token
    must be A with probability 0.7; the retrospective plan gives 0.5 * (0.8 + 0.2 * 0.7) +
    0.5 * 0.7 = 0.82. A lagged capacity (from earlier, independent confidences) stays exact."""
    sps = table([1.0, 0.5, 0.45, 0.45])
    a_of = {x2: np.array([[0.8, 0.4, 0.4 * (1.0 if x2 == 0 else 0.01)]]) for x2 in (0, 1)}
    early = {x2: int(plan_verify_lens_reference(a, sps)[0]) for x2, a in a_of.items()}
    retro = {x2: int(retrospective_lens(a, sps)[0]) for x2, a in a_of.items()}
    assert early == {0: 0, 1: 0} and retro == {0: 3, 1: 0}

    n, g = 200_000, 3
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.7, 0.3])
    q = torch.tensor([0.5, 0.5])

    def second_token(rule):
        drafts = (torch.rand(n, g, generator=gen) < 0.5).long()  # token 1 (B) w.p. 0.5
        lens = rule(drafts)
        res = rejection_verify_block(drafts, q.expand(n, g, 2), p.expand(n, g + 1, 2), lens,
                                     uniforms=torch.rand(n, g + 1, generator=gen))
        # A round that committed one token is followed by a fresh draw from the target.
        fresh = (torch.rand(n, generator=gen) >= 0.7).long()
        return torch.where(res.accept_len >= 2, res.accepted_tokens[:, 1], fresh)

    def share_of_a(tokens):
        return float((tokens == 0).double().mean())

    tol = 4 * (0.7 * 0.3 / n) ** 0.5
    by_x2 = torch.tensor([retro[0], retro[1]])
    assert abs(share_of_a(second_token(lambda d: by_x2[d[:, 1]])) - 0.82) < tol
    assert abs(share_of_a(second_token(lambda d: torch.full((n,), early[0]))) - 0.7) < tol
    # Lagged: K from the previous round's (independent) drafts, then top-K of the current.
    old = (torch.rand(n, generator=gen) < 0.5).long()
    lagged = torch.tensor([lagged_capacity_reference(a_of[x], sps) for x in (0, 1)])[old]
    assert abs(share_of_a(second_token(lambda d: lagged.clamp(max=g))) - 0.7) < tol


# ------------------------------------------------------------------------------------------
# GPU: the planner captures in a CUDA graph
# ------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_planner_captures_in_cuda_graph():
    dev = "cuda"
    planner = DSparkPlanner(4, table([1.0, 0.95, 0.9, 0.7, 0.6, 0.5, 0.4, 0.3], 20),
                            [1.0, 1.2, 1.4, 1.6], device=dev)
    z = torch.randn(5, 4, device=dev)
    active = torch.tensor([True, True, True, False, True], device=dev)

    def body():
        k = planner.capacity(z, active)
        return planner.plan(z, active), planner.plan_top_k(z, k, active)

    eager = body()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(out, eager))
