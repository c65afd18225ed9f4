"""Server hardening through a real server process: body-size cap (413), bounded batches and
top-logprobs, malformed input always a 4xx in the one error shape (never a 500), no NaN in a
response, a failed hand-off to the scheduler unregisters its rid, and ``/start_profile`` confined
to the profiler directory.

One tiny server serves the module, started with a small body limit
(``SGLANG_MAX_REQUEST_BODY_BYTES``) and its own ``SGLANG_TORCH_PROFILER_DIR``.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import os
from typing import Any, Dict, Iterator, List, Tuple
from urllib.parse import urlparse

import pytest
import requests

from sglang.srt.entrypoints.openai import serving_base
from sglang.srt.entrypoints.openai.request_checks import MAX_JSON_DEPTH
from sglang.srt.managers import io_struct
from sglang.srt.managers.io_struct import MAX_BATCH_SIZE, MAX_TOP_LOGPROBS, GenerateReqInput
from sglang.test.test_utils import TinyServer, launch_tiny_server

BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def profiler_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("profiles"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, profiler_dir) -> Iterator[TinyServer]:
    env = {"SGLANG_MAX_REQUEST_BODY_BYTES": str(BODY_LIMIT),
           "SGLANG_TORCH_PROFILER_DIR": profiler_dir}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the server process inherits them
    try:
        srv = launch_tiny_server(str(tmp_path_factory.mktemp("hardening")))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield srv
    finally:
        srv.stop()


def _strict_json(text: str) -> Any:
    """Parse as strict JSON: NaN / Infinity literals fail the test."""
    def reject(name: str) -> Any:
        raise AssertionError(f"non-JSON constant {name} in a response: {text[:200]}")
    return json.loads(text, parse_constant=reject)


def _post(server: TinyServer, path: str, data: Any) -> requests.Response:
    raw = data if isinstance(data, (str, bytes)) else json.dumps(data)
    return requests.post(server.base_url + path, data=raw,
                         headers={"Content-Type": "application/json"}, timeout=60)


def _assert_error(resp: requests.Response, status: int, *needles: str) -> str:
    """The one error shape, with the HTTP status as its code and every needle in the message."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    err = _strict_json(resp.text)["error"]
    assert err["code"] == status and err["type"] and err["message"], err
    for needle in needles:
        assert needle in err["message"], (needle, err["message"])
    return err["message"]


def _state(server: TinyServer) -> Dict[str, Any]:
    return requests.get(f"{server.base_url}/server_info", timeout=30).json()["internal_states"][0]


def _greedy(n: int, **extra: Any) -> Dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True, **extra}


# ----------------------------------------------------------------------------- item 1: limits
def test_body_over_the_limit_is_413_before_it_is_read(server):
    url = urlparse(server.base_url)
    # Declared too large: refused on the header, without sending (or reading) the body.
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.putrequest("POST", "/generate")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(10 * BODY_LIMIT))
    conn.endheaders()
    resp = conn.getresponse()
    body = _strict_json(resp.read().decode())
    conn.close()
    assert resp.status == 413 and body["error"]["code"] == 413
    assert str(BODY_LIMIT) in body["error"]["message"]

    # Chunked (no Content-Length): counted while read, on /generate and /v1 alike.
    filler = json.dumps({"text": "x" * (2 * BODY_LIMIT)}).encode()
    for path in ("/generate", "/v1/completions"):
        chunks = (filler[i:i + 8192] for i in range(0, len(filler), 8192))
        r = requests.post(server.base_url + path, data=chunks, timeout=60,
                          headers={"Content-Type": "application/json"})
        _assert_error(r, 413, str(BODY_LIMIT), "SGLANG_MAX_REQUEST_BODY_BYTES")

    # Just under the limit still works (the cap is not off by a lot).
    ids = [5] * ((BODY_LIMIT - 200) // 3)
    r = _post(server, "/generate", {"input_ids": ids, "sampling_params": _greedy(1)})
    assert len(json.dumps({"input_ids": ids})) < BODY_LIMIT
    assert r.status_code in (200, 400), r.text[:300]  # 400 only for the context length
    if r.status_code == 400:
        assert "context length" in r.json()["error"]["message"]


def test_top_logprobs_num_is_capped_like_v1(server):
    assert serving_base.MAX_TOP_LOGPROBS is io_struct.MAX_TOP_LOGPROBS  # one constant
    base = {"input_ids": [5, 6, 7], "sampling_params": _greedy(1), "return_logprob": True}
    _assert_error(_post(server, "/generate", {**base, "top_logprobs_num": MAX_TOP_LOGPROBS + 1}),
                  400, "top_logprobs_num", str(MAX_TOP_LOGPROBS))
    batch = {**base, "input_ids": [[5, 6], [7, 8]], "top_logprobs_num": [1, 10 ** 6]}
    _assert_error(_post(server, "/generate", batch), 400, "top_logprobs_num")
    _assert_error(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1,
                                                    "logprobs": MAX_TOP_LOGPROBS + 1}),
                  400, str(MAX_TOP_LOGPROBS))
    ok = _post(server, "/generate", {**base, "top_logprobs_num": MAX_TOP_LOGPROBS})
    assert ok.status_code == 200, ok.text
    tops = ok.json()["meta_info"]["output_top_logprobs"]
    assert len(tops) == 1 and len(tops[0]) == MAX_TOP_LOGPROBS


def test_batch_size_is_bounded(server):
    before = _state(server)["forward_ct"]
    too_many = MAX_BATCH_SIZE + 1
    for body in ({"input_ids": [[5]] * too_many}, {"text": ["a"] * too_many},
                 {"text": ["a"] * too_many, "rid": [f"r{i}" for i in range(too_many)]}):
        _assert_error(_post(server, "/generate", {**body, "sampling_params": _greedy(1)}),
                      400, str(too_many), str(MAX_BATCH_SIZE))
    _assert_error(_post(server, "/v1/completions", {"prompt": [[5]] * too_many, "max_tokens": 1}),
                  400, str(MAX_BATCH_SIZE))
    assert _state(server)["forward_ct"] == before  # refused before anything was scheduled
    ok = _post(server, "/generate", {"input_ids": [[5]] * 3, "sampling_params": _greedy(1)})
    assert ok.status_code == 200 and len(ok.json()) == 3


# ----------------------------------------------------------------------------- item 2: malformed
def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _chat(content: Any, **extra: Any) -> Dict[str, Any]:
    return {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": content}],
            **extra}


GEN = {"text": "hi", "sampling_params": _greedy(1)}
# (name, path, raw body or dict, words the message must contain)
MALFORMED: List[Tuple[str, str, Any, Tuple[str, ...]]] = [
    ("parser recursion /generate", "/generate", _nested(20_000), ("nested",)),
    ("parser recursion /v1/completions", "/v1/completions", _nested(20_000), ("nested",)),
    ("parser recursion chat", "/v1/chat/completions", _nested(20_000), ("nested",)),
    ("parser recursion abort", "/abort_request", _nested(20_000), ("nested",)),
    ("parser recursion profile", "/start_profile", _nested(20_000), ("nested",)),
    ("deep custom_params", "/generate",
     '{"text": "hi", "sampling_params": {"custom_params": {"a": %s}}}' % _nested(900),
     ("deeper than", str(MAX_JSON_DEPTH), "sampling_params.custom_params.a")),
    ("deep chat_template_kwargs", "/v1/chat/completions",
     json.dumps(_chat("hi"))[:-1] + ', "chat_template_kwargs": {"x": %s}}' % _nested(900),
     ("deeper than",)),
    ("NaN literal", "/generate", '{"text": "hi", "sampling_params": {"temperature": NaN}}',
     ("NaN",)),
    ("Infinity literal", "/v1/completions", '{"prompt": "hi", "temperature": Infinity}',
     ("Infinity",)),
    ("surrogate text", "/generate", {**GEN, "text": "a\ud800b"}, ("text", "surrogate")),
    ("surrogate text batch", "/generate", {**GEN, "text": ["ok", "\udfff"]}, ("text[1]",)),
    ("surrogate stop", "/generate",
     {"text": "hi", "sampling_params": {**_greedy(1), "stop": ["x", "\ud83d"]}},
     ("sampling_params.stop[1]",)),
    ("surrogate rid", "/generate", {**GEN, "rid": "\ud800"}, ("rid",)),
    ("surrogate key", "/generate", {**GEN, "\ud800": 1}, ("surrogate",)),
    ("surrogate model", "/v1/completions", {"model": "\udc00", "prompt": "hi", "max_tokens": 1},
     ("model",)),
    ("surrogate completion stop", "/v1/completions",
     {"prompt": "hi", "max_tokens": 1, "stop": "\ud800"}, ("stop",)),
    ("surrogate chat content", "/v1/chat/completions", _chat("hi \ud800"),
     ("messages[0].content",)),
    ("surrogate chat part", "/v1/chat/completions", _chat([{"type": "text", "text": "\udbff"}]),
     ("messages[0].content[0].text",)),
    ("surrogate chat model", "/v1/chat/completions", {**_chat("hi"), "model": "\ud800"},
     ("model",)),
    ("rid int", "/generate", {**GEN, "rid": 5}, ("rid", "non-empty string")),
    ("rid list for single", "/generate", {**GEN, "rid": ["a"]}, ("rid",)),
    ("rid object", "/generate", {**GEN, "rid": {"a": 1}}, ("rid",)),
    ("rid empty", "/generate", {**GEN, "rid": ""}, ("rid", "non-empty")),
    ("batch rid int", "/generate", {**GEN, "text": ["a", "b"], "rid": ["x", 7]}, ("rid[1]",)),
    ("batch rid unhashable", "/generate", {**GEN, "text": ["a", "b"], "rid": [["x"], "y"]},
     ("rid[0]",)),
    ("batch rid empty", "/generate", {**GEN, "text": ["a", "b"], "rid": ["", "y"]}, ("rid[0]",)),
    ("logit_bias high", "/generate",
     {"text": "hi", "sampling_params": {**_greedy(1), "logit_bias": {"5": 100.5}}},
     ("logit_bias", "[-100, 100]")),
    ("logit_bias huge negative", "/generate",
     {"text": "hi", "sampling_params": {**_greedy(1), "logit_bias": {"5": -1e30}}},
     ("logit_bias",)),
    ("logit_bias /v1", "/v1/completions",
     {"prompt": "hi", "max_tokens": 1, "logit_bias": {"5": 1e6}}, ("logit_bias",)),
    ("logit_bias chat", "/v1/chat/completions", {**_chat("hi"), "logit_bias": {"5": -101}},
     ("logit_bias",)),
    ("openai wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "many"},
     ("max_tokens",)),
]


@pytest.mark.parametrize("name,path,body,needles", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_input_is_4xx_json_never_500(server, name, path, body, needles):
    before = _state(server)["forward_ct"]
    _assert_error(_post(server, path, body), 400, *needles)
    if isinstance(body, dict) and path != "/abort_request":
        _assert_error(_post(server, path, {**body, "stream": True}), 400, *needles)
    assert _state(server)["forward_ct"] == before  # nothing reached the scheduler


def test_framework_errors_use_the_one_shape(server):
    _assert_error(requests.get(f"{server.base_url}/no_such_endpoint", timeout=30), 404)
    _assert_error(requests.get(f"{server.base_url}/generate", timeout=30), 405)
    _assert_error(requests.post(f"{server.base_url}/flush_cache?timeout=soon", timeout=30), 400,
                  "timeout")


def test_extreme_logit_bias_never_gives_nan(server):
    bias = {"5": 100, "6": -100, "7": -100.0}
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 3,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 2, "ignore_eos": True, "temperature": 0.7,
                                "logit_bias": bias}}
    r = _post(server, "/generate", body)
    assert r.status_code == 200, r.text
    out = _strict_json(r.text)
    assert out["output_ids"] == [5, 5]  # +100 forces the token even when sampling
    for entry in out["meta_info"]["output_token_logprobs"]:
        assert entry[0] is not None and entry[0] <= 0.0
    stream = requests.post(f"{server.base_url}/generate", json={**body, "stream": True},
                           stream=True, timeout=60)
    lines = [ln[len(b"data: "):] for ln in stream.iter_lines() if ln]
    assert lines[-1] == b"[DONE]"
    for payload in lines[:-1]:
        _strict_json(payload.decode())
    chat = _post(server, "/v1/chat/completions",
                 {**_chat("hi"), "logit_bias": bias, "logprobs": True, "top_logprobs": 2})
    assert chat.status_code == 200, chat.text
    _strict_json(chat.text)


def test_failed_handoff_unregisters_the_rid(server):
    """A request the manager cannot hand to the scheduler is forgotten at once: the same rid is
    usable again (it used to stay "still running" forever)."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.server_args import PortArgs, ServerArgs

    args = ServerArgs(model_path=server.model_dir, device="cpu")
    tm = TokenizerManager(args, PortArgs.init_new(args))

    async def submit(obj: GenerateReqInput) -> None:
        async for _ in tm.generate_request(obj):
            pass

    try:
        # Too deep to pickle for the scheduler (the Python API bypasses the HTTP depth check).
        deep: Dict[str, Any] = {}
        node = deep
        for _ in range(5000):
            node["a"] = {}
            node = node["a"]
        obj = GenerateReqInput(input_ids=[5, 6], rid="deep",
                               sampling_params={"max_new_tokens": 1, "custom_params": deep})
        with pytest.raises(ValueError, match="cannot be sent to the scheduler"):
            asyncio.run(submit(obj))
        assert tm.rid_to_state == {}

        tm._send_to_scheduler.close(linger=0)  # the hand-off itself now fails
        for _ in range(2):  # the second try must not be "duplicate request id"
            with pytest.raises(RuntimeError, match="could not hand request 'r1'"):
                asyncio.run(submit(GenerateReqInput(input_ids=[5, 6], rid="r1")))
            assert tm.rid_to_state == {}
        with pytest.raises(RuntimeError, match="could not hand request"):
            asyncio.run(submit(GenerateReqInput(input_ids=[[5], [6]], rid=["b1", "b2"])))
        assert tm.rid_to_state == {}
    finally:
        tm.close()


# ----------------------------------------------------------------------------- item 4: profile
@pytest.mark.parametrize("body,field", [
    ({"output_dir": "/etc"}, "output_dir"),
    ({"output_dir": "/"}, "output_dir"),
    ({"output_dir": "../escape"}, "output_dir"),
    ({"output_dir": "sub/../../escape"}, "output_dir"),
    ({"output_dir": "PROFILER/../x"}, "output_dir"),
    ({"profile_prefix": "../evil-"}, "profile_prefix"),
    ({"profile_prefix": "sub/run-"}, "profile_prefix"),
    ({"profile_prefix": "a..b"}, "profile_prefix"),
])
def test_start_profile_rejects_paths_outside_the_profiler_dir(server, profiler_dir, body, field):
    if body.get("output_dir", "").startswith("PROFILER"):
        body = {"output_dir": body["output_dir"].replace("PROFILER", profiler_dir)}
    _assert_error(_post(server, "/start_profile", body), 400, "/start_profile", field)
    # Nothing started: a stop has nothing to stop.
    assert requests.post(f"{server.base_url}/stop_profile", timeout=30).status_code == 400


def test_start_profile_writes_inside_the_profiler_dir(server, profiler_dir, tmp_path):
    outside = tmp_path / "outside"
    os.symlink(tmp_path, os.path.join(profiler_dir, "link"))  # a link pointing out is refused
    _assert_error(_post(server, "/start_profile", {"output_dir": "link/x"}), 400, "output_dir")

    for body, where in (({"output_dir": "rel/run"}, os.path.join(profiler_dir, "rel", "run")),
                        ({"output_dir": os.path.join(profiler_dir, "abs")},
                         os.path.join(profiler_dir, "abs"))):
        started = _post(server, "/start_profile", {**body, "num_steps": 1, "activities": ["CPU"],
                                                   "with_stack": False, "profile_prefix": "p-"})
        assert started.status_code == 200, started.text
        r = _post(server, "/generate", {"input_ids": [5, 6], "sampling_params": _greedy(3)})
        assert r.status_code == 200
        traces = [f for f in os.listdir(where) if f.startswith("p-")]
        assert len(traces) == 1 and traces[0].endswith("-TP-0.trace.json.gz"), traces
    assert not outside.exists()
