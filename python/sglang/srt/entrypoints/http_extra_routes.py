"""Endpoints beside generation: ``/tokenize``, ``/detokenize`` (also under ``/v1``) and
``/metrics``, on an ``APIRouter`` that ``http_server`` includes with :func:`include_extra_routes`.

Bodies and answers follow upstream SGLang:

* ``POST /tokenize`` ``{"prompt": str | [str], "add_special_tokens": true}`` ->
  ``{"tokens": [int] | [[int]], "count": int | [int], "max_model_len": int}``
  (``max_model_len``: the context length the server enforces);
* ``POST /detokenize`` ``{"tokens": [int] | [[int]], "skip_special_tokens": true}`` ->
  ``{"text": str | [str]}``;
* ``GET /metrics``: Prometheus text format with ``--enable-metrics``, else a 404.

Bad input is a 400 in the server's one error shape (``{"error": {"message", "type", "code"}}``):
bodies go through ``request_checks.validate_body`` (size, depth, types: strict, so ``"1"`` is no
token id), prompts are capped in characters before the tokenizer runs
(``SGLANG_MAX_PROMPT_CHARS``), token ids must lie in the model's vocabulary. Tokenizing and
decoding run in a worker thread, off the event loop.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, List, Optional, Union

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, StrictBool, StrictInt, StrictStr

from sglang.srt.entrypoints.openai.request_checks import validate_body
from sglang.srt.entrypoints.openai.serving_base import create_error_response, json_response
from sglang.srt.managers.io_struct import check_batch_size
from sglang.srt.managers.request_state import check_prompt_chars

logger = logging.getLogger(__name__)

# How long a scrape waits for the scheduler's state (the gauges keep their last values after).
METRICS_STATE_TIMEOUT_S = 5.0

router = APIRouter()
_tokenizer_manager: Optional[Callable[[], Any]] = None


def include_extra_routes(app: FastAPI, tokenizer_manager: Callable[[], Any]) -> None:
    """Serve this module's endpoints on ``app``; ``tokenizer_manager()`` returns the manager
    (called per request: the app is created before the manager exists)."""
    global _tokenizer_manager
    _tokenizer_manager = tokenizer_manager
    app.include_router(router)


def _tm() -> Any:
    if _tokenizer_manager is None:
        raise RuntimeError("include_extra_routes was not called")
    return _tokenizer_manager()


class TokenizeRequest(BaseModel):
    """Body of ``/tokenize`` (``model`` is accepted and ignored: one model is served)."""

    model: Optional[str] = None
    prompt: Union[StrictStr, List[StrictStr]]
    add_special_tokens: StrictBool = True


class TokenizeResponse(BaseModel):
    """Answer of ``/tokenize``: one id list and count per prompt (bare for a single prompt)."""

    tokens: Union[List[int], List[List[int]]]
    count: Union[int, List[int]]
    max_model_len: int


class DetokenizeRequest(BaseModel):
    """Body of ``/detokenize``."""

    model: Optional[str] = None
    tokens: Union[List[StrictInt], List[List[StrictInt]]]
    skip_special_tokens: StrictBool = True


class DetokenizeResponse(BaseModel):
    """Answer of ``/detokenize``: one text per id list (bare for a single list)."""

    text: Union[str, List[str]]


def _tokenizer_of(tm: Any, endpoint: str) -> Any:
    if tm.tokenizer is None:
        raise ValueError(f"this model has no tokenizer, so {endpoint} is unavailable")
    return tm.tokenizer


def tokenize(tm: Any, request: TokenizeRequest) -> TokenizeResponse:
    """Encode the prompt(s) of ``request`` with the served tokenizer; ``ValueError`` on bad
    input."""
    tokenizer = _tokenizer_of(tm, "/tokenize")
    single = isinstance(request.prompt, str)
    prompts = [request.prompt] if single else list(request.prompt)
    check_batch_size(len(prompts))
    for i, prompt in enumerate(prompts):  # all of them before any is tokenized
        check_prompt_chars(len(prompt), tm.context_len, "the prompt" if single else f"prompt[{i}]")
    ids = [list(tokenizer.encode(p, add_special_tokens=request.add_special_tokens))
           for p in prompts]
    if single:
        return TokenizeResponse(tokens=ids[0], count=len(ids[0]), max_model_len=tm.context_len)
    return TokenizeResponse(tokens=ids, count=[len(x) for x in ids], max_model_len=tm.context_len)


def detokenize(tm: Any, request: DetokenizeRequest) -> DetokenizeResponse:
    """Decode the id list(s) of ``request``; ``ValueError`` naming an id outside the
    vocabulary."""
    tokenizer = _tokenizer_of(tm, "/detokenize")
    tokens = request.tokens
    nested = bool(tokens) and isinstance(tokens[0], list)
    lists: List[List[int]] = list(tokens) if nested else [list(tokens)]
    if nested:
        check_batch_size(len(lists))
    for i, ids in enumerate(lists):
        bad = [t for t in ids if not 0 <= t < tm.vocab_size]
        if bad:
            where = f"tokens[{i}]" if nested else "tokens"
            raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary "
                             f"[0, {tm.vocab_size})")
    try:
        texts = [tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens)
                 for ids in lists]
    except (ValueError, TypeError, OverflowError) as e:
        raise ValueError(f"cannot decode the tokens: {e}") from e
    return DetokenizeResponse(text=texts if nested else texts[0])


async def _answer(raw_request: Request, model: Any, handler: Callable[[Any, Any], Any]) -> Response:
    request = await validate_body(raw_request, model)
    if isinstance(request, JSONResponse):
        return request
    try:
        body = await asyncio.to_thread(handler, _tm(), request)
    except ValueError as e:
        return create_error_response(str(e))
    return json_response(body.model_dump())


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize_endpoint(raw_request: Request) -> Response:
    """Text -> token ids (body: :class:`TokenizeRequest`)."""
    return await _answer(raw_request, TokenizeRequest, tokenize)


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize_endpoint(raw_request: Request) -> Response:
    """Token ids -> text (body: :class:`DetokenizeRequest`)."""
    return await _answer(raw_request, DetokenizeRequest, detokenize)


@router.get("/metrics")
async def metrics_endpoint() -> Response:
    """Prometheus metrics; the scheduler gauges are refreshed from its state first."""
    tm = _tm()
    metrics = getattr(tm, "metrics", None)
    if metrics is None:
        return create_error_response("/metrics is served only when the server is started with "
                                     "--enable-metrics", "NotFoundError", 404)
    try:
        states = await tm.get_internal_state(timeout=METRICS_STATE_TIMEOUT_S)
        if states:
            metrics.scheduler.log_internal_state(states[0])
    except (asyncio.TimeoutError, RuntimeError) as e:
        # Busy or unhealthy scheduler: the request metrics still count; gauges keep their values.
        logger.warning("/metrics: no scheduler state (%s); serving the last gauge values",
                       type(e).__name__ if not str(e) else e)
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)
