"""Helpers shared by the layer-level tests."""
from __future__ import annotations

import contextlib

from sglang.srt.distributed import parallel_state


@contextlib.contextmanager
def fake_tp(rank: int, size: int):
    """Build layers as rank ``rank`` of ``size`` without a process group (loaders only)."""
    old = parallel_state._TP_RANK, parallel_state._TP_SIZE
    parallel_state._TP_RANK, parallel_state._TP_SIZE = rank, size
    try:
        yield
    finally:
        parallel_state._TP_RANK, parallel_state._TP_SIZE = old
