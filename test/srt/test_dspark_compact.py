"""DSpark's compact verify (``--speculative-dspark-verify-mode compact``): each round's target forward
holds the anchor and a tier of drafts (:func:`verify_tiers`) that the host picks from the lagged
planner's budget before the round is enqueued.

* Greedy output still equals plain decoding (batch 1 and a staggered batch of 3), rounds run at
  more than one tier, and no round verifies more drafts than its tier;
* emulated CUDA graphs (one per tier) equal the eager compact rounds for greedy, seeded and
  logprob rows; the round reads nothing from the device on the host;
* the mode's requirements are refused with messages naming the variable or the flag.
"""
from __future__ import annotations

from typing import Any, List, Optional

import pytest

from engine_test_utils import make_scheduler, refuse_host_reads
from sglang.srt.rounds.dspark.planner import tier_for_budget, verify_tiers
from test_cuda_graph_runner import _requests, _run, assert_same_outputs
from test_dspark_worker import (GAMMA, GRAPH_KW, KW, MODEL, check_lossless, ckpts,  # noqa: F401
                                greedy, install_oracle, plain, prompts, ref, run)

pytestmark = pytest.mark.usefixtures("two_torch_threads")


def compact(ckpts, draft: str = "random", **kw: Any):
    """A DSPARK scheduler in compact mode with the cutting SPS table (overlap on); the STS
    table at the checkpoints' own block size."""
    if "speculative_dspark_block_size" not in kw:
        kw["speculative_dspark_confidence_sts_path"] = ckpts["sts"]
    return make_scheduler(MODEL, speculative_algorithm="DSPARK",
                          speculative_draft_model_path=ckpts[draft],
                          speculative_dspark_sps_table_path=ckpts["sps"],
                          speculative_dspark_verify_mode="compact", **kw)


def test_tiers_and_the_budget_they_hold():
    assert verify_tiers(16) == [4, 8, 16] and verify_tiers(4) == [1, 2, 4]
    assert verify_tiers(1) == [1] and verify_tiers(3) == [1, 3]
    tiers = verify_tiers(16)
    assert [tier_for_budget(tiers, b) for b in (None, 0, 1, 4, 5, 8, 9, 40)] == \
        [16, 4, 4, 4, 8, 8, 16, 16]


def test_greedy_is_lossless_and_rounds_shrink_to_their_tier(ckpts, prompts, ref, monkeypatch):
    sched = compact(ckpts, "oracle", **KW)
    install_oracle(sched.draft_worker, [p[-1:] + r for p, r in zip(prompts, ref)])
    worker = sched.draft_worker
    shapes: List[Optional[int]] = []
    verified: List[tuple] = []
    apply, launch = worker.apply_round_shape, worker.pending_round

    def record_shape(shape):
        shapes.append(shape)
        apply(shape)

    def pending(*args: Any, **kwargs: Any):
        result = launch(*args, **kwargs)
        verified.append((worker.verify_drafts, result.host_copy))
        return result

    monkeypatch.setattr(worker, "apply_round_shape", record_shape)
    monkeypatch.setattr(worker, "pending_round", pending)
    check_lossless(sched, prompts, ref)
    assert len(set(shapes)) > 1 and min(shapes) < GAMMA, shapes  # several tiers ran
    for tier, copy in verified:
        host = copy.wait()
        assert int(host["verify_len"].max()) <= tier
        assert (host["accept_len"] <= tier + 1).all()
        assert (host["tokens"][:, tier + 1:] == -1).all()  # the block's width, padded
    state = worker.internal_state()
    assert state["dspark_verify_mode"] == "compact"
    assert state["dspark_planner"] == "lagged-top-k"


def test_emulated_graphs_equal_eager_compact_rounds(ckpts):
    eager = compact(ckpts, **GRAPH_KW)
    want = _run(eager, _requests(eager.tokenizer), stagger=3)
    graphed = compact(ckpts, **GRAPH_KW)
    graphed.round_worker.init_cuda_graphs([1, 2, 4], emulate=True)
    runner = graphed.round_worker.graph_runner
    got = _run(graphed, _requests(graphed.tokenizer), stagger=3)
    assert_same_outputs(got, want)
    assert runner.num_replays > 0
    assert len({k.round_shape for k in runner.graphs}) > 1, list(runner.graphs)


def test_compact_round_never_reads_device_values_on_the_host(ckpts, prompts, ref, monkeypatch):
    sched = compact(ckpts, **KW)
    rounds: List[Any] = []
    refuse_host_reads(monkeypatch, sched.draft_worker, "forward_round", rounds)
    ids, _ = run(sched, [greedy("h0", prompts[0], 8)])
    assert len(rounds) >= 3 and ids["h0"] == ref[0][:8]


@pytest.mark.parametrize("mode,kw,message", [
    ("compact", dict(disable_overlap_schedule=True), "needs the overlap|runs with the overlap"),
    ("compact", dict(sps=False), "needs --speculative-dspark-sps-table-path"),
    ("cap-accept", dict(sps=False), "needs --speculative-dspark-sps-table-path"),
    ("ragged", {}, "--speculative-dspark-verify-mode must be one of auto, static"),
])
def test_mode_requirements_are_named(ckpts, mode, kw, message):
    args = dict(KW, speculative_algorithm="DSPARK", speculative_draft_model_path=ckpts["random"])
    if kw.pop("sps", True):
        args["speculative_dspark_sps_table_path"] = ckpts["sps"]
    with pytest.raises(ValueError, match=message):
        make_scheduler(MODEL, **args, **kw, speculative_dspark_verify_mode=mode)


def test_static_mode_verifies_every_draft_despite_a_table(ckpts, prompts, ref):
    sched = make_scheduler(MODEL, speculative_algorithm="DSPARK",
                           speculative_draft_model_path=ckpts["random"],
                           speculative_dspark_sps_table_path=ckpts["sps"],
                           speculative_dspark_verify_mode="static", **KW)
    assert sched.draft_worker.internal_state()["dspark_planner"] == "verify-all"
    ids, _ = run(sched, [greedy("s0", prompts[0], 8)])
    assert ids["s0"] == ref[0][:8]
