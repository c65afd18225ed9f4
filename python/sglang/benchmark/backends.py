"""Benchmark clients: one coroutine per backend that sends a request and times its stream.

- ``sglang``: ``POST /generate`` with SGLang's native payload (upstream SGLang's field names).
- ``sglang-oai`` and ``vllm``: ``POST /v1/completions``; ``sglang-oai-chat`` and ``vllm-chat``:
  ``POST /v1/chat/completions`` (upstream treats vLLM as an OpenAI-compatible server).
Both OpenAI clients ask for ``stream_options.continuous_usage_stats`` so that every chunk carries
the cumulative completion-token count and multi-token chunks split their ITL like the native one;
a server that sends no per-chunk usage gets one ITL per content chunk (each counted as a token,
as upstream's OpenAI client), and the final usage chunk fixes the output length.
TTFT is the time to the first chunk with non-empty text in every client.
"""
from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Dict, List, Optional, Union

import aiohttp

from sglang.benchmark.metrics import RequestFuncOutput, StreamTimer

# Long benchmarks must not be cut by a client timeout; big non-stream bodies need a big buffer.
AIOHTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)
READ_BUFSIZE = 10 * 1024 * 1024


@dataclass
class RequestFuncInput:
    """Everything one request needs; ``prompt`` is text or a list of token ids."""

    prompt: Union[str, List[int]]
    api_url: str
    prompt_len: int
    output_len: int
    model: str = ""
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = True
    stream: bool = True
    return_logprob: bool = False
    extra_request_body: Dict[str, Any] = field(default_factory=dict)
    # The served model has no tokenizer (e.g. a dummy-weight preset): its chunks carry token ids
    # but empty text, so progress is counted by completion_tokens instead of by text.
    ids_only: bool = False


def _sse_payload(line: bytes) -> Optional[str]:
    """The JSON text of one SSE line, ``"[DONE]"``, or None for blank/comment lines."""
    text = line.decode("utf-8").strip()
    if not text or text.startswith(":"):
        return None
    return text[len("data:"):].strip() if text.startswith("data:") else text


async def _post_and_time(
    session: aiohttp.ClientSession,
    inp: RequestFuncInput,
    payload: Dict[str, Any],
    on_data: Callable[[Dict[str, Any], float, StreamTimer, RequestFuncOutput], None],
) -> RequestFuncOutput:
    """POST ``payload``, feed every parsed chunk to ``on_data``; E2E ends at end of body."""
    out = RequestFuncOutput(prompt_len=inp.prompt_len)
    out.start_time = time.perf_counter()
    timer = StreamTimer(out)
    try:
        async with session.post(inp.api_url, json=payload) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:2000]}"
                return out
            if inp.stream:
                async for line in resp.content:
                    chunk = _sse_payload(line)
                    if chunk is None or chunk == "[DONE]":
                        continue
                    data = json.loads(chunk)
                    if isinstance(data, dict) and data.get("error"):
                        out.error = json.dumps(data["error"])
                        return out
                    on_data(data, time.perf_counter(), timer, out)
                out.latency = time.perf_counter() - out.start_time
            else:
                # One JSON body: TTFT == E2E and there are no ITLs (as upstream).
                data = json.loads(await resp.read())
                now = time.perf_counter()
                on_data(data, now, timer, out)
                out.latency = now - out.start_time
        out.success = True
    except Exception:  # a failed request is recorded, never fatal for the run
        out.error = traceback.format_exc()
    return out


def read_spec_meta(meta: Dict[str, Any], out: RequestFuncOutput) -> None:
    """Copy the speculative fields of a ``/generate`` chunk's ``meta_info`` into ``out`` (only
    the finishing chunk carries them; read before any early return, whatever its text)."""
    if meta.get("spec_verify_ct") is not None:
        out.spec_verify_ct = int(meta["spec_verify_ct"])
    for name in ("spec_correct_drafts_histogram", "spec_cap_lens_histogram"):
        if meta.get(name) is not None:
            setattr(out, name, [int(n) for n in meta[name]])
    for name in ("spec_accept_length", "spec_cap_length", "spec_block_accept_length"):
        if meta.get(name) is not None:
            setattr(out, name, float(meta[name]))


async def async_request_sglang_generate(
    session: aiohttp.ClientSession, inp: RequestFuncInput
) -> RequestFuncOutput:
    """SGLang native ``/generate``: cumulative ``text`` and ``meta_info.completion_tokens``."""
    sampling: Dict[str, Any] = {
        "temperature": inp.temperature,
        "max_new_tokens": inp.output_len,
        "ignore_eos": inp.ignore_eos,
    }
    if inp.top_p < 1.0:
        sampling["top_p"] = inp.top_p
    payload: Dict[str, Any] = {
        ("input_ids" if isinstance(inp.prompt, list) else "text"): inp.prompt,
        "sampling_params": sampling,
        "stream": inp.stream,
        "lora_path": None,
        "return_logprob": inp.return_logprob,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }
    payload.update(inp.extra_request_body)

    def on_data(data, now, timer, out):
        meta = data.get("meta_info", {})
        read_spec_meta(meta, out)
        if inp.ids_only:
            if int(meta.get("completion_tokens", 0)) <= out.output_len:
                return
        elif not data.get("text"):
            return
        out.generated_text = data.get("text", "")
        out.output_len = int(meta.get("completion_tokens", out.output_len + 1))
        timer.on_chunk(now, out.output_len)

    return await _post_and_time(session, inp, payload, on_data)


def _openai_payload(inp: RequestFuncInput) -> Dict[str, Any]:
    payload: Dict[str, Any] = {
        "model": inp.model,
        "temperature": inp.temperature,
        "max_tokens": inp.output_len,
        "stream": inp.stream,
        "ignore_eos": inp.ignore_eos,
    }
    if inp.top_p < 1.0:
        payload["top_p"] = inp.top_p
    if inp.stream:
        payload["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if inp.return_logprob:
        payload["logprobs"] = True
    return payload


def _make_openai_on_data(get_text: Callable[[Dict[str, Any]], str]):
    """Chunk handler shared by completions and chat: text deltas, token counts from usage."""

    def on_data(data, now, timer, out):
        usage = data.get("usage") or {}
        choices = data.get("choices") or []
        delta = get_text(choices[0]) if choices else ""
        if delta:
            out.generated_text += delta
            # Without per-chunk usage, a chunk counts as one token (upstream's OpenAI client).
            out.output_len = int(usage.get("completion_tokens", out.output_len + 1))
            timer.on_chunk(now, out.output_len)
        elif usage.get("completion_tokens") is not None:
            out.output_len = int(usage["completion_tokens"])

    return on_data


async def async_request_openai_completions(
    session: aiohttp.ClientSession, inp: RequestFuncInput
) -> RequestFuncOutput:
    """OpenAI ``/v1/completions`` (prompt text or token ids)."""
    payload = _openai_payload(inp)
    payload["prompt"] = inp.prompt
    payload.update(inp.extra_request_body)

    def text_of(choice: Dict[str, Any]) -> str:
        return choice.get("text") or ""

    return await _post_and_time(session, inp, payload, _make_openai_on_data(text_of))


async def async_request_openai_chat_completions(
    session: aiohttp.ClientSession, inp: RequestFuncInput
) -> RequestFuncOutput:
    """OpenAI ``/v1/chat/completions`` with the prompt as one user message."""
    if not isinstance(inp.prompt, str):
        raise ValueError("the chat backend needs text prompts")
    payload = _openai_payload(inp)
    payload["messages"] = [{"role": "user", "content": inp.prompt}]
    payload.update(inp.extra_request_body)

    def text_of(choice: Dict[str, Any]) -> str:
        part = choice.get("delta") if "delta" in choice else choice.get("message")
        return (part or {}).get("content") or ""

    return await _post_and_time(session, inp, payload, _make_openai_on_data(text_of))


RequestFunc = Callable[[aiohttp.ClientSession, RequestFuncInput], Awaitable[RequestFuncOutput]]

# backend name -> (request coroutine, URL path)
ASYNC_REQUEST_FUNCS: Dict[str, tuple] = {
    "sglang": (async_request_sglang_generate, "/generate"),
    "sglang-native": (async_request_sglang_generate, "/generate"),
    "sglang-oai": (async_request_openai_completions, "/v1/completions"),
    "sglang-oai-chat": (async_request_openai_chat_completions, "/v1/chat/completions"),
    "vllm": (async_request_openai_completions, "/v1/completions"),
    "vllm-chat": (async_request_openai_chat_completions, "/v1/chat/completions"),
}

# Upstream's --port default per backend (when neither --port nor --base-url is given).
DEFAULT_PORTS: Dict[str, int] = {"vllm": 8000, "vllm-chat": 8000}
