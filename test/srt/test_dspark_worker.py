"""DSpark speculative decoding (``--speculative-algorithm DSPARK``) on the bundled target with
random draft checkpoints, in process.

* Lossless: greedy DSPARK == greedy plain decoding token for token at batch 1 and at batch 3
  with staggered arrivals and ragged lengths, overlap on and off, for a random draft (nearly
  nothing accepted) and an "oracle" draft whose Markov head is set to the reference continuation
  (most drafts accepted, so multi-token commits, KDA commits at every window index and context
  writes of several rows happen); also with the confidence scheduler (early stop; lagged budget +
  top-K under overlap), which caps acceptance.
* The draft's context: every draft pass equals a from-scratch one whose context is the target's
  hidden states of exactly the committed tokens (prefill + accepted windows).
* Sampling: top-k 1 sampling (the rejection-sampling path, deterministic) == greedy; seeded
  sampling reproducible across runs and overlap modes. The rejection rule itself is proven
  exact in test_dspark_verify.py.
* Emulated CUDA graphs == eager through the scheduler; a round never reads device values on the
  host; metrics; flag and draft validation.
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

import pytest
import torch

from engine_test_utils import (held_out_prompts, make_scheduler, refuse_host_reads, sampling,
                               submit_staggered)
from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.srt.managers.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang.srt.rounds.dspark.setup import dspark_setup
from sglang.srt.rounds.dspark.worker import DSparkWorker
from sglang.srt.rounds.registry import get_spec_worker_class
from sglang.srt.speculative.spec_info import SpecMetricsOutput
from sglang.test.random_dspark_checkpoint import tiny_dspark_config, write_random_dspark_checkpoint
from test_cuda_graph_runner import _requests, _run, assert_same_outputs

MODEL = str(BUNDLED_MODEL_DIR)
TARGET = ModelConfig.from_path(MODEL)
VOCAB = TARGET.vocab_size
GAMMA = 4  # the random checkpoints' block_size
GEN = 20
KW = dict(max_total_tokens=4096, max_running_requests=8)

pytestmark = pytest.mark.usefixtures("two_torch_threads")


def request(rid: str, ids: List[int], **kw: Any) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid, None, list(ids), sampling(VOCAB, **kw))


def greedy(rid: str, prompt: List[int], n: int = GEN) -> TokenizedGenerateReqInput:
    return request(rid, prompt, max_new_tokens=n, temperature=0, ignore_eos=True)


def run(sched: Scheduler, reqs, stagger: int = 0) -> Tuple[Dict[str, List[int]], Dict]:
    """Token ids per rid, and the spec metrics ``(verify_ct, correct, proposed)`` per rid."""
    submit_staggered(sched, reqs, stagger)
    ids: Dict[str, List[int]] = {}
    spec: Dict[str, Tuple[int, int, int]] = {}
    for msg in sched.outbox:
        if isinstance(msg, SpecMetricsOutput):
            for i, rid in enumerate(msg.rids):
                spec[rid] = (msg.spec_verify_ct[i], msg.spec_num_correct_drafts[i],
                             msg.spec_num_proposed_drafts[i])
        elif isinstance(msg, BatchTokenIDOutput):
            for i, rid in enumerate(msg.rids):
                ids.setdefault(rid, []).extend(msg.decode_ids[i])
    sched.outbox.clear()
    return ids, spec


# ------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Dict[str, str]:
    """Draft checkpoints: ``random`` (rank 16) and ``oracle`` (rank 64, weights set later),
    an SPS table that makes the scheduler cut blocks, and an STS table."""
    root = tmp_path_factory.mktemp("dspark")
    out = {"random": write_random_dspark_checkpoint(str(root / "random"), seed=3),
           "oracle": write_random_dspark_checkpoint(
               str(root / "oracle"), tiny_dspark_config(markov_rank=64), seed=4),
           "sps": str(root / "sps.json"), "sts": str(root / "sts.json")}
    with open(out["sps"], "w") as f:  # steep beyond 3 tokens: a request verifies ~2 drafts
        json.dump({"sample_batch_tokens": [1, 2, 3, 4, 8, 12],
                   "sample_steps_per_sec": [1.0, 0.95, 0.9, 0.35, 0.3, 0.25],
                   "max_batch_tokens": 32}, f)
    with open(out["sts"], "w") as f:
        json.dump([1.0, 1.2, 1.4, 1.6], f)
    return out


@pytest.fixture(scope="module")
def plain() -> Scheduler:
    return make_scheduler(MODEL, **KW)


@pytest.fixture(scope="module")
def prompts(plain) -> List[List[int]]:
    """Three 24-token prompts from held-out Python files, each at a function definition."""
    return held_out_prompts(plain.tokenizer)


@pytest.fixture(scope="module")
def ref(plain, prompts) -> List[List[int]]:
    """Plain greedy decoding of the prompts."""
    ids, _ = run(plain, [greedy(f"p{i}", p) for i, p in enumerate(prompts)])
    return [ids[f"p{i}"] for i in range(len(prompts))]


_SCHEDULERS: Dict[Tuple, Scheduler] = {}


def dspark(ckpts, prompts, ref, draft: str = "random", **kw: Any) -> Scheduler:
    """One DSPARK scheduler per configuration for the module; the oracle draft's Markov head
    maps each token of the reference continuations to the token after it."""
    key = (draft, tuple(sorted(kw.items())))
    if key not in _SCHEDULERS:
        sched = make_scheduler(MODEL, speculative_algorithm="DSPARK",
                               speculative_draft_model_path=ckpts[draft], **{**KW, **kw})
        if draft == "oracle":
            install_oracle(sched.draft_worker, [p[-1:] + r for p, r in zip(prompts, ref)])
        _SCHEDULERS[key] = sched
    return _SCHEDULERS[key]


@torch.no_grad()
def install_oracle(worker: DSparkWorker, seqs: List[List[int]]) -> None:
    """Markov bias ``+1000`` on ``next`` after ``prev`` for every consecutive pair of ``seqs``
    (one rank per distinct ``prev``; the last pair wins)."""
    pairs: Dict[int, int] = {}
    for s in seqs:
        pairs.update(zip(s[:-1], s[1:]))
    w1 = worker.draft.markov_head.markov_w1.weight
    w2 = worker.draft.markov_head.markov_w2.weight  # [V, rank]
    assert len(pairs) <= w1.shape[1]
    w1.zero_()
    w2.zero_()
    for i, (prev, nxt) in enumerate(pairs.items()):
        w1[prev, i] = 1.0
        w2[nxt, i] = 1000.0


def check_lossless(sched: Scheduler, prompts, ref) -> None:
    """Batch 1, then batch 3 with staggered arrivals and ragged lengths."""
    ids, spec = run(sched, [greedy("solo", prompts[0])])
    assert ids["solo"] == ref[0]
    ct, correct, proposed = spec["solo"]
    assert proposed == ct * GAMMA and 0 <= correct <= ct * GAMMA
    lens = [GEN, 13, GEN]
    ids, _ = run(sched, [greedy(f"b{i}", prompts[i], n) for i, n in enumerate(lens)], stagger=2)
    for i, n in enumerate(lens):
        assert ids[f"b{i}"] == ref[i][:n], f"batch 3, request {i}"


# ------------------------------------------------------------------------------- lossless
@pytest.mark.parametrize("draft", ["random", "oracle"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_greedy_matches_plain_decoding(ckpts, prompts, ref, draft, overlap):
    sched = dspark(ckpts, prompts, ref, draft, disable_overlap_schedule=not overlap)
    check_lossless(sched, prompts, ref)
    accept = sched.get_internal_state()["avg_spec_accept_length"]
    if draft == "oracle":
        assert accept > 2.0, accept  # most drafts accepted: multi-token rounds happened
    assert 1.0 <= accept <= GAMMA + 1


@pytest.mark.parametrize("overlap", [False, True], ids=["early-stop", "lagged-top-k"])
def test_confidence_scheduler_is_lossless_and_cuts_blocks(ckpts, prompts, ref, overlap,
                                                          monkeypatch):
    """Greedy output unchanged; no round accepts more drafts than it planned to verify; the
    plans do cut blocks; the lagged planner runs under overlap."""
    sched = dspark(ckpts, prompts, ref, "oracle", disable_overlap_schedule=not overlap,
                   speculative_dspark_sps_table_path=ckpts["sps"],
                   speculative_dspark_confidence_sts_path=ckpts["sts"])
    worker = sched.draft_worker
    rounds: List[Tuple[List[int], List[int]]] = []
    launch = worker.pending_round

    def pending(*args: Any, **kwargs: Any):
        result = launch(*args, **kwargs)
        wait = result.wait

        def wait_and_record():
            out = wait()
            rounds.append((result.host_copy.wait()["verify_len"].tolist(), out.accept_lens))
            return out

        result.wait = wait_and_record
        return result

    monkeypatch.setattr(worker, "pending_round", pending)
    check_lossless(sched, prompts, ref)
    pairs = [(l, a) for lens, accepts in rounds for l, a in zip(lens, accepts)]
    assert all(0 <= a - 1 <= l <= GAMMA for l, a in pairs)
    assert any(l < GAMMA for l, _ in pairs) and any(a > 2 for _, a in pairs)
    state = worker.internal_state()
    assert state["dspark_planner"] == ("lagged-top-k" if overlap else "early-stop")
    assert 0 < state["dspark_avg_planned_verify_len"] < GAMMA


@pytest.mark.parametrize("chunk", [None, 8], ids=["one-prefill", "chunked-prefill"])
def test_context_holds_exactly_the_committed_tokens(ckpts, prompts, ref, monkeypatch, chunk):
    """Each round's draft pass (oracle draft: windows of every accept length) equals a pass over
    a fresh context built from a from-scratch prefill of the committed sequence; also when the
    prompt's context arrives in chunks of 8."""
    extra = {} if chunk is None else dict(chunked_prefill_size=chunk)
    sched = dspark(ckpts, prompts, ref, "oracle", **extra)
    draft = sched.draft_worker.draft
    calls = []
    inner = draft.forward_block

    def record(anchor, pos, cache, slots, ctx_lens, width=None):
        h, logits = inner(anchor, pos, cache, slots, ctx_lens, width)
        calls.append((int(anchor[0]), int(pos[0]), int(ctx_lens[0]), logits[0].clone()))
        return h, logits

    monkeypatch.setattr(draft, "forward_block", record)
    ids, spec = run(sched, [greedy("ctx", prompts[1])])
    # With overlap one more round is launched before the host sees the finish.
    assert ids["ctx"] == ref[1] and spec["ctx"][0] <= len(calls) <= spec["ctx"][0] + 1 < GEN
    seq = prompts[1] + ids["ctx"]
    aux = target_aux(seq, draft.config.target_layer_ids)
    for anchor, pos, ctx_len, logits in calls[:spec["ctx"][0]]:
        assert anchor == seq[pos] and ctx_len == pos  # context = every position before it
        cache = draft.new_context_cache(1, len(seq) + GAMMA)
        with torch.no_grad():
            draft.write_context(aux[:pos], torch.arange(pos), torch.zeros(pos, dtype=torch.long),
                                cache)
            _, want = inner(torch.tensor([anchor]), torch.tensor([pos]), cache,
                            torch.tensor([0]), torch.tensor([pos]))
        torch.testing.assert_close(logits, want[0], atol=2e-4, rtol=2e-4)


def target_aux(seq: List[int], layers: List[int]) -> torch.Tensor:
    """The target's outputs of ``layers`` for every token of ``seq`` by one prefill."""
    runner = ModelRunner(TARGET, device="cpu", dtype=torch.float32, max_running_requests=1,
                         max_total_tokens=len(seq) + 8)
    runner.model.set_dspark_layers_to_capture(layers)
    slot = runner.req_to_token_pool.alloc(1)[0]
    loc = runner.token_to_kv_pool_allocator.alloc(len(seq))
    runner.req_to_token_pool.write(slot, 0, loc)
    fb = ForwardBatch.for_extend(torch.tensor(seq), [slot], [0], [len(seq)], loc)
    return runner.forward(fb).aux_hidden_states


# ------------------------------------------------------------------------------- sampling
def test_top_k_1_sampling_equals_greedy(ckpts, prompts, ref):
    """Top-k 1 makes both distributions one-hot, so the rejection-sampling path (draft
    distributions, coins, residuals, the capped final token) must reproduce greedy exactly."""
    sched = dspark(ckpts, prompts, ref, "oracle")
    reqs = [request(f"k{i}", prompts[i], max_new_tokens=GEN, temperature=0.7, top_k=1,
                    ignore_eos=True) for i in range(2)]
    ids, _ = run(sched, reqs, stagger=1)
    assert [ids["k0"], ids["k1"]] == ref[:2]


def test_seeded_sampling_is_reproducible(ckpts, prompts, ref):
    """Seeded sampled rows (next to a greedy row) give the same tokens on a second run and with
    the overlap schedule off; the greedy row stays exact; every token is in the vocabulary."""
    def reqs():
        return [request("s0", prompts[0], max_new_tokens=12, temperature=1.0, top_p=0.9,
                        sampling_seed=11, ignore_eos=True),
                request("s1", prompts[1], max_new_tokens=9, temperature=0.6, sampling_seed=12,
                        ignore_eos=True),
                greedy("g2", prompts[2], 12)]

    on = dspark(ckpts, prompts, ref)
    first, _ = run(on, reqs(), stagger=1)
    again, _ = run(on, reqs(), stagger=1)
    off, _ = run(dspark(ckpts, prompts, ref, disable_overlap_schedule=True), reqs(), stagger=1)
    assert first == again == off
    assert len(first["s0"]) == 12 and len(first["s1"]) == 9 and first["g2"] == ref[2][:12]
    assert all(0 <= t < VOCAB for t in first["s0"] + first["s1"])


# ------------------------------------------------------------------------------- graphs
# Block size 3: a bucket-4 verify (4 x 4 tokens, top-4 experts) stays within the torch-native
# MoE's capture limit (64 token-expert pairs).
GRAPH_KW = dict(KW, speculative_dspark_block_size=3)


@pytest.fixture(scope="module")
def graph_eager(ckpts) -> Dict[str, List[int]]:
    """test_cuda_graph_runner's requests (greedy, seeded top-k, penalised, logprob rows),
    staggered, through an eager DSPARK scheduler with the lagged confidence scheduler."""
    eager = make_scheduler(MODEL, speculative_algorithm="DSPARK",
                           speculative_draft_model_path=ckpts["random"],
                           speculative_dspark_sps_table_path=ckpts["sps"], **GRAPH_KW)
    return _run(eager, _requests(eager.tokenizer), stagger=3)


@pytest.mark.parametrize("per_phase", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["one-graph", "per-phase"])
def test_emulated_graphs_equal_eager_through_the_scheduler(ckpts, graph_eager, per_phase):
    """Batches of 1..4 replay buckets 1, 2 and 4 with padding rows (the lagged planner's padding
    rows inactive); the outputs equal the eager ones (:func:`assert_same_outputs`)."""
    graphed = make_scheduler(MODEL, speculative_algorithm="DSPARK",
                             speculative_draft_model_path=ckpts["random"],
                             speculative_dspark_sps_table_path=ckpts["sps"], **GRAPH_KW)
    graphed.round_worker.init_cuda_graphs([1, 2, 4], emulate=True, per_phase=per_phase)
    runner = graphed.round_worker.graph_runner
    got = _run(graphed, _requests(graphed.tokenizer), stagger=3)
    assert_same_outputs(got, graph_eager)
    assert runner.num_replays > 0 and {1, 2, 4} <= {k.bs for k in runner.graphs}
    assert any(k.variant == "sampled" for k in runner.graphs)
    assert any(k.return_logprob for k in runner.graphs) and len(got["l4:lp"]) == 30
    assert all(k.width is not None for k in runner.graphs)  # keyed by the context width


def test_round_never_reads_device_values_on_the_host(ckpts, prompts, ref, monkeypatch):
    """Draft, plan (lagged budget + top-K), verify, commits and the context write of a round
    are launched without any tensor-to-Python conversion; greedy and seeded sampled rows."""
    sched = dspark(ckpts, prompts, ref, speculative_dspark_sps_table_path=ckpts["sps"])
    rounds: List[Any] = []
    refuse_host_reads(monkeypatch, sched.draft_worker, "forward_round", rounds)
    reqs = [greedy("h0", prompts[0], 6),
            request("h1", prompts[1], max_new_tokens=6, temperature=0.9, sampling_seed=2,
                    ignore_eos=True)]
    ids, _ = run(sched, reqs)
    assert len(rounds) >= 3 and ids["h0"] == ref[0][:6] and len(ids["h1"]) == 6


# ------------------------------------------------------------------------------- setup
def test_registry_target_layers_and_sizing(ckpts, prompts, ref):
    assert get_spec_worker_class("dspark") is DSparkWorker
    sched = dspark(ckpts, prompts, ref)
    worker = sched.draft_worker
    layers = worker.draft.config.target_layer_ids
    assert sched.tp_worker.model_runner.model.dspark_layers_to_capture == tuple(layers)
    assert (worker.round_tokens, worker.proposed_per_round) == (GAMMA + 1, GAMMA)
    assert sched.tp_worker.model_runner.spec_num_draft_tokens == GAMMA + 1
    state = sched.get_internal_state()
    assert "avg_spec_accept_length" in state
    assert worker.internal_state()["speculative_num_draft_tokens"] == GAMMA + 1
    args = SimpleNamespace(speculative_draft_model_path=ckpts["random"],
                           speculative_dspark_block_size=2)
    req = DSparkWorker.requirements(args, TARGET)  # --speculative-dspark-block-size wins
    assert (req.kda_scratch_depth, req.token_headroom, req.draft_extra_mla_layers) == (3, 6, False)


def _args(ckpts, **kw: Any) -> SimpleNamespace:
    return SimpleNamespace(**{"speculative_draft_model_path": ckpts["random"], **kw})


@pytest.mark.parametrize("kw,message", [
    (dict(speculative_num_steps=3), "--speculative-num-steps is NEXTN-only"),
    (dict(speculative_num_draft_tokens=5), "--speculative-num-draft-tokens is NEXTN-only"),
    (dict(speculative_eagle_topk=2), "--speculative-eagle-topk"),
    (dict(speculative_draft_model_path="/nonexistent/draft"), "--speculative-draft-model-path"),
    (dict(speculative_dspark_confidence_sts_path="STS"), "runs only with"),
    (dict(speculative_dspark_sps_table_path="SPS", speculative_dspark_confidence_sts_path="BAD4"),
     "--speculative-dspark-confidence-sts-path: .*has 3 temperatures.*gamma\\) is 4"),
    (dict(speculative_dspark_sps_table_path="BADSPS"), "--speculative-dspark-sps-table-path: "),
    (dict(speculative_dspark_sps_table_path="SPS", speculative_draft_model_path="NOCONF"),
     "needs a draft with a confidence head"),
])
def test_setup_refusals_name_the_flag(ckpts, tmp_path, kw, message):
    files = {"SPS": ckpts["sps"], "STS": ckpts["sts"]}
    (tmp_path / "bad4.json").write_text("[1.0, 1.0, 1.0]")
    (tmp_path / "badsps.json").write_text('{"sample_batch_tokens": [1]}')
    files.update(BAD4=str(tmp_path / "bad4.json"), BADSPS=str(tmp_path / "badsps.json"))
    if kw.get("speculative_draft_model_path") == "NOCONF":
        files["NOCONF"] = write_random_dspark_checkpoint(
            str(tmp_path / "noconf"), tiny_dspark_config(enable_confidence_head=False))
    kw = {k: files.get(v, v) for k, v in kw.items()}
    with pytest.raises(ValueError, match=message):
        dspark_setup(_args(ckpts, **kw), TARGET)


def test_server_args_flags(ckpts, tmp_path, capsys):
    base = ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", ckpts["random"]]
    a = prepare_server_args(base + ["--speculative-dspark-sps-table-path", ckpts["sps"],
                                    "--speculative-dspark-confidence-sts-path", ckpts["sts"]])
    assert a.speculative_dspark_sps_table_path == ckpts["sps"]
    missing = str(tmp_path / "missing.json")
    for extra, flag in (
            (["--speculative-dspark-sps-table-path", missing], "--speculative-dspark-sps-table-path"),
            (["--speculative-dspark-sps-table-path", ckpts["sps"],
              "--speculative-dspark-confidence-sts-path", missing],
             "--speculative-dspark-confidence-sts-path"),
            (["--speculative-dspark-confidence-sts-path", ckpts["sts"]], "runs only with"),
            (["--speculative-num-steps", "3"], "--speculative-num-steps is NEXTN-only"),
            (["--speculative-dspark-verify-mode", "cap-accept"],
             "--speculative-dspark-verify-mode cap-accept: the verify lengths come from"),
            (["--speculative-dspark-sps-table-path", ckpts["sps"], "--disable-overlap-schedule",
              "--speculative-dspark-verify-mode", "compact"], "runs with the overlap schedule"),
            (["--speculative-dspark-verify-mode", "ragged"], "invalid choice: 'ragged'")):
        with pytest.raises(SystemExit) as e:
            prepare_server_args(base + extra)
        assert e.value.code == 2 and flag in capsys.readouterr().err
    with pytest.raises(ValueError, match="--speculative-dspark-sps-table-path is DSPARK-only"):
        ServerArgs(speculative_algorithm="NEXTN", speculative_dspark_sps_table_path=ckpts["sps"])
    with pytest.raises(ValueError, match="--speculative-dspark-verify-mode is DSPARK-only"):
        ServerArgs(speculative_algorithm="NEXTN", speculative_dspark_verify_mode="static")
    with pytest.raises(ValueError, match="needs --speculative-algorithm"):
        ServerArgs(speculative_dspark_confidence_sts_path=ckpts["sts"])
    # The bundled model carries its draft in dspark/; a target without one needs the flag.
    assert ServerArgs(speculative_algorithm="DSPARK").speculative_algorithm == "DSPARK"
    bare = _target_without_draft(tmp_path)
    with pytest.raises(ValueError, match="--speculative-draft-model-path is required"):
        ServerArgs(model_path=bare, speculative_algorithm="DSPARK")


def _target_without_draft(tmp_path) -> str:
    """The bundled target's files linked into a folder of its own, without its ``dspark/``."""
    target = tmp_path / "target"
    target.mkdir()
    for name in os.listdir(MODEL):
        if name != "dspark":  # a link to the bundled draft would let writes reach the asset
            os.symlink(os.path.join(MODEL, name), target / name)
    return str(target)


def test_draft_found_in_the_target_dspark_subfolder(tmp_path, prompts, ref):
    """Without --speculative-draft-model-path the target's ``dspark/`` subfolder is the draft;
    --speculative-dspark-block-size overrides the checkpoint's block size."""
    target = tmp_path / "target"
    _target_without_draft(tmp_path)
    write_random_dspark_checkpoint(str(target / "dspark"), seed=5)
    sched = make_scheduler(str(target), speculative_algorithm="DSPARK",
                           speculative_dspark_block_size=2, **KW)
    assert sched.draft_worker.setup.draft_path == str(target / "dspark")
    assert sched.draft_worker.round_tokens == 3
    ids, spec = run(sched, [greedy("sub", prompts[2], 8)])
    assert ids["sub"] == ref[2][:8] and spec["sub"][2] == spec["sub"][0] * 2
