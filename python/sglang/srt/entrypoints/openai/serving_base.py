"""What the OpenAI-compatible handlers share: request -> ``GenerateReqInput`` -> JSON or SSE.

A handler turns its pydantic request into one ``GenerateReqInput`` (a batch when there are
several prompts or ``n > 1``: choice ``i`` is batch entry ``i``, prompt-major), hands it to the
``TokenizerManager`` and shapes what comes back.

Per choice: a client's ``rid`` is kept (a string for one choice, a list of one rid per choice
otherwise), so ``/abort_request`` reaches the request; and with ``seed`` and several choices,
choice ``i`` samples with :func:`choice_seed` ``(seed, i)``, so the choices differ from each
other while the same request always gives the same choices (seeded sampling does not depend on
the batch a request runs in). Validation errors (``ValueError`` from the
handler or the TokenizerManager) become a 400 before anything is streamed: the first chunk is
awaited before the response starts, so a bad request never turns into a 200 stream. The
conversion (which may render a chat template and tokenize) runs in a worker thread, off the
event loop.
"""
from __future__ import annotations

import asyncio
import json
import math
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sglang.srt.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, UsageInfo
from sglang.srt.managers.io_struct import (
    CONSTRAINED_DECODING_KEYS,
    MAX_TOP_LOGPROBS,
    UNSUPPORTED_FEATURES,
    GenerateReqInput,
    is_set,
)
from sglang.srt.sampling.sampling_params import MAX_SAMPLING_SEED

__all__ = ["MAX_TOP_LOGPROBS"]  # re-exported: the one cap shared with /generate


def create_error_response(
    message: str, err_type: str = "BadRequestError", status_code: int = 400
) -> JSONResponse:
    """``{"error": {"message", "type", "code"}}`` with the given HTTP status."""
    # A message may quote the client's input; a lone surrogate in it must not break UTF-8.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, code=status_code))
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status_code)


def _finite(value: Any) -> Any:
    """``value`` with every NaN / infinite float replaced by ``None`` (lists and dicts walked)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def dumps_strict(content: Any) -> str:
    """Strict JSON: ``NaN`` / ``Infinity`` are not JSON (clients reject them), so a non-finite
    float is written as ``null``. The walk only runs when the fast path finds one."""
    try:
        return json.dumps(content, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(content), ensure_ascii=False, allow_nan=False)


def json_response(content: Any, status_code: int = 200) -> Response:
    """A JSON body serialized like the SSE records (strict JSON, see :func:`dumps_strict`)."""
    return Response(dumps_strict(content), status_code=status_code,
                    media_type="application/json")


def sse_event(payload: Any) -> bytes:
    """One Server-Sent-Events record: ``data: <json>`` and a blank line."""
    text = payload if isinstance(payload, str) else dumps_strict(payload)
    return f"data: {text}\n\n".encode("utf-8")


SSE_DONE = b"data: [DONE]\n\n"


def finish_reason_to_openai(reason: Optional[Dict[str, Any]]) -> Tuple[Optional[str], Any]:
    """SGLang's finish dict -> (OpenAI ``finish_reason``, ``matched_stop``)."""
    if not reason:
        return None, None
    kind = reason.get("type")
    if kind == "stop":
        return "stop", reason.get("matched")
    if kind == "length":
        return "length", None
    return "abort", None


def build_sampling_params(request: Any, max_new_tokens: Optional[int]) -> Dict[str, Any]:
    """The ``sampling_params`` dict of an OpenAI request (``None`` = the engine's default)."""
    return {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": request.min_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "frequency_penalty": request.frequency_penalty,
        "presence_penalty": request.presence_penalty,
        "repetition_penalty": request.repetition_penalty,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "ignore_eos": request.ignore_eos,
        "skip_special_tokens": request.skip_special_tokens,
        "no_stop_trim": request.no_stop_trim,
        "logit_bias": request.logit_bias,
        "sampling_seed": request.seed,
    }


# Odd 64-bit constant (2**64 / golden ratio): adding i times it is a bijection on i modulo
# 2**63, so the seeds of different choices never coincide, and they are far apart for the hash.
_SEED_STEP = 0x9E3779B97F4A7C15


def choice_seed(seed: int, index: int) -> int:
    """The sampling seed of choice ``index`` of a request with ``seed``.

    ``(seed + index * 0x9E3779B97F4A7C15) mod 2**63``: choice 0 keeps ``seed`` itself (so
    ``n = 1`` is unchanged), and distinct choices get distinct seeds.
    """
    return (seed + index * _SEED_STEP) % (MAX_SAMPLING_SEED + 1)


def sampling_params_per_choice(request: Any, max_new_tokens: Optional[int],
                               count: int) -> Any:
    """One ``sampling_params`` dict for all ``count`` choices, or, with a ``seed`` and more
    than one choice, a list whose entry ``i`` has ``sampling_seed = choice_seed(seed, i)``."""
    params = build_sampling_params(request, max_new_tokens)
    if request.seed is None:
        return params
    if not 0 <= request.seed <= MAX_SAMPLING_SEED:
        raise ValueError(f"seed must be in [0, 2**63), got {request.seed}")
    if count == 1:
        return params
    return [{**params, "sampling_seed": choice_seed(request.seed, i)} for i in range(count)]


def choice_rids(rid: Any, count: int) -> List[str]:
    """The rids of ``count`` choices: the client's (kept, so ``/abort_request`` reaches them)
    or fresh ones. One choice takes a string; several take a list of as many distinct rids."""
    if rid is None:
        return new_rids(count)
    if isinstance(rid, str):
        if count != 1:
            raise ValueError(f"'rid' must be a list of {count} rids, one per choice (the "
                             f"request has {count} choices), got a single string")
        return [rid]
    if len(rid) != count:
        raise ValueError(f"'rid' has {len(rid)} entries but the request has {count} choices")
    if len(set(rid)) != count:
        raise ValueError("'rid' must not repeat an id")
    return list(rid)


def check_unsupported_fields(request: Any) -> None:
    """``ValueError`` naming the first field of a feature this server lacks that is set."""
    for name in UNSUPPORTED_FEATURES + CONSTRAINED_DECODING_KEYS:
        if is_set(getattr(request, name, None)):
            raise ValueError(f"'{name}' is not supported by this server (leave it unset or null)")


def last_hidden_state(meta: Dict[str, Any]) -> List[float]:
    """A choice's ``hidden_states`` (``return_hidden_states``), as upstream: the last generated
    token's row of ``meta_info["hidden_states"]`` (whose first entry holds the prompt's rows);
    empty while no token after the first has one."""
    rows = meta.get("hidden_states") or []
    return list(rows[-1]) if len(rows) > 1 else []


def check_top_logprobs(name: str, value: Optional[int]) -> None:
    """``ValueError`` unless ``value`` is None or in ``[0, MAX_TOP_LOGPROBS]``."""
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")


def new_rids(count: int) -> List[str]:
    """Fresh request ids, set before submission so a disconnect can always abort them."""
    return [uuid.uuid4().hex for _ in range(count)]


def fan_out(values: List[Any], n: int) -> List[Any]:
    """Repeat each prompt ``n`` times, prompt-major (choice index = prompt * n + sample)."""
    return [v for v in values for _ in range(n)]


def usage_from_metas(metas: List[Dict[str, Any]], n: int) -> UsageInfo:
    """Usage over all choices; each distinct prompt's tokens are counted once."""
    prompt = sum(int(m.get("prompt_tokens", 0)) for i, m in enumerate(metas) if i % n == 0)
    completion = sum(int(m.get("completion_tokens", 0)) for m in metas)
    cached = sum(int(m.get("cached_tokens", 0)) for i, m in enumerate(metas) if i % n == 0)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details={"cached_tokens": cached} if cached else None,
    )


def token_logprob_entries(
    meta: Dict[str, Any], start: int, tokenizer: Any
) -> List[Tuple[str, float, List[Tuple[str, float]]]]:
    """(token text, logprob, [(alt text, alt logprob)]) of output tokens ``start..`` of ``meta``.

    Entries in meta_info are ``[logprob, token_id, text_or_None]``; text is decoded here when the
    TokenizerManager did not add it.
    """
    tokens = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []

    def text_of(entry: List[Any]) -> str:
        if len(entry) > 2 and entry[2] is not None:
            return entry[2]
        return tokenizer.decode([entry[1]]) if tokenizer is not None else str(entry[1])

    out = []
    for i in range(start, len(tokens)):
        entry = tokens[i]
        alts = tops[i] if i < len(tops) and tops[i] else []
        out.append((text_of(entry), float(entry[0]),
                    [(text_of(a), float(a[0])) for a in alts]))
    return out


class OpenAIServingBase:
    """Template of an OpenAI handler; subclasses convert requests and shape responses."""

    def __init__(self, tokenizer_manager: Any) -> None:
        self.tokenizer_manager = tokenizer_manager

    # --- subclass hooks ---------------------------------------------------------------
    def convert_request(self, request: Any) -> GenerateReqInput:
        """Build the internal request; raise ``ValueError`` with a clear message on bad input."""
        raise NotImplementedError

    def build_response(self, request: Any, outputs: List[Dict[str, Any]]) -> Dict[str, Any]:
        """The non-streamed JSON body from the final output of every choice."""
        raise NotImplementedError

    def stream_chunks(
        self, request: Any, chunks: AsyncIterator[Dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        """SSE records (ending with ``[DONE]``) from the TokenizerManager's stream."""
        raise NotImplementedError

    # --- the request cycle ------------------------------------------------------------
    async def handle_request(self, request: Any, raw_request: Request) -> Response:
        """Validate, generate and answer (JSON or an SSE stream)."""
        try:
            # In a worker thread: rendering a chat template and tokenizing a long prompt take a
            # while, and on the event loop they would stall every other request's stream.
            obj = await asyncio.to_thread(self.convert_request, request)
            generator = self.tokenizer_manager.generate_request(obj, raw_request)
            if not request.stream:
                outputs = await _collect(generator)
            else:
                first = await generator.__anext__()
        except ValueError as e:
            return create_error_response(str(e))
        except RecursionError:
            return create_error_response("the request is nested too deeply to be processed")
        except RuntimeError as e:  # the engine is unhealthy or shutting down
            return create_error_response(str(e), "InternalServerError", 500)
        except StopAsyncIteration:
            return create_error_response("the request produced no output",
                                         "InternalServerError", 500)
        if not request.stream:
            return json_response(self.build_response(request, outputs))
        return StreamingResponse(
            self._guarded_stream(request, obj, first, generator),
            media_type="text/event-stream",
        )

    async def _guarded_stream(
        self, request: Any, obj: GenerateReqInput, first: Dict[str, Any], generator: AsyncIterator
    ) -> AsyncIterator[bytes]:
        """Stream, report a late error in-band, and abort the request if the client leaves."""

        async def chained() -> AsyncIterator[Dict[str, Any]]:
            yield first
            async for item in generator:
                yield item

        completed = False
        try:
            async for record in self.stream_chunks(request, chained()):
                yield record
            completed = True
        except (ValueError, RuntimeError) as e:
            completed = True  # the TokenizerManager already dropped the request
            info = ErrorInfo(message=str(e)) if isinstance(e, ValueError) else \
                ErrorInfo(message=str(e), type="InternalServerError", code=500)
            yield sse_event(ErrorResponse(error=info).model_dump(exclude_none=True))
            yield SSE_DONE
        finally:
            if not completed:
                # Client disconnect (cancellation) lands here. Abort synchronously first: under
                # anyio's level-triggered cancellation any await here would raise again.
                abort_rids(self.tokenizer_manager, obj.rid)
                await _close_quietly(generator)


def abort_rids(tokenizer_manager: Any, rid: Any) -> None:
    """Abort one rid or a list of rids (unknown / finished rids are ignored by the manager)."""
    for r in rid if isinstance(rid, list) else [rid]:
        if r is not None:
            tokenizer_manager.abort_request(r)


async def _close_quietly(generator: Any) -> None:
    try:
        await generator.aclose()
    except (Exception, asyncio.CancelledError):  # cancelled again or already closed: done
        pass


async def _collect(generator: AsyncIterator[Any]) -> List[Dict[str, Any]]:
    """The final output of every choice of a non-streamed request, in index order."""
    last: Any = None
    async for item in generator:
        last = item
    if last is None:
        raise ValueError("the request produced no output")
    return last if isinstance(last, list) else [last]
