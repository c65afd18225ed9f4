"""Tokenizing cannot stall or bloat the server: prompts are capped in characters before the
tokenizer (or the chat template) runs (``SGLANG_MAX_PROMPT_CHARS``), tokenizing and template
rendering run off the event loop, and ``chat_template_kwargs`` pass an allow-list.

The event-loop tests use tokenizer stubs that block on a ``threading.Event``: while the stub is
blocked, a coroutine on the loop checks that the stub is *still* blocked. Were tokenizing on the
loop, that coroutine could only run after the stub gave up waiting, and the check would fail
(after the stub's 10 s timeout) instead of hanging.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List

import pytest
import requests
import zmq

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.entrypoints.openai.serving_chat import (
    ALLOWED_CHAT_TEMPLATE_KWARGS,
    OpenAIServingChat,
    check_chat_template_kwargs,
)
from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from sglang.srt.managers.request_state import (
    DEFAULT_PROMPT_CHARS_PER_TOKEN,
    build_tokenized_request,
    max_prompt_chars,
)
from sglang.test.test_utils import TinyServer, launch_tiny_server
from test_server_hardening import _assert_error, _chat, _post

PROMPT_CHAR_LIMIT = 600
BLOCK_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[TinyServer]:
    saved = os.environ.get("SGLANG_MAX_PROMPT_CHARS")
    os.environ["SGLANG_MAX_PROMPT_CHARS"] = str(PROMPT_CHAR_LIMIT)  # the server inherits it
    try:
        srv = launch_tiny_server(str(tmp_path_factory.mktemp("tokenizing")))
    finally:
        if saved is None:
            os.environ.pop("SGLANG_MAX_PROMPT_CHARS", None)
        else:
            os.environ["SGLANG_MAX_PROMPT_CHARS"] = saved
    try:
        yield srv
    finally:
        srv.stop()


class _NoTokenizer:
    """A tokenizer that fails the test if anything is tokenized or rendered."""

    chat_template = "{{ messages }}"

    def encode(self, *args: Any, **kwargs: Any) -> List[int]:
        raise AssertionError("the tokenizer ran on a prompt over the character limit")

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        raise AssertionError("the chat template ran on messages over the character limit")


class _BlockingTokenizer:
    """Wraps a real tokenizer; ``encode`` / ``apply_chat_template`` block until released."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()
        self.inside = False

    def _block(self) -> None:
        self.inside = True
        self.entered.set()
        self.release.wait(BLOCK_TIMEOUT_S)
        self.inside = False

    def encode(self, *args: Any, **kwargs: Any) -> List[int]:
        self._block()
        return self.inner.encode(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        self._block()
        return self.inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _assert_loop_runs_while_blocked(stub: _BlockingTokenizer, task: asyncio.Future) -> None:
    """Wait (on the loop) until the stub blocks, then check it is still blocked meanwhile."""
    deadline = time.monotonic() + BLOCK_TIMEOUT_S
    while not stub.entered.is_set():
        assert time.monotonic() < deadline, "the tokenizer was never called"
        await asyncio.sleep(0.005)
    ticks = 0
    for _ in range(3):  # several loop turns, each while the tokenizer is still blocked
        await asyncio.sleep(0.01)
        ticks += 1
        assert stub.inside, "the event loop was blocked while the tokenizer ran"
    assert ticks == 3 and not task.done()
    stub.release.set()


# ----------------------------------------------------------------------------- prompt cap
def test_prompt_cap_default_and_flag():
    assert max_prompt_chars(1000) == DEFAULT_PROMPT_CHARS_PER_TOKEN * 1000
    with envs.SGLANG_MAX_PROMPT_CHARS.override(123):
        assert max_prompt_chars(1000) == 123
    with envs.SGLANG_MAX_PROMPT_CHARS.override(-1):
        with pytest.raises(ValueError, match="SGLANG_MAX_PROMPT_CHARS"):
            max_prompt_chars(1000)


def test_text_over_the_cap_is_refused_before_tokenizing():
    ctx = 16
    limit = DEFAULT_PROMPT_CHARS_PER_TOKEN * ctx
    obj = GenerateReqInput(text="a" * (limit + 1))
    obj.normalize_batch_and_arguments()
    with pytest.raises(ValueError, match=f"limit of {limit} characters.*SGLANG_MAX_PROMPT_CHARS"):
        build_tokenized_request(obj, _NoTokenizer(), vocab_size=100, context_len=ctx)
    # At the limit the tokenizer runs (and here fails the test's way, proving it was reached).
    obj = GenerateReqInput(text="a" * limit)
    obj.normalize_batch_and_arguments()
    with pytest.raises(AssertionError, match="the tokenizer ran"):
        build_tokenized_request(obj, _NoTokenizer(), vocab_size=100, context_len=ctx)


def test_chat_over_the_cap_is_refused_before_the_template():
    handler = OpenAIServingChat(SimpleNamespace(tokenizer=_NoTokenizer(), context_len=4))
    limit = DEFAULT_PROMPT_CHARS_PER_TOKEN * 4
    req = ChatCompletionRequest(messages=[{"role": "system", "content": "s" * (limit // 2)},
                                          {"role": "user", "content": "u" * (limit // 2 + 1)}])
    with pytest.raises(ValueError, match=f"messages' content has {limit + 1} characters"):
        handler.convert_request(req)


def test_prompt_cap_through_the_server(server):
    over = "x" * (PROMPT_CHAR_LIMIT + 1)
    for path, body in (("/generate", {"text": over, "sampling_params": {"max_new_tokens": 1}}),
                       ("/generate", {"text": ["ok", over]}),
                       ("/v1/completions", {"model": "m", "prompt": over, "max_tokens": 1}),
                       ("/v1/completions", {"model": "m", "prompt": ["ok", over]}),
                       ("/v1/chat/completions", _chat(over))):
        _assert_error(_post(server, path, body), 400, str(PROMPT_CHAR_LIMIT),
                      "SGLANG_MAX_PROMPT_CHARS")
    # The rendered chat prompt counts too: the template adds its own text to the messages.
    near = "x" * (PROMPT_CHAR_LIMIT - 2)
    _assert_error(_post(server, "/v1/chat/completions", _chat(near)), 400,
                  "after the chat template", str(PROMPT_CHAR_LIMIT))
    r = _post(server, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- chat_template_kwargs
@pytest.mark.parametrize("kwargs,needles", [
    ({"chat_template": "{{ 'pwned' }}"}, ("'chat_template'", "not allowed")),
    ({"tokenize": True}, ("'tokenize'", "not allowed")),
    ({"return_dict": True}, ("'return_dict'",)),
    ({"continue_final_message": True}, ("'continue_final_message'",)),
    ({"enable_thinking": "yes"}, ("enable_thinking", "bool")),
    ({"reasoning_effort": 3}, ("reasoning_effort", "str")),
])
def test_chat_template_kwargs_outside_the_allow_list_are_refused(server, kwargs, needles):
    with pytest.raises(ValueError):
        check_chat_template_kwargs(kwargs)
    _assert_error(_post(server, "/v1/chat/completions",
                        _chat("hi", chat_template_kwargs=kwargs)), 400, *needles)


def test_allowed_chat_template_kwargs_are_passed(server):
    assert set(ALLOWED_CHAT_TEMPLATE_KWARGS) >= {"enable_thinking", "add_generation_prompt"}
    seen: Dict[str, Any] = {}

    class Recording:
        chat_template = "t"

        def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
            seen.update(kwargs)
            return "rendered"

        def encode(self, text: str, **kwargs: Any) -> List[int]:
            return [1, 2]

    handler = OpenAIServingChat(SimpleNamespace(tokenizer=Recording(), context_len=64))
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                chat_template_kwargs={"enable_thinking": False})
    handler.convert_request(req)
    assert seen == {"enable_thinking": False, "add_generation_prompt": True, "tokenize": False}
    r = _post(server, "/v1/chat/completions",
              _chat("hi", chat_template_kwargs={"enable_thinking": True,
                                                "add_generation_prompt": True}))
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- off the loop
def test_tokenizing_runs_off_the_event_loop(server):
    """While one request's tokenizer call is blocked, the manager's loop keeps running; once
    released, the request reaches the scheduler's socket."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.server_args import PortArgs, ServerArgs

    args = ServerArgs(model_path=server.model_dir, device="cpu")
    port_args = PortArgs.init_new(args)
    ctx = zmq.Context()
    scheduler = ctx.socket(zmq.PULL)
    scheduler.bind(port_args.scheduler_input_ipc_name)
    tm = TokenizerManager(args, port_args)
    stub = _BlockingTokenizer(tm.tokenizer)
    tm.tokenizer = stub

    async def scenario() -> TokenizedGenerateReqInput:
        gen = tm.generate_request(GenerateReqInput(text="hello world", rid="slow",
                                                   sampling_params={"max_new_tokens": 1}))
        task = asyncio.ensure_future(gen.__anext__())
        try:
            await _assert_loop_runs_while_blocked(stub, task)
            if not await asyncio.to_thread(scheduler.poll, 10_000):
                raise AssertionError("the request never reached the scheduler")
            return scheduler.recv_pyobj()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await gen.aclose()

    try:
        sent = asyncio.run(scenario())
        assert sent.rid == "slow" and sent.input_ids == list(stub.inner.encode("hello world"))
    finally:
        stub.release.set()
        tm.close()
        scheduler.close(linger=0)
        ctx.term()


def test_chat_template_renders_off_the_event_loop(server):
    """The OpenAI handler converts a request (template + tokenizer) in a worker thread."""
    from transformers import AutoTokenizer

    stub = _BlockingTokenizer(AutoTokenizer.from_pretrained(server.model_dir))
    submitted: List[GenerateReqInput] = []

    async def generate_request(obj: GenerateReqInput, raw_request: Any = None):
        submitted.append(obj)
        yield {"text": "ok", "output_ids": [1],
               "meta_info": {"finish_reason": {"type": "length"}, "prompt_tokens": 1,
                             "completion_tokens": 1}}

    handler = OpenAIServingChat(SimpleNamespace(tokenizer=stub, context_len=4096,
                                                generate_request=generate_request))
    req = ChatCompletionRequest(**_chat("hi"))

    async def scenario() -> Any:
        task = asyncio.ensure_future(handler.handle_request(req, None))
        await _assert_loop_runs_while_blocked(stub, task)
        return await asyncio.wait_for(task, BLOCK_TIMEOUT_S)

    try:
        resp = asyncio.run(scenario())
    finally:
        stub.release.set()
    assert resp.status_code == 200, resp.body
    assert len(submitted) == 1 and submitted[0].input_ids
