"""Scheduler invariants, in process (no sockets): recompute parity, chunked prefill, batching,
seeded sampling, finish conditions, aborts and slot accounting; plus the detokenizer logic."""
from __future__ import annotations

import random

import pytest
import torch

from engine_test_utils import (
    VOCAB,
    Collected,
    make_scheduler,
    reference_greedy,
    request,
    run_requests,
    write_checkpoint,
)
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.detokenizer_manager import IncrementalDetokenizer, longest_stop_prefix_suffix
from sglang.srt.managers.io_struct import AbortReq, BatchTokenIDOutput, FlushCacheReqInput
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch, release_kv_cache
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.train.reference import ReferenceBailingMoeV3


pytestmark = pytest.mark.usefixtures("one_thread")  # test/srt/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("sched_ckpt")))


@pytest.fixture(scope="module")
def ref_model(ckpt):
    return ReferenceBailingMoeV3.from_pretrained(ckpt).eval()


@pytest.fixture(scope="module")
def sched(ckpt):
    return make_scheduler(ckpt)


def _prompt(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, VOCAB, (n,), generator=g).tolist()


def _decode_batch(batch: ScheduleBatch, runner) -> ForwardBatch:
    """A host-built one-token decode batch of ``batch``'s requests (the newest output token at
    position ``seqlen - 1``), outside the round worker, for a step-by-step comparison."""
    reqs = batch.reqs
    loc = runner.token_to_kv_pool_allocator.alloc(len(reqs))
    rows = torch.tensor([[r.output_ids[-1], r.req_pool_idx, r.seqlen] for r in reqs])
    ids, slots, lens = rows[:, 0], rows[:, 1], rows[:, 2]
    runner.req_to_token_pool.req_to_token[slots, lens - 1] = loc.to(torch.int32)
    for r in reqs:
        r.kv_len += 1
    return ForwardBatch.for_decode(ids, slots, lens, loc,
                                   seq_lens_upper_bound=max(r.seqlen for r in reqs))


def test_prefill_then_decode_logits_match_full_recompute(sched, ref_model):
    runner = sched.tp_worker.model_runner
    prompt, steps = _prompt(13, 1), 6
    ref_tokens, ref_logits = reference_greedy(ref_model, prompt, steps)

    req = Req("r", None, prompt, SamplingParams())
    req.req_pool_idx = runner.req_to_token_pool.alloc(1)[0]
    runner.kda_state_pool.clear_slots([req.req_pool_idx])
    req.extend_input_len = len(prompt)
    batch = ScheduleBatch.init_new([req], runner.req_to_token_pool,
                                   runner.token_to_kv_pool_allocator, runner.device)
    logits = [runner.forward(batch.prepare_for_extend()).next_token_logits[0]]
    batch.commit_forward()
    for _ in range(steps):
        req.output_ids.append(int(logits[-1].argmax()))
        logits.append(runner.forward(_decode_batch(batch, runner)).next_token_logits[0])
    assert req.output_ids == ref_tokens
    got = torch.stack(logits)
    want = ref_logits[len(prompt) - 1:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    # The same positions recomputed in one extend over a fresh slot agree too.
    full = prompt + req.output_ids
    row = runner.req_to_token_pool.alloc(1)[0]
    runner.kda_state_pool.clear_slots([row])
    loc = runner.token_to_kv_pool_allocator.alloc(len(full))
    runner.req_to_token_pool.write(row, 0, loc)
    fb = ForwardBatch.for_extend(torch.tensor(full), [row], [0], [len(full)], loc,
                                 return_full_logits=True)
    recompute = runner.forward(fb).next_token_logits[len(prompt) - 1:]
    torch.testing.assert_close(got, recompute, rtol=1e-4, atol=1e-4)
    runner.token_to_kv_pool_allocator.free(loc)
    runner.req_to_token_pool.free(row)
    release_kv_cache(req, runner.req_to_token_pool, runner.token_to_kv_pool_allocator)
    sched.check_memory()


def test_greedy_matches_reference_model(sched, ref_model):
    prompt = _prompt(10, 2)
    ref_tokens, _ = reference_greedy(ref_model, prompt, 12)
    got = run_requests(sched, [request("g", prompt, temperature=0, max_new_tokens=12,
                                       ignore_eos=True)])
    assert got.ids["g"] == ref_tokens
    assert got.finish["g"] == {"type": "length", "length": 12}


def test_chunked_prefill_matches_unchunked(ckpt, ref_model):
    prompts = {"a": _prompt(23, 3), "b": _prompt(7, 4), "c": _prompt(12, 5)}

    def run(chunk):
        s = make_scheduler(ckpt, chunked_prefill_size=chunk)
        reqs = [request(rid, p, temperature=0, max_new_tokens=6, ignore_eos=True,
                        return_logprob=True, logprob_start_len=0) for rid, p in prompts.items()]
        out = run_requests(s, reqs)
        s.check_memory()
        return out, s.forward_ct

    whole, n_whole = run(-1)
    chunked, n_chunked = run(5)
    assert n_chunked > n_whole  # the prompts really went through in several chunks
    for rid, prompt in prompts.items():
        assert chunked.ids[rid] == whole.ids[rid]
        assert chunked.in_ids[rid] == prompt
        assert chunked.in_lp[rid][0] is None and whole.in_lp[rid][0] is None
        torch.testing.assert_close(torch.tensor(chunked.in_lp[rid][1:]),
                                   torch.tensor(whole.in_lp[rid][1:]), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.tensor(chunked.out_lp[rid]),
                                   torch.tensor(whole.out_lp[rid]), rtol=1e-4, atol=1e-4)
    # Input logprobs against the reference model.
    prompt = prompts["a"]
    with torch.no_grad():
        logits, _ = ref_model(torch.tensor([prompt]))
    lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(1, torch.tensor(prompt[1:])[:, None])
    torch.testing.assert_close(torch.tensor(chunked.in_lp["a"][1:]), lp[:, 0],
                               rtol=1e-4, atol=1e-4)


def test_prompt_logprob_batches_are_capped(ckpt, monkeypatch):
    """SGLANG_INPUT_LOGPROB_LOGITS_BYTES bounds the tokens of every prefill batch that returns
    full logits (prompt logprobs): a long prompt is chunked more, a logprob request waits rather
    than joining a batch already at the cap, and the logprobs equal an uncapped run's."""
    prompts = {"plain": _prompt(20, 8), "lp": _prompt(23, 9), "lp2": _prompt(6, 10)}

    def run(cap_tokens):
        if cap_tokens:
            vocab = ModelConfig.from_path(ckpt).vocab_size
            monkeypatch.setenv("SGLANG_INPUT_LOGPROB_LOGITS_BYTES", str(4 * vocab * cap_tokens))
        s = make_scheduler(ckpt, chunked_prefill_size=-1)
        seen = []
        forward = s.tp_worker.model_runner.forward

        def spy(fb, **kw):
            if fb.return_full_logits:
                seen.append(fb.num_tokens)
            return forward(fb, **kw)

        s.tp_worker.model_runner.forward = spy
        reqs = [request("plain", prompts["plain"], temperature=0, max_new_tokens=3)]
        reqs += [request(rid, prompts[rid], temperature=0, max_new_tokens=3, return_logprob=True,
                         logprob_start_len=0) for rid in ("lp", "lp2")]
        out = run_requests(s, reqs)
        s.check_memory()
        return out, seen

    whole, seen_whole = run(None)
    capped, seen_capped = run(7)
    assert max(seen_whole) > 7 and seen_capped and max(seen_capped) <= 7
    for rid in prompts:
        assert capped.ids[rid] == whole.ids[rid]
    for rid in ("lp", "lp2"):
        assert capped.in_ids[rid] == prompts[rid]
        torch.testing.assert_close(torch.tensor(capped.in_lp[rid][1:]),
                                   torch.tensor(whole.in_lp[rid][1:]), rtol=1e-4, atol=1e-4)


def test_logprob_start_len_selects_prompt_suffix(sched):
    prompt = _prompt(9, 6)
    out = run_requests(sched, [
        request("s0", prompt, temperature=0, max_new_tokens=2, return_logprob=True,
                logprob_start_len=0),
        request("s4", prompt, temperature=0, max_new_tokens=2, return_logprob=True,
                logprob_start_len=4),
        request("none", prompt, temperature=0, max_new_tokens=2, return_logprob=True)])
    assert out.in_ids["s4"] == prompt[4:]
    torch.testing.assert_close(torch.tensor(out.in_lp["s4"]), torch.tensor(out.in_lp["s0"][4:]))
    assert out.in_lp["none"] == [] and len(out.out_lp["none"]) == 2


def test_batch_of_four_matches_each_alone(sched):
    prompts = [_prompt(n, 10 + n) for n in (3, 9, 17, 30)]
    kw = dict(temperature=0, max_new_tokens=8, ignore_eos=True, return_logprob=True)
    together = run_requests(sched, [request(f"t{i}", p, **kw) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        alone = run_requests(sched, [request(f"s{i}", p, **kw)])
        assert together.ids[f"t{i}"] == alone.ids[f"s{i}"]
        torch.testing.assert_close(torch.tensor(together.out_lp[f"t{i}"]),
                                   torch.tensor(alone.out_lp[f"s{i}"]), rtol=1e-4, atol=1e-4)
    sched.check_memory()


def test_seeded_sampling_reproducible_and_seed_dependent(sched):
    prompt = _prompt(6, 20)
    kw = dict(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    a = run_requests(sched, [request("a", prompt, sampling_seed=7, **kw)]).ids["a"]
    b = run_requests(sched, [request("b", prompt, sampling_seed=7, **kw)]).ids["b"]
    c = run_requests(sched, [request("c", prompt, sampling_seed=8, **kw)]).ids["c"]
    # The draw of a seeded request does not depend on the batch it runs in.
    mixed = run_requests(sched, [request("d", _prompt(11, 21), **kw),
                                 request("e", prompt, sampling_seed=7, **kw)])
    assert a == b == mixed.ids["e"]
    assert a != c


def test_finish_on_eos_and_stop_token_ids(sched):
    prompt = _prompt(8, 30)
    free = run_requests(sched, [request("f", prompt, temperature=0, max_new_tokens=10,
                                        ignore_eos=True)]).ids["f"]
    j = next(j for j in range(2, 10) if free[j] not in free[:j])
    stop = run_requests(sched, [request("st", prompt, temperature=0, max_new_tokens=10,
                                        stop_token_ids=[free[j]])])
    assert stop.ids["st"] == free[: j + 1]
    assert stop.finish["st"] == {"type": "stop", "matched": free[j]}

    saved = sched.eos_token_ids
    sched.eos_token_ids = {free[j]}
    try:
        eos = run_requests(sched, [request("e", prompt, temperature=0, max_new_tokens=10)])
        ign = run_requests(sched, [request("i", prompt, temperature=0, max_new_tokens=10,
                                           ignore_eos=True)])
    finally:
        sched.eos_token_ids = saved
    assert eos.ids["e"] == free[: j + 1] and eos.finish["e"]["matched"] == free[j]
    assert ign.ids["i"] == free
    # As upstream, ignore_eos also disables stop_token_ids.
    both = run_requests(sched, [request("b", prompt, temperature=0, max_new_tokens=10,
                                        stop_token_ids=[free[j]], ignore_eos=True)])
    assert both.ids["b"] == free and both.finish["b"]["type"] == "length"


def test_request_that_cannot_fit_is_aborted_not_crashing(ckpt):
    s = make_scheduler(ckpt, max_total_tokens=40)
    out = run_requests(s, [request("big", _prompt(30, 40), max_new_tokens=20),
                           request("ok", _prompt(10, 41), max_new_tokens=5, ignore_eos=True),
                           request("oov", [3, VOCAB + 5], max_new_tokens=2)])
    assert out.finish["big"]["type"] == "abort" and out.finish["big"]["status_code"] == 400
    assert "KV cache slots" in out.finish["big"]["message"]
    assert out.finish["oov"]["type"] == "abort" and "vocabulary" in out.finish["oov"]["message"]
    assert len(out.ids["ok"]) == 5
    s.check_memory()


def _record_batches(s) -> list:
    """Wrap ``s.get_next_batch_to_run`` to log each batch: ``("decode", n)`` for a step of the
    running batch, ``("prefill", [(rid, tokens), ...])`` for a prefill batch."""
    log, pick = [], s.get_next_batch_to_run

    def logged():
        batch = pick()
        if batch is not None and batch is s.running_batch:
            log.append(("decode", len(batch.reqs)))
        elif batch is not None:
            log.append(("prefill", [(r.rid, r.extend_input_len) for r in batch.reqs]))
        return batch

    s.get_next_batch_to_run = logged
    return log


def test_running_requests_decode_between_the_chunks_of_a_long_prompt(ckpt):
    kw = dict(temperature=0, max_new_tokens=12, ignore_eos=True)
    alone = run_requests(make_scheduler(ckpt), [request("run", _prompt(3, 50), **kw)])
    s = make_scheduler(ckpt, chunked_prefill_size=4)
    s.submit(request("run", _prompt(3, 50), **kw))
    s.process_input_requests(s.recv_requests())
    s.step()  # "run" prefilled: it decodes from here on
    log = _record_batches(s)
    s.submit(request("long", _prompt(14, 70), **kw))
    s.run_until_idle()
    chunks = [i for i, (kind, _) in enumerate(log) if kind == "prefill"]
    assert [log[i][1] for i in chunks] == [[("long", 4)], [("long", 4)], [("long", 4)],
                                           [("long", 2)]]
    # One decode step of "run" after every chunk that leaves more of the prompt to come.
    for i in chunks[:-1]:
        assert log[i + 1] == ("decode", 1)
    out = Collected().add(s.outbox)
    assert out.ids["run"] == alone.ids["run"]  # interleaving changes no token
    assert len(out.ids["long"]) == 12
    s.check_memory()


def test_max_prefill_tokens_splits_new_requests_over_batches(ckpt):
    s = make_scheduler(ckpt, max_prefill_tokens=25)
    log = _record_batches(s)
    kw = dict(temperature=0, max_new_tokens=2, ignore_eos=True)
    out = run_requests(s, [request(f"r{i}", _prompt(10, 80 + i), **kw) for i in range(3)]
                       + [request("big", _prompt(30, 90), **kw)])
    prefills = [batch for kind, batch in log if kind == "prefill"]
    assert prefills[0] == [("r0", 10), ("r1", 10)]
    assert prefills[1] == [("r2", 10)]
    assert prefills[2] == [("big", 30)]  # longer than the cap: taken alone, whole
    assert all(len(out.ids[r]) == 2 for r in ("r0", "r1", "r2", "big"))


def test_abort_frees_waiting_chunked_and_running(ckpt):
    s = make_scheduler(ckpt, chunked_prefill_size=4, max_running_requests=2)
    kw = dict(temperature=0, max_new_tokens=50, ignore_eos=True)
    for rid, n in (("run", 3), ("chunk", 20), ("wait", 5)):
        s.submit(request(rid, _prompt(n, 50 + n), **kw))
    s.process_input_requests(s.recv_requests())
    for _ in range(3):  # "run" prefilled and decoding, "chunk" half prefilled, "wait" queued
        s.step()
    assert s.chunked_req is not None and s.chunked_req.rid == "chunk"
    assert [r.rid for r in s.running_batch.reqs] == ["run"]
    assert [r.rid for r in s.waiting_queue] == ["wait"]
    for rid in ("chunk", "run", "wait", "unknown-rid"):
        s.submit(AbortReq(rid=rid))
    s.run_until_idle()
    out = Collected().add(s.outbox)
    assert {rid: f["type"] for rid, f in out.finish.items()} == \
        {"run": "abort", "chunk": "abort", "wait": "abort"}
    s.check_memory()


def test_random_requests_with_aborts_leave_no_leaks(ckpt):
    rng = random.Random(0)
    s = make_scheduler(ckpt, max_total_tokens=300, max_running_requests=4, chunked_prefill_size=16)
    rids = []
    for i in range(200):
        rid = f"r{i}"
        rids.append(rid)
        n = rng.randint(1, 40) if i % 50 else 290  # a few can never fit
        s.submit(request(rid, _prompt(n, 1000 + i), temperature=rng.choice([0.0, 1.0]),
                         max_new_tokens=rng.randint(1, 8), ignore_eos=rng.random() < 0.5,
                         stream=rng.random() < 0.5))
        if rng.random() < 0.3:
            s.submit(AbortReq(rid=rng.choice(rids)))
        for _ in range(rng.randint(0, 3)):
            s.process_input_requests(s.recv_requests())
            s.step()
    s.run_until_idle()
    out = Collected().add(s.outbox)
    assert sorted(out.finish) == sorted(rids)
    assert set(out.finish_count.values()) == {1}  # each request finished exactly once
    assert any(f["type"] == "abort" and f["status_code"] is None for f in out.finish.values())
    s.check_memory()
    assert s.token_to_kv_pool_allocator.available_size() == s.max_total_num_tokens
    assert s.req_to_token_pool.available_size() == s.max_running_requests  # = KDA state slots


def test_flush_cache_only_when_idle_and_internal_state(ckpt):
    s = make_scheduler(ckpt)
    s.submit(request("x", _prompt(5, 60), max_new_tokens=3, ignore_eos=True))
    s.process_input_requests(s.recv_requests())
    s.step()
    assert not s.flush_cache().success
    s.run_until_idle()
    assert s.flush_cache().success
    state = s.get_internal_state()
    assert state["num_running_reqs"] == 0 and state["available_kv_tokens"] == 2048
    assert state["num_generated_tokens"] == 3 and "last_gen_throughput" in state
    s.submit(FlushCacheReqInput())
    s.run_until_idle()
    assert s.outbox[-1].success


# ---------------------------------------------------------------------------- detokenizer
class _ByteTokenizer:
    """Token id = one byte (ids 0..255); id 256 is a special token decoding to '<eos>'."""

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        data = bytes(i for i in ids if i < 256)
        text = data.decode("utf-8", errors="replace")
        if not skip_special_tokens and 256 in ids:
            text += "<eos>"
        return text


def _msg(rid, ids, finished=None, stop=(), no_trim=False):
    return BatchTokenIDOutput(
        rids=[rid], finished_reasons=[finished], decode_ids=[ids], prompt_tokens=[1],
        completion_tokens=[0], cached_tokens=[0], skip_special_tokens=[True],
        spaces_between_special_tokens=[True], no_stop_trim=[no_trim], stop_strs=[list(stop)],
        output_token_logprobs_val=[[]], output_token_logprobs_idx=[[]],
        output_top_logprobs_val=[[]], output_top_logprobs_idx=[[]],
        input_token_logprobs_val=[[]], input_token_logprobs_idx=[[]],
        input_top_logprobs_val=[[]], input_top_logprobs_idx=[[]])


def test_detokenizer_never_splits_multibyte_characters():
    detok = IncrementalDetokenizer(_ByteTokenizer())
    data = "a中文b€".encode()
    pieces = [detok.process(_msg("r", [b])).output_strs[0] for b in data[:-1]]
    pieces.append(detok.process(_msg("r", [data[-1]], {"type": "length", "length": 9}))
                  .output_strs[0])
    assert "".join(pieces) == "a中文b€"
    assert all("\ufffd" not in p for p in pieces)
    assert "r" not in detok.status  # state dropped at finish


def test_detokenizer_holds_back_stop_prefix_and_trims():
    detok = IncrementalDetokenizer(_ByteTokenizer())
    seen = ""
    for ch in "hello wor":
        seen += detok.process(_msg("r", list(ch.encode()), stop=["world"])).output_strs[0]
    assert seen == "hello "  # "wor" might start the stop string
    seen += detok.process(_msg("r", list(b"ld!"), {"type": "stop", "matched": "world"},
                               stop=["world"])).output_strs[0]
    assert seen == "hello "
    # A stop token's text is dropped unless no_stop_trim.
    out = detok.process(_msg("t", [104, 105, 256], {"type": "stop", "matched": 256}))
    assert out.output_strs[0] == "hi"
    assert longest_stop_prefix_suffix("abcwo", ["world", "cw"]) == 2


def test_max_new_tokens_zero_is_prefill_only(sched):
    out = run_requests(sched, [request("z", _prompt(5, 70), max_new_tokens=0,
                                       return_logprob=True, logprob_start_len=0)])
    assert out.ids["z"] == [] and out.finish["z"] == {"type": "length", "length": 0}
    assert len(out.in_lp["z"]) == 5
    sched.check_memory()


def test_profile_waits_for_start_step_and_ends_after_num_steps(sched, tmp_path, monkeypatch):
    """A profile with start_step waits for that forward count, covers num_steps scheduler steps,
    writes one trace and replies once per start / stop (rank 0)."""
    from sglang.srt.managers.io_struct import ProfileReq, ProfileReqOutput

    start_at = sched.forward_ct + 3
    sched.submit(ProfileReq(start=True, start_step=start_at, num_steps=2, output_dir=str(tmp_path),
                            activities=["CPU"], with_stack=False))
    sched.process_input_requests(sched.recv_requests())
    assert sched._profiler is None and sched._profile_req is not None  # pending
    replies = [o for o in sched.outbox if isinstance(o, ProfileReqOutput)]
    assert len(replies) == 1 and replies[0].success and str(start_at) in replies[0].message
    sched.outbox.clear()
    begun_at = []
    real_begin = sched._begin_profiler
    monkeypatch.setattr(sched, "_begin_profiler",
                        lambda: begun_at.append(sched.forward_ct) or real_begin())
    run_requests(sched, [request("p", _prompt(5, 11), max_new_tokens=8)])
    assert begun_at == [start_at] and sched._profile_steps == 2
    assert len(list(tmp_path.glob("*-TP-0.trace.json.gz"))) == 1
    assert sched._profile_req is None
    assert not sched.stop_profile().success  # it ended by itself
