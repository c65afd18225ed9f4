"""What runs between two CUDA-graph replays: the static inputs' refill (the "seam").

Before a replay the graph's static inputs must hold the live batch: the request slots, the
round's KV slots (``loc``), and the sampling rows the graph variant reads; after it the sampling
step counters that the body advanced go back to the live batch. At batch 1 each of these device
copies moves a few bytes, so dispatching it on the host costs more than running it on the device
(docs/performance.md, "Kernel design measurements (moved from code comments)"); the fewer copies,
the shorter the seam. :class:`GraphRefill` does it one of three ways:

* ``full`` (a test / benchmark parameter): every input, every replay -- the reference.
* ``changed`` (default): the KV slots are allocated straight into the static ``loc``
  (:meth:`GraphRefill.loc_buffer`), and the slots and sampling rows are copied only when the
  live tensors are not the ones copied last time. A batch keeps its slot tensor and sampling
  object while its requests do (``ScheduleBatch``), and the copy back after each replay keeps
  the live step counters equal to the static ones, so a steady decode replays with no copy
  before it and one after it. Identity is checked on objects this class holds references to, so
  an address cannot be reused by a new batch while it is remembered; an eager round (which
  advances the live counters by itself) forgets them (:meth:`GraphRefill.forget`).
* ``glue`` (opt-in ``SGLANG_ENABLE_METADATA_GLUE_GRAPH=1``): the full refill and the copy back
  captured in two small graphs per (graph key, batch size, live tensors), replayed around the
  round graph. A graph freezes the addresses it read, hence four safety mechanisms: (1) a set of
  live tensors is captured only on its third sighting in a row, after two eager refills (JIT and
  allocator warm-up outside the capture; single-step batches never capture); (2) before every
  replay the live tensors are checked against the captured ones (identity and address), and any
  difference runs the refill eagerly -- the attention backends' Python-side replay hooks always
  run eagerly, so no Python state is frozen; (3) a failed capture turns glue graphs off for good
  with a warning (eager refill from then on); (4) workers whose attention plan is rebuilt on the
  host every round (``host_planned_attention``) never use them, since a graph would replay the
  plan of its capture.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

__all__ = ["GraphRefill", "REFILL_MODES"]

REFILL_MODES = ("full", "changed", "glue")
# Consecutive sightings of a set of live tensors before its glue graphs are captured.
GLUE_CAPTURE_AFTER = 3


@dataclass
class _Glue:
    sources: Tuple[object, ...]  # the live tensors / sampling object the graphs read (kept alive)
    ptrs: Tuple[int, ...]
    pre: object  # graph of the refill
    post: object  # graph of the copy back


class GraphRefill:
    """The refill of one :class:`~sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner`'s
    static buffers ``slots [max_bs]``, ``loc [max_bs, N]`` and sampling rows ``info``.
    ``new_graph`` makes a graph object (``capture(fn)`` / ``replay()``)."""

    def __init__(self, mode: str, slots: torch.Tensor, loc: torch.Tensor, info: object,
                 new_graph: Callable[[], object]):
        if mode not in REFILL_MODES:
            raise ValueError(f"GraphRefill: mode must be one of {REFILL_MODES}, got {mode!r}")
        self.mode = mode
        self.slots, self.loc, self.info = slots, loc, info
        self._new_graph = new_graph
        self._dirty = slots.shape[0]  # rows >= this are zero in slots and loc
        self._filled: Tuple[Optional[object], Optional[object], frozenset] = (None, None, frozenset())
        self._glue: Dict[tuple, _Glue] = {}
        self._seen: Optional[tuple] = None
        self._seen_count = 0
        self.glue_failed: Optional[str] = None
        self.glue_replays = 0
        self._active_glue: Optional[_Glue] = None  # the glue graphs of the current replay

    # ------------------------------------------------------------------ before the round
    def loc_buffer(self, bs: int) -> Optional[torch.Tensor]:
        """The static ``loc[:bs]`` a round of ``bs`` requests allocates its KV slots into
        (None in ``full`` mode or beyond the buffer: the round passes its own tensor)."""
        if self.mode == "full" or bs > self.loc.shape[0]:
            return None
        self._dirty = max(self._dirty, bs)
        return self.loc[:bs]

    def forget(self) -> None:
        """The live step counters moved without a replay (an eager round): copy them again."""
        self._filled = (None, None, frozenset())

    # ------------------------------------------------------------------ around a replay
    def before(self, padded_bs: int, slots: torch.Tensor, loc: torch.Tensor, info: object,
               fields: Tuple[str, ...]) -> None:
        """Make the static inputs hold the live batch (``bs = len(slots)`` rows, padding rows up
        to ``padded_bs`` on slot 0)."""
        if self.mode == "glue" and self._glue_before(padded_bs, slots, loc, info, fields):
            return
        bs = int(slots.shape[0])
        if self.mode != "changed":
            self._copy_all(padded_bs, slots, loc, info, fields)
            return
        filled_slots, filled_info, filled_fields = self._filled
        if slots is not filled_slots:
            self.slots[:bs].copy_(slots)
        if loc.data_ptr() != self.loc.data_ptr():  # not allocated in place
            self.loc[:bs].copy_(loc)
        self._dirty = max(self._dirty, bs)
        if padded_bs > bs and self._dirty > bs:
            self.slots[bs:self._dirty].zero_()
            self.loc[bs:self._dirty].zero_()
            self._dirty = bs
        if info is not filled_info or not set(fields) <= filled_fields:
            for name in fields:
                getattr(self.info, name)[:bs].copy_(getattr(info, name))
            filled_fields = frozenset(fields)
        self._filled = (slots, info, filled_fields)

    def after(self, slots: torch.Tensor, info: object) -> None:
        """Copy the step counters the body advanced back to the live batch."""
        glue = self._active_glue
        if glue is not None:
            glue.post.replay()
            return
        info.steps.copy_(self.info.steps[:int(slots.shape[0])])

    def _copy_all(self, padded_bs: int, slots: torch.Tensor, loc: torch.Tensor, info: object,
                  fields: Tuple[str, ...]) -> None:
        bs = int(slots.shape[0])
        self.slots[:bs].copy_(slots)
        if loc.data_ptr() != self.loc.data_ptr():
            self.loc[:bs].copy_(loc)
        if padded_bs > bs:
            self.slots[bs:padded_bs].zero_()
            self.loc[bs:padded_bs].zero_()
        for name in fields:
            getattr(self.info, name)[:bs].copy_(getattr(info, name))

    # ------------------------------------------------------------------ glue graphs
    def _glue_before(self, padded_bs: int, slots: torch.Tensor, loc: torch.Tensor, info: object,
                     fields: Tuple[str, ...]) -> bool:
        """Replay the glue graph of these live tensors if there is one (True), else refill
        eagerly and count the sighting (False)."""
        self._active_glue = None
        if self.glue_failed is not None:
            return False
        sources = (slots, loc, info) + tuple(getattr(info, f) for f in fields)
        ptrs = tuple(t.data_ptr() for t in sources if isinstance(t, torch.Tensor))
        key = (padded_bs, int(slots.shape[0]), fields)
        glue = self._glue.get(key)
        if glue is not None and all(a is b for a, b in zip(glue.sources, sources)) \
                and glue.ptrs == ptrs:
            glue.pre.replay()
            self._active_glue = glue
            self.glue_replays += 1
            return True
        sighting = (key, ptrs)
        self._seen_count = self._seen_count + 1 if sighting == self._seen else 1
        self._seen = sighting
        if self._seen_count < GLUE_CAPTURE_AFTER:
            return False  # the eager refill runs; it is also the warm-up before a capture
        def refill() -> dict:
            self._copy_all(padded_bs, slots, loc, info, fields)
            return {}

        def copy_back() -> dict:
            info.steps.copy_(self.info.steps[:int(slots.shape[0])])
            return {}

        try:
            pre, post = self._new_graph(), self._new_graph()
            pre.capture(refill)
            post.capture(copy_back)
        except Exception as e:  # noqa: BLE001 - a capture problem must never stop serving
            self.glue_failed = f"{type(e).__name__}: {e}"
            logger.warning("metadata glue graph capture failed (%s); the refill runs eagerly "
                           "from now on", self.glue_failed)
            return False
        # A graph replaced for the same key drops the previous one's sources (and their memory).
        self._glue[key] = _Glue(sources, ptrs, pre, post)
        # Capturing does not run the work on CUDA; replaying it now does.
        pre.replay()
        self._active_glue = self._glue[key]
        self.glue_replays += 1
        return True
