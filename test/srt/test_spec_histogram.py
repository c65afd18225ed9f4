"""Speculative accept histograms and DSpark cap-length statistics, end to end.

* Scheduler (in process, bundled model): per request the accepted-drafts histogram sums to
  ``spec_verify_ct`` and its first moment is ``spec_num_correct_drafts``, for NEXTN and for
  DSPARK (bundled draft, confidence scheduler: early stop without overlap, lagged top-K with
  it); DSPARK's cap histogram and cap sum are exactly the planned verify lengths each round of
  the request ran with (recorded independently from the rounds' outputs), and the tokens the
  rounds committed are the output minus the prefill's token; the server-level histograms in
  ``internal_states`` are the sums over the requests and reset with ``flush_cache``.
* ``meta_info`` (``ReqState``): the upstream field names and their definitions.
* ``bench_serving``: aggregation of fake outputs, the table rows, the JSON line; one run
  against a real DSPARK server whose summed histograms equal the server's (~15 s).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Dict, List, Tuple

import pytest

from engine_test_utils import held_out_prompts, make_scheduler, sampling, submit_staggered
from sglang.benchmark.backends import read_spec_meta
from sglang.benchmark.metrics import (
    RequestFuncOutput,
    aggregate_spec_metrics,
    calculate_metrics,
    format_table,
)
from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.srt.managers.io_struct import (
    BatchStrOutput,
    BatchTokenIDOutput,
    GenerateReqInput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.request_state import ReqState
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.speculative.spec_info import SpecMetricsOutput

MODEL = str(BUNDLED_MODEL_DIR)
VOCAB = ModelConfig.from_path(MODEL).vocab_size
KW = dict(max_total_tokens=4096, max_running_requests=8)
NEXTN_STEPS = 3
DSPARK_GAMMA = 7  # the bundled draft's block size
# Steep beyond 3 tokens (as test_dspark_worker's): the planner cuts most blocks short.
SPS_TABLE = {"sample_batch_tokens": [1, 2, 3, 4, 8, 12],
             "sample_steps_per_sec": [1.0, 0.95, 0.9, 0.35, 0.3, 0.25], "max_batch_tokens": 32}
LENS = [40, 17, 33]  # ragged: requests finish inside a round and join a running batch

pytestmark = pytest.mark.usefixtures("two_torch_threads")


@pytest.fixture(scope="module")
def prompts() -> List[List[int]]:
    """Three 24-token prompts from held-out Python files, each at a function definition."""
    from sglang.srt.managers.utils import load_tokenizer
    from sglang.srt.server_args import ServerArgs

    return held_out_prompts(load_tokenizer(ServerArgs(device="cpu")))


@pytest.fixture(scope="module")
def sps_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sps") / "sps.json"
    path.write_text(json.dumps(SPS_TABLE))
    return str(path)


def greedy(rid: str, prompt: List[int], n: int) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid, None, list(prompt),
                                     sampling(VOCAB, max_new_tokens=n, temperature=0,
                                              ignore_eos=True))


def record_rounds(sched: Scheduler, monkeypatch) -> Dict[str, List[Tuple[int, Any]]]:
    """Per rid, ``(accept_len, cap_len or None)`` of every round the scheduler counts for it
    (the rounds of requests still running when the round is consumed), read from the rounds'
    outputs before the scheduler sees them."""
    rounds: Dict[str, List[Tuple[int, Any]]] = {}
    inner = sched.process_round

    def process(pending):
        out = pending.result.wait()
        for b, r in enumerate(pending.reqs):
            if not r.finished() and r.req_pool_idx is not None:
                cap = None if out.cap_lens is None else out.cap_lens[b]
                rounds.setdefault(r.rid, []).append((out.accept_lens[b], cap))
        inner(pending)

    monkeypatch.setattr(sched, "process_round", process)
    return rounds


def run(sched: Scheduler, reqs) -> Tuple[Dict[str, List[int]], Dict[str, Dict[str, Any]]]:
    """Output ids per rid, and each finished request's fields of its SpecMetricsOutput."""
    submit_staggered(sched, reqs, stagger=2)
    ids: Dict[str, List[int]] = {}
    spec: Dict[str, Dict[str, Any]] = {}
    for msg in sched.outbox:
        if isinstance(msg, SpecMetricsOutput):
            for i, rid in enumerate(msg.rids):
                spec[rid] = {name: (None if value is None else value[i])
                             for name, value in vars(msg).items() if name != "rids"}
        elif isinstance(msg, BatchTokenIDOutput):
            for i, rid in enumerate(msg.rids):
                ids.setdefault(rid, []).extend(msg.decode_ids[i])
    sched.outbox.clear()
    return ids, spec


def check_histograms(spec: Dict[str, Any], bins: int) -> None:
    hist = spec["spec_correct_drafts_histogram"]
    assert len(hist) == bins and min(hist) >= 0
    assert sum(hist) == spec["spec_verify_ct"] > 0
    assert sum(k * n for k, n in enumerate(hist)) == spec["spec_num_correct_drafts"]


def check_server_sums(sched: Scheduler, specs: Dict[str, Dict[str, Any]], bins: int,
                      capped: bool) -> None:
    state = sched.get_internal_state()
    want = [sum(s["spec_correct_drafts_histogram"][k] for s in specs.values())
            for k in range(bins)]
    assert state["spec_correct_drafts_histogram"] == want
    assert sum(want) == state["spec_num_verify_reqs"]
    if capped:
        assert state["spec_cap_lens_histogram"] == [
            sum(s["spec_cap_lens_histogram"][k] for s in specs.values()) for k in range(bins)]
    else:
        assert "spec_cap_lens_histogram" not in state
    assert sched.flush_cache().success
    after = sched.get_internal_state()
    assert after["spec_correct_drafts_histogram"] == [0] * bins
    assert "spec_cap_lens_histogram" not in after


# ------------------------------------------------------------------------------- scheduler
def test_nextn_histograms(prompts, monkeypatch):
    sched = make_scheduler(MODEL, speculative_algorithm="NEXTN",
                           speculative_num_steps=NEXTN_STEPS, **KW)
    rounds = record_rounds(sched, monkeypatch)
    ids, specs = run(sched, [greedy(f"n{i}", p, n) for i, (p, n) in
                             enumerate(zip(prompts, LENS))])
    assert sorted(specs) == ["n0", "n1", "n2"]
    for rid, spec in specs.items():
        check_histograms(spec, NEXTN_STEPS + 1)
        assert spec["spec_verify_ct"] == len(rounds[rid])
        assert spec["spec_cap_lens_histogram"] is None and spec["spec_num_cap_tokens"] is None
        assert spec["spec_num_block_accept_tokens"] is None
    assert any(h > 0 for s in specs.values() for h in s["spec_correct_drafts_histogram"][1:])
    check_server_sums(sched, specs, NEXTN_STEPS + 1, capped=False)


@pytest.mark.parametrize("overlap", [False, True], ids=["early-stop", "lagged-top-k"])
def test_dspark_histograms_and_cap_lengths(prompts, sps_path, overlap, monkeypatch):
    sched = make_scheduler(MODEL, speculative_algorithm="DSPARK",
                           speculative_dspark_sps_table_path=sps_path,
                           disable_overlap_schedule=not overlap, **KW)
    assert sched.round_worker.proposed_per_round == DSPARK_GAMMA
    rounds = record_rounds(sched, monkeypatch)
    ids, specs = run(sched, [greedy(f"d{i}", p, n) for i, (p, n) in
                             enumerate(zip(prompts, LENS))])
    bins = DSPARK_GAMMA + 1
    all_caps = []
    for rid, spec in specs.items():
        check_histograms(spec, bins)
        recorded = rounds[rid]
        assert spec["spec_verify_ct"] == len(recorded)
        caps = [cap for _, cap in recorded]
        all_caps += caps
        assert all(0 <= a - 1 <= cap <= DSPARK_GAMMA for a, cap in recorded)
        assert spec["spec_cap_lens_histogram"] == [caps.count(l) for l in range(bins)]
        assert spec["spec_num_cap_tokens"] == sum(caps)
        assert spec["spec_correct_drafts_histogram"] == [
            sum(1 for a, _ in recorded if a - 1 == k) for k in range(bins)]
        # Every output token but the prefill's came from a round.
        assert spec["spec_num_block_accept_tokens"] == len(ids[rid]) - 1
    assert len(set(all_caps)) > 1 and min(all_caps) < DSPARK_GAMMA  # the plans vary
    check_server_sums(sched, specs, bins, capped=True)


# ------------------------------------------------------------------------------- meta_info
def _meta(spec_msg: SpecMetricsOutput, completion: int) -> Dict[str, Any]:
    """``meta_info`` of a request that received ``spec_msg`` then a finishing token message."""
    loop = asyncio.new_event_loop()
    try:
        obj = GenerateReqInput(input_ids=[1, 2, 3], rid="r")
        tokenized = TokenizedGenerateReqInput("r", None, [1, 2, 3], None)
        state = ReqState(obj, tokenized, loop, tokenizer=None)
        state.post_spec_metrics(spec_msg, 0)
        state.post(BatchStrOutput(
            rids=["r"], finished_reasons=[{"type": "length", "length": completion}],
            output_strs=[""], output_ids=[list(range(completion))], prompt_tokens=[3],
            completion_tokens=[completion], cached_tokens=[0],
            output_token_logprobs_val=[[]], output_token_logprobs_idx=[[]],
            output_top_logprobs_val=[[]], output_top_logprobs_idx=[[]],
            input_token_logprobs_val=[[]], input_token_logprobs_idx=[[]],
            input_top_logprobs_val=[[]], input_top_logprobs_idx=[[]]), 0)
        loop.run_until_complete(asyncio.sleep(0))
        return state.to_output()["meta_info"]
    finally:
        loop.close()


def test_meta_info_fields():
    # 4 rounds of gamma 3: accepted 0, 2, 3, 3 drafts; committed 1 + 3 + 4 + 2 (finished
    # inside the last round) = 10 tokens after the prefill's one.
    base = dict(rids=["r"], spec_verify_ct=[4], spec_num_correct_drafts=[8],
                spec_num_proposed_drafts=[12], spec_correct_drafts_histogram=[[1, 0, 1, 2]])
    meta = _meta(SpecMetricsOutput(**base), completion=11)
    assert meta["spec_correct_drafts_histogram"] == [1, 0, 1, 2]
    assert meta["spec_accept_length"] == pytest.approx(11 / 4)
    assert meta["spec_accept_rate"] == pytest.approx(8 / 12)
    assert not {"spec_cap_length", "spec_cap_lens_histogram", "spec_block_accept_length"} & \
        set(meta)
    capped = SpecMetricsOutput(**base, spec_cap_lens_histogram=[[0, 1, 0, 3]],
                               spec_num_cap_tokens=[10], spec_num_block_accept_tokens=[10])
    meta = _meta(capped, completion=11)
    assert meta["spec_cap_length"] == pytest.approx(10 / 4)
    assert meta["spec_cap_lens_histogram"] == [0, 1, 0, 3]
    assert meta["spec_block_accept_length"] == pytest.approx(10 / 4)
    json.dumps(meta)  # JSON-serializable as the HTTP layer sends it


# ------------------------------------------------------------------------------- bench_serving
def _fake(hist=None, caps=None, cap_len=None, block=None, ct=None, success=True):
    return RequestFuncOutput(success=success, start_time=0.0, ttft=0.1, latency=1.0,
                             output_len=5, spec_correct_drafts_histogram=hist,
                             spec_cap_lens_histogram=caps, spec_cap_length=cap_len,
                             spec_block_accept_length=block, spec_verify_ct=ct)


def test_bench_aggregation_and_table():
    outs = [_fake([1, 2, 3], [0, 1, 5], 11 / 6, 2.0, 6),
            _fake([0, 4], [1, 3], 0.75, 1.5, 4),  # a shorter histogram counts as zeros
            _fake([9, 9, 9], [9, 9, 9], 1.0, 9.0, 27, success=False)]  # failed: ignored
    agg = aggregate_spec_metrics(outs)
    assert agg["spec_correct_drafts_histogram"] == [1, 6, 3]
    assert agg["spec_cap_lens_histogram"] == [1, 4, 5]
    assert agg["spec_cap_length"] == pytest.approx((4 + 10) / 10)
    assert agg["spec_block_accept_length"] == pytest.approx((2.0 * 6 + 1.5 * 4) / 10)
    m = calculate_metrics([4, 4, 4], outs, dur_s=2.0, accept_length=2.5)
    assert m.spec_correct_drafts_histogram == [1, 6, 3]
    table = format_table(m, "sglang", float("inf"), None, 2.0)
    rows = ["Accept length:", "Accept histogram:", "Mean cap length:", "Cap length histogram:",
            "Block accept length:", "End-to-End Latency"]
    pos = [table.index(r) for r in rows]
    assert pos == sorted(pos)
    assert "Accept histogram:                        [1, 6, 3]" in table
    assert "Mean cap length:                         1.40" in table
    # NEXTN-like: a histogram without caps; other backends: nothing, no rows.
    m = calculate_metrics([4], [_fake([2, 1], ct=3)], dur_s=1.0)
    assert m.spec_cap_length is None and m.spec_block_accept_length is None
    table = format_table(m, "sglang", 1.0, None, 1.0)
    assert "Accept histogram:" in table and "Mean cap length:" not in table
    m = calculate_metrics([4], [_fake()], dur_s=1.0)
    assert aggregate_spec_metrics([_fake()]) == dict.fromkeys(
        ["spec_correct_drafts_histogram", "spec_cap_length", "spec_cap_lens_histogram",
         "spec_block_accept_length"])
    assert "Accept histogram:" not in format_table(m, "sglang-oai", 1.0, None, 1.0)


def test_bench_reads_finishing_chunk_meta():
    out = RequestFuncOutput()
    read_spec_meta({"completion_tokens": 3}, out)  # a chunk before the finish
    assert out.spec_correct_drafts_histogram is None and out.spec_verify_ct is None
    read_spec_meta({"spec_verify_ct": 2, "spec_correct_drafts_histogram": [1, 1],
                    "spec_cap_lens_histogram": [0, 2], "spec_cap_length": 1.0,
                    "spec_block_accept_length": 1.5}, out)
    assert (out.spec_verify_ct, out.spec_correct_drafts_histogram, out.spec_cap_lens_histogram,
            out.spec_cap_length, out.spec_block_accept_length) == (2, [1, 1], [0, 2], 1.0, 1.5)


@pytest.mark.slow  # a real DSPARK server (~25 s); the aggregation is unit-tested above
def test_bench_serving_against_a_dspark_server(sps_path, tmp_path):
    """bench_serving's summed histograms (after its --flush-cache) equal the server's lifetime
    ones, and the rows and JSON keys are there."""
    from sglang.benchmark.serving import build_parser, run_benchmark
    from sglang.test.test_utils import find_available_port, kill_process_tree, popen_launch_server

    port = find_available_port(32100)
    proc = popen_launch_server(
        MODEL, f"http://127.0.0.1:{port}", timeout=300,
        other_args=["--device", "cpu", "--dtype", "float32", "--speculative-algorithm", "DSPARK",
                    "--speculative-dspark-sps-table-path", sps_path, "--max-total-tokens", "4096",
                    "--skip-server-warmup"])
    try:
        args = build_parser().parse_args([
            "--backend", "sglang", "--port", str(port), "--dataset-name", "random-ids",
            "--random-input-len", "16", "--random-output-len", "24", "--random-range-ratio", "1",
            "--num-prompts", "3", "--max-concurrency", "2", "--flush-cache", "--disable-tqdm",
            "--output-file", str(tmp_path / "out.jsonl")])
        result = run_benchmark(args)
    finally:
        kill_process_tree(proc.pid)
    assert result["completed"] == 3
    state = result["server_info"]["internal_states"][0]
    hist = result["spec_correct_drafts_histogram"]
    assert hist == state["spec_correct_drafts_histogram"] and len(hist) == DSPARK_GAMMA + 1
    assert result["spec_cap_lens_histogram"] == state["spec_cap_lens_histogram"]
    caps = result["spec_cap_lens_histogram"]
    assert result["spec_cap_length"] == pytest.approx(
        sum(k * n for k, n in enumerate(caps)) / sum(caps))
    # Every generated token but each request's first came from a verify round.
    assert result["spec_block_accept_length"] == pytest.approx(
        (result["total_output_tokens"] - 3) / sum(hist))
    line = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[-1])
    assert line["spec_correct_drafts_histogram"] == hist
