"""Speculative-decoding vocabulary shared by the scheduler and the workers.

* :class:`SpeculativeAlgorithm` — ``--speculative-algorithm`` as an enum (SGLang's name).
* :class:`SpecMetricsOutput` — per-request speculative counters of finishing requests,
  scheduler -> TokenizerManager (routed through the detokenizer, which forwards unknown messages
  unchanged and in order, so it arrives before the finishing token message it belongs to).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import List, Optional

from sglang.srt.rounds.registry import canonical_name

__all__ = ["SpeculativeAlgorithm", "SpecMetricsOutput"]


class SpeculativeAlgorithm(IntEnum):
    """The speculative algorithm of a server (``NONE`` when speculation is off)."""

    NONE = auto()
    NEXTN = auto()  # MTP layer as a chain drafter (upstream maps NEXTN to its EAGLE worker)
    DSPARK = auto()  # block drafter with confidence-scheduled verify length

    @classmethod
    def from_string(cls, name: Optional[str]) -> "SpeculativeAlgorithm":
        """Case-insensitive; ``None`` / ``""`` / ``"NONE"`` is ``NONE``; ``EAGLE`` means NEXTN."""
        key = canonical_name(name) or "NONE"
        if key not in cls.__members__:
            raise ValueError(f"--speculative-algorithm {name!r} is unknown; choose one of "
                             f"{', '.join(m for m in cls.__members__ if m != 'NONE')}")
        return cls[key]

    def is_none(self) -> bool:
        """Speculation is off."""
        return self == SpeculativeAlgorithm.NONE

    def is_nextn(self) -> bool:
        """The MTP chain drafter."""
        return self == SpeculativeAlgorithm.NEXTN


@dataclass
class SpecMetricsOutput:
    """Speculative counters of requests that finish in the token message that follows.

    The ``cap`` fields are ``None`` unless the speculative worker plans a verify length per
    request per round (a "cap" on how many drafts that round may accept, ``0 ..`` the drafts
    proposed); then they hold one entry per request like the others.
    """

    rids: List[str]
    spec_verify_ct: List[int]  # verify rounds that counted toward the request
    spec_num_correct_drafts: List[int]  # accepted draft tokens (bonus tokens excluded)
    spec_num_proposed_drafts: List[int]  # spec_verify_ct * (num_draft_tokens - 1)
    # [request][k]: the request's verify rounds that accepted exactly k drafts, k = 0 .. the
    # drafts proposed per round.
    spec_correct_drafts_histogram: List[List[int]] = field(default_factory=list)
    # [request][l]: the request's rounds whose planned verify length (cap) was l.
    spec_cap_lens_histogram: Optional[List[List[int]]] = None
    spec_num_cap_tokens: Optional[List[int]] = None  # sum of the planned verify lengths
    # Output tokens committed by the request's verify rounds (the prefill's first token and
    # tokens past the finish point excluded).
    spec_num_block_accept_tokens: Optional[List[int]] = None
