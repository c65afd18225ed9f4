"""``--watchdog-timeout``: a scheduler that stops making progress takes itself down.

A forward that never returns (a deadlocked collective, a hung kernel, a stuck device) would
otherwise leave the server up, answering ``/health`` from the main process while every request
waits forever. The watchdog, a daemon thread in each scheduler process, watches the scheduler's
forward counter: if the scheduler has work (requests waiting, running or a launched round) and
the counter has not moved for ``--watchdog-timeout`` seconds, it logs what was pending, dumps the
stack of every thread (to stderr, which the server log holds) and exits the process. The
TokenizerManager sees the dead child, turns ``/health`` unhealthy and fails the pending requests,
as upstream SGLang's watchdog intends ("crash the server to prevent hanging").

An idle scheduler never trips it: the clock restarts whenever the scheduler has nothing to do.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)


class SchedulerWatchdog(threading.Thread):
    """Daemon thread calling ``on_timeout`` once if ``scheduler`` has work and its
    ``forward_ct`` stays unchanged for ``timeout_s`` seconds (default action: exit the
    process after dumping every thread's stack)."""

    def __init__(self, scheduler: Any, timeout_s: float,
                 on_timeout: Optional[Callable[[str], None]] = None,
                 poll_s: Optional[float] = None) -> None:
        super().__init__(name="scheduler-watchdog", daemon=True)
        if not timeout_s > 0:
            raise ValueError(f"--watchdog-timeout must be > 0 seconds, got {timeout_s!r}")
        self.scheduler = scheduler
        self.timeout_s = float(timeout_s)
        self.on_timeout = on_timeout or _exit_stuck_process
        # Checking a few times per timeout bounds the overshoot; the cap keeps the thread idle.
        self.poll_s = poll_s if poll_s is not None else min(5.0, self.timeout_s / 4)
        self._stop_event = threading.Event()

    def stop(self) -> None:
        """End the thread (tests; the process exit ends it otherwise)."""
        self._stop_event.set()

    def _has_work(self) -> bool:
        try:
            return bool(self.scheduler.has_work())
        except Exception:  # noqa: BLE001 - read mid-update by the loop thread: look again later
            return False

    def run(self) -> None:
        last_ct = self.scheduler.forward_ct
        since = time.monotonic()
        while not self._stop_event.wait(self.poll_s):
            now = time.monotonic()
            ct = self.scheduler.forward_ct
            if ct != last_ct or not self._has_work():
                last_ct, since = ct, now
                continue
            if now - since >= self.timeout_s:
                self.on_timeout(self._describe(now - since))
                return

    def _describe(self, stalled_s: float) -> str:
        s = self.scheduler
        running = s.running_batch.batch_size() if getattr(s, "running_batch", None) else 0
        return (f"scheduler TP{getattr(s, 'tp_rank', 0)} finished no forward for "
                f"{stalled_s:.0f} s (--watchdog-timeout {self.timeout_s:g}) with work pending: "
                f"{running} running, {len(getattr(s, 'waiting_queue', []))} waiting, "
                f"forward_ct {s.forward_ct}")


def _exit_stuck_process(reason: str) -> None:
    """Log ``reason``, dump every thread's stack to stderr and exit with status 1."""
    logger.error("%s; dumping the threads' stacks and exiting", reason)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(1)  # the main thread is the one that is stuck: it cannot be asked to leave
