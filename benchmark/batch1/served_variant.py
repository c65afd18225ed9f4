"""Serve with a diagnostic variant of the prefill-graph capture (a benchmark tool, not a product
switch): which part of ``--prefill-cuda-graph-tokens`` leaves a server decoding slower
(docs/performance.md, "Prefill graphs and the decode step").

    PREFILL_CAPTURE_VARIANT=MODE python benchmark/batch1/served_variant.py [server args]

takes the server arguments of ``python -m sglang.launch_server`` and patches
:class:`~sglang.srt.model_executor.prefill_graph_runner.PrefillGraphRunner` first, in this
process and in every child it starts: the children are spawned, and a spawned child runs this
file's top level again (as ``__mp_main__``) before it unpickles its work. In
``scripts/gpu_prefill.sh``, ``SERVE_MAIN=benchmark/batch1/served_variant.py`` together with
``PREFILL_CAPTURE_VARIANT=MODE`` on a ``STAGE=served`` stage starts every server of the stage
this way, or one server where they lead its entry of ``SERVED_VARIANTS``. The modes
(:data:`VARIANTS`):

* ``side_stream``: graphs captured as usual, each replay on a stream of its own (the stream
  waits for the current one before, the current one for it after);
* ``no_replay``: graphs captured at start-up, never replayed (every prefill eager);
* ``release``: as ``no_replay``, and the graphs dropped right after the start-up captures
  (graphs released, ``gc``, the allocator's cache emptied);
* ``warmup``: no capture; each bucket's two padded eager warm-ups, a sync and
  ``torch.cuda.empty_cache``, as a capture runs them before capturing;
* ``warmup_keep``: as ``warmup`` without emptying the cache;
* ``unpadded``: as ``warmup`` with the warm-ups unpadded (``padding=None``: the KDA layers'
  ordinary prefill path instead of the padded one);
* ``empty``: no capture, no warm-up; only ``torch.cuda.empty_cache``;
* ``tiny_capture``: no warm-up of the model; a graph of one small torch op (``ids + 1`` over
  the bucket's static ids) captured in the prefill graphs' pool and held (kept in
  ``PrefillGraphRunner.tiny_graphs``): whether any capture at that point is enough;
* ``shared_pool``: graphs captured and replayed as usual, in the decode graphs' memory pool
  (that of the first :class:`~sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner`
  built in the process, the target's round graphs) instead of a pool of their own;
* ``tiny_shared_pool``: as ``tiny_capture``, in the decode graphs' pool;
* ``recapture_decode``: graphs captured and replayed as usual, then every decode graph
  captured again (a fresh pool, the same keys, the same order), so that the decode graphs are
  the process's last ones again.

``side_stream``, ``shared_pool`` and ``recapture_decode`` replay prefill graphs; every other
mode keeps prefills eager (no lazy capture at a request). The shared-pool modes fall back to
the prefill graphs' own pool, saying so, when no decode graphs were captured
(``--disable-cuda-graph``).
``test/srt/test_served_variant.py`` runs each mode on CPU (emulated graphs).
"""
from __future__ import annotations

import gc
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

VARIANTS: Dict[str, str] = {
    "side_stream": "each replay on a stream of its own",
    "no_replay": "captured at start-up, never replayed",
    "release": "captured at start-up, then dropped; never replayed",
    "warmup": "the two padded eager warm-ups and empty_cache, no capture",
    "warmup_keep": "the two padded eager warm-ups, no empty_cache, no capture",
    "unpadded": "two unpadded eager warm-ups and empty_cache, no capture",
    "empty": "empty_cache only",
    "tiny_capture": "a one-op graph captured in the prefill pool and held, no model forward",
    "shared_pool": "captured and replayed in the decode graphs' pool",
    "tiny_shared_pool": "a one-op graph captured in the decode graphs' pool and held",
    "recapture_decode": "captured and replayed, then the decode graphs captured again",
}
# Modes by what they do: capture the real prefill graphs, replay them, capture the one-op graph
# instead, take the decode graphs' pool, need the decode graph runners.
CAPTURING = ("side_stream", "no_replay", "release", "shared_pool", "recapture_decode")
REPLAYING = ("side_stream", "shared_pool", "recapture_decode")
TINY = ("tiny_capture", "tiny_shared_pool")
SHARED_POOL = ("shared_pool", "tiny_shared_pool")
USES_DECODE_RUNNERS = SHARED_POOL + ("recapture_decode",)
# Every CudaGraphRunner built in this process, in order (apply() records them for the modes
# that use the decode graphs).
DECODE_RUNNERS: List[Any] = []
ENV = "PREFILL_CAPTURE_VARIANT"


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _side_stream_replay(replay: Callable[[], Any], device: Any) -> Callable[[], Any]:
    """``replay`` run on a stream of its own, ordered after and before the current stream."""
    import torch

    if torch.device(device).type != "cuda":
        return replay
    side = torch.cuda.Stream(device)

    def run() -> Any:
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = replay()
        current.wait_stream(side)
        return out
    return run


def _decode_pool(own: Any) -> Any:
    """The first recorded decode graphs' pool, else ``own`` (with a line saying so)."""
    if DECODE_RUNNERS:
        return DECODE_RUNNERS[0]._pool
    print("served_variant: no decode graphs were captured; the prefill graphs keep their own "
          "pool", file=sys.stderr, flush=True)
    return own


def _recapture(runner: Any) -> None:
    """Capture every graph of the decode graph runner ``runner`` again, in a fresh pool (the
    old one is freed with its last graph), in the order they were captured."""
    import torch

    keys = list(runner.graphs)
    runner.graphs.clear()
    if not runner.emulate:
        torch.cuda.synchronize(runner.device)
        runner._pool = torch.cuda.graph_pool_handle()
    for key in keys:
        runner._capture(key)


def _record_decode_runners() -> Callable[[], None]:
    """Patch ``CudaGraphRunner.__init__`` to append each runner to :data:`DECODE_RUNNERS`;
    returns the undo."""
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

    original = CudaGraphRunner.__dict__["__init__"]

    def init(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        DECODE_RUNNERS.append(self)

    CudaGraphRunner.__init__ = init

    def undo() -> None:
        CudaGraphRunner.__init__ = original
    return undo


def apply(mode: str, runner_class: Optional[type] = None) -> Callable[[], None]:
    """Patch ``runner_class`` (default: ``PrefillGraphRunner``) for ``mode``; returns a function
    that undoes the patch (for tests). An unknown mode raises ``SystemExit`` naming the modes."""
    if mode not in VARIANTS:
        raise SystemExit(f"{ENV}={mode!r}: choose one of {', '.join(VARIANTS)}")
    import dataclasses

    if runner_class is None:
        from sglang.srt.model_executor.prefill_graph_runner import PrefillGraphRunner
        runner_class = PrefillGraphRunner
    cls = runner_class
    saved: List[Tuple[str, Any]] = [(name, cls.__dict__[name])
                                    for name in ("__init__", "_capture", "run")]
    original_init, original_capture, original_run = (fn for _, fn in saved)

    def capture(self, key):
        if mode in SHARED_POOL:
            self._pool = _decode_pool(self._pool)
        if mode in CAPTURING:
            captured = original_capture(self, key)
            if captured is not None and mode == "side_stream":
                captured.graph.replay = _side_stream_replay(captured.graph.replay, self.device)
            return captured
        if mode == "empty":
            _empty_cache()
            return None
        if mode in TINY:
            from sglang.srt.model_executor.cuda_graph_runner import new_graph

            ids = self.input_ids[:key.tokens]

            def body() -> Dict[str, Any]:
                return {"ids": ids + 1}
            body()  # the eager run before a capture, as the model's has
            self._sync()
            graph = new_graph(self.emulate, self._pool)
            held = getattr(self, "tiny_graphs", [])
            held.append((graph, graph.capture(body)))
            self.tiny_graphs = held
            self._sync()
            return None
        def unpadded(key) -> None:
            batch = dataclasses.replace(
                self._static_batch(key.tokens, key.capture_hidden_mode), padding=None)
            self.runner.forward_eager(batch, **{n: b[:key.tokens] for n, b in self.inputs.items()})
        self._warm_up(key, unpadded if mode == "unpadded" else None)
        if mode != "warmup_keep":
            _empty_cache()
        return None

    def init(self, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if mode == "recapture_decode":
            for runner in DECODE_RUNNERS:
                _recapture(runner)
        if mode == "release":
            self.graphs.clear()
            gc.collect()
            _empty_cache()

    def run(self, forward_batch, model_inputs=None):
        if mode not in REPLAYING:
            return None  # eager, and no capture at a request
        return original_run(self, forward_batch, model_inputs)

    cls.__init__, cls._capture, cls.run = init, capture, run
    undo_runners = _record_decode_runners() if mode in USES_DECODE_RUNNERS else None
    print(f"served_variant: {cls.__name__} patched for {mode!r} in process {os.getpid()}",
          file=sys.stderr, flush=True)

    def undo() -> None:
        for name, fn in saved:
            setattr(cls, name, fn)
        if undo_runners is not None:
            undo_runners()
            DECODE_RUNNERS.clear()
    return undo


if os.environ.get(ENV):  # in the server process and, re-run as __mp_main__, in each child
    apply(os.environ[ENV])

if __name__ == "__main__":
    from sglang.launch_server import run_server

    print(f"{ENV}={os.environ.get(ENV, '')!r}: "
          f"{VARIANTS.get(os.environ.get(ENV, ''), 'no variant')}", flush=True)
    sys.exit(run_server())
