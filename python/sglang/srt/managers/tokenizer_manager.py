"""TokenizerManager: the main process's front door to the scheduler (asyncio).

It validates and tokenizes requests (bad input raises ``ValueError`` here and never reaches the
scheduler), sends them to scheduler rank 0, and turns the detokenizer's updates into SGLang's
output dicts ``{"text", "output_ids", "meta_info"}`` for ``generate_request``.

Threading: one background thread owns the receiving socket. It never touches request state
directly: it hands each update to the event loop that created the request
(``loop.call_soon_threadsafe``), so a request can be awaited from any loop (the Engine's private
loop, uvicorn's, or a user's) and all state changes happen on that loop's thread. The same
thread watches the child processes: if one dies, every pending request fails with an error and
``is_healthy()`` turns False, so nothing waits forever.

With ``--log-requests`` each request is logged when sent and when finished
(``request_logger``); with ``--enable-metrics`` the receive thread feeds the Prometheus request
metrics (``metrics.collector``), which ``GET /metrics`` serves.
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import threading
import time
from collections import deque
from typing import Any, AsyncIterator, Deque, Dict, List, Optional, Tuple

import zmq

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchStrOutput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    ProfileReq,
    ProfileReqOutput,
)
from sglang.srt.managers.request_logger import RequestLogger
from sglang.srt.managers.request_state import ReqState, build_tokenized_request
from sglang.srt.managers.template_manager import apply_chat_template_override
from sglang.srt.managers.utils import load_tokenizer
from sglang.srt.speculative.spec_info import SpecMetricsOutput

logger = logging.getLogger(__name__)

# How often a waiting request checks whether its HTTP client went away.
DISCONNECT_CHECK_S = 2.0
CONTROL_TIMEOUT_S = 60.0
PROFILE_STOP_TIMEOUT_S = 600.0


class TokenizerManager:
    """Tokenizes requests, sends them to the scheduler and streams results back."""

    def __init__(self, server_args: Any, port_args: Any):
        self.server_args = server_args
        self.port_args = port_args
        self.model_config = ModelConfig.from_path(server_args.model_path,
                                                  server_args.json_model_override_args)
        self.tokenizer = load_tokenizer(server_args)
        apply_chat_template_override(self.tokenizer, server_args.chat_template)
        self.context_len = server_args.context_length or self.model_config.context_len
        self.vocab_size = self.model_config.vocab_size
        # --log-requests / --enable-metrics (prometheus_client is imported only with the flag).
        self.request_logger = (RequestLogger(server_args.log_requests_level)
                               if server_args.log_requests else None)
        self.metrics = None
        if server_args.enable_metrics:
            from sglang.srt.metrics.collector import ServerMetrics

            self.metrics = ServerMetrics(server_args.served_model_name)

        self.rid_to_state: Dict[str, ReqState] = {}
        self._control_waiters: Dict[type, Deque[Tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {
            FlushCacheReqOutput: deque(), GetInternalStateReqOutput: deque(),
            ProfileReqOutput: deque()}
        self._lock = threading.Lock()  # guards the send socket, rid_to_state and the waiters
        self._child_processes: List[Tuple[str, Any]] = []
        self._dead_reason: Optional[str] = None
        self._closed = False
        # Set by abort_all_requests (shutdown): why new generate requests are refused.
        self._refusing: Optional[str] = None
        # Wall-clock time of the last message from the backend (health checks under load).
        self.last_receive_tstamp = 0.0

        self._context = zmq.Context(2)
        self._send_to_scheduler = self._context.socket(zmq.PUSH)
        self._send_to_scheduler.connect(port_args.scheduler_input_ipc_name)
        self._recv = self._context.socket(zmq.PULL)
        self._recv.bind(port_args.tokenizer_ipc_name)
        self._thread = threading.Thread(target=self._recv_loop, name="tokenizer-manager-recv",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ health
    def watch_processes(self, processes: List[Tuple[str, Any]]) -> None:
        """Register child processes ``(name, multiprocessing.Process)`` whose death is fatal."""
        self._child_processes = list(processes)

    def is_healthy(self) -> bool:
        """False once a child process died or the manager was closed."""
        return self._dead_reason is None and not self._closed

    def is_ready(self) -> bool:
        """Ready to serve (the launcher creates this object only after the children are up)."""
        return self.is_healthy()

    def _check_alive(self) -> None:
        if self._dead_reason is not None:
            raise RuntimeError(f"the engine is not healthy: {self._dead_reason}")
        if self._closed:
            raise RuntimeError("the engine has been shut down")

    # ------------------------------------------------------------------ sending
    def _send(self, obj: Any) -> None:
        with self._lock:
            if not self._closed:
                self._send_to_scheduler.send_pyobj(obj)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Ask the scheduler to abort a request (its waiter then gets finish_reason abort)."""
        self._send(AbortReq(rid=rid, abort_all=abort_all))

    def abort_all_requests(self, reason: str = "the server is shutting down") -> int:
        """Shutdown: refuse new generate requests from now on (``RuntimeError(reason)``) and
        abort every running or queued one in the scheduler; each then ends with finish_reason
        abort. Returns how many requests were pending here. Control requests keep working."""
        with self._lock:
            # Under the lock: a request being tokenized right now is refused when it registers,
            # so nothing slips past the abort below and runs to its end.
            self._refusing = reason
            pending = len(self.rid_to_state)
        self.abort_request("", abort_all=True)
        return pending

    # ------------------------------------------------------------------ generate
    async def generate_request(self, obj: GenerateReqInput,
                               request: Any = None) -> AsyncIterator[Any]:
        """Yield SGLang output dicts (see the class docstring of ``ReqState.to_output``).

        Single request: streaming yields one dict per update (cumulative text), non-streaming
        yields one final dict. Batch: non-streaming yields one list of dicts; streaming yields
        dicts carrying an ``index`` key. Raises ``ValueError`` for invalid input (nothing is sent
        then) and ``RuntimeError`` if the engine dies. If ``request`` (a starlette Request) is
        given, a client disconnect aborts the request.
        """
        self._check_alive()
        if self._refusing is not None:
            raise RuntimeError(self._refusing)
        obj.normalize_batch_and_arguments()
        if obj.is_single:
            tokenized = (await self._tokenize([obj]))[0]
            state = self._register(obj, tokenized)
            async for out in self._wait_one_response(state, request):
                yield out
            return
        items = [obj[i] for i in range(obj.batch_size)]
        if len({it.rid for it in items}) != len(items):
            raise ValueError("the rids of a batch must be distinct")
        tokenized = await self._tokenize(items)
        with self._lock:  # all-or-nothing: a clash must not leave earlier items registered
            clash = [it.rid for it in items if it.rid in self.rid_to_state]
        if clash:
            raise ValueError(f"duplicate request id {clash[0]!r}: a request with this rid is "
                             "still running")
        states: List[ReqState] = []
        try:
            for it, tok in zip(items, tokenized):
                states.append(self._register(it, tok))
        except (ValueError, RuntimeError):  # a rid clash or a failed hand-off: withdraw the
            self._abort_unfinished(states)   # items already sent
            raise
        if not obj.stream:
            try:
                results = await asyncio.gather(*[self._collect(s, request) for s in states])
            finally:
                self._abort_unfinished(states)
            yield list(results)
            return
        async for out in self._merge_streams(states, request):
            yield out

    async def _tokenize(self, items: List[GenerateReqInput]) -> List[Any]:
        """Validate and tokenize ``items`` in a worker thread.

        A long prompt takes the tokenizer a while; on the event loop that would freeze every
        other request's stream and ``/health`` meanwhile. The tokenizer is only read here
        (encode and decode never change its settings), so concurrent calls are safe. A caller
        cancelled meanwhile (a client that left) simply drops the result: nothing is registered
        before it returns.
        """
        def run() -> List[Any]:
            return [build_tokenized_request(it, self.tokenizer, self.vocab_size,
                                            self.context_len) for it in items]

        return await asyncio.to_thread(run)

    def _register(self, obj: GenerateReqInput, tokenized: Any) -> ReqState:
        state = ReqState(obj, tokenized, asyncio.get_running_loop(), self.tokenizer)
        with self._lock:
            if self._refusing is not None:
                raise RuntimeError(self._refusing)
            if obj.rid in self.rid_to_state:
                raise ValueError(f"duplicate request id {obj.rid!r}: a request with this rid is "
                                 "still running")
            self.rid_to_state[obj.rid] = state
        if self._dead_reason is not None:  # died between the check and the registration
            state.fail(self._dead_reason)
        if self.metrics is not None:  # before the send: the first output may arrive at once
            self.metrics.tokenizer.on_request(obj.rid, state.created_time, state.prompt_tokens,
                                              bool(obj.stream), obj.log_metrics)
        try:
            self._send(tokenized)
        except Exception as e:
            # Nothing reached the scheduler, so nothing will ever finish this rid: unregister it,
            # or it would read "still running" forever and block its reuse.
            with self._lock:
                if self.rid_to_state.get(obj.rid) is state:
                    del self.rid_to_state[obj.rid]
            if self.metrics is not None:
                self.metrics.tokenizer.forget(obj.rid)
            if isinstance(e, (RecursionError, pickle.PicklingError, TypeError)):
                raise ValueError(f"request {obj.rid!r} cannot be sent to the scheduler (it is "
                                 f"nested too deeply or holds non-serializable values): "
                                 f"{type(e).__name__}: {e}") from e
            raise RuntimeError(f"could not hand request {obj.rid!r} to the scheduler: "
                               f"{type(e).__name__}: {e}") from e
        if self.request_logger is not None:
            self.request_logger.log_received(obj, tokenized.input_ids)
        return state

    async def _wait_one_response(self, state: ReqState, request: Any) -> AsyncIterator[dict]:
        try:
            while True:
                if state.seen_updates == state.updates and not state.finished \
                        and state.error is None:
                    await self._wait_event(state, request)
                state.event.clear()
                if state.error is not None:
                    raise RuntimeError(state.error)
                if state.finished:
                    out = state.to_output()
                    if self.request_logger is not None:
                        self.request_logger.log_finished(state.obj, out)
                    if state.bad_request_message is not None:
                        raise ValueError(state.bad_request_message)
                    yield out
                    return
                if state.updates > state.seen_updates:
                    state.seen_updates = state.updates
                    if state.obj.stream:
                        yield state.to_output()  # cumulative: older unseen updates fold in
        finally:
            self._abort_unfinished([state])

    async def _wait_event(self, state: ReqState, request: Any) -> None:
        if request is None:
            await state.event.wait()
            return
        while True:
            try:
                await asyncio.wait_for(state.event.wait(), timeout=DISCONNECT_CHECK_S)
                return
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    # The finally of _wait_one_response sends the abort to the scheduler.
                    raise ValueError(f"the client disconnected; request {state.rid} aborted")

    async def _collect(self, state: ReqState, request: Any) -> dict:
        last = None
        async for out in self._wait_one_response(state, request):
            last = out
        return last

    async def _merge_streams(self, states: List[ReqState], request: Any) -> AsyncIterator[dict]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, state: ReqState) -> None:
            try:
                async for out in self._wait_one_response(state, request):
                    await queue.put((i, out, None))
            except BaseException as e:  # surfaced to the consumer below
                await queue.put((i, None, e))
            finally:
                await queue.put((i, None, StopAsyncIteration()))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(states)]
        remaining = len(states)
        try:
            while remaining:
                i, out, err = await queue.get()
                if isinstance(err, StopAsyncIteration):
                    remaining -= 1
                elif err is not None:
                    raise err
                else:
                    out["index"] = i
                    yield out
        finally:
            for t in tasks:
                t.cancel()
            self._abort_unfinished(states)

    def _abort_unfinished(self, states: List[ReqState]) -> None:
        """Forget the states; a request still running in the scheduler is aborted there."""
        with self._lock:  # all of them first: a failing abort below must not leave any behind
            for state in states:
                if self.rid_to_state.get(state.rid) is state:
                    del self.rid_to_state[state.rid]
        for state in states:
            if not state.finished and state.error is None and self._dead_reason is None:
                try:
                    self.abort_request(state.rid)
                except Exception as e:  # noqa: BLE001 - the socket is broken; nothing to abort
                    logger.error("could not abort request %s: %s", state.rid, e)

    # ------------------------------------------------------------------ control requests
    async def _control(self, req: Any, reply_type: type, timeout: float) -> Any:
        self._check_alive()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._control_waiters[reply_type].append((loop, fut))
        self._send(req)
        return await asyncio.wait_for(fut, timeout)

    async def flush_cache(self, timeout: float = CONTROL_TIMEOUT_S) -> bool:
        """Reset the scheduler's pools; False (with a log line) if requests are in flight."""
        out: FlushCacheReqOutput = await self._control(FlushCacheReqInput(),
                                                       FlushCacheReqOutput, timeout)
        if not out.success:
            logger.warning("flush_cache refused: %s", out.message)
        return out.success

    async def get_internal_state(self, timeout: float = CONTROL_TIMEOUT_S) -> List[dict]:
        """One internal-state dict per data-parallel rank (this engine has one)."""
        out: GetInternalStateReqOutput = await self._control(GetInternalStateReq(),
                                                             GetInternalStateReqOutput, timeout)
        return [out.internal_state]

    async def profile(self, req: ProfileReq) -> ProfileReqOutput:
        """Start or stop the scheduler's torch profiler (a stop writes the traces first, which
        takes a while for a long GPU profile: it gets PROFILE_STOP_TIMEOUT_S)."""
        timeout = CONTROL_TIMEOUT_S if req.start else PROFILE_STOP_TIMEOUT_S
        return await self._control(req, ProfileReqOutput, timeout)

    async def health_generate(self, timeout: float = 20.0) -> bool:
        """A one-token greedy probe (``input_ids=[0]``); True as soon as any output arrives."""
        if not self.is_healthy():
            return False
        obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1,
                                                               "temperature": 0.0},
                               log_metrics=False, stream=True)
        gen = self.generate_request(obj)
        try:
            await asyncio.wait_for(gen.__anext__(), timeout)
            return True
        except (asyncio.TimeoutError, RuntimeError, StopAsyncIteration, ValueError):
            return False
        finally:
            await gen.aclose()

    # ------------------------------------------------------------------ receiving thread
    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._recv, zmq.POLLIN)
        next_check = 0.0
        while not self._closed:
            try:
                ready = poller.poll(100)
            except zmq.ZMQError:
                break  # socket closed during shutdown
            if ready:
                while True:
                    try:
                        obj = self._recv.recv_pyobj(zmq.NOBLOCK)
                    except (zmq.Again, zmq.ZMQError):
                        break
                    self.last_receive_tstamp = time.time()
                    self._dispatch(obj)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.5
                self._check_children()

    def _dispatch(self, obj: Any) -> None:
        if isinstance(obj, BatchStrOutput):
            with self._lock:
                states = [self.rid_to_state.get(rid) for rid in obj.rids]
            for i, state in enumerate(states):
                if state is not None:
                    state.post(obj, i)
            if self.metrics is not None:  # by rid: a request whose client left still finishes
                now = time.perf_counter()
                for i, rid in enumerate(obj.rids):
                    self.metrics.tokenizer.on_output(rid, obj.completion_tokens[i],
                                                     obj.cached_tokens[i],
                                                     obj.finished_reasons[i], now)
        elif isinstance(obj, SpecMetricsOutput):
            # Sent just before the token message that finishes these requests.
            with self._lock:
                states = [self.rid_to_state.get(rid) for rid in obj.rids]
            for i, state in enumerate(states):
                if state is not None:
                    state.post_spec_metrics(obj, i)
        elif type(obj) in self._control_waiters:
            with self._lock:
                waiters = self._control_waiters[type(obj)]
                waiter = waiters.popleft() if waiters else None
            if waiter is not None:
                _resolve(waiter, result=obj)
        else:
            logger.error("tokenizer manager got an unknown message %s", type(obj).__name__)

    def _check_children(self) -> None:
        if self._dead_reason is not None:
            return
        for name, proc in self._child_processes:
            if not proc.is_alive():
                self._mark_dead(f"the {name} process (pid {proc.pid}) exited with code "
                                f"{proc.exitcode}")
                return

    def _mark_dead(self, reason: str) -> None:
        logger.error("%s; failing all pending requests", reason)
        self._dead_reason = reason
        with self._lock:
            states = list(self.rid_to_state.values())
            waiters = [w for q in self._control_waiters.values() for w in q]
            for q in self._control_waiters.values():
                q.clear()
        for state in states:
            state.fail(reason)
        for waiter in waiters:
            _resolve(waiter, error=RuntimeError(f"the engine is not healthy: {reason}"))

    def close(self) -> None:
        """Stop the receive thread and close the sockets (pending requests fail)."""
        if self._closed:
            return
        self._closed = True
        self._thread.join(timeout=2)
        with self._lock:
            states = list(self.rid_to_state.values())
        for state in states:
            state.fail("the engine has been shut down")
        self._send_to_scheduler.close(linger=0)
        self._recv.close(linger=0)
        self._context.term()


def _resolve(waiter: Tuple[asyncio.AbstractEventLoop, asyncio.Future], result: Any = None,
             error: Optional[BaseException] = None) -> None:
    """Complete a future that belongs to another thread's loop."""
    loop, fut = waiter

    def done() -> None:
        if not fut.done():
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:  # that loop is closed: nobody is waiting any more
        pass
