"""NEXTN (MTP) speculative decoding on the bundled trained model, in process (no sockets).

Losslessness: greedy speculative output equals greedy plain output token for token over 256
tokens for num_steps 1..5, at batch 1 and at batch 4 with requests joining and leaving; state
pollution (greedy, then sampled / penalized / seeded requests, then the same greedy requests);
chunked prefill; exact finishing on max_new_tokens, EOS, stop tokens and stop strings although
the host learns accept counts one round late; aborts; metrics; KV-slot accounting (the
scheduler's leak check runs whenever it goes idle). The accept length of the bundled model on
held-out Python prompts is printed for steps 1..5 (``pytest -s``).

Statistical exactness of the rejection sampler is tested in ``test_spec_utils.py``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

from engine_test_utils import (
    make_scheduler,
    refuse_host_reads,
    sampling,
    submit_staggered,
    write_checkpoint,
)
from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.srt.layers.sampler import apply_penalties
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOutput,
    FlushCacheReqInput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.rounds.relay import AsyncHostCopy
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm, SpecMetricsOutput
from sglang.srt.rounds.chain_sampling import expand_for_chain
from sglang.train.data import HELD_OUT_FILES, stdlib_root

MODEL = str(BUNDLED_MODEL_DIR)
GEN = 256
PROMPT_LEN = 64
KW = dict(max_total_tokens=8192, max_running_requests=8)
VOCAB = ModelConfig.from_path(MODEL).vocab_size


def request(rid: str, ids: List[int], **kw: Any) -> TokenizedGenerateReqInput:
    """A tokenized request for the bundled model; other keywords are sampling params."""
    return TokenizedGenerateReqInput(rid, None, list(ids), sampling(VOCAB, **kw))


pytestmark = pytest.mark.usefixtures("two_torch_threads")


class Out:
    """Outputs of an in-process scheduler per rid (token messages and spec metrics)."""

    def __init__(self, outbox: List[Any]):
        self.ids: Dict[str, List[int]] = {}
        self.finish: Dict[str, dict] = {}
        self.chunks: Dict[str, List[int]] = {}
        self.spec: Dict[str, Tuple[int, int, int]] = {}
        self.logprobs: Dict[str, List[float]] = {}
        self.top_ids: Dict[str, List[List[int]]] = {}
        for msg in outbox:
            if isinstance(msg, SpecMetricsOutput):
                for i, rid in enumerate(msg.rids):
                    assert rid not in self.finish, "spec metrics must precede the finishing message"
                    self.spec[rid] = (msg.spec_verify_ct[i], msg.spec_num_correct_drafts[i],
                                      msg.spec_num_proposed_drafts[i])
                continue
            assert isinstance(msg, BatchTokenIDOutput), type(msg)
            for i, rid in enumerate(msg.rids):
                self.ids.setdefault(rid, []).extend(msg.decode_ids[i])
                self.chunks.setdefault(rid, []).append(len(msg.decode_ids[i]))
                self.logprobs.setdefault(rid, []).extend(msg.output_token_logprobs_val[i])
                self.top_ids.setdefault(rid, []).extend(msg.output_top_logprobs_idx[i])
                if msg.finished_reasons[i] is not None:
                    assert rid not in self.finish, f"{rid} finished twice"
                    self.finish[rid] = msg.finished_reasons[i]
        outbox.clear()


def run(sched: Scheduler, reqs, stagger: int = 0) -> Out:
    """Submit ``reqs`` (one every ``stagger`` steps when > 0) and run until idle."""
    submit_staggered(sched, reqs, stagger)
    return Out(sched.outbox)


def greedy(rid: str, prompt: List[int], n: int = GEN, **kw: Any):
    return request(rid, prompt, max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


_SCHEDULERS: Dict[Tuple, Scheduler] = {}


def spec_scheduler(steps: int, **kw: Any) -> Scheduler:
    """One scheduler per configuration for the whole module (building one takes ~1 s)."""
    key = (steps, tuple(sorted(kw.items())))
    if key not in _SCHEDULERS:
        _SCHEDULERS[key] = make_scheduler(MODEL, speculative_algorithm="NEXTN",
                                          speculative_num_steps=steps, **{**KW, **kw})
    return _SCHEDULERS[key]


@pytest.fixture(scope="module")
def prompts() -> List[List[int]]:
    """64-token prompts from the held-out files, each starting at a function definition."""
    tok = spec_scheduler(1).tokenizer
    out = []
    for name in HELD_OUT_FILES[:8]:
        text = (stdlib_root() / name).read_text(encoding="utf-8")
        start = text.find("\ndef ", len(text) // 3) + 1
        ids = tok.encode(text[start:start + 2000])[:PROMPT_LEN]
        assert len(ids) == PROMPT_LEN, name
        out.append(ids)
    return out


@pytest.fixture(scope="module")
def plain() -> Scheduler:
    return make_scheduler(MODEL, **KW)


@pytest.fixture(scope="module")
def ref(plain, prompts) -> List[List[int]]:
    """Greedy plain decoding of every prompt (batch of 8)."""
    out = run(plain, [greedy(f"p{i}", p) for i, p in enumerate(prompts)])
    return [out.ids[f"p{i}"] for i in range(len(prompts))]


# ------------------------------------------------------------------------------- no host reads

@pytest.mark.parametrize("steps,batch,moe", [
    (3, 2, "torch_native"),
    pytest.param(5, 4, "triton", marks=pytest.mark.slow),  # whole rounds in the interpreter
])
def test_round_never_reads_device_values_on_the_host(prompts, monkeypatch, steps, batch, moe):
    """The invariant the CUDA relay rests on: launching a round (draft, verify, acceptance, KDA
    commit, draft extend, the async result copy) never turns a tensor into a host value, so the
    host can run ahead of the device. Every tensor-to-Python conversion raises inside
    ``forward_round``; greedy and sampled rows. With the native MoE this holds while the
    verify routes <= 64 (token, expert) pairs (batch 2 x 4 positions x top-4 here); with
    ``--moe-runner-backend triton`` for any decode-sized batch (4 x 6 x 4 = 96 pairs; on CPU the
    kernels run in Triton's interpreter), here with the Triton KDA recurrence too."""
    kernels = dict(moe_runner_backend=moe)
    if moe == "triton":  # and the Triton KDA decode / verify recurrence
        kernels["linear_attn_decode_backend"] = "triton"
    sched = spec_scheduler(steps, **kernels)
    rounds: List[Any] = []
    refuse_host_reads(monkeypatch, sched.draft_worker, "forward_round", rounds)
    n, plen = (24, PROMPT_LEN) if moe == "torch_native" else (6, 8)  # the interpreter is slow
    reqs = [greedy(f"h{i}", prompts[i][:plen], n) if i % 2 == 0 else
            request(f"h{i}", prompts[i][:plen], max_new_tokens=n, temperature=0.8,
                    sampling_seed=5 + i, ignore_eos=True) for i in range(batch)]
    got = run(sched, reqs)
    assert len(rounds) >= n // steps and all(len(got.ids[f"h{i}"]) == n for i in range(batch))


@pytest.mark.slow  # two schedulers of whole models in the interpreter
def test_greedy_lossless_with_triton_kernels(prompts):
    """``--moe-runner-backend triton`` and ``--linear-attn-decode-backend triton`` (Triton's
    interpreter on CPU): greedy NEXTN equals greedy plain decoding with the same kernels, token
    for token (the verify and the decode of a token run the same kernels on the same state)."""
    kernels = dict(moe_runner_backend="triton", linear_attn_decode_backend="triton")
    reqs = lambda: [greedy(f"t{i}", prompts[i][:8], 16) for i in range(2)]  # noqa: E731
    base = run(make_scheduler(MODEL, **KW, **kernels), reqs())
    got = run(spec_scheduler(3, **kernels), reqs())
    assert got.ids == base.ids and all(len(ids) == 16 for ids in got.ids.values())


# ------------------------------------------------------------------------------- lossless
# The tests taking ``ref`` (plain greedy of 8 prompts x 256 tokens, then as many speculative
# tokens) are slow; the fast set checks NEXTN == plain through the penalized, logprob and
# no-host-read tests here and test_nextn_engine / test_overlap / test_cuda_graph_runner.
@pytest.mark.slow
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5])
def test_greedy_matches_plain_decoding(steps, prompts, ref):
    sched = spec_scheduler(steps)
    sched.process_input_requests([FlushCacheReqInput()])  # resets avg_spec_accept_length
    sched.outbox.clear()
    solo = (steps - 1) % len(prompts)
    out = run(sched, [greedy("solo", prompts[solo])])
    assert out.ids["solo"] == ref[solo], f"batch 1, steps {steps}"
    assert out.finish["solo"] == {"type": "length", "length": GEN}

    # Batch 4, ragged: requests join while others decode and leave at different lengths.
    idx = [(steps + k) % len(prompts) for k in range(4)]
    lens = [GEN, 180, GEN, 97]
    reqs = [greedy(f"b{k}", prompts[i], n) for k, (i, n) in enumerate(zip(idx, lens))]
    out = run(sched, reqs, stagger=3)
    for k, (i, n) in enumerate(zip(idx, lens)):
        assert out.ids[f"b{k}"] == ref[i][:n], f"batch 4, steps {steps}, request {k}"
    assert max(max(c) for c in out.chunks.values()) > 1  # multi-token rounds did happen
    accept = sched.get_internal_state()["avg_spec_accept_length"]
    print(f"\nNEXTN steps={steps} (draft tokens {steps + 1}): avg accept length {accept:.3f} "
          "on held-out Python prompts (bundled model, greedy)")
    assert 1.2 < accept <= steps + 1


@pytest.mark.slow
def test_state_pollution(prompts, ref):
    """Greedy, then sampled / penalized / seeded requests interleaved with greedy ones, then the
    same greedy requests again: identical."""
    sched = spec_scheduler(3)
    n = 48
    first = run(sched, [greedy(f"g{i}", prompts[i], n) for i in range(4)])
    mixed = [
        request("t", prompts[4], max_new_tokens=n, temperature=0.9, top_p=0.9, top_k=40),
        greedy("g", prompts[0], n),
        request("m", prompts[5], max_new_tokens=n, temperature=1.2, min_p=0.05, sampling_seed=3),
        request("pen", prompts[6], max_new_tokens=n, temperature=0.7, frequency_penalty=0.6,
                presence_penalty=0.4, repetition_penalty=1.3, min_new_tokens=20,
                logit_bias={"5": 2.0}),
        request("gp", prompts[7], max_new_tokens=n, temperature=0, repetition_penalty=1.5),
    ]
    out = run(sched, mixed, stagger=2)
    assert out.ids["g"] == ref[0][:n]
    for rid in ("t", "m", "pen", "gp"):
        assert len(out.ids[rid]) == n or out.finish[rid]["type"] == "stop"
    again = run(sched, [greedy(f"g{i}", prompts[i], n) for i in range(4)])
    assert again.ids == first.ids
    assert [first.ids[f"g{i}"] for i in range(4)] == [r[:n] for r in ref[:4]]


def test_penalized_greedy_matches_plain(plain, prompts):
    """Per-position penalties inside a chain are exact: greedy with repetition / frequency
    penalties and min_new_tokens gives the plain result."""
    kw = dict(max_new_tokens=40, temperature=0, repetition_penalty=1.4, frequency_penalty=0.5,
              presence_penalty=0.2, min_new_tokens=30)
    want = run(plain, [request(f"r{i}", prompts[i], **kw) for i in range(3)])
    got = run(spec_scheduler(3), [request(f"r{i}", prompts[i], **kw) for i in range(3)])
    assert got.ids == want.ids and got.finish == want.finish


def test_output_logprobs_match_plain(plain, prompts):
    """Output logprobs of committed tokens are the target's at each chain position (with that
    position's penalties), as plain decoding reports them."""
    def reqs():
        return [TokenizedGenerateReqInput(f"l{i}", None, prompts[i], sampling(
            VOCAB, max_new_tokens=30, temperature=0, ignore_eos=True,
            repetition_penalty=1.0 + 0.3 * i), return_logprob=True, top_logprobs_num=3)
            for i in range(2)]

    want, got = run(plain, reqs()), run(spec_scheduler(2), reqs())
    assert got.ids == want.ids and got.top_ids == want.top_ids
    for rid in want.ids:
        assert len(got.logprobs[rid]) == 30
        torch.testing.assert_close(torch.tensor(got.logprobs[rid]),
                                   torch.tensor(want.logprobs[rid]), rtol=1e-4, atol=1e-4)


def test_seeded_sampling_is_reproducible(prompts):
    sched = spec_scheduler(4)

    def seeded(rid: str, i: int, seed: int):
        return request(rid, prompts[i], max_new_tokens=24, temperature=0.8, top_k=50,
                       sampling_seed=seed, ignore_eos=True)

    a = run(sched, [seeded("a", 0, 11)]).ids["a"]
    b = run(sched, [seeded("a", 0, 11)]).ids["a"]
    c = run(sched, [seeded("x", 1, 5), seeded("a", 0, 11), greedy("y", prompts[2], 20)],
            stagger=2).ids["a"]
    d = run(sched, [seeded("a", 0, 12)]).ids["a"]
    assert a == b == c
    assert a != d  # another seed, another sample (fails only on an astronomically rare tie)


# ------------------------------------------------------------------------------- scheduling
@pytest.mark.slow
def test_chunked_prefill(prompts, ref):
    sched = spec_scheduler(2, chunked_prefill_size=24)
    reqs = [greedy(f"c{i}", prompts[i], 60) for i in range(3)]
    out = run(sched, reqs, stagger=2)  # chunks of later prompts interleave with decoding
    for i in range(3):
        assert out.ids[f"c{i}"] == ref[i][:60]
    # The per-chunk draft extends fill the MTP cache as one extend over the prompt would: the
    # drafts, and so the acceptance, match an unchunked run.
    whole = run(spec_scheduler(2), [greedy(f"c{i}", prompts[i], 60) for i in range(3)])
    assert out.spec == whole.spec


@pytest.mark.slow
def test_finish_exactly_like_plain_decoding(plain, prompts, ref):
    """max_new_tokens, stop tokens, EOS and stop strings cut the output where plain decoding
    does, although the host sees tokens only one round (up to N tokens) late."""
    sched = spec_scheduler(5)
    r = ref[1]
    stop_tok = r[25]
    k = r.index(stop_tok)
    text = sched.tokenizer.decode(r[30:34])
    cases = [
        ("len", dict(max_new_tokens=37, temperature=0)),
        ("stop_id", dict(max_new_tokens=GEN, temperature=0, stop_token_ids=[stop_tok])),
        ("stop_str", dict(max_new_tokens=GEN, temperature=0, stop=[text.strip()[:3] or text])),
        ("one", dict(max_new_tokens=1, temperature=0)),
    ]
    want = run(plain, [request(rid, prompts[1], **kw) for rid, kw in cases])
    got = run(sched, [request(rid, prompts[1], **kw) for rid, kw in cases])
    assert got.ids == want.ids and got.finish == want.finish
    assert got.ids["len"] == r[:37] and got.ids["stop_id"] == r[:k + 1]
    assert got.finish["stop_id"] == {"type": "stop", "matched": stop_tok}
    assert got.finish["stop_str"]["type"] == "stop" and len(got.ids["stop_str"]) < 40

    # EOS: make the (k+1)-th token the model's EOS for requests created from now on.
    for s in (plain, sched):
        s.eos_token_ids, saved = {stop_tok}, s.eos_token_ids
        try:
            out = run(s, [request("eos", prompts[1], max_new_tokens=GEN, temperature=0)])
        finally:
            s.eos_token_ids = saved
        assert out.ids["eos"] == r[:k + 1]
        assert out.finish["eos"] == {"type": "stop", "matched": stop_tok}
    alloc = sched.token_to_kv_pool_allocator
    assert alloc.available_size() == sched.max_total_num_tokens


@pytest.mark.slow
def test_abort_mid_generation(prompts, ref):
    sched = spec_scheduler(3)
    reqs = [greedy(f"a{i}", prompts[i], 120) for i in range(3)]
    for r in reqs:
        sched.submit(r)
    for _ in range(6):
        sched.process_input_requests(sched.recv_requests())
        sched.step()
    assert sched.pending_round is not None  # a round is in flight when the abort lands
    sched.submit(AbortReq(rid="a1"))
    sched.run_until_idle()  # on_idle -> check_memory: every slot came back
    out = Out(sched.outbox)
    assert out.finish["a1"]["type"] == "abort"
    assert ref[1][:len(out.ids["a1"])] == out.ids["a1"] and len(out.ids["a1"]) < 120
    assert out.ids["a0"] == ref[0][:120] and out.ids["a2"] == ref[2][:120]

    for r in reqs:
        sched.submit(r)
    for _ in range(5):
        sched.process_input_requests(sched.recv_requests())
        sched.step()
    sched.submit(AbortReq(abort_all=True))
    sched.run_until_idle()
    out = Out(sched.outbox)
    assert all(f["type"] == "abort" for f in out.finish.values()) and len(out.finish) == 3
    assert sched.token_to_kv_pool_allocator.available_size() == sched.max_total_num_tokens


# ------------------------------------------------------------------------------- metrics
def test_metrics(prompts):
    sched = spec_scheduler(3)
    sched.process_input_requests([FlushCacheReqInput()])
    sched.outbox.clear()
    out = run(sched, [greedy(f"m{i}", prompts[i], 50 + 10 * i) for i in range(3)])
    state = sched.get_internal_state()
    n = sched.round_worker.round_tokens
    total_ct = total_accept = 0
    for i in range(3):
        ct, correct, proposed = out.spec[f"m{i}"]
        assert proposed == ct * (n - 1) and 0 <= correct <= proposed
        completion = len(out.ids[f"m{i}"])
        # Each round commits correct + 1 tokens; the first token comes from the prefill; the
        # last round may overshoot max_new_tokens by up to N - 1 tokens.
        assert completion - 1 <= correct + ct <= completion - 1 + n - 1
        total_ct += ct
        total_accept += correct + ct
    assert state["spec_num_verify_reqs"] == total_ct
    assert state["avg_spec_accept_length"] == pytest.approx(total_accept / total_ct)
    assert state["speculative_num_draft_tokens"] == n
    sched.process_input_requests([FlushCacheReqInput()])
    assert sched.outbox.pop().success
    assert sched.get_internal_state()["avg_spec_accept_length"] == 0.0


# ------------------------------------------------------------------------------- setup
def test_checkpoint_without_mtp_layer_fails_at_startup(tmp_path):
    path = write_checkpoint(str(tmp_path), num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="no MTP layer"):
        make_scheduler(path, speculative_algorithm="NEXTN")
    with pytest.raises(ValueError, match="no DSpark draft config"):  # a target is no draft
        make_scheduler(path, speculative_algorithm="DSPARK",
                       speculative_draft_model_path=path)


def test_speculative_algorithm_enum():
    assert SpeculativeAlgorithm.from_string(None).is_none()
    assert SpeculativeAlgorithm.from_string("eagle").is_nextn()
    assert SpeculativeAlgorithm.from_string("NextN") == SpeculativeAlgorithm.NEXTN
    assert SpeculativeAlgorithm.from_string("dspark") == SpeculativeAlgorithm.DSPARK
    with pytest.raises(ValueError, match="speculative-algorithm"):
        SpeculativeAlgorithm.from_string("medusa")


def test_target_runner_spec_sizing():
    cfg = ModelConfig.from_path(MODEL)
    n = 4
    runner = ModelRunner(cfg, device="cpu", dtype=torch.float32, max_running_requests=2,
                         max_total_tokens=64, context_length=128, draft_extra_mla_layers=True,
                         spec_num_draft_tokens=n, position_headroom=2 * n)
    pool = runner.kda_state_pool
    assert pool.has_spec_scratch and pool.spec_num_draft_tokens == n
    assert pool.spec_bytes_per_slot() == n * pool.bytes_per_slot()
    assert runner.req_to_token_pool.max_context_len == 128 + 2 * n
    assert runner.context_len == 128
    assert cfg.hf_config.mtp_layer_id in runner.token_to_kv_pool.layer_ids
    with pytest.raises(ValueError, match="spec_num_draft_tokens"):
        ModelRunner(cfg, device="cpu", dtype=torch.float32, spec_num_draft_tokens=-1)
    # At the full context the map (and the RoPE table) reach 2N positions past it.
    full = ModelRunner(cfg, device="cpu", dtype=torch.float32, max_running_requests=1,
                       max_total_tokens=64, draft_extra_mla_layers=True, spec_num_draft_tokens=n,
                       position_headroom=2 * n)
    ctx = cfg.context_len
    assert full.req_to_token_pool.max_context_len == ctx + 2 * n
    rope = full.model.model.layers[cfg.hf_config.full_attention_layer_ids[0]].attention.rotary_emb
    assert rope.cos_sin_cache(torch.device("cpu")).shape[0] >= ctx + 2 * n


def test_expand_for_chain_equals_sequential_history():
    """Row (b, i) of the chain expansion transforms logits exactly like the batch info after
    appending drafts d_1..d_i one by one."""
    vocab, n = 12, 4
    params = [SamplingParams(temperature=0.7, frequency_penalty=0.5, presence_penalty=0.3,
                             repetition_penalty=1.3, min_new_tokens=3),
              SamplingParams(temperature=0, logit_bias={2: 1.5})]
    for p in params:
        p.verify(vocab)
        p.normalize(None)
    info = SamplingBatchInfo.from_reqs(params, [[1, 1, 4], [7]], vocab,
                                       prompt_ids=[[3, 5], [9]], eos_token_ids=[0])
    drafts = torch.tensor([[4, 2, 4], [0, 7, 11]])
    logits = torch.randn(2 * n, vocab, generator=torch.Generator().manual_seed(0))
    got = apply_penalties(logits.clone(), expand_for_chain(info, drafts, n))
    seq = SamplingBatchInfo.from_reqs(params, [[1, 1, 4], [7]], vocab,
                                      prompt_ids=[[3, 5], [9]], eos_token_ids=[0])
    for i in range(n):
        rows = logits.view(2, n, vocab)[:, i].clone()
        torch.testing.assert_close(got.view(2, n, vocab)[:, i], apply_penalties(rows, seq))
        if i < n - 1:
            seq.append_tokens(drafts[:, i])
    # A single position (as the draft steps use it) equals that row of the full expansion.
    row2 = logits.view(2, n, vocab)[:, 2].clone()
    torch.testing.assert_close(apply_penalties(row2.clone(), expand_for_chain(info, drafts, 1, 2)),
                               got.view(2, n, vocab)[:, 2])


def test_async_host_copy_on_cpu():
    x = torch.arange(6).view(2, 3)
    copy = AsyncHostCopy({"x": x})
    x.add_(1)  # the copy was taken at construction
    assert copy.ready() and copy.wait()["x"].tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,kernels", [("float32", "torch_native"), ("bfloat16", "torch_native"),
                                           ("bfloat16", "triton")])
def test_greedy_lossless_on_cuda(prompts, dtype, kernels):
    """On CUDA (side-stream copies, copy-done events, one-round-late host): speculative greedy
    equals plain greedy. fp32 checks the algorithm; bf16 is the GPU gate of losslessness (a
    verify over N tokens and a 1-token decode must round alike for it to hold);
    ``kernels="triton"`` runs the MoE and the KDA recurrence through the project's Triton
    kernels."""
    kw = dict(device="cuda", dtype=dtype, max_total_tokens=8192, max_running_requests=8,
              moe_runner_backend=kernels, linear_attn_decode_backend=kernels)
    plain = make_scheduler(MODEL, **kw)
    base = run(plain, [greedy(f"g{i}", prompts[i], GEN) for i in range(4)])
    solo = run(plain, [greedy("solo", prompts[0], GEN)])  # batch 1 throughout
    for steps in (1, 3, 5):
        sched = make_scheduler(MODEL, speculative_algorithm="NEXTN",
                               speculative_num_steps=steps, **kw)
        got1 = run(sched, [greedy("solo", prompts[0], GEN)])
        diff1 = next((j for j, (a, b) in enumerate(zip(solo.ids["solo"], got1.ids["solo"]))
                      if a != b), None)
        print(f"{dtype} steps {steps}: batch 1, first differing token {diff1}")
        got = run(sched, [greedy(f"g{i}", prompts[i], GEN) for i in range(4)], stagger=2)
        first_diff = {rid: next((j for j, (a, b) in enumerate(zip(ids, got.ids[rid])) if a != b),
                                None) for rid, ids in base.ids.items()}
        print(f"{dtype} steps {steps}: first differing token per request {first_diff}")
        assert got.ids == base.ids, f"steps {steps}: first differing token {first_diff}"
