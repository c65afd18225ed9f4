"""sglang.Engine end to end (real scheduler/detokenizer processes, CPU fp32, tiny checkpoints)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from engine_test_utils import VOCAB, reference_greedy, write_checkpoint
from sglang.srt.entrypoints.engine import Engine
from sglang.train.reference import ReferenceBailingMoeV3

ENGINE_KW = dict(device="cpu", dtype="float32", random_seed=0, max_total_tokens=2048,
                 max_running_requests=8, log_level="warning")


pytestmark = pytest.mark.usefixtures("one_thread_children")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("engine_ckpt")), with_tokenizer=True)


@pytest.fixture(scope="module")
def engine(ckpt):
    with Engine(model_path=ckpt, **ENGINE_KW) as eng:
        yield eng


@pytest.fixture(scope="module")
def ref_model(ckpt):
    return ReferenceBailingMoeV3.from_pretrained(ckpt).eval()


def _greedy(n, **kw):
    return {"temperature": 0, "max_new_tokens": n, **kw}


def test_greedy_tokens_match_reference_model(engine, ref_model):
    prompt = [17, 99, 230, 401, 12, 7, 300, 64]
    out = engine.generate(input_ids=prompt, sampling_params=_greedy(12, ignore_eos=True))
    ref, _ = reference_greedy(ref_model, prompt, 12)
    assert out["output_ids"] == ref
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == 8 and meta["completion_tokens"] == 12
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
    # A text prompt goes through the tokenizer, and the text is the decoded output.
    tok = engine.tokenizer_manager.tokenizer
    text_out = engine.generate("def main():", _greedy(6, ignore_eos=True))
    ref, _ = reference_greedy(ref_model, tok.encode("def main():"), 6)
    assert text_out["output_ids"] == ref
    assert text_out["text"] == tok.decode(ref, skip_special_tokens=True)


def test_stream_is_cumulative_and_matches_non_stream(engine):
    params = _greedy(10, ignore_eos=True)
    final = engine.generate("import os", params)
    chunks = list(engine.generate("import os", params, stream=True))
    assert len(chunks) >= 2 and chunks[-1]["meta_info"]["finish_reason"] is not None
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["text"] == final["text"] and chunks[-1]["output_ids"] == final["output_ids"]


def _pick_stop_string(text):
    for pos in range(2, len(text) - 2):
        cand = text[pos: pos + 2]
        if cand.isascii() and cand.isprintable() and text.find(cand) == pos:
            return pos, cand
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_cut_exactly(engine):
    tok = engine.tokenizer_manager.tokenizer
    free = engine.generate("class Config:", _greedy(24, ignore_eos=True))
    pos, stop = _pick_stop_string(free["text"])

    out = engine.generate("class Config:", _greedy(24, ignore_eos=True, stop=[stop]))
    assert out["text"] == free["text"][:pos]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    ids = out["output_ids"]
    assert ids == free["output_ids"][: len(ids)]
    assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])  # stopped at once

    kept = engine.generate("class Config:", _greedy(24, ignore_eos=True, stop=stop,
                                                    no_stop_trim=True))
    assert kept["output_ids"] == ids and kept["text"] == tok.decode(ids)

    texts = [c["text"] for c in engine.generate("class Config:", _greedy(24, ignore_eos=True,
                                                                          stop=[stop]),
                                                stream=True)]
    assert texts[-1] == free["text"][:pos]
    assert all(texts[-1].startswith(t) for t in texts)  # streamed text never shrinks


def test_stop_token_ids_cut_exactly(engine):
    tok = engine.tokenizer_manager.tokenizer
    free = engine.generate("return value", _greedy(16, ignore_eos=True))["output_ids"]
    j = next(j for j in range(2, 16) if free[j] not in free[:j])
    out = engine.generate("return value", _greedy(16, stop_token_ids=[free[j]]))
    assert out["output_ids"] == free[: j + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": free[j]}
    assert out["text"] == tok.decode(free[:j], skip_special_tokens=True)


def test_batch_generate_and_batch_stream(engine):
    prompts = ["import os", "def add(a, b):", "x = 1"]
    outs = engine.generate(prompts, _greedy(5, ignore_eos=True))
    assert isinstance(outs, list) and len(outs) == 3
    for p, o in zip(prompts, outs):
        assert o["output_ids"] == engine.generate(p, _greedy(5, ignore_eos=True))["output_ids"]
    finals = {}
    for chunk in engine.generate(prompts, _greedy(5, ignore_eos=True), stream=True):
        finals[chunk["index"]] = chunk
    assert [finals[i]["output_ids"] for i in range(3)] == [o["output_ids"] for o in outs]


def test_logprobs_in_meta_info(engine):
    out = engine.generate(input_ids=[5, 60, 70, 80], sampling_params=_greedy(3),
                          return_logprob=True, logprob_start_len=1, top_logprobs_num=2,
                          return_text_in_logprobs=True)
    meta = out["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == [60, 70, 80]
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(isinstance(e[2], str) for e in meta["output_token_logprobs"])
    assert len(meta["output_top_logprobs"]) == 3 and len(meta["output_top_logprobs"][0]) == 2
    # Greedy: the chosen token is the most likely one.
    for chosen, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert chosen[1] == top[0][1] and abs(chosen[0] - top[0][0]) < 1e-6


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_ids=[]), "empty"),
    (dict(input_ids=[1, VOCAB + 3]), "outside the vocabulary"),
    (dict(input_ids=[1, 2], sampling_params={"max_new_tokens": 600}), "context length"),
    (dict(input_ids=[1, 2], sampling_params={"temperature": -1}), "temperature"),
    (dict(input_ids=[1, 2], sampling_params={"max_tokens": 3}), "unknown sampling parameter"),
    (dict(prompt="a", input_ids=[1]), "exactly one"),
    (dict(input_ids=[1, 2], return_logprob=True, logprob_start_len=5), "logprob_start_len"),
])
def test_invalid_requests_raise_value_error(engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(**kwargs)
    assert engine.is_healthy()


def test_abort_flush_and_server_info(engine):
    stream = engine.generate(input_ids=[3, 4, 5], stream=True, rid="to-abort",
                             sampling_params=_greedy(400, ignore_eos=True))
    first = next(stream)
    assert first["meta_info"]["finish_reason"] is None
    engine.abort_request("to-abort")
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(last["output_ids"]) < 400
    assert engine.flush_cache() is True
    info = engine.get_server_info()
    state = info["internal_states"][0]
    assert state["available_kv_tokens"] == info["max_total_num_tokens"] == 2048
    assert state["last_gen_throughput"] > 0 and info["tp_size"] == 1
    json.dumps(info)  # /server_info must be serializable


def test_batch_with_a_running_rid_registers_nothing(engine):
    stream = engine.generate(input_ids=[3, 4, 5], stream=True, rid="busy",
                             sampling_params=_greedy(400, ignore_eos=True))
    next(stream)
    with pytest.raises(ValueError, match="duplicate request id 'busy'"):
        engine.generate(input_ids=[[6, 7], [8, 9]], rid=["fresh", "busy"],
                        sampling_params=_greedy(2))
    engine.abort_request("busy")
    list(stream)
    # "fresh" must not have been left registered by the failed batch.
    out = engine.generate(input_ids=[6, 7], rid="fresh", sampling_params=_greedy(2))
    assert len(out["output_ids"]) == 2


def test_async_generate_in_another_loop(engine):
    async def main():
        one = await engine.async_generate(input_ids=[9, 8, 7], sampling_params=_greedy(4))
        chunks = [c async for c in await engine.async_generate(
            input_ids=[9, 8, 7], sampling_params=_greedy(4), stream=True)]
        return one, chunks

    one, chunks = asyncio.run(main())
    assert chunks[-1]["output_ids"] == one["output_ids"]


@pytest.mark.slow  # two engines (~16 s); test_tp.py checks TP=2 == TP=1 in the fast set
def test_tp2_matches_tp1(engine, ckpt):
    prompts = [[17, 99, 230, 401, 12], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    params = _greedy(8, ignore_eos=True)
    tp1 = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    with Engine(model_path=ckpt, tp_size=2, **ENGINE_KW) as eng2:
        tp2 = [o["output_ids"] for o in eng2.generate(input_ids=prompts, sampling_params=params)]
        children = [p for _, p in eng2._children]
    assert tp2 == tp1
    assert not any(p.is_alive() for p in children)  # shutdown leaves no processes


def test_dead_scheduler_fails_pending_requests(tmp_path):
    ckpt = write_checkpoint(str(tmp_path / "ckpt"))  # no tokenizer: input_ids only
    eng = Engine(model_path=ckpt, **{**ENGINE_KW, "max_total_tokens": 256})
    try:
        out = eng.generate(input_ids=[1, 2, 3], sampling_params=_greedy(2, ignore_eos=True))
        assert out["text"] == "" and len(out["output_ids"]) == 2
        # Fits the context (512) but never the KV pool (256): answered with an error at once.
        with pytest.raises(ValueError, match="KV cache slots"):
            eng.generate(input_ids=list(range(10, 20)), sampling_params=_greedy(300))
        stream = eng.generate(input_ids=[1, 2, 3], stream=True,
                              sampling_params=_greedy(250, ignore_eos=True))
        next(stream)
        sched = next(p for name, p in eng._children if name.startswith("scheduler"))
        os.kill(sched.pid, signal.SIGKILL)
        tic = time.monotonic()
        with pytest.raises(RuntimeError, match="scheduler TP0"):
            list(stream)
        assert time.monotonic() - tic < 10
        assert not eng.is_healthy()
        with pytest.raises(RuntimeError, match="not healthy"):
            eng.generate(input_ids=[1, 2], sampling_params=_greedy(1))
    finally:
        eng.shutdown()
    assert not any(p.is_alive() for _, p in eng._children)


def test_child_startup_error_is_reported(tmp_path):
    ckpt = write_checkpoint(str(tmp_path / "ckpt"))
    with open(os.path.join(ckpt, "model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(RuntimeError, match="scheduler TP0 failed to start"):
        Engine(model_path=ckpt, **ENGINE_KW)


class _DisconnectingRequest:
    """Stands in for a starlette Request whose client goes away after ``after`` checks."""

    def __init__(self, after: int):
        self.checks, self.after = 0, after

    async def is_disconnected(self) -> bool:
        self.checks += 1
        return self.checks > self.after


def test_client_disconnect_aborts_request(engine, monkeypatch):
    from sglang.srt.managers import tokenizer_manager as tm_module
    from sglang.srt.managers.io_struct import GenerateReqInput

    monkeypatch.setattr(tm_module, "DISCONNECT_CHECK_S", 0.05)
    tm = engine.tokenizer_manager
    obj = GenerateReqInput(input_ids=[4, 5, 6], stream=False,
                           sampling_params=_greedy(450, ignore_eos=True))

    async def consume():
        async for _ in tm.generate_request(obj, _DisconnectingRequest(after=1)):
            pass

    with pytest.raises(ValueError, match="disconnected"):
        engine.loop.run_until_complete(consume())
    deadline = time.monotonic() + 10
    while True:  # the scheduler drops the request and frees its slots
        state = engine.get_server_info()["internal_states"][0]
        if state["num_running_reqs"] == 0 and state["available_kv_tokens"] == 2048:
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    assert not tm.rid_to_state


def test_health_generate_probe(engine):
    assert engine.loop.run_until_complete(engine.tokenizer_manager.health_generate(timeout=10))
    assert engine.tokenizer_manager.is_ready() and engine.tokenizer_manager.last_receive_tstamp > 0
