"""The two offline DSpark tools, on the bundled model (fp32, CPU).

* ``python -m sglang.benchmark.dspark_sts_fit``: one run through ``main(argv)`` (engine
  generation of held-out greedy text, features, rounds, fit) whose JSON the worker's loader
  accepts for the draft's gamma, with the ECE of position 1 not raised by the fit (``T = 1`` is
  on the grid) and the mean ECE lowered; a re-run from its data cache reproduces it and a
  mismatched cache is refused; the calibration report by hand; refused flags.
* ``python -m sglang.benchmark.dspark_sps_profiler``: the verify layout and default probes; the
  profiled verify is a real verify (its logits equal a plain prefill of prefix + window) and
  does not advance the context (two runs give the same logits); the emulated graph path; one
  run through ``main(argv)`` whose table ``SPSTable`` and the worker's loader accept (sorted
  probes, positive values, floor lookups); refused flags; (GPU) timing inside CUDA graphs.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.srt.rounds.dspark.sps import SPSTable
from sglang.srt.rounds.dspark.sts import load_sts_temperatures
from sglang.srt.rounds.dspark.setup import load_dspark_tables

pytestmark = pytest.mark.usefixtures("two_torch_threads")

GAMMA = 7  # the bundled draft's block size
WINDOW = GAMMA + 1


# ============================================================================ STS fit
STS_ARGS = ["--num-prompts", "4", "--prompt-len", "24", "--max-new-tokens", "32",
            "--gen-batch-size", "4"]


@pytest.fixture(scope="module")
def sts_run(tmp_path_factory, one_thread_children):
    """One fit on the bundled target and draft (engine generation included)."""
    from sglang.benchmark.dspark_sts_fit import main

    root = tmp_path_factory.mktemp("sts")
    out, cache = root / "sts.json", root / "held_out.pt"
    result = main(["--output", str(out), "--data-cache", str(cache)] + STS_ARGS)
    return root, out, cache, result


def test_sts_fit_writes_what_the_worker_loads(sts_run, tmp_path):
    root, out, cache, result = sts_run
    temps = load_sts_temperatures(out, GAMMA)  # the server's loader, length = gamma
    assert temps == pytest.approx(result["temperatures"]) and result["gamma"] == GAMMA
    sps = tmp_path / "sps.json"
    SPSTable.constant(WINDOW * 4).save(sps)
    table, loaded = load_dspark_tables(str(sps), str(out), GAMMA)
    assert loaded == temps and table is not None
    # Every generated token but the last is an anchor; slot k is verified while the sequence
    # has a label for it.
    assert result["rounds"] == 4 * 31 and result["sequences"] == 4
    assert result["before"]["rounds"] == [4 * (31 - k) for k in range(GAMMA)]


def test_sts_fit_lowers_the_calibration_error(sts_run):
    result = sts_run[3]
    before, after = result["before"]["ece"], result["after"]["ece"]
    assert all(0 <= e <= 1 for e in before + after)
    assert after[0] <= before[0]  # T_1 = 1 is on the grid: never worse at position 1
    assert result["mean_ece_after"] < result["mean_ece_before"]
    # The temperatures change the prediction, not the observations.
    assert result["after"]["observed"] == result["before"]["observed"]


def test_sts_fit_rerun_from_cache_and_mismatch(sts_run, tmp_path):
    from sglang.benchmark.dspark_sts_fit import main

    root, out, cache, result = sts_run
    again = main(["--output", str(tmp_path / "again.json"), "--data-cache", str(cache)]
                 + STS_ARGS)  # no engine: the held-out features come from the cache
    assert again["temperatures"] == result["temperatures"]
    with pytest.raises(ValueError, match="num_prompts"):
        main(["--output", str(tmp_path / "bad.json"), "--data-cache", str(cache)]
             + STS_ARGS[2:] + ["--num-prompts", "3"])


def test_confidence_rounds_agree_with_the_offline_eval(sts_run):
    """The fit's rounds are the offline evaluation's: same accepted counts, the head's logits
    giving its survival, one verified slot per label inside the sequence."""
    from sglang.srt.models.dspark import load_dspark_draft
    from sglang.train.dspark_data import TargetFeatureRunner, load_feature_cache
    from sglang.train.dspark_eval import confidence_rounds, draft_sequence

    _, seqs = load_feature_cache(str(sts_run[2]), {})
    fr = TargetFeatureRunner(str(BUNDLED_MODEL_DIR), [1, 3, 4], max_batch_tokens=64,
                             max_batch_seqs=1)
    embed, head = fr.embed_and_head()
    model = load_dspark_draft(str(BUNDLED_MODEL_DIR / "dspark"), fr.hf_config,
                              dtype=torch.float32, device="cpu")
    model.set_embed_and_head(embed, head)
    rounds = confidence_rounds(model, seqs[:2], head)
    acc, surv, valid = zip(*(draft_sequence(model, s, head) for s in seqs[:2]))
    assert torch.equal(rounds.accepted, torch.cat(acc))
    assert torch.allclose(torch.cumprod(torch.sigmoid(rounds.confidence_logits), 1),
                          torch.cat(surv))
    assert torch.equal(rounds.verify_lens, torch.cat(valid).sum(1))
    assert int(rounds.verify_lens.max()) == GAMMA and int(rounds.verify_lens.min()) == 1


def test_calibration_report_by_hand():
    from sglang.benchmark.dspark_sts_fit import calibration_report

    # Two rounds, logits 0 (c = 1/2): a_1 = 1/2, a_2 = 1/4. Round 0 accepts both drafts, round
    # 1 none; position 3 is never verified.
    z = torch.zeros(2, 3)
    rep = calibration_report(z, torch.tensor([2, 0]), torch.tensor([2, 2]))
    assert rep["rounds"] == [2, 2, 0]
    assert rep["observed"][:2] == [0.5, 0.5] and rep["predicted"][:2] == [0.5, 0.25]
    assert rep["ece"][0] == pytest.approx(0.0) and rep["ece"][1] == pytest.approx(0.25)
    assert all(math.isnan(rep[k][2]) for k in ("observed", "predicted", "ece"))
    # T = 2 on a logit of 2 gives sigmoid(1).
    rep = calibration_report(torch.full((1, 1), 2.0), torch.tensor([1]), torch.tensor([1]),
                             [2.0])
    assert rep["predicted"][0] == pytest.approx(1 / (1 + math.exp(-1)))


def test_sts_fit_refuses_bad_flags(tmp_path):
    from sglang.benchmark.dspark_sts_fit import main

    out = ["--output", str(tmp_path / "t.json")]
    with pytest.raises(SystemExit, match="--max-new-tokens"):
        main(out + ["--max-new-tokens", "1"])
    with pytest.raises(SystemExit, match="--num-prompts"):
        main(out + ["--num-prompts", "0"])
    with pytest.raises(SystemExit, match="folder"):
        main(["--output", str(tmp_path)])
    with pytest.raises(SystemExit, match="config.json"):
        main(out + ["--target-path", str(tmp_path)])
    # A draft without a confidence head has nothing to calibrate (refused before any work).
    cfg = json.loads((BUNDLED_MODEL_DIR / "dspark" / "config.json").read_text())
    cfg["enable_confidence_head"] = False
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit, match="confidence head"):
        main(out + ["--draft-path", str(draft)])


# ============================================================================ SPS profiler
def test_verify_layout_and_default_probes():
    from sglang.benchmark.dspark_sps_profiler import default_batch_tokens, verify_layout

    assert verify_layout(16, 8) == (2, 8) and verify_layout(8, 8) == (1, 8)
    assert verify_layout(12, 8) == (2, 6) and verify_layout(3, 8) == (1, 3)
    assert verify_layout(13, 8) == (13, 1)  # a prime: one token per request
    with pytest.raises(ValueError, match="batch_tokens"):
        verify_layout(0, 8)
    assert default_batch_tokens(384) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 384]
    assert default_batch_tokens(16) == [1, 2, 4, 8, 16] and default_batch_tokens(1) == [1]


@pytest.fixture(scope="module")
def profiler():
    """A profiler on the bundled target: two requests of 8 prefix tokens (and room for one
    more request, the reference of the verify test)."""
    from sglang.benchmark.dspark_sps_profiler import VerifyProfiler
    from sglang.srt.model_executor.model_runner import ModelRunner

    runner = ModelRunner(ModelConfig.from_path(None), device="cpu", dtype="float32",
                         max_running_requests=3, max_total_tokens=3 * (8 + WINDOW),
                         spec_num_draft_tokens=WINDOW, position_headroom=2 * WINDOW)
    return VerifyProfiler(runner, WINDOW, requests=2, prefix_len=8, seed=0)


def test_profiled_verify_is_a_real_verify_and_repeatable(profiler):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    step = profiler.verify_step(16)
    assert (step.requests, step.window) == (2, 8)
    logits = step.run().clone()
    assert logits.shape == (16, ModelConfig.from_path(None).vocab_size)
    # The verify neither commits KDA state nor moves the context: a repeat is identical.
    assert torch.equal(step.run(), logits)
    # Request 1's verify equals a plain prefill of its prefix + window in a fresh slot.
    runner = profiler.runner
    slot = runner.req_to_token_pool.alloc(1)
    runner.kda_state_pool.clear_slots(slot)
    ids = torch.cat([profiler.prefix_ids[1], step.input_ids[1]])
    loc = runner.token_to_kv_pool_allocator.alloc(ids.numel())
    runner.req_to_token_pool.write(slot[0], 0, loc)
    ref = runner.forward(ForwardBatch.for_extend(ids, slot, [0], [ids.numel()], loc,
                                                 return_full_logits=True)).next_token_logits
    assert torch.allclose(logits[8:], ref[8:], atol=1e-4)
    with pytest.raises(ValueError, match="requests"):
        profiler.verify_step(WINDOW * 3)  # three requests; the profiler holds two


def test_profile_eager_and_emulated_graph(profiler):
    row = profiler.profile(8, warmup=1, repeats=2)
    assert row["cuda_graph"] is False and row["requests"] == 1 and row["window"] == 8
    assert row["seconds"] > 0 and row["steps_per_sec"] == pytest.approx(1 / row["seconds"])
    # The capture path (attention backend hooks, warm-up, replay) with the CPU stand-in graph.
    row = profiler.profile(16, warmup=0, repeats=1, graph="emulated")
    assert row["cuda_graph"] is True and row["steps_per_sec"] > 0


def test_sps_profiler_writes_a_table_the_worker_loads(tmp_path):
    from sglang.benchmark.dspark_sps_profiler import main

    out = tmp_path / "sps.json"
    data = main(["--output", str(out), "--max-running-requests", "2", "--prefix-len", "8",
                 "--warmup", "1", "--repeats", "2"])
    assert json.loads(out.read_text()) == data
    table = SPSTable.load(out)
    # Default probes: powers of two up to (gamma + 1) x --max-running-requests.
    assert list(table.sample_batch_tokens) == [1, 2, 4, 8, 16]
    assert data["sample_batch_tokens"] == sorted(data["sample_batch_tokens"])
    assert table.max_batch_tokens == 16
    sps = table.sample_steps_per_sec
    assert all(s > 0 for s in sps)
    assert data["sample_requests"] == [1, 1, 1, 1, 2] and data["sample_window"] == [1, 2, 4, 8, 8]
    assert data["sample_steps_per_sec"] == pytest.approx(
        [1 / t for t in data["sample_seconds_per_step"]])
    assert data["gamma"] == GAMMA and data["timed_in_cuda_graph"] == [False] * 5
    # Floor lookups: the largest probe <= B; nothing above max_batch_tokens.
    assert table.steps_per_sec(3) == sps[1] and table.steps_per_sec(15) == sps[3]
    assert table.steps_per_sec(16) == sps[4] and table.steps_per_sec(17) == 0.0
    loaded, _ = load_dspark_tables(str(out), None, GAMMA)  # the server's flag path
    assert loaded == table


def test_sps_profiler_refuses_bad_flags(tmp_path):
    from sglang.benchmark.dspark_sps_profiler import main

    out = ["--output", str(tmp_path / "s.json")]
    with pytest.raises(SystemExit, match="--repeats"):
        main(out + ["--repeats", "0"])
    with pytest.raises(SystemExit, match="--batch-tokens"):
        main(out + ["--batch-tokens", "4", "0"])
    with pytest.raises(SystemExit, match="DSPARK"):
        main(out + ["--speculative-algorithm", "NEXTN"])
    with pytest.raises(SystemExit, match="folder"):
        main(["--output", str(tmp_path)])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--cuda-graph needs CUDA"):
            main(out + ["--cuda-graph"])
    with pytest.raises(SystemExit, match="--prefix-len"):
        main(out + ["--prefix-len", "100000", "--batch-tokens", "1"])


@pytest.mark.gpu
def test_sps_profiler_cuda_graph_on_gpu(tmp_path):
    from sglang.benchmark.dspark_sps_profiler import main

    out = tmp_path / "sps.json"
    data = main(["--output", str(out), "--device", "cuda", "--max-running-requests", "4",
                 "--prefix-len", "64", "--warmup", "2", "--repeats", "5", "--cuda-graph"])
    table = SPSTable.load(out)
    assert list(table.sample_batch_tokens) == [1, 2, 4, 8, 16, 32]
    assert all(s > 0 for s in table.sample_steps_per_sec)
    assert all(data["timed_in_cuda_graph"])
    assert data["dtype"] == "bfloat16"
