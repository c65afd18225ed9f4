"""Start and end of the HTTP server process: the port check and the graceful shutdown.

* :func:`check_port_free` runs before any child process starts (and before torch is imported),
  so a port that is taken is one clear error at once instead of a failure after the model load.
* :class:`DrainGate` wraps the ASGI app: it counts the HTTP requests in flight and, once the
  server drains, answers every new request 503 in the one error shape.
* :class:`GracefulServer` is ``uvicorn.Server`` with a drain on SIGTERM / SIGINT: in-flight
  requests get up to ``SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT`` seconds to finish, what is left is then
  aborted through the TokenizerManager, and uvicorn's own shutdown gives the aborted responses
  :data:`ABORT_SETTLE_S` to go out before it cancels whatever is still stuck (a streaming client
  that stopped reading blocks its response's writes forever). So the process exits within about
  grace + settle seconds, whatever the clients do.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import math
import os
import signal
import socket
import time
from types import FrameType
from typing import Any, Callable, Dict, List, Optional, Tuple

import requests
import uvicorn

from sglang.srt.entrypoints.openai.serving_base import create_error_response
from sglang.srt.environ import envs

logger = logging.getLogger(__name__)

DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S: float = envs.SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT.default
# After the abort: how long the aborted responses (their final chunk) get to reach the clients
# before uvicorn cancels the connections still open (its timeout_graceful_shutdown).
ABORT_SETTLE_S = 2.0
_DRAIN_POLL_S = 0.05


class PortInUseError(RuntimeError):
    """The server's ``host:port`` is already taken (raised before any child process starts)."""


def graceful_shutdown_timeout() -> float:
    """``SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT`` in seconds; ``ValueError`` naming it if not >= 0."""
    value = envs.SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT.get()
    if not math.isfinite(value) or value < 0:
        raise ValueError("SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT must be a finite number of seconds "
                         f">= 0, got {value!r}")
    return float(value)


def _display(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind_addresses(host: str, port: int) -> List[Tuple[int, Any]]:
    """(family, sockaddr) of every address uvicorn will listen on for ``host`` (as asyncio's
    ``create_server`` resolves it: ``localhost`` may mean both 127.0.0.1 and ::1)."""
    infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0,
                               socket.AI_PASSIVE)
    seen: List[Tuple[int, Any]] = []
    for family, _, _, _, addr in infos:
        if (family, addr) not in seen:
            seen.append((family, addr))
    return seen


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`PortInUseError` (or ``RuntimeError`` for an address that cannot be used at
    all) naming ``host:port`` unless the server could listen there now.

    A bind test with the options asyncio uses when uvicorn binds later (``SO_REUSEADDR``, v6-only
    IPv6 sockets), so connections of a previous server left in TIME_WAIT do not count as "in
    use" and a listening socket does. The socket is closed again at once: holding it through the
    model load would make early clients hang on a port that accepts but never answers.
    """
    where = _display(host, port)
    try:
        addresses = _bind_addresses(host, port)
    except OSError as e:  # socket.gaierror: the host does not resolve
        raise RuntimeError(f"cannot listen on {where}: {e.strerror or e}") from None
    usable, last_error = 0, "no address"
    for family, addr in addresses:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
                usable += 1
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise PortInUseError(
                        f"{where} is already in use (is another server running there?); "
                        "pass a free port with --port") from None
                if e.errno != errno.EADDRNOTAVAIL:  # asyncio skips those (family not enabled)
                    raise RuntimeError(f"cannot listen on {where}: {e.strerror or e}") from None
                last_error = e.strerror or str(e)
    if not usable:
        raise RuntimeError(f"cannot listen on {where}: {last_error}")


class DrainGate:
    """ASGI wrapper around the app: counts HTTP requests in flight; refuses new ones when draining.

    A refused request gets ``503 {"error": {...}}`` with ``Connection: close``, so a client's
    keep-alive connection does not keep coming back. Lifespan events pass through unchanged.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.in_flight = 0
        self.draining = False

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            resp = create_error_response("the server is shutting down",
                                         "ServiceUnavailableError", 503)
            resp.headers["Connection"] = "close"
            await resp(scope, receive, send)
            return
        self.in_flight += 1  # one event loop: no lock needed
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` that drains in-flight requests on SIGTERM / SIGINT before it exits.

    On the first signal ``on_drain`` runs (the health checks turn 503), the gate refuses new
    requests, and the server waits until none is in flight or ``grace_s`` have passed. Then
    ``abort_all`` aborts what is left and uvicorn's shutdown follows, bounded by the config's
    ``timeout_graceful_shutdown`` (set it to :data:`ABORT_SETTLE_S`). A second signal ends the
    grace period at once; a SIGINT after that also skips the settling (uvicorn's force exit).
    Unlike plain uvicorn, the signal is not re-raised afterwards: ``run`` simply returns.
    """

    def __init__(self, config: uvicorn.Config, gate: DrainGate, grace_s: float,
                 abort_all: Callable[[], Any], on_drain: Optional[Callable[[], None]] = None):
        super().__init__(config)
        self.gate = gate
        self.grace_s = grace_s
        self._abort_all = abort_all
        self._on_drain = on_drain
        self._signals = 0
        self._drain_task: Optional[asyncio.Task] = None

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        """Signal handler (installed by uvicorn while serving): only counts; the drain itself
        runs on the event loop, started by :meth:`on_tick`."""
        self._signals += 1
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's 10 Hz tick: start the drain once a signal came; True ends the main loop."""
        if self._signals and self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        self.gate.draining = True
        if self._on_drain is not None:
            self._on_drain()
        deadline = time.monotonic() + self.grace_s
        if self.gate.in_flight:
            logger.info("Shutting down: waiting up to %.1f s for %d request(s) in flight",
                        self.grace_s, self.gate.in_flight)
        while self.gate.in_flight and time.monotonic() < deadline and self._signals < 2:
            await asyncio.sleep(_DRAIN_POLL_S)
        if self.gate.in_flight:
            logger.warning("Shutting down: aborting %d request(s) still in flight",
                           self.gate.in_flight)
            try:
                self._abort_all()
            except Exception as e:  # noqa: BLE001 - the backend is gone; uvicorn cancels below
                logger.error("could not abort the requests in flight: %s", e)
        self.should_exit = True


# ----------------------------------------------------------------------------- warm-up
WARMUP_MAX_NEW_TOKENS = 8  # as upstream's warmup for generation models


def warmup_payload(tm: Any) -> Dict[str, Any]:
    """The warm-up ``/generate`` body: a short greedy prompt (token ids without a tokenizer)."""
    sampling = {"temperature": 0.0, "max_new_tokens": WARMUP_MAX_NEW_TOKENS}
    if getattr(tm, "tokenizer", None) is None:
        vocab = tm.model_config.vocab_size
        return {"input_ids": [t % vocab for t in (1, 2, 3, 4)], "sampling_params": sampling}
    return {"text": "The capital city of France is", "sampling_params": sampling}


def fail_server(state: Any, reason: str) -> None:
    """Stop serving because the server is unusable: ``state.failure`` (which
    ``launch_server`` raises after the shutdown) and SIGTERM to this process, the graceful
    path (nothing is in flight)."""
    logger.error("%s; shutting down", reason)
    state.failure = reason
    os.kill(os.getpid(), signal.SIGTERM)


def wait_and_warmup(server_args: Any, tm: Any, state: Any,
                    on_ready: Optional[Callable[[], None]] = None) -> None:
    """Wait for the HTTP port, send the warm-up request, set ``state.warmed_up`` (the health
    checks answer 200 from then on) and log the URL; :func:`fail_server` on failure. ``state``
    has ``shutting_down`` (set by a signal: stop quietly), ``warmed_up`` and ``failure``."""
    url = server_args.url()
    headers = {"Authorization": f"Bearer {server_args.api_key}"} if server_args.api_key else {}
    deadline = time.time() + 600
    while True:
        try:
            if requests.get(f"{url}/model_info", headers=headers, timeout=5).status_code == 200:
                break
        except requests.RequestException:
            pass
        if state.shutting_down:
            return
        if time.time() > deadline:
            fail_server(state, f"the HTTP server did not come up at {url}")
            return
        time.sleep(0.2)
    if not server_args.skip_server_warmup:
        try:
            r = requests.post(f"{url}/generate", json=warmup_payload(tm), headers=headers,
                              timeout=600)
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
        except Exception as e:  # noqa: BLE001 - any failure means the server is unusable
            if not state.shutting_down:  # else a signal cut the warmup short: not a failure
                fail_server(state, f"the warmup request failed: {e}")
            return
    if state.shutting_down:
        return
    state.warmed_up = True
    logger.info("The server is fired up and ready to roll! Serving at %s", url)
    if on_ready is not None:
        on_ready()
