"""The HTTP server: SGLang's native API and the OpenAI-compatible API on FastAPI + uvicorn.

``launch_server`` starts the scheduler and detokenizer processes (through the engine), keeps the
``TokenizerManager`` in this process, serves ``app`` with uvicorn, warms the model up with one
request, and on exit (SIGINT/SIGTERM, or a failed warmup) takes every child process down.

Bad input never reaches the scheduler: every body is size-capped and parsed by
``openai/request_checks.py`` (413 / 400), wrong types are answered here, and the
TokenizerManager's validation (``ValueError``) is turned into a 400 before any byte of a stream is
sent (the first chunk is awaited before the response starts). Every error, including FastAPI's
own 404 / 405, has the one shape ``{"error": {"message", "type", "code"}}``.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

import sglang
from sglang.srt.entrypoints.http_extra_routes import include_extra_routes
from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from sglang.srt.entrypoints.openai.serving_base import (
    SSE_DONE,
    abort_rids,
    create_error_response,
    json_response,
    sse_event,
)
from sglang.srt.entrypoints.openai.request_checks import (
    BodySizeLimitMiddleware,
    install_error_handlers,
    read_json_body,
    validate_body,
)
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import GenerateReqInput, ProfileReq, check_batch_size

logger = logging.getLogger(__name__)

# Top-level /generate fields that select the response shape: checked here, before use.
_BOOL_FIELDS = ("stream", "return_text_in_logprobs", "log_metrics")


@dataclass
class _GlobalState:
    """What the endpoints need; set once by :func:`set_global_state` before serving."""

    tokenizer_manager: Any
    server_args: Any
    serving_completion: OpenAIServingCompletion
    serving_chat: OpenAIServingChat
    scheduler_info: Dict[str, Any]
    startup_time: float
    shutting_down: bool = False
    # The warmup request has completed (or was skipped and the HTTP port answers): until then
    # the health checks answer 503, so a load balancer never routes to a cold server.
    warmed_up: bool = False
    failure: Optional[str] = None  # why the server stopped itself (warmup failed, ...)


_state: Optional[_GlobalState] = None


def set_global_state(tokenizer_manager: Any, server_args: Any,
                     scheduler_info: Optional[Dict[str, Any]] = None) -> None:
    """Bind the app to a TokenizerManager (``scheduler_info``: what rank 0 reported at start)."""
    global _state
    _state = _GlobalState(
        tokenizer_manager=tokenizer_manager,
        server_args=server_args,
        serving_completion=OpenAIServingCompletion(tokenizer_manager),
        serving_chat=OpenAIServingChat(tokenizer_manager),
        scheduler_info=dict(scheduler_info or {}),
        startup_time=time.time(),
    )


def _st() -> _GlobalState:
    if _state is None:
        raise RuntimeError("the HTTP app has no TokenizerManager: call set_global_state first")
    return _state


def _flag(obj: Any, name: str) -> bool:
    """Read a readiness flag that may be an attribute or a method."""
    value = getattr(obj, name, True)
    return bool(value() if callable(value) else value)


app = FastAPI(title="sglang", version=sglang.__version__)


install_error_handlers(app)
include_extra_routes(app, lambda: _st().tokenizer_manager)  # /tokenize, /detokenize, /metrics


class _ApiKeyMiddleware:
    """With ``--api-key``, every endpoint except the health checks needs the bearer token.

    A plain ASGI middleware on purpose: starlette's ``BaseHTTPMiddleware`` wraps ``receive`` so
    that ``Request.is_disconnected()`` never fires, which would stop client disconnects from
    aborting their requests.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        key = getattr(_state.server_args, "api_key", None) if _state else None
        if key and scope["type"] == "http" and not scope["path"].startswith("/health"):
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {key}":
                resp = create_error_response("missing or wrong API key", "AuthenticationError", 401)
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


app.add_middleware(BodySizeLimitMiddleware)
app.add_middleware(_ApiKeyMiddleware)  # added last = outermost: no body is read without the key


# ----------------------------------------------------------------------------- health
async def _generation_alive(tm: Any, timeout_s: float) -> bool:
    """Submit a 1-token greedy request; True as soon as the backend answers anything.

    A busy server answers other requests meanwhile, which also proves the backend is alive, so
    the check costs nothing under load (the TokenizerManager's last-receive time moves).
    """
    rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
    obj = GenerateReqInput(
        input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        rid=rid, log_metrics=False,
    )
    tic = time.time()

    async def run() -> None:
        async for _ in tm.generate_request(obj, None):
            pass

    task = asyncio.create_task(run())
    try:
        while time.time() - tic < timeout_s:
            if task.done():
                return task.exception() is None
            if getattr(tm, "last_receive_tstamp", 0.0) > tic:
                return True
            await asyncio.sleep(0.05)
        return False
    finally:
        if not task.done():
            tm.abort_request(rid)
            task.cancel()


@app.get("/health")
@app.get("/health_generate")
async def health(request: Request) -> Response:
    """503 until the warmup is done, while shutting down or after a child died; otherwise a
    generation probe."""
    st = _state
    if st is None or st.shutting_down or not st.warmed_up:
        return Response(status_code=503)
    tm = st.tokenizer_manager
    if not _flag(tm, "is_ready") or not _flag(tm, "is_healthy"):
        return Response(status_code=503)
    probe = (request.url.path == "/health_generate"
             or envs.SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION.get())
    if probe and not await _generation_alive(tm, envs.SGLANG_HEALTH_CHECK_TIMEOUT.get()):
        return Response(status_code=503)
    return Response(status_code=200)


@app.get("/ready")
async def ready() -> Response:
    """200 once the warmup is done and the TokenizerManager reports ready."""
    st = _state
    ok = (st is not None and not st.shutting_down and st.warmed_up
          and _flag(st.tokenizer_manager, "is_ready"))
    return Response(status_code=200 if ok else 503)


# ----------------------------------------------------------------------------- info
def _context_len(tm: Any) -> Optional[int]:
    sa = tm.server_args
    if getattr(sa, "context_length", None):
        return int(sa.context_length)
    cfg = getattr(tm, "model_config", None)
    return int(cfg.context_len) if cfg is not None else None


@app.get("/model_info")
@app.get("/get_model_info")
async def model_info() -> Dict[str, Any]:
    """What is served (SGLang's ``/model_info`` keys)."""
    tm = _st().tokenizer_manager
    sa = tm.server_args
    hf = tm.model_config.hf_config
    return {
        "model_path": tm.model_config.model_path,
        "served_model_name": sa.served_model_name,
        "tokenizer_path": sa.tokenizer_path or tm.model_config.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": sa.load_format,
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": hf.model_type,
        "architectures": list(hf.architectures),
        "context_length": _context_len(tm),
        "vocab_size": tm.model_config.vocab_size,
    }


@app.get("/server_info")
@app.get("/get_server_info")
async def server_info() -> Dict[str, Any]:
    """Resolved server args (flattened) plus one internal-state dict per scheduler group."""
    st = _st()
    internal_states = await st.tokenizer_manager.get_internal_state()
    # Imported here like _launch_subprocesses below (the engine module pulls in the scheduler).
    from sglang.srt.entrypoints.engine import reported_server_args

    args = reported_server_args(st.server_args)  # resolved model path, masked API key
    return {
        **args,
        **st.scheduler_info,
        "internal_states": internal_states,
        "startup_time": st.startup_time,
        "version": sglang.__version__,
    }


@app.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(timeout: float = 0.0) -> PlainTextResponse:
    """Reset the caches when idle; ``timeout`` seconds to wait for running requests to end."""
    tm = _st().tokenizer_manager
    deadline = time.time() + max(0.0, float(timeout))
    while True:
        if await tm.flush_cache():
            return PlainTextResponse("Cache flushed.\n", status_code=200)
        if time.time() >= deadline:
            return PlainTextResponse(
                "Cache not flushed: the scheduler has running or waiting requests.\n",
                status_code=400,
            )
        await asyncio.sleep(0.1)


@app.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """Abort one request by ``rid`` (or all of them with ``abort_all``)."""
    body = await read_json_body(request)
    if isinstance(body, JSONResponse):
        return body
    if not isinstance(body, dict):
        return create_error_response("body must be a JSON object with 'rid'")
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(rid, str) or not isinstance(abort_all, bool) or not (rid or abort_all):
        return create_error_response("'rid' must be a non-empty string (or set 'abort_all': true)")
    tm = _st().tokenizer_manager
    if abort_all:
        tm.abort_request("", abort_all=True)
    else:
        tm.abort_request(rid)
    return Response(status_code=200)


@app.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(request: Request) -> Response:
    """Start the torch profiler in the scheduler (optional JSON body: ``ProfileReq`` fields)."""
    body = await read_json_body(request) if await request.body() else None
    if isinstance(body, JSONResponse):
        return body
    try:
        req = ProfileReq.from_body(body)
    except ValueError as e:
        return create_error_response(f"/start_profile: {e}")
    return await _profile(req)


@app.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile() -> Response:
    """Stop the running profile and write one trace per TP rank."""
    return await _profile(ProfileReq(start=False))


async def _profile(req: ProfileReq) -> Response:
    try:
        out = await _st().tokenizer_manager.profile(req)
    except asyncio.TimeoutError:
        return create_error_response("the scheduler did not answer the profile request in time",
                                     "ServiceUnavailableError", 503)
    if not out.success:
        return create_error_response(out.message)
    return PlainTextResponse(out.message + "\n", status_code=200)


# ----------------------------------------------------------------------------- /generate
def _parse_generate_body(body: Any) -> GenerateReqInput:
    """``GenerateReqInput`` from a JSON body; unknown keys are ignored, wrong types rejected."""
    if not isinstance(body, dict):
        raise ValueError(f"request body must be a JSON object, got {type(body).__name__}")
    for name in _BOOL_FIELDS:
        if name in body and not isinstance(body[name], bool):
            raise ValueError(f"'{name}' must be a boolean, got {body[name]!r}")
    obj = GenerateReqInput.from_dict(body)
    if obj.rid is None:
        # Known before submission, so a disconnect can abort it whatever the manager does.
        size = _batch_size(obj)
        if size is not None:
            check_batch_size(size)  # before making one rid per prompt
        obj.rid = uuid.uuid4().hex if size is None else [uuid.uuid4().hex for _ in range(size)]
    return obj


def _batch_size(obj: GenerateReqInput) -> Optional[int]:
    """None for a single request, else the number of prompts (types are checked later)."""
    prompts = obj.text if obj.text is not None else obj.input_ids
    if isinstance(prompts, list) and (obj.text is not None or
                                      (prompts and all(isinstance(x, list) for x in prompts))):
        return len(prompts)
    return None


async def _stream_generate(
    obj: GenerateReqInput, first: Dict[str, Any], generator: AsyncIterator[Dict[str, Any]]
) -> AsyncIterator[bytes]:
    """SSE: one ``data:`` record per chunk (cumulative text), then ``[DONE]``."""
    completed = False
    try:
        yield sse_event(first)
        async for chunk in generator:
            yield sse_event(chunk)
        completed = True
    except ValueError as e:
        completed = True
        yield sse_event({"error": {"message": str(e), "type": "BadRequestError", "code": 400}})
    except RuntimeError as e:  # the engine died or shut down mid-stream
        completed = True
        yield sse_event({"error": {"message": str(e), "type": "InternalServerError", "code": 500}})
    finally:
        if not completed:
            # Client gone (cancelled): abort synchronously, awaits would be cancelled again.
            abort_rids(_st().tokenizer_manager, obj.rid)
    yield SSE_DONE


@app.api_route("/generate", methods=["POST", "PUT"])
async def generate_request(request: Request) -> Response:
    """SGLang's native generation endpoint (single or batch, JSON or SSE)."""
    body = await read_json_body(request)
    if isinstance(body, JSONResponse):
        return body
    tm = _st().tokenizer_manager
    try:
        obj = _parse_generate_body(body)
        generator = tm.generate_request(obj, request)
        if obj.stream:
            first = await generator.__anext__()
            return StreamingResponse(_stream_generate(obj, first, generator),
                                     media_type="text/event-stream")
        result = None
        async for result in generator:
            pass
    except ValueError as e:
        return create_error_response(str(e))
    except RecursionError:
        return create_error_response("the request is nested too deeply to be processed")
    except RuntimeError as e:  # the engine is unhealthy or shutting down
        return create_error_response(str(e), "InternalServerError", 500)
    except StopAsyncIteration:
        return create_error_response("the request produced no output", "InternalServerError", 500)
    return json_response(result)


# ----------------------------------------------------------------------------- OpenAI
@app.get("/v1/models")
async def available_models() -> Dict[str, Any]:
    """The one served model."""
    tm = _st().tokenizer_manager
    name = str(tm.server_args.served_model_name)
    card = ModelCard(id=name, root=name, max_model_len=_context_len(tm))
    return ModelList(data=[card]).model_dump()


@app.post("/v1/completions")
async def openai_v1_completions(raw_request: Request) -> Response:
    """OpenAI text completions (body: ``CompletionRequest``)."""
    request = await validate_body(raw_request, CompletionRequest)
    if isinstance(request, JSONResponse):
        return request
    return await _st().serving_completion.handle_request(request, raw_request)


@app.post("/v1/chat/completions")
async def openai_v1_chat_completions(raw_request: Request) -> Response:
    """OpenAI chat completions with the tokenizer's chat template (body: ``ChatCompletionRequest``)."""
    request = await validate_body(raw_request, ChatCompletionRequest)
    if isinstance(request, JSONResponse):
        return request
    return await _st().serving_chat.handle_request(request, raw_request)


# ----------------------------------------------------------------------------- launch
def _begin_shutdown() -> None:
    # Called on the event loop when the drain starts: the health checks turn 503 at once.
    _st().shutting_down = True


def launch_server(server_args: Any, on_ready: Optional[Any] = None) -> None:
    """Check the port, start the engine's children, serve HTTP until SIGINT/SIGTERM (which
    drain: ``server_lifecycle.GracefulServer``), then stop the children.

    ``on_ready`` (optional) is called from the warmup thread once the server answers requests.
    Raises ``RuntimeError`` if the port is taken (``PortInUseError``, before any child starts)
    or the server had to stop itself (e.g. the warmup request failed).
    """
    from sglang.srt.entrypoints import server_lifecycle as lifecycle

    grace_s = lifecycle.graceful_shutdown_timeout()  # ValueError naming the variable
    lifecycle.check_port_free(server_args.host, server_args.port)  # before torch is imported
    from sglang.srt.entrypoints.engine import _launch_subprocesses, shutdown_subprocesses

    tm, scheduler_info, children = _launch_subprocesses(server_args)
    set_global_state(tm, server_args, scheduler_info)
    try:  # from here on, whatever ends this (a signal included) stops the children
        gate = lifecycle.DrainGate(app)
        config = uvicorn.Config(gate, host=server_args.host, port=server_args.port,
                                log_level=server_args.log_level, timeout_keep_alive=5,
                                timeout_graceful_shutdown=lifecycle.ABORT_SETTLE_S,
                                access_log=server_args.log_level == "debug")
        server = lifecycle.GracefulServer(config, gate, grace_s, abort_all=tm.abort_all_requests,
                                          on_drain=_begin_shutdown)
        threading.Thread(target=lifecycle.wait_and_warmup, args=(server_args, tm, _st(), on_ready),
                         name="warmup", daemon=True).start()
        server.run()
    finally:
        _st().shutting_down = True
        tm.close()
        shutdown_subprocesses(children, tm.port_args)
        if _st().failure is not None:
            raise RuntimeError(_st().failure)
