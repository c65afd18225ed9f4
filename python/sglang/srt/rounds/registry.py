"""``--speculative-algorithm`` name -> speculative worker class.

The generic layers look workers up here and never import an algorithm's module themselves.
Entries are import paths, so a server without speculation imports none of them.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Dict, Optional, Type

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

if TYPE_CHECKING:
    from sglang.srt.rounds.contract import BaseSpecWorker

__all__ = ["SPEC_WORKERS", "get_spec_worker_class"]

SPEC_WORKERS: Dict[str, str] = {
    "NEXTN": "sglang.srt.rounds.nextn.worker:NEXTNWorker",
    "DSPARK": "sglang.srt.rounds.dspark.worker:DSparkWorker",
}


def get_spec_worker_class(algorithm: Optional[str]) -> Optional[Type["BaseSpecWorker"]]:
    """The worker class of ``algorithm`` (``None`` / ``"NONE"``: no speculation, ``None``).
    Raises ``ValueError`` for a known algorithm this engine has no worker for, or an unknown one."""
    algo = SpeculativeAlgorithm.from_string(algorithm)
    if algo.is_none():
        return None
    target = SPEC_WORKERS.get(algo.name)
    if target is None:
        raise ValueError(f"--speculative-algorithm {algo.name}: this engine has no {algo.name} "
                         f"worker yet; available: {', '.join(SPEC_WORKERS)}")
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
