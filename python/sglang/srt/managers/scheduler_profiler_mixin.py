"""``/start_profile`` and ``/stop_profile`` in the scheduler: the torch profiler around real
serving steps, one Chrome trace per TP rank.

The profiler runs in the scheduler process (where the forwards are launched), on every rank:
the request reaches all ranks through the same broadcast as generate requests, and only rank 0
answers. A start may wait for a forward count (``start_step``) and may end itself after
``num_steps`` scheduler steps; otherwise ``/stop_profile`` ends it. The trace is written as
``{output_dir}/{profile_prefix}{start time}-TP-{rank}.trace.json.gz`` (Perfetto / chrome://tracing
read it). Traces are only ever written inside ``SGLANG_TORCH_PROFILER_DIR``: the directory and
prefix are checked again here, so a ``ProfileReq`` built without ``from_body`` cannot escape it.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

import torch

from sglang.srt.managers.io_struct import (
    ProfileReq,
    ProfileReqOutput,
    check_profile_prefix,
    resolve_profile_output_dir,
)

logger = logging.getLogger(__name__)

__all__ = ["SchedulerProfilerMixin"]


class SchedulerProfilerMixin:
    """Profiler state of a :class:`~sglang.srt.managers.scheduler.Scheduler` (``tp_rank``,
    ``forward_ct`` and ``send_to_tokenizer`` come from it)."""

    def init_profiler(self) -> None:
        self._profile_req: Optional[ProfileReq] = None  # accepted: pending or running
        self._profiler: Optional[torch.profiler.profile] = None  # running
        self._profile_steps = 0
        self._profile_id = ""

    def handle_profile_request(self, req: ProfileReq) -> None:
        """Start or stop; the outcome goes back to the TokenizerManager (from rank 0 only)."""
        self.send_to_tokenizer(self.start_profile(req) if req.start else self.stop_profile())

    def start_profile(self, req: ProfileReq) -> ProfileReqOutput:
        """Accept a start: now, or once ``forward_ct`` reaches ``req.start_step``."""
        if self._profile_req is not None:
            return ProfileReqOutput(False, "profiling is already running; /stop_profile first")
        try:
            check_profile_prefix(req.profile_prefix)
            req.output_dir = resolve_profile_output_dir(req.output_dir)
        except ValueError as exc:
            return ProfileReqOutput(False, str(exc))
        try:
            os.makedirs(req.output_dir, exist_ok=True)
        except OSError as exc:
            return ProfileReqOutput(False, f"cannot use output_dir {req.output_dir!r}: {exc}")
        self._profile_req, self._profile_steps = req, 0
        if req.start_step is None or self.forward_ct >= req.start_step:
            self._begin_profiler()
            return ProfileReqOutput(True, "Start profiling.")
        return ProfileReqOutput(True, f"Profiling will start at forward step {req.start_step}.")

    def stop_profile(self) -> ProfileReqOutput:
        """End the running profile and write its trace (a pending one is cancelled)."""
        if self._profile_req is None:
            return ProfileReqOutput(False, "profiling is not running; /start_profile first")
        if self._profiler is None:
            self._profile_req = None
            return ProfileReqOutput(True, "Profiling cancelled before its start_step.")
        return ProfileReqOutput(True, f"Stop profiling. Trace: {self._end_profiler()}")

    def profile_tick(self) -> None:
        """After every scheduler step that ran a batch: start a pending profile whose step has
        come, and end a running one that has its ``num_steps``."""
        req = self._profile_req
        if req is None:
            return
        if self._profiler is None:
            if self.forward_ct >= (req.start_step or 0):
                self._begin_profiler()
            return
        self._profile_steps += 1
        if req.num_steps is not None and self._profile_steps >= req.num_steps:
            self._end_profiler()

    def _begin_profiler(self) -> None:
        req = self._profile_req
        acts = [torch.profiler.ProfilerActivity.CPU] if "CPU" in req.activities else []
        if "GPU" in req.activities and torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile_id = f"{time.time():.3f}"
        self._profiler = torch.profiler.profile(
            activities=acts or [torch.profiler.ProfilerActivity.CPU],
            with_stack=req.with_stack, record_shapes=req.record_shapes,
            profile_memory="MEM" in req.activities)
        self._profiler.start()
        logger.info("profiling started (%s) on TP%d", ", ".join(req.activities), self.tp_rank)

    def _end_profiler(self) -> str:
        """Stop, write the trace, clear the state; returns the trace path."""
        req, prof = self._profile_req, self._profiler
        self._profile_req = self._profiler = None
        prof.stop()
        path = os.path.join(req.output_dir,
                            f"{req.profile_prefix}{self._profile_id}-TP-{self.tp_rank}.trace.json.gz")
        prof.export_chrome_trace(path)
        logger.info("profiling stopped after %d steps; trace %s", self._profile_steps, path)
        return path
