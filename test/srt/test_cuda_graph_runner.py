"""The CUDA graph runner's logic without CUDA: buckets, keys, padding, refill, fallback, and
graph == eager through the scheduler on the bundled model (``EmulatedGraph`` re-runs the
captured body over the static buffers, so a refill or padding mistake changes the tokens).

On the GPU host the same comparisons run with real graphs (``test_graph_equals_eager_on_cuda``).
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from engine_test_utils import make_scheduler, sampling, submit_staggered
from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.model_executor.cuda_graph_runner import (
    WIDTH_BUCKET,
    CudaGraphRunner,
    GraphKey,
    graph_variant,
)
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams

MODEL = str(BUNDLED_MODEL_DIR)
VOCAB = ModelConfig.from_path(MODEL).vocab_size
KW = dict(max_total_tokens=4096, max_running_requests=8)


pytestmark = pytest.mark.usefixtures("two_torch_threads")


def _info(n: int, **params) -> SamplingBatchInfo:
    sp = SamplingParams.from_dict(params)
    sp.verify(VOCAB)
    return SamplingBatchInfo.from_reqs([sp.normalize(None)] * n, [[]] * n, VOCAB)


def _toy_runner(**kw) -> CudaGraphRunner:
    """A runner over a body that records what it saw and echoes its static inputs."""
    seen: List[Dict[str, object]] = []

    def body(slots, loc, info, bound, return_logprob):
        seen.append({"bs": int(slots.shape[0]), "bound": bound, "lp": return_logprob})
        info.steps += 1
        return {"slots": slots * 10, "loc": loc + 1, "temps": info.temperatures * 2}

    args = dict(device=torch.device("cpu"), vocab_size=VOCAB, round_tokens=2, tokens_per_request=2,
                batch_sizes=[1, 2, 4, 8], max_width=4096, emulate=True)
    args.update(kw)
    runner = CudaGraphRunner(body, **args)
    runner.seen = seen
    return runner


def test_buckets_keys_and_capture_limit():
    runner = _toy_runner()
    assert runner.batch_sizes == [1, 2, 4, 8]
    assert [runner.bucket(b) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    # Greedy graphs of every bucket were captured at start-up, largest first (2 warm-ups each).
    assert set(runner.graphs) == {GraphKey(b, None, "greedy", False) for b in (1, 2, 4, 8)}
    assert [s["bs"] for s in runner.seen[:3]] == [8, 8, 8]
    greedy, sampled = _info(3, temperature=0), _info(3, temperature=0.7, top_p=0.9)
    assert runner.key(3, greedy, False, 100) == GraphKey(4, None, "greedy", False)
    assert runner.key(3, sampled, True, 100) == GraphKey(4, None, "sampled", True)
    assert runner.key(9, greedy, False, 100) is None  # larger than every bucket
    penalised = _info(2, temperature=0.7, frequency_penalty=0.5)
    assert graph_variant(penalised) is None and runner.key(2, penalised, False, 1) is None
    # A forward of 2 tokens per request under a 10-token limit: buckets up to 5 requests.
    limited = _toy_runner(max_graph_tokens=10, capture_now=False)
    assert limited.batch_sizes == [1, 2, 4] and not limited.graphs


def test_width_buckets_for_width_dependent_backends():
    runner = _toy_runner(width_independent=False, capture_now=False, max_width=1300)
    info = _info(1, temperature=0)
    assert runner.key(1, info, False, 1) == GraphKey(1, WIDTH_BUCKET, "greedy", False)
    assert runner.key(1, info, False, WIDTH_BUCKET + 1).width == 2 * WIDTH_BUCKET
    assert runner.key(1, info, False, 5000).width == 1300  # never past the map's width
    out = runner.replay(runner.key(1, info, False, 700), torch.tensor([3]),
                        torch.tensor([[5, 6]]), info)
    assert runner.seen[-1]["bound"] == 2 * WIDTH_BUCKET and out["slots"].tolist() == [30]


def test_replay_pads_refills_and_copies_steps_back():
    runner = _toy_runner()
    info = _info(3, temperature=0.5)
    info.steps.copy_(torch.tensor([4, 7, 9]))
    key = runner.key(3, info, False, 10)
    out = runner.replay(key, torch.tensor([5, 6, 7]), torch.tensor([[1, 2], [3, 4], [5, 6]]), info)
    # Only the live rows come back; the padding row went to slot 0.
    assert out["slots"].tolist() == [50, 60, 70]
    assert out["loc"].tolist() == [[2, 3], [4, 5], [6, 7]]
    assert runner.slots[:4].tolist() == [5, 6, 7, 0] and runner.loc[3].tolist() == [0, 0]
    assert torch.allclose(out["temps"], torch.full((3,), 1.0))  # the live temperatures, doubled
    assert info.steps.tolist() == [5, 8, 10]  # advanced by the body, copied back
    # A smaller batch in the same bucket: stale rows are re-padded, not reused.
    out = runner.replay(key, torch.tensor([2]), torch.tensor([[8, 9]]), _info(1, temperature=0.5))
    assert out["slots"].tolist() == [20] and runner.slots[:4].tolist() == [2, 0, 0, 0]
    # Greedy graphs refill only the step counters (their body ignores the other rows), plus the
    # temperatures when they return logprobs.
    greedy = _info(2, temperature=0)
    greedy.temperatures.fill_(3.0)
    zeros = torch.zeros(2, 2, dtype=torch.int64)
    out = runner.replay(runner.key(2, greedy, False, 1), torch.tensor([1, 2]), zeros, greedy)
    assert runner.num_replays == 3 and out["temps"].tolist() != [6.0, 6.0]
    out = runner.replay(runner.key(2, greedy, True, 1), torch.tensor([1, 2]), zeros, greedy)
    assert out["temps"].tolist() == [6.0, 6.0]


def test_failed_capture_falls_back_to_eager(caplog):
    def body(slots, loc, info, bound, return_logprob):
        if return_logprob:
            raise RuntimeError("operation not permitted when stream is capturing")
        return {"x": slots + 1}

    runner = CudaGraphRunner(body, device=torch.device("cpu"), vocab_size=VOCAB, round_tokens=1,
                             tokens_per_request=1, batch_sizes=[1, 2], max_width=64, emulate=True)
    info = _info(1, temperature=0)
    key = runner.key(1, info, True, 8)
    with caplog.at_level("WARNING"):
        assert runner.replay(key, torch.tensor([1]), torch.tensor([[1]]), info) is None
    assert "capture" in caplog.text and key in runner.failed
    assert runner.key(1, info, True, 8) is None  # not retried: eager from now on
    assert runner.replay(runner.key(1, info, False, 8), torch.tensor([4]), torch.tensor([[1]]),
                         info)["x"].tolist() == [5]


def test_captures_are_counted_and_the_fourth_graph_reported(caplog):
    """Every returned capture counts (emulated ones too, released or not); the start-up report
    warns only when the prefill graphs bring the process from below SLOW_REPLAY_GRAPH_COUNT
    to it or past it."""
    import logging

    from sglang.srt.model_executor import cuda_graph_runner as cgr

    before = cgr.captured_graph_count()
    for _ in range(2):
        cgr.new_graph(True).capture(lambda: {"x": torch.ones(1)})
    with pytest.raises(RuntimeError):
        cgr.new_graph(True).capture(lambda: (_ for _ in ()).throw(RuntimeError("no")))
    assert cgr.captured_graph_count() == before + 2
    log = logging.getLogger("test_graph_count")
    warned = []
    for decode, prefill in ((1, 2), (3, 0), (3, 1), (2, 3), (12, 2), (4, 0)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="test_graph_count"):
            cgr.report_graph_count(decode, prefill, log)
        assert caplog.records[0].getMessage() == (
            f"CUDA graphs captured at start-up: {decode + prefill} ({decode} decode, "
            f"{prefill} prefill)")
        if len(caplog.records) > 1:
            warned.append((decode, prefill))
            assert caplog.records[1].levelno == logging.WARNING
            assert "--cuda-graph-max-bs 1" in caplog.records[1].getMessage()
    assert cgr.SLOW_REPLAY_GRAPH_COUNT == 4
    assert warned == [(3, 1), (2, 3)]


def test_a_graph_first_met_while_serving_warns_when_it_is_the_fourth(monkeypatch, caplog):
    """A batch-1 ladder starts with one greedy graph; the sampled and the logprob graphs
    captured while serving are the second and third (no warning), the fourth warns once."""
    import logging

    from sglang.srt.model_executor import cuda_graph_runner as cgr

    monkeypatch.setattr(cgr, "_captured", 0)
    runner = _toy_runner(batch_sizes=[1])
    assert cgr.captured_graph_count() == 1
    zeros = torch.zeros(1, 2, dtype=torch.int64)
    keys = [(_info(1, temperature=0.5), False), (_info(1, temperature=0), True),
            (_info(1, temperature=0.5), True), (_info(1, temperature=0), False)]
    warnings = []
    for info, logprob in keys:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=cgr.__name__):
            runner.replay(runner.key(1, info, logprob, 1), torch.tensor([3]), zeros, info)
        warnings.append([r.getMessage() for r in caplog.records])
    assert cgr.captured_graph_count() == 4 and runner.num_replays == 4
    assert warnings[:2] == [[], []] and warnings[3] == []
    [message] = warnings[2]
    assert message.startswith("capturing GraphKey(bs=1, width=None, variant='sampled', "
                              "return_logprob=True") and "made this process's CUDA graphs 4" \
        in message


def test_scheduler_reports_the_graphs_of_its_start_up(monkeypatch, caplog):
    """The scheduler counts the graphs its prefill graphs add to those before them."""
    import logging

    from sglang.srt.managers import scheduler_round
    from sglang.srt.model_executor import cuda_graph_runner as cgr

    def two_prefill_graphs(worker, args):
        for _ in range(2):
            cgr.new_graph(True).capture(lambda: {"x": torch.ones(1)})
        return []

    monkeypatch.setattr(scheduler_round, "init_prefill_graphs_from_args", two_prefill_graphs)
    before = cgr.captured_graph_count()
    with caplog.at_level(logging.INFO, logger=cgr.__name__):
        make_scheduler(MODEL)
    assert (f"CUDA graphs captured at start-up: {before + 2} ({before} decode, 2 prefill)"
            in [r.getMessage() for r in caplog.records])


def test_graph_count_is_capped(monkeypatch):
    import sglang.srt.model_executor.cuda_graph_runner as cgr

    monkeypatch.setattr(cgr, "MAX_GRAPHS", 5)
    runner = _toy_runner(width_independent=False, capture_now=False, max_width=1 << 20)
    info = _info(1, temperature=0)
    keys = [runner.key(1, info, False, w * WIDTH_BUCKET) for w in range(1, 8)]
    for key in keys[:5]:
        runner.replay(key, torch.tensor([1]), torch.tensor([[1, 2]]), info)
    assert len(runner.graphs) == 5
    assert runner.key(1, info, False, 6 * WIDTH_BUCKET) is None  # a sixth shape runs eagerly
    assert runner.key(1, info, False, WIDTH_BUCKET) == keys[0]  # captured ones still replay


def test_moe_capture_limit_follows_the_expert_path(monkeypatch):
    """The torch MoE's loop reads expert counts on the host above GATHER_MAX_PAIRS pairs, so its
    graphs stop there; the Triton path (grouped GEMV, then the grouped GEMM over device-sorted
    pairs) has no limit; nor has the torch path with ``KernelChoices.moe_grouped_mm`` and
    weights torch's grouped GEMM takes."""
    from sglang.srt.layers.moe.fused_moe_native import GATHER_MAX_PAIRS
    from sglang.srt.layers.moe.moe_layer import BailingMoE

    sched = make_scheduler(MODEL, **KW)
    runner = sched.tp_worker.model_runner
    blocks = [m for m in runner.model.modules() if isinstance(m, BailingMoE)]
    top_k = blocks[0].gate.top_k
    assert runner.max_cuda_graph_tokens() == GATHER_MAX_PAIRS // top_k
    for m in blocks:
        m.experts.runner_backend = "triton"
    assert runner.max_cuda_graph_tokens() is None
    for m in blocks:
        m.experts.runner_backend = "torch_native"
        m.experts.grouped_mm = True  # fp32 on CPU: torch's grouped GEMM takes it
    assert runner.max_cuda_graph_tokens() is None


# ------------------------------------------------------------------------------ through the engine
def _request(rid: str, ids: List[int], **kw) -> TokenizedGenerateReqInput:
    lp = {k: kw.pop(k) for k in ("return_logprob", "top_logprobs_num") if k in kw}
    return TokenizedGenerateReqInput(rid, None, list(ids), sampling(VOCAB, **kw), **lp)


def _run(sched, reqs, stagger: int = 0) -> Dict[str, List[int]]:
    submit_staggered(sched, reqs, stagger)
    ids: Dict[str, List[int]] = {}
    for msg in sched.outbox:
        for i, rid in enumerate(getattr(msg, "rids", [])):
            if hasattr(msg, "decode_ids"):
                ids.setdefault(rid, []).extend(msg.decode_ids[i])
                ids.setdefault(rid + ":lp", []).extend(
                    round(v, 4) for v in msg.output_token_logprobs_val[i])
                ids.setdefault(rid + ":top", []).extend(msg.output_top_logprobs_idx[i])
    sched.outbox.clear()
    return ids


def assert_same_outputs(got: Dict[str, List], want: Dict[str, List]) -> None:
    """``_run``'s outputs of a graphed run equal the eager ones: tokens and top-logprob ids
    exactly, logprobs (rounded to 4 decimals) within one unit of that rounding. A graph pads
    its batch to the captured size, and torch's CPU matmul may round a row differently at
    another row count (seen with torch 2.13: -0.4323 against -0.4322, the token the same)."""
    assert got.keys() == want.keys()
    for key, row in got.items():
        if key.endswith(":lp"):
            assert row == pytest.approx(want[key], abs=1.5e-4), key
        else:
            assert row == want[key], key


def _requests(prompt_tok) -> List[TokenizedGenerateReqInput]:
    base = prompt_tok.encode("def fibonacci(n):\n    ")
    return [
        _request("g0", base, max_new_tokens=40, temperature=0, ignore_eos=True),
        _request("s1", base[:-2], max_new_tokens=33, temperature=0.8, top_k=20, sampling_seed=3,
                 ignore_eos=True),
        _request("g2", base[:-4], max_new_tokens=25, temperature=0, ignore_eos=True),
        _request("p3", base[:-1], max_new_tokens=6, temperature=0.7, frequency_penalty=0.3,
                 sampling_seed=4, ignore_eos=True),  # dense penalties: eager rounds
        _request("l4", base[:-3], max_new_tokens=30, temperature=0, ignore_eos=True,
                 return_logprob=True, top_logprobs_num=2),
    ]


@pytest.mark.parametrize("spec,per_phase", [
    ({}, False), (dict(speculative_algorithm="NEXTN", speculative_num_steps=3), False),
    pytest.param(dict(speculative_algorithm="NEXTN", speculative_num_steps=3), True,
                 marks=pytest.mark.slow)],
    ids=["plain", "nextn3", "nextn3-per-phase"])
def test_emulated_graphs_equal_eager_through_the_scheduler(spec, per_phase):
    """Staggered arrivals make batches of 1..4 requests replay buckets 1, 2 and 4 with padding
    rows; greedy and seeded rows (and logprobs) must come out exactly as in eager execution,
    with the round as one graph or (NEXTN) as one graph per phase."""
    eager = make_scheduler(MODEL, **KW, **spec)
    want = _run(eager, _requests(eager.tokenizer), stagger=3)
    graphed = make_scheduler(MODEL, **KW, **spec)
    graphed.round_worker.init_cuda_graphs([1, 2, 4], emulate=True, per_phase=per_phase)
    runner = graphed.round_worker.graph_runner
    got = _run(graphed, _requests(graphed.tokenizer), stagger=3)
    assert got == want
    assert runner.num_replays > 0
    used = {k.bs for k in runner.graphs}
    assert {1, 2, 4} <= used and any(k.variant == "sampled" for k in runner.graphs)
    assert any(k.return_logprob for k in runner.graphs) and len(got["l4:lp"]) == 30


# ------------------------------------------------------------------------------ GPU (real graphs)
def _gpu_prompts(tok) -> List[List[int]]:
    from sglang.train.data import HELD_OUT_FILES, stdlib_root

    out = []
    for name in HELD_OUT_FILES[:4]:
        text = (stdlib_root() / name).read_text()
        start = max(text.find("\ndef "), 0)
        out.append(tok.encode(text[start:start + 4000])[:64])
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["torch_native", "triton"])
def test_graph_equals_eager_on_cuda(kernels):
    """The gate of the graph runner on the GPU, bf16: greedy tokens through CUDA graphs (with
    overlap) == eager greedy tokens (without overlap) over 256 tokens, for plain decode and NEXTN
    1 / 3 / 5, at batch 1 and at batch 4 with staggered arrivals; then the state-pollution check
    (seeded sampled and penalised requests through the same graphs, then the greedy requests
    again, unchanged), and seeded sampled NEXTN through graphs == eager (the exact rejection
    sampler is proven on its own in test_spec_utils)."""
    kw = dict(device="cuda", dtype="bfloat16", max_total_tokens=16384, max_running_requests=8,
              moe_runner_backend=kernels, linear_attn_decode_backend=kernels,
              attention_backend="triton" if kernels == "triton" else "torch_native")
    for spec in ({}, *(dict(speculative_algorithm="NEXTN", speculative_num_steps=s)
                       for s in (1, 3, 5))):
        eager = make_scheduler(MODEL, disable_cuda_graph=True, disable_overlap_schedule=True,
                               **kw, **spec)
        prompts = _gpu_prompts(eager.tokenizer)
        greedy = [_request(f"g{i}", p, max_new_tokens=256, temperature=0, ignore_eos=True)
                  for i, p in enumerate(prompts)]
        seeded = [_request(f"s{i}", p, max_new_tokens=64, temperature=0.8, top_p=0.9,
                           sampling_seed=11 + i, ignore_eos=True) for i, p in enumerate(prompts)]
        want1 = _run(eager, greedy[:1])
        want4 = _run(eager, greedy, stagger=2)
        want_s = _run(eager, seeded, stagger=1)
        del eager
        torch.cuda.empty_cache()
        graphed = make_scheduler(MODEL, **kw, **spec)
        runner = graphed.round_worker.graph_runner
        assert runner is not None, "no CUDA graph runner"
        got1 = _run(graphed, greedy[:1])
        got4 = _run(graphed, greedy, stagger=2)
        got_s = _run(graphed, seeded, stagger=1)
        penalised = [_request(f"p{i}", p, max_new_tokens=32, temperature=0.9,
                              frequency_penalty=0.4, ignore_eos=True)
                     for i, p in enumerate(prompts)]
        _run(graphed, penalised, stagger=1)
        again = _run(graphed, greedy, stagger=2)
        name = spec.get("speculative_num_steps", 0)
        for label, w, g in (("batch 1", want1, got1), ("batch 4", want4, got4),
                            ("seeded", want_s, got_s), ("after pollution", want4, again)):
            diff = {rid: next((j for j, (a, b) in enumerate(zip(w[rid], g[rid])) if a != b), None)
                    for rid in w}
            print(f"{kernels} nextn={name} {label}: first differing token {diff}, "
                  f"replays {runner.num_replays}, graphs {sorted(runner.graphs)}")
            assert g == w, f"{kernels} nextn={name} {label}: first differing token {diff}"
        assert runner.graphs and runner.num_replays > 0, "no CUDA graph was replayed"
        assert not runner.failed, runner.failed
        del graphed
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_fp8_graphs_equal_eager_and_nextn_equals_plain_on_cuda():
    """The bundled model quantized to block fp8 at load, the Triton kernel set (fp8 grouped
    GEMV and small-M GEMM, on by default on CUDA): greedy tokens through CUDA graphs == eager,
    and greedy NEXTN-3 == greedy plain decoding (both at batch 1 and 4), 128 tokens. The second
    holds only if every fp8 kernel rounds a token alike whatever the rows beside it."""
    kw = dict(device="cuda", dtype="bfloat16", quantization="fp8", max_total_tokens=16384,
              max_running_requests=8, moe_runner_backend="triton",
              linear_attn_decode_backend="triton", attention_backend="triton")
    results = {}
    for name, spec in (("plain", {}), ("nextn3", dict(speculative_algorithm="NEXTN",
                                                       speculative_num_steps=3))):
        for graphs in (False, True):
            sched = make_scheduler(MODEL, disable_cuda_graph=not graphs,
                                   disable_overlap_schedule=not graphs, **kw, **spec)
            assert sched.tp_worker.model_runner.small_m_gemm
            prompts = _gpu_prompts(sched.tokenizer)
            greedy = [_request(f"g{i}", p, max_new_tokens=128, temperature=0, ignore_eos=True)
                      for i, p in enumerate(prompts)]
            results[name, graphs] = (_run(sched, greedy[:1]), _run(sched, greedy, stagger=2))
            del sched
            torch.cuda.empty_cache()
    want = results["plain", False]
    for key, got in results.items():
        for label, w, g in (("batch 1", want[0], got[0]), ("batch 4", want[1], got[1])):
            diff = {rid: next((j for j, (a, b) in enumerate(zip(w[rid], g[rid])) if a != b),
                              None) for rid in w}
            print(f"fp8 {key} {label}: first differing token vs eager plain {diff}")
            assert g == w, f"fp8 {key} {label}: first differing token {diff}"
