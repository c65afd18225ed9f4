"""Checks on raw HTTP request bodies, shared by the native and the OpenAI-compatible API.

Every body is bounded and parsed here before any handler looks at it, so malformed input is a
4xx in the server's one error shape (``{"error": {"message", "type", "code"}}``) and never a 500:

* the size: ``SGLANG_MAX_REQUEST_BODY_BYTES`` (413), checked on ``Content-Length`` before a
  byte is read, and counted while a chunked body arrives;
* the JSON itself: malformed text, ``NaN`` / ``Infinity`` (not JSON, and they would come back
  out as invalid JSON), nesting deep enough to overflow the parser's stack (``RecursionError``);
* the parsed tree: nesting deeper than :data:`MAX_JSON_DEPTH` (later copies, pickling for the
  scheduler and template rendering recurse too), and strings holding a lone UTF-16 surrogate
  (``"\\ud800"`` is valid JSON but not Unicode: tokenizers and the UTF-8 response encoder fail on
  it). The error names the offending field.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglang.srt.entrypoints.openai.serving_base import create_error_response
from sglang.srt.environ import envs

# Deepest JSON nesting a request may use. Real requests stay under ~10 levels (chat content
# parts, tool schemas); the bound keeps every recursive step after parsing far from the stack
# limit.
MAX_JSON_DEPTH = 64


class BodyTooLargeError(Exception):
    """A request body grew past the limit while being read (chunked transfer)."""


def max_body_bytes() -> int:
    """The body-size limit in bytes (``SGLANG_MAX_REQUEST_BODY_BYTES``)."""
    return int(envs.SGLANG_MAX_REQUEST_BODY_BYTES.get())


def _too_large(limit: int) -> Any:
    return create_error_response(
        f"the request body is larger than the server's limit of {limit} bytes "
        "(SGLANG_MAX_REQUEST_BODY_BYTES)", "PayloadTooLargeError", 413)


class BodySizeLimitMiddleware:
    """Answers 413 to a body over :func:`max_body_bytes` (plain ASGI, see ``_ApiKeyMiddleware``).

    A declared ``Content-Length`` over the limit is refused before the body is read. A body
    without one (chunked) is counted as the app reads it; crossing the limit stops the read
    and, as nothing has been sent yet, the 413 goes out instead of the handler's answer.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = max_body_bytes()
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await create_error_response("the Content-Length header is not an integer")(
                    scope, receive, send)
                return
            if size > limit:
                await _too_large(limit)(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the HTTP layer enforces the declared length
            return

        received = 0
        started = False

        async def counting_receive() -> Dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLargeError()
            return message

        async def tracking_send(message: Dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLargeError:
            if not started:
                await _too_large(limit)(scope, receive, send)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def parse_json_body(raw: bytes) -> Any:
    """The parsed body; ``ValueError`` naming the problem for anything malformed (see above)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON body: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"malformed JSON body: not UTF-8 ({e})") from None
    except RecursionError:
        raise ValueError(f"the JSON body is nested too deeply (at most {MAX_JSON_DEPTH} "
                         "levels)") from None
    except ValueError as e:
        raise ValueError(f"malformed JSON body: {e}") from None
    check_json_tree(body)
    return body


def _where(path: Tuple[Any, ...]) -> str:
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or "the body"


def _check_str(s: str, path: Tuple[Any, ...]) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{_where(path)}: lone UTF-16 surrogate \\u{ord(s[e.start]):04x} at "
                         f"character {e.start}; strings must be valid Unicode") from None


def check_json_tree(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """``ValueError`` if the parsed JSON nests deeper than ``max_depth`` or holds a string (key
    or value) that is not valid Unicode. Iterative, so it cannot overflow the stack itself."""
    stack: List[Tuple[Any, int, Tuple[Any, ...]]] = [(value, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            _check_str(node, path)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > max_depth:
            raise ValueError(f"the JSON body is nested deeper than {max_depth} levels "
                             f"(at {_where(path)})")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(key, str):
                _check_str(key, path + (key,))
            if isinstance(child, str):
                _check_str(child, path + (key,))
            elif isinstance(child, (dict, list)):
                stack.append((child, depth + 1, path + (key,)))


async def read_json_body(request: Request) -> Any:
    """The parsed, checked body of ``request``, or a 400 response naming the problem."""
    try:
        return parse_json_body(await request.body())
    except ValueError as e:
        return create_error_response(str(e))


def describe_validation_errors(errors: Any) -> str:
    """One line naming every field pydantic rejected (``loc: msg; ...``)."""
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


async def validate_body(request: Request, model: Any) -> Any:
    """The body checked here and validated into the pydantic ``model``, or a 400 response.

    The OpenAI endpoints parse their bodies through this rather than FastAPI's body binding, so
    the size, depth and Unicode checks apply to them too.
    """
    body = await read_json_body(request)
    if isinstance(body, JSONResponse):
        return body
    try:
        return model.model_validate(body)
    except ValidationError as e:
        return create_error_response(describe_validation_errors(e.errors()))
    except RecursionError:
        return create_error_response("the request is nested too deeply to be processed")


def install_error_handlers(app: FastAPI) -> None:
    """Make FastAPI's own errors use the one error shape, and deep recursion a 400."""

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return create_error_response(describe_validation_errors(exc.errors()))

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown path (404), wrong method (405), ...: FastAPI would answer {"detail": ...}.
        kind = "NotFoundError" if exc.status_code == 404 else (
            "BadRequestError" if exc.status_code < 500 else "InternalServerError")
        resp = create_error_response(str(exc.detail), kind, exc.status_code)
        resp.headers.update(exc.headers or {})
        return resp

    async def recursion_error(request: Request, exc: RecursionError) -> JSONResponse:
        # Last line of defence: input that still recursed too deeply is bad input, not a 500.
        return create_error_response("the request is nested too deeply to be processed")

    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RecursionError, recursion_error)
