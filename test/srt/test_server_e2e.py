"""End-to-end: a real ``python -m sglang.launch_server`` process on a tiny random model (CPU).

One server serves the whole module (started once, ~20 s); the last test shuts it down with
SIGTERM and checks that no child process survives. Everything talks real HTTP: ``requests`` for
SGLang's native API and the ``openai`` client for the OpenAI-compatible one.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest

openai = pytest.importorskip("openai")
import requests

from sglang.test.test_utils import (
    DEFAULT_PORT_FOR_SRT_TEST_RUNNER,
    TinyServer,
    descendant_pids,
    find_available_port,
    launch_tiny_server,
    process_alive,
)

MAX_RUNNING = 4  # fewer than the 8 concurrent requests below: the rest must queue
# Long enough that a request told to fill it runs for seconds, so an abort visibly cuts it short.
CONTEXT = 4096
PROMPTS = [
    "def add(a, b):", "The server", "import os", "class Config:", "return value",
    "raise ValueError(", "for item in items:", "# comment about flags",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = launch_tiny_server(str(tmp_path_factory.mktemp("e2e")),
                             ["--max-running-requests", str(MAX_RUNNING), "--random-seed", "0"],
                             max_position_embeddings=CONTEXT)
    try:
        yield srv
    finally:
        srv.stop()


def _greedy(max_new_tokens: int, **extra: Any) -> Dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **extra}


def _generate(server: TinyServer, body: Dict[str, Any]) -> requests.Response:
    return requests.post(f"{server.base_url}/generate", json=body, timeout=120)


def _sse_events(resp: requests.Response) -> List[Any]:
    events = []
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: "):]
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def _state(server: TinyServer) -> Dict[str, Any]:
    info = requests.get(f"{server.base_url}/server_info", timeout=30).json()
    return info["internal_states"][0]


def _wait_idle(server: TinyServer, timeout: float = 30.0) -> Dict[str, Any]:
    deadline = time.time() + timeout
    while True:
        st = _state(server)
        if st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0:
            return st
        assert time.time() < deadline, f"scheduler still busy: {st}"
        time.sleep(0.1)


# ----------------------------------------------------------------------------- native API
def test_info_endpoints(server):
    assert requests.get(f"{server.base_url}/health", timeout=30).status_code == 200
    assert requests.get(f"{server.base_url}/health_generate", timeout=30).status_code == 200
    for path in ("/model_info", "/get_model_info"):
        info = requests.get(server.base_url + path, timeout=30).json()
        assert info["model_path"] == server.model_dir
        assert info["is_generation"] is True
        assert info["architectures"] == ["BailingMoeV3ForCausalLM"]
    for path in ("/server_info", "/get_server_info"):
        info = requests.get(server.base_url + path, timeout=30).json()
        assert info["max_running_requests"] == MAX_RUNNING and info["device"] == "cpu"
        assert isinstance(info["internal_states"], list) and len(info["internal_states"]) == 1
        assert "avg_spec_accept_length" not in info["internal_states"][0]  # not speculating
    models = requests.get(f"{server.base_url}/v1/models", timeout=30).json()
    assert models["object"] == "list" and models["data"][0]["id"] == info["served_model_name"]
    assert f"127.0.0.1:{server.base_url.rsplit(':', 1)[1]}" in server.log()  # URL logged


def test_generate_non_stream_and_stream_agree(server):
    body = {"text": "def add(a, b):", "sampling_params": _greedy(12)}
    out = _generate(server, body).json()
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 12 and meta["completion_tokens"] == 12
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] > 0 and "cached_tokens" in meta and meta["e2e_latency"] > 0
    assert isinstance(meta["id"], str) and out["text"]

    resp = requests.post(f"{server.base_url}/generate", json={**body, "stream": True},
                         stream=True, timeout=120)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(resp)
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = events[:-1]
    texts = [c["text"] for c in chunks]
    for prev, cur in zip(texts, texts[1:]):
        assert cur.startswith(prev)  # cumulative text
    assert texts[-1] == out["text"] and chunks[-1]["output_ids"] == out["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_generate_input_ids_batch_and_bench_keys(server):
    single = _generate(server, {"input_ids": [5, 6, 7], "sampling_params": _greedy(4)}).json()
    batch = _generate(server, {
        "input_ids": [[5, 6, 7], [8, 9]], "sampling_params": _greedy(4),
        # keys SGLang's bench_serving sends must be tolerated
        "lora_path": None, "return_routed_experts": False, "logprob_start_len": -1,
        "return_logprob": False,
    }).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == single["output_ids"]
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [3, 2]


def test_generate_logprobs(server):
    out = _generate(server, {"text": "import os", "sampling_params": _greedy(3),
                             "return_logprob": True, "top_logprobs_num": 2}).json()
    lps = out["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in lps] == out["output_ids"]
    assert all(e[0] <= 0.0 for e in lps)
    tops = out["meta_info"]["output_top_logprobs"]
    assert len(tops) == 3 and all(len(t) == 2 for t in tops)
    assert all(t[0][1] == e[1] for t, e in zip(tops, lps))  # greedy picks the top-1


def test_concurrent_requests_match_sequential(server):
    bodies = [{"text": p, "sampling_params": _greedy(10)} for p in PROMPTS]
    sequential = [_generate(server, b).json() for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        concurrent = list(pool.map(lambda b: _generate(server, b), bodies))
    assert all(r.status_code == 200 for r in concurrent)
    for seq, con in zip(sequential, concurrent):
        assert con.json()["output_ids"] == seq["output_ids"]
        assert con.json()["text"] == seq["text"]
    assert len({tuple(s["output_ids"]) for s in sequential}) > 1  # outputs depend on prompts


# ----------------------------------------------------------------------------- OpenAI API
def _client(server: TinyServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_openai_completions(server):
    client = _client(server)
    ref = _generate(server, {"text": "The server", "sampling_params": _greedy(8)}).json()
    r = client.completions.create(model="m", prompt="The server", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]

    chunks = list(client.completions.create(
        model="m", prompt="The server", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    r = client.completions.create(model="m", prompt=["import os", "The server"], max_tokens=4,
                                  temperature=0, n=2, logprobs=2, extra_body={"ignore_eos": True})
    assert len(r.choices) == 4 and r.usage.completion_tokens == 16
    assert r.choices[0].text == r.choices[1].text  # greedy: both samples of a prompt agree
    assert r.choices[2].text == ref["text"][:len(r.choices[2].text)]
    assert len(r.choices[0].logprobs.tokens) == 4
    assert len(r.choices[0].logprobs.top_logprobs[0]) <= 2


def test_openai_completion_stop_string(server):
    client = _client(server)
    full = client.completions.create(model="m", prompt="class Config:", max_tokens=16,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[3:5] if len(text) >= 5 else None
    if not stop or not stop.strip():
        pytest.skip(f"generated text {text!r} offers no usable stop string")
    r = client.completions.create(model="m", prompt="class Config:", max_tokens=16,
                                  temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]


def test_openai_chat(server):
    client = _client(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=6,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 6
    # The tokenizer's chat template is what the server renders.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model_dir)
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = _generate(server, {"input_ids": tok.encode(prompt, add_special_tokens=False),
                             "sampling_params": _greedy(6)}).json()
    assert r.choices[0].message.content == ref["text"]
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]

    stream = client.chat.completions.create(
        model="m", messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref["text"]
    assert chunks[-1].usage.completion_tokens == 6

    r = client.chat.completions.create(model="m", messages=messages, max_tokens=3, n=2,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and len(r.choices[1].logprobs.content) == 3


def test_chat_without_template_is_a_clear_error(server):
    from transformers import AutoTokenizer

    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

    tok = AutoTokenizer.from_pretrained(server.model_dir)
    tok.chat_template = None
    handler = OpenAIServingChat(SimpleNamespace(tokenizer=tok))
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no chat template"):
        handler.convert_request(req)


# ----------------------------------------------------------------------------- robustness
BAD_GENERATE = [
    ("malformed JSON", '{"text": "hi",'),
    ("body not an object", "[1, 2]"),
    ("text wrong type", {"text": 5}),
    ("stream wrong type", {"text": "hi", "stream": "yes"}),
    ("max_new_tokens wrong type", {"text": "hi", "sampling_params": {"max_new_tokens": "ten"}}),
    ("sampling_params wrong type", {"text": "hi", "sampling_params": [1]}),
    ("empty text", {"text": ""}),
    ("empty input_ids", {"input_ids": []}),
    ("both text and input_ids", {"text": "hi", "input_ids": [1, 2]}),
    ("neither text nor input_ids", {"sampling_params": {"max_new_tokens": 1}}),
    ("token id >= vocab", {"input_ids": [5, 100000]}),
    ("negative token id", {"input_ids": [-1]}),
    ("negative max_new_tokens", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}),
    ("huge max_new_tokens", {"text": "hi", "sampling_params": {"max_new_tokens": 10 ** 9}}),
    ("temperature < 0", {"text": "hi", "sampling_params": {"temperature": -0.5}}),
    ("top_p = 0", {"text": "hi", "sampling_params": {"top_p": 0.0}}),
    ("top_p > 1", {"text": "hi", "sampling_params": {"top_p": 1.5}}),
    ("top_k = 0", {"text": "hi", "sampling_params": {"top_k": 0}}),
    ("top_k < -1", {"text": "hi", "sampling_params": {"top_k": -2}}),
    ("prompt + output > context",
     {"input_ids": [5] * (CONTEXT - 10), "sampling_params": {"max_new_tokens": 64}}),
    ("prompt longer than context", {"input_ids": [5] * (CONTEXT + 1)}),
    ("unknown sampling key", {"text": "hi", "sampling_params": {"temprature": 0.5}}),
]
BAD_COMPLETIONS = [
    ("malformed JSON", '{"prompt": '),
    ("prompt wrong type", {"prompt": {"a": 1}}),
    ("missing prompt", {"max_tokens": 3}),
    ("empty prompt", {"prompt": ""}),
    ("max_tokens wrong type", {"prompt": "hi", "max_tokens": "3"}),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -1}),
    ("huge max_tokens", {"prompt": "hi", "max_tokens": 10 ** 9}),
    ("temperature < 0", {"prompt": "hi", "temperature": -1}),
    ("top_p > 1", {"prompt": "hi", "top_p": 2}),
    ("top_k = 0", {"prompt": "hi", "top_k": 0}),
    ("n = 0", {"prompt": "hi", "n": 0}),
    ("logprobs too many", {"prompt": "hi", "logprobs": 50}),
    ("token id >= vocab", {"prompt": [1, 100000]}),
]
BAD_CHAT = [
    ("no messages", {"messages": []}),
    ("messages wrong type", {"messages": "hi"}),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("negative max_tokens", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}),
    ("image content", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
]


def _post_raw(server: TinyServer, path: str, body: Any) -> requests.Response:
    data = body if isinstance(body, str) else json.dumps(body)
    return requests.post(server.base_url + path, data=data,
                         headers={"Content-Type": "application/json"}, timeout=60)


def test_bad_inputs_get_4xx_and_never_reach_the_scheduler(server):
    before = _wait_idle(server)
    cases = ([("/generate", n, b) for n, b in BAD_GENERATE]
             + [("/v1/completions", n, b) for n, b in BAD_COMPLETIONS]
             + [("/v1/chat/completions", n, b) for n, b in BAD_CHAT])
    for path, name, body in cases:
        if isinstance(body, dict) and path != "/generate":
            body = {"model": "m", **body}
        for stream in ((False, True) if isinstance(body, dict) else (False,)):
            sent = {**body, "stream": True} if stream and name != "stream wrong type" else body
            r = _post_raw(server, path, sent)
            assert 400 <= r.status_code < 500, (path, name, stream, r.status_code, r.text)
            err = r.json()["error"]
            assert err["message"], (path, name)
    after = _state(server)
    # Nothing was scheduled: no forward pass and no token since the snapshot.
    assert after["forward_ct"] == before["forward_ct"]
    assert after["num_generated_tokens"] == before["num_generated_tokens"]
    # ...and the server still serves.
    assert requests.get(f"{server.base_url}/health", timeout=30).status_code == 200
    assert _generate(server, {"text": "hi", "sampling_params": _greedy(2)}).status_code == 200


def test_client_disconnect_aborts_stream(server):
    before = _wait_idle(server)
    budget = CONTEXT - 16
    resp = requests.post(f"{server.base_url}/generate", stream=True, timeout=120, json={
        "text": "hi", "sampling_params": _greedy(budget), "stream": True})
    lines = resp.iter_lines()
    got = [line for line, _ in zip((l for l in lines if l), range(2))]
    assert len(got) == 2
    resp.close()  # the client goes away mid-stream
    after = _wait_idle(server)
    assert after["available_req_slots"] == before["available_req_slots"]
    assert after["available_kv_tokens"] == before["available_kv_tokens"]
    generated = after["num_generated_tokens"] - before["num_generated_tokens"]
    assert 0 < generated < budget, generated  # cut short, not run to the end


def test_client_disconnect_aborts_non_stream(server):
    before = _wait_idle(server)
    budget = CONTEXT - 16
    body = json.dumps({"text": "hi", "sampling_params": _greedy(budget)}).encode()
    host, port = server.base_url[len("http://"):].split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.time() + 30
        while _state(server)["num_running_reqs"] == 0:
            assert time.time() < deadline
            time.sleep(0.05)
    after = _wait_idle(server)
    assert after["available_req_slots"] == before["available_req_slots"]
    generated = after["num_generated_tokens"] - before["num_generated_tokens"]
    assert generated < budget, generated


def test_abort_request_endpoint(server):
    rid = "abort-me-1"
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_generate, server, {"text": "hi", "rid": rid,
                                              "sampling_params": _greedy(CONTEXT - 16)})
        deadline = time.time() + 30
        while _state(server)["num_running_reqs"] == 0:
            assert time.time() < deadline
            time.sleep(0.05)
        r = requests.post(f"{server.base_url}/abort_request", json={"rid": rid}, timeout=30)
        assert r.status_code == 200
        out = fut.result(timeout=60).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert requests.post(f"{server.base_url}/abort_request", json={}, timeout=30).status_code == 400


def test_flush_cache(server):
    _wait_idle(server)
    for method in ("post", "get"):
        r = getattr(requests, method)(f"{server.base_url}/flush_cache", timeout=30)
        assert r.status_code == 200 and r.text.startswith("Cache flushed")
        assert r.headers["content-type"].startswith("text/plain")
    # Busy scheduler: refused with 400; the server keeps serving and flushes once idle.
    rid = "flush-blocker"
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_generate, server, {"text": "hi", "rid": rid,
                                              "sampling_params": _greedy(CONTEXT - 16)})
        deadline = time.time() + 30
        while _state(server)["num_running_reqs"] == 0:
            assert time.time() < deadline
            time.sleep(0.05)
        r = requests.post(f"{server.base_url}/flush_cache", timeout=30)
        assert r.status_code == 400 and "not flushed" in r.text
        requests.post(f"{server.base_url}/abort_request", json={"rid": rid}, timeout=30)
        assert fut.result(timeout=120).status_code == 200
    assert requests.post(f"{server.base_url}/flush_cache?timeout=30", timeout=60).status_code == 200


def test_missing_bundled_model_message(tmp_path):
    # Point the bundled-model location at an empty folder (whether or not the real one exists).
    code = (
        "import sys, pathlib\n"
        "import sglang.srt.configs.model_config as mc\n"
        f"mc.BUNDLED_MODEL_DIR = pathlib.Path({str(tmp_path / 'missing')!r})\n"
        "from sglang.launch_server import run_server\n"
        "sys.exit(run_server(['--device', 'cpu']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "bundled model is not present" in proc.stderr and "--model-path" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- shutdown
@pytest.mark.slow  # a second server that must fail its warm-up (~18 s)
def test_failed_warmup_exits_nonzero_without_orphans(server):
    # A context shorter than the warmup prompt: the server starts, its warmup gets a 400, and it
    # must stop itself cleanly with a non-zero exit code and the reason.
    port = find_available_port(DEFAULT_PORT_FOR_SRT_TEST_RUNNER + 400)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", server.model_dir,
         "--device", "cpu", "--port", str(port), "--context-length", "4"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = set()
    deadline = time.time() + 120
    while proc.poll() is None:
        assert time.time() < deadline, "server did not stop after its warmup failed"
        seen.update(descendant_pids(proc.pid))
        time.sleep(0.05)
    assert proc.returncode == 1
    assert "warmup request failed" in proc.stderr.read()
    assert seen
    # Children may finish exiting just after the parent (e.g. multiprocessing's resource
    # tracker sees its pipe close): a short grace period, as for SIGTERM below.
    deadline = time.time() + 10
    while any(process_alive(k) for k in seen):
        assert time.time() < deadline, [k for k in seen if process_alive(k)]
        time.sleep(0.1)


def test_sigterm_shuts_down_without_orphans(server):
    kids = descendant_pids(server.process.pid)
    assert len(kids) >= 2, kids  # at least a scheduler and the detokenizer
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=60) == 0
    deadline = time.time() + 10
    while any(process_alive(k) for k in kids):
        assert time.time() < deadline, [k for k in kids if process_alive(k)]
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{server.process.pid}/stat") or \
        not process_alive(server.process.pid)
