"""NEXTN's flags (upstream's names): the chain's draft steps, branches and verified tokens.

Registered with the CLI and ``ServerArgs`` through :mod:`sglang.srt.rounds.registry`.
Light module: no torch at import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from sglang.srt.arg_checks import int_at_least

__all__ = ["ARGS", "NEXTN_DEFAULT_SPEC", "NextnArgs", "add_args", "resolve_args", "check_args"]

# (num_steps, eagle_topk, num_draft_tokens) upstream auto-chooses for Bailing MTP.
NEXTN_DEFAULT_SPEC: Tuple[int, int, int] = (3, 1, 4)


@dataclass(kw_only=True)
class NextnArgs:
    """NEXTN's fields of ``ServerArgs`` (None: not given)."""

    speculative_num_steps: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None
    speculative_num_draft_tokens: Optional[int] = None


ARGS = NextnArgs


def add_args(g: Any, d: Dict[str, Any], add_flag: Callable[..., Any]) -> None:
    """Register NEXTN's flags on the CLI's speculative-decoding group ``g``."""
    steps, topk, draft_tokens = NEXTN_DEFAULT_SPEC
    add_flag(g, "--speculative-num-steps", type=int, default=d["speculative_num_steps"],
             words=f"NEXTN: {steps}, or --speculative-num-draft-tokens - 1 when that is given",
             help="NEXTN: draft steps per round (the chain's length).")
    add_flag(g, "--speculative-eagle-topk", type=int, default=d["speculative_eagle_topk"],
             words=f"NEXTN: {topk}",
             help="NEXTN: draft branches per step; only 1 (a chain) is supported by hybrid KDA "
                  "models.")
    add_flag(g, "--speculative-num-draft-tokens", type=int,
             default=d["speculative_num_draft_tokens"],
             words=f"NEXTN: {draft_tokens}, or --speculative-num-steps + 1 when that is given",
             help="NEXTN: tokens verified per round (--speculative-num-steps + 1 for a chain).")


def resolve_args(a: Any) -> None:
    """Chain defaults: steps/topk/draft = 3/1/4 when unset; a chain of ``s`` draft steps
    verifies ``s + 1`` tokens, so a missing one of the pair follows from the other."""
    steps, topk, draft = NEXTN_DEFAULT_SPEC
    if a.speculative_eagle_topk is None:
        a.speculative_eagle_topk = topk
    if a.speculative_num_steps is None and a.speculative_num_draft_tokens is None:
        a.speculative_num_steps, a.speculative_num_draft_tokens = steps, draft
    elif a.speculative_num_steps is None and isinstance(a.speculative_num_draft_tokens, int):
        a.speculative_num_steps = a.speculative_num_draft_tokens - 1
    elif a.speculative_num_draft_tokens is None and isinstance(a.speculative_num_steps, int):
        a.speculative_num_draft_tokens = a.speculative_num_steps + 1


def check_args(a: Any) -> None:
    """A chain: ``topk == 1`` and ``draft tokens == steps + 1``."""
    int_at_least("--speculative-num-steps", a.speculative_num_steps, 1)
    int_at_least("--speculative-eagle-topk", a.speculative_eagle_topk, 1)
    int_at_least("--speculative-num-draft-tokens", a.speculative_num_draft_tokens, 2)
    if a.speculative_eagle_topk > 1:
        # The KDA recurrent state cannot branch: verify stages one state per chain position.
        raise ValueError(f"--speculative-eagle-topk {a.speculative_eagle_topk}: hybrid KDA "
                         "models support chain drafts only (topk 1)")
    if a.speculative_num_draft_tokens != a.speculative_num_steps + 1:
        raise ValueError(
            f"--speculative-num-draft-tokens must equal --speculative-num-steps + 1 for a chain "
            f"(topk 1): got {a.speculative_num_draft_tokens} draft tokens for "
            f"{a.speculative_num_steps} steps")
