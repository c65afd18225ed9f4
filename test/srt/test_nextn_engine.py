"""NEXTN through ``sglang.Engine`` (real scheduler / detokenizer processes, bundled model, CPU):
greedy output equal to plain decoding, per-request spec meta_info, streaming in multi-token
chunks, an abort mid-stream (slots come back), and the server-wide accept length in
``internal_states`` reset by ``flush_cache``."""
from __future__ import annotations


import pytest
import torch

from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR
from sglang.srt.entrypoints.engine import Engine
from sglang.srt.managers.utils import load_tokenizer
from sglang.srt.server_args import ServerArgs
from sglang.train.data import HELD_OUT_FILES, stdlib_root

from test_nextn import greedy, make_scheduler, run

KW = dict(device="cpu", dtype="float32", random_seed=0, max_total_tokens=4096,
          max_running_requests=4, log_level="warning")
N_TOKENS = 64


pytestmark = pytest.mark.usefixtures("one_thread_children")


@pytest.fixture(scope="module")
def prompt():
    tok = load_tokenizer(ServerArgs(device="cpu"))
    text = (stdlib_root() / HELD_OUT_FILES[10]).read_text(encoding="utf-8")
    start = text.find("\ndef ") + 1
    return tok.encode(text[start:start + 1500])[:48]


@pytest.fixture(scope="module")
def reference(prompt):
    torch.set_num_threads(1)
    sched = make_scheduler(str(BUNDLED_MODEL_DIR), max_total_tokens=4096)
    return run(sched, [greedy("r", prompt, 160)]).ids["r"]


@pytest.fixture(scope="module")
def engine():
    with Engine(speculative_algorithm="NEXTN", speculative_num_steps=3, **KW) as eng:
        yield eng


def _greedy(n):
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def test_generate_and_spec_meta_info(engine, prompt, reference):
    assert engine.flush_cache()
    out = engine.generate(input_ids=prompt, sampling_params=_greedy(N_TOKENS))
    assert out["output_ids"] == reference[:N_TOKENS]
    meta = out["meta_info"]
    assert meta["completion_tokens"] == N_TOKENS
    ct = meta["spec_verify_ct"]
    assert 0 < ct < N_TOKENS
    assert meta["spec_accept_length"] == pytest.approx(N_TOKENS / ct)
    assert meta["spec_num_proposed_drafts"] == 3 * ct
    assert 0 <= meta["spec_num_correct_drafts"] <= meta["spec_num_proposed_drafts"]
    state = engine.get_server_info()["internal_states"][0]
    assert state["avg_spec_accept_length"] > 1.0
    assert state["available_kv_tokens"] == state["max_total_num_tokens"]
    assert engine.flush_cache()
    assert engine.get_server_info()["internal_states"][0]["avg_spec_accept_length"] == 0.0


def test_streaming_in_multi_token_chunks(engine, prompt, reference):
    sizes, last, final = [], 0, None
    for chunk in engine.generate(input_ids=prompt, sampling_params=_greedy(N_TOKENS),
                                 stream=True):
        ids = chunk["output_ids"]
        sizes.append(len(ids) - last)
        last, final = len(ids), chunk
    assert final["output_ids"] == reference[:N_TOKENS]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": N_TOKENS}
    assert max(sizes) > 1  # a round committed several tokens at once
    assert final["meta_info"]["spec_verify_ct"] == len(sizes) - 1  # first chunk: the prefill


def test_abort_mid_stream_frees_slots(engine, prompt, reference):
    stream = engine.generate(input_ids=prompt, sampling_params=_greedy(150), stream=True,
                             rid="to-abort")
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 3:
            engine.abort_request("to-abort")
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    n = len(final["output_ids"])
    assert 0 < n < 150 and final["output_ids"] == reference[:n]
    # The scheduler is alive (its idle leak check passed) and every slot is free again.
    out = engine.generate(input_ids=prompt, sampling_params=_greedy(8))
    assert out["output_ids"] == reference[:8]
    state = engine.get_server_info()["internal_states"][0]
    assert state["available_kv_tokens"] == state["max_total_num_tokens"]
    assert engine.is_healthy()
