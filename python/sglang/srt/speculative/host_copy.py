"""Device-to-host copies the host consumes one step late.

A speculative round leaves its accept counts and committed tokens on the device. The host needs
them only for EOS / stop checks, streaming, detokenization and freeing surplus KV slots, and it
reads them after it has launched the next round. :class:`AsyncHostCopy` starts the copies right
after the round is enqueued: on CUDA into pinned host memory on a side stream (ordered after the
producing kernels by an event, so the main stream never waits) with a ``copy_done`` event that
:meth:`AsyncHostCopy.wait` synchronizes on; on CPU the same call is a plain copy.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

__all__ = ["AsyncHostCopy"]

_SIDE_STREAMS: Dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = torch.cuda.Stream(device=device)
        _SIDE_STREAMS[device] = stream
    return stream


class AsyncHostCopy:
    """Start copying named device tensors to the host now; :meth:`wait` returns the host copies.

    The sources must not be written again by later work (pass per-round tensors, not persistent
    buffers): the side stream reads them while the main stream moves on.
    """

    def __init__(self, tensors: Dict[str, torch.Tensor]):
        if not tensors:
            raise ValueError("AsyncHostCopy needs at least one tensor")
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise ValueError(f"AsyncHostCopy: tensors on several devices {sorted(map(str, devices))}")
        device = devices.pop()
        self._event: Optional["torch.cuda.Event"] = None
        if device.type != "cuda":
            self._host = {name: t.detach().clone() for name, t in tensors.items()}
            return
        main = torch.cuda.current_stream(device)
        side = _side_stream(device)
        side.wait_stream(main)  # after the kernels that produce the tensors
        with torch.cuda.stream(side):
            self._host = {}
            for name, t in tensors.items():
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(side)  # keep the source alive until the copy ran
                self._host[name] = host
            self._event = torch.cuda.Event()
            self._event.record(side)

    def ready(self) -> bool:
        """Whether the copies have completed (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self) -> Dict[str, torch.Tensor]:
        """Block until the copies are done; the host tensors by name."""
        if self._event is not None:
            self._event.synchronize()
        return self._host
