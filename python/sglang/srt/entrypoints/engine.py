"""The offline engine (``sglang.Engine``): the server's processes without HTTP.

``_launch_subprocesses`` starts one scheduler process per TP rank and the detokenizer process
(multiprocessing *spawn*: CUDA and fork do not mix), waits until every scheduler reports ready
through its pipe (a startup failure is re-raised here with the child's traceback), then creates
the :class:`TokenizerManager` in this process. The HTTP server reuses the same function.

Spawn starts each child by re-importing the parent's main module (as ``__mp_main__``), so a
plain script that builds the Engine at its top level, without ``if __name__ == "__main__":``,
would build it again in every child. The child notices (:func:`refuse_main_reimport`) and exits
with :data:`MAIN_REIMPORT_EXIT_CODE` at once, and the parent raises one ``RuntimeError`` saying
to add the guard, instead of multiprocessing's bootstrap traceback from every child.

The children ignore SIGINT and SIGTERM: a Ctrl-C in a terminal (or a service manager's SIGTERM)
reaches the whole process group, and the children must keep serving while the parent drains its
in-flight requests; the parent then stops them (:func:`shutdown_subprocesses`), and they die
with it if it is killed outright (parent-death signal).

Example (the guard is required, see below)::

    import sglang

    if __name__ == "__main__":
        with sglang.Engine(model_path="path/to/ckpt") as engine:
            out = engine.generate("Hello", {"max_new_tokens": 8, "temperature": 0})
            print(out["text"], out["meta_info"]["finish_reason"])
"""
from __future__ import annotations

import asyncio
import atexit
import dataclasses
import importlib
import logging
import multiprocessing as mp
import os
import signal
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Tuple, Union

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)

ChildProcesses = List[Tuple[str, Any]]  # (name, multiprocessing.Process)
CHILD_JOIN_TIMEOUT_S = 5.0  # how long shutdown waits for each killed child to be reaped
# The children's entry points (imported in the child only, see _child_main).
SCHEDULER_ENTRY = "sglang.srt.managers.scheduler:run_scheduler_process"
DETOKENIZER_ENTRY = "sglang.srt.managers.detokenizer_manager:run_detokenizer_process"
# Exit status of a child that found itself starting an engine while re-importing the main
# module; the parent maps it to MAIN_GUARD_MESSAGE. Any value the children never use otherwise.
MAIN_REIMPORT_EXIT_CODE = 87
MAIN_GUARD_MESSAGE = (
    "put the code that creates and uses sglang.Engine in an `if __name__ == \"__main__\":` "
    "block: the Engine's worker processes start by re-importing the script (multiprocessing "
    "'spawn'), and this script creates an Engine at its top level, so each of them would "
    "start one again")


def refuse_main_reimport() -> None:
    """Exit quietly with :data:`MAIN_REIMPORT_EXIT_CODE` in a spawned child importing ``__main__``.

    ``multiprocessing`` flags the current process ``_inheriting`` exactly while a spawned child
    prepares itself, which is when it re-imports the parent's main module; an unguarded script
    then reaches ``Engine(...)`` again. Exiting here (``SystemExit`` leaves the child without a
    traceback) lets the parent report the one line that says what to change.
    """
    if getattr(mp.current_process(), "_inheriting", False):
        raise SystemExit(MAIN_REIMPORT_EXIT_CODE)


def _launch_subprocesses(
    server_args: ServerArgs,
) -> Tuple[TokenizerManager, Dict[str, Any], ChildProcesses]:
    """Start schedulers + detokenizer and build the TokenizerManager.

    Returns ``(tokenizer_manager, scheduler_info, children)``; ``scheduler_info`` is what rank 0
    reported when ready (pool sizes, context length). ``children`` go to
    :func:`shutdown_subprocesses` when the caller is done. Raises ``RuntimeError`` naming the
    failing process if any child fails to start (all children are stopped first).
    """
    refuse_main_reimport()  # before any port, file or process is made
    port_args = PortArgs.init_new(server_args)
    ctx = mp.get_context("spawn")
    children: ChildProcesses = []
    readers = []
    tokenizer_manager: Optional[TokenizerManager] = None
    try:
        for rank in range(server_args.tp_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child_main, name=f"sglang-scheduler-tp{rank}",
                               args=(SCHEDULER_ENTRY, server_args, port_args, rank, writer),
                               daemon=True)
            proc.start()
            writer.close()  # only the child writes; EOF then means the child is gone
            children.append((f"scheduler TP{rank}", proc))
            readers.append(reader)
        detok = ctx.Process(target=_child_main, name="sglang-detokenizer",
                            args=(DETOKENIZER_ENTRY, server_args, port_args), daemon=True)
        detok.start()
        children.append(("detokenizer", detok))
        # Built while the children load (the tokenizer takes seconds to load): its sockets
        # wait for their peers, and a tokenizer that cannot load fails the start at once.
        tokenizer_manager = TokenizerManager(server_args, port_args)
        infos = [_wait_ready(name, proc, reader)
                 for (name, proc), reader in zip(children, readers)]
    except BaseException:
        if tokenizer_manager is not None:
            tokenizer_manager.close()
        shutdown_subprocesses(children, port_args)
        raise
    tokenizer_manager.watch_processes(children)
    scheduler_info = dict(infos[0])
    scheduler_info.pop("status", None)
    return tokenizer_manager, scheduler_info, children


def _child_main(entry: str, *args: Any) -> None:
    """Entry point of every child process: ignore SIGINT / SIGTERM, then import ``entry``
    (``"module:function"``) and run it on ``args``.

    Those signals are meant for the parent, which drains in-flight requests first and needs the
    children alive meanwhile; a signal sent to the process group must not cut them short. The
    entry is named rather than imported here, so that neither the parent nor the detokenizer
    imports the scheduler's modules (torch, the model): seconds of every start-up.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    module, _, name = entry.partition(":")
    getattr(importlib.import_module(module), name)(*args)


def _exited_error(name: str, proc: Any) -> RuntimeError:
    """The error for a child that exited before reporting ready."""
    if proc.exitcode == MAIN_REIMPORT_EXIT_CODE:
        return RuntimeError(MAIN_GUARD_MESSAGE)
    return RuntimeError(f"{name} exited during startup (exit code {proc.exitcode})")


def _wait_ready(name: str, proc: Any, reader: Any) -> Dict[str, Any]:
    """Block until a scheduler reports; raise with its error if it failed or died."""
    while True:
        if reader.poll(0.5):
            try:
                msg = reader.recv()
            except EOFError:
                proc.join(timeout=5)
                # Not chained: the pipe's EOF says nothing the exit code does not.
                raise _exited_error(name, proc) from None
            if msg.get("status") == "ready":
                return msg
            raise RuntimeError(f"{name} failed to start: {msg.get('error')}\n"
                               f"--- child traceback ---\n{msg.get('traceback', '')}")
        if not proc.is_alive():
            raise _exited_error(name, proc)


def shutdown_subprocesses(children: ChildProcesses, port_args: Optional[PortArgs] = None) -> None:
    """Stop the children and remove the IPC files.

    SIGKILL, because the children ignore SIGTERM (see the module docstring) and hold nothing that
    needs flushing: requests are drained (or aborted) by the caller before this, the IPC files
    are removed here, and the OS frees their memory (device memory included).
    """
    for _, proc in children:
        if proc.is_alive():
            proc.kill()
    for name, proc in children:
        proc.join(timeout=CHILD_JOIN_TIMEOUT_S)
        if proc.is_alive():  # e.g. stuck in uninterruptible device I/O: do not hang on it
            logger.error("the %s process (pid %s) did not exit after SIGKILL", name, proc.pid)
    if port_args is not None:
        for path in port_args.ipc_paths():
            try:
                os.unlink(path)
            except OSError:
                pass


def reported_server_args(server_args: ServerArgs) -> Dict[str, Any]:
    """The server args as ``/get_server_info`` and :meth:`Engine.get_server_info` report them.

    ``model_path`` (and ``tokenizer_path`` when unset) are the resolved paths: ``None`` stands
    for the bundled model, and a client asking what is served needs its folder, not ``null``.
    The API key is masked: the reply must never echo the secret.
    """
    args = dataclasses.asdict(server_args)
    args["model_path"] = server_args.resolved_model_path()
    args["tokenizer_path"] = server_args.resolved_tokenizer_path()
    if args.get("api_key"):
        args["api_key"] = "***"
    return args


class Engine:
    """Offline inference API: ``generate`` / ``async_generate`` without an HTTP server.

    ``Engine(model_path=None, **kwargs)``: keyword arguments are :class:`ServerArgs` fields
    (``tp_size``, ``chunked_prefill_size``, ``max_total_tokens``, ...); ``model_path=None`` is
    the bundled model. Use as a context manager or call :meth:`shutdown`; child processes are
    also stopped at interpreter exit.
    """

    def __init__(self, model_path: Optional[str] = None, **kwargs: Any):
        refuse_main_reimport()  # an unguarded script's re-import in a child: see the module doc
        server_args = kwargs.pop("server_args", None)
        if server_args is None:
            server_args = ServerArgs(model_path=model_path, **kwargs)
        elif kwargs or model_path is not None:
            raise ValueError("pass either server_args or model_path/keyword arguments, not both")
        # A missing folder or a repo id is a ConfigError here, in this process, rather than a
        # scheduler's startup failure wrapped in its traceback.
        ModelConfig.from_path(server_args.model_path, server_args.json_model_override_args)
        self.server_args = server_args
        self._children: ChildProcesses = []
        self._shut = False
        self.loop = asyncio.new_event_loop()
        try:
            self.tokenizer_manager, self.scheduler_info, self._children = \
                _launch_subprocesses(server_args)
        except BaseException:
            self.loop.close()
            raise
        self._port_args = self.tokenizer_manager.port_args
        atexit.register(self.shutdown)

    # ------------------------------------------------------------------ generation
    def _make_request(self, prompt, sampling_params, input_ids, return_logprob,
                      logprob_start_len, top_logprobs_num, stream, rid,
                      return_text_in_logprobs, return_hidden_states) -> GenerateReqInput:
        return GenerateReqInput(
            text=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, stream=stream,
            return_text_in_logprobs=return_text_in_logprobs,
            return_hidden_states=return_hidden_states,
        )

    def generate(
        self,
        prompt: Optional[Union[str, List[str]]] = None,
        sampling_params: Optional[Union[Dict[str, Any], List[Dict[str, Any]]]] = None,
        input_ids: Optional[Union[List[int], List[List[int]]]] = None,
        return_logprob: Union[bool, List[bool]] = False,
        logprob_start_len: Optional[Union[int, List[int]]] = None,
        top_logprobs_num: Optional[Union[int, List[int]]] = None,
        stream: bool = False,
        rid: Optional[Union[str, List[str]]] = None,
        return_text_in_logprobs: bool = False,
        return_hidden_states: Union[bool, List[bool]] = False,
    ) -> Union[Dict[str, Any], List[Dict[str, Any]], Iterator[Dict[str, Any]]]:
        """Generate for one prompt (a dict) or a batch (a list of dicts).

        ``stream=True`` returns an iterator of dicts with cumulative ``text`` (batch: each dict
        has an ``index``). ``return_hidden_states`` (per prompt as a list) adds
        ``meta_info["hidden_states"]``: the prompt's final-normed hidden states (one float list
        per prompt token) as the first entry, then one row per decode step (``prompt_len +
        output_len - 1`` rows in all; cumulative when streaming, as upstream). Raises
        ``ValueError`` for invalid requests.
        """
        self._check_open()
        obj = self._make_request(prompt, sampling_params, input_ids, return_logprob,
                                 logprob_start_len, top_logprobs_num, stream, rid,
                                 return_text_in_logprobs, return_hidden_states)
        agen = self.tokenizer_manager.generate_request(obj)
        if stream:
            return self._iterate(agen)
        try:
            return self.loop.run_until_complete(agen.__anext__())
        finally:
            self.loop.run_until_complete(agen.aclose())

    def _iterate(self, agen: AsyncIterator[Dict[str, Any]]) -> Iterator[Dict[str, Any]]:
        try:
            while True:
                try:
                    yield self.loop.run_until_complete(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self.loop.is_closed():
                self.loop.run_until_complete(agen.aclose())

    async def async_generate(
        self,
        prompt: Optional[Union[str, List[str]]] = None,
        sampling_params: Optional[Union[Dict[str, Any], List[Dict[str, Any]]]] = None,
        input_ids: Optional[Union[List[int], List[List[int]]]] = None,
        return_logprob: Union[bool, List[bool]] = False,
        logprob_start_len: Optional[Union[int, List[int]]] = None,
        top_logprobs_num: Optional[Union[int, List[int]]] = None,
        stream: bool = False,
        rid: Optional[Union[str, List[str]]] = None,
        return_text_in_logprobs: bool = False,
        return_hidden_states: Union[bool, List[bool]] = False,
    ) -> Union[Dict[str, Any], List[Dict[str, Any]], AsyncIterator[Dict[str, Any]]]:
        """Async :meth:`generate` for the caller's event loop (stream: an async iterator)."""
        self._check_open()
        obj = self._make_request(prompt, sampling_params, input_ids, return_logprob,
                                 logprob_start_len, top_logprobs_num, stream, rid,
                                 return_text_in_logprobs, return_hidden_states)
        agen = self.tokenizer_manager.generate_request(obj)
        if stream:
            return agen
        try:
            return await agen.__anext__()
        finally:
            await agen.aclose()

    def abort_request(self, rid: str) -> None:
        """Abort a running request; its generate call returns with finish_reason abort."""
        self.tokenizer_manager.abort_request(rid)

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        """Reset the KV pools (only when idle); returns whether it happened."""
        self._check_open()
        return self.loop.run_until_complete(self.tokenizer_manager.flush_cache())

    def get_server_info(self) -> Dict[str, Any]:
        """Server args, scheduler info and ``internal_states`` (one dict per DP rank)."""
        self._check_open()
        from sglang import __version__

        states = self.loop.run_until_complete(self.tokenizer_manager.get_internal_state())
        return {**reported_server_args(self.server_args), **self.scheduler_info,
                "internal_states": states, "version": __version__}

    def is_healthy(self) -> bool:
        """Open and every child process alive."""
        return not self._shut and self.tokenizer_manager.is_healthy()

    def _check_open(self) -> None:
        if self._shut:
            raise RuntimeError("the engine has been shut down")

    # ------------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        """Stop the child processes and release sockets (idempotent)."""
        if self._shut:
            return
        self._shut = True
        atexit.unregister(self.shutdown)
        self.tokenizer_manager.close()
        shutdown_subprocesses(self._children, self._port_args)
        if not self.loop.is_closed():
            self.loop.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
