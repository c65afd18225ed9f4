"""DSPARK's flags: the block size, the confidence scheduler's tables and the verify mode.

Registered with the CLI and ``ServerArgs`` through :mod:`sglang.srt.rounds.registry`. Light
module: the checks that read files import what they need when they run.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from sglang.srt.arg_checks import int_at_least, one_of

__all__ = ["ARGS", "DSparkArgs", "VERIFY_MODES", "add_args", "resolve_args", "check_args",
           "resolve_verify_mode"]

# How a round's planned verify lengths shape its target forward: static = every draft is
# verified; cap-accept = the whole block is forwarded and acceptance is capped at the planned
# length; compact = the target forwards a verify-width tier chosen on the host from the lagged
# planner's budget (one CUDA graph per tier); auto = cap-accept with an SPS table, else static.
VERIFY_MODES = ("auto", "static", "cap-accept", "compact")


@dataclass(kw_only=True)
class DSparkArgs:
    """DSPARK's fields of ``ServerArgs`` (None: not given)."""

    speculative_dspark_block_size: Optional[int] = None
    speculative_dspark_sps_table_path: Optional[str] = None
    speculative_dspark_confidence_sts_path: Optional[str] = None
    speculative_dspark_verify_mode: Optional[str] = None


ARGS = DSparkArgs


def add_args(g: Any, d: Dict[str, Any], add_flag: Callable[..., Any]) -> None:
    """Register DSPARK's flags on the CLI's speculative-decoding group ``g``."""
    add_flag(g, "--speculative-dspark-block-size", type=int,
             default=d["speculative_dspark_block_size"],
             words="the draft checkpoint's block_size, else 7",
             help="DSPARK: draft tokens per round (gamma; the verify window is gamma + 1).")
    add_flag(g, "--speculative-dspark-sps-table-path", type=str,
             default=d["speculative_dspark_sps_table_path"],
             words="none: every draft is verified in full",
             help="DSPARK: JSON table of target steps/s per verify batch size; turns on the "
                  "confidence scheduler (per-request verify lengths).")
    add_flag(g, "--speculative-dspark-confidence-sts-path", type=str,
             default=d["speculative_dspark_confidence_sts_path"], words="none: uncalibrated",
             help="DSPARK: JSON list of gamma per-position temperatures calibrating the "
                  "confidence head for the scheduler (needs "
                  "--speculative-dspark-sps-table-path).")
    add_flag(g, "--speculative-dspark-verify-mode", choices=VERIFY_MODES,
             default=d["speculative_dspark_verify_mode"],
             words="auto: cap-accept with an SPS table, else static",
             help="DSPARK: how the planned verify lengths shape the target's verify forward: "
                  "static verifies every draft; cap-accept forwards the whole block and caps "
                  "acceptance at the planned length; compact forwards a verify-width tier "
                  "chosen from the planner's budget (needs the overlap schedule). cap-accept "
                  "and compact need --speculative-dspark-sps-table-path.")


def resolve_args(a: Any) -> None:
    """Nothing to fill at parse time: the block size defaults to the draft checkpoint's, read
    when the worker is built; the verify mode resolves with :func:`resolve_verify_mode`."""


def resolve_verify_mode(mode: Optional[str], has_sps_table: bool, overlap: bool) -> str:
    """``--speculative-dspark-verify-mode`` resolved (``None`` / ``auto``) and checked against
    the planner it needs: ``static`` | ``cap-accept`` | ``compact``."""
    mode = "auto" if mode is None else mode
    one_of("--speculative-dspark-verify-mode", mode, VERIFY_MODES)
    if mode == "auto":
        return "cap-accept" if has_sps_table else "static"
    if mode != "static" and not has_sps_table:
        raise ValueError(f"--speculative-dspark-verify-mode {mode}: the verify lengths come from "
                         "the confidence scheduler, which needs "
                         "--speculative-dspark-sps-table-path")
    if mode == "compact" and not overlap:
        raise ValueError("--speculative-dspark-verify-mode compact: the host picks each round's "
                         "verify width from the lagged planner's budget, which runs with the "
                         "overlap schedule (drop --disable-overlap-schedule, or use cap-accept)")
    return mode


def check_args(a: Any) -> None:
    """The draft is given or beside the target (a draft preset only with dummy weights), the
    block size and verify mode are valid and the planner's files exist and parse (their fit to
    the draft is checked by the worker)."""
    from sglang.srt.configs.dspark import (dspark_preset_for_target, dspark_preset_needs_dummy,
                                           is_dspark_preset)
    from sglang.srt.configs.model_config import is_preset, resolve_model_path
    from sglang.srt.rounds.dspark.setup import load_dspark_tables

    draft = a.speculative_draft_model_path
    if not draft:
        # Else the draft is the target checkpoint's dspark/ subfolder (configs/dspark.py
        # find_dspark_draft, which the worker runs with the full checks).
        target = resolve_model_path(a.model_path)
        if not os.path.isdir(os.path.join(target, "dspark")):
            # A target preset has no folder to look in; its draft preset, when one ships, is
            # what the user wants.
            preset = dspark_preset_for_target(target) if is_preset(target) else None
            hint = (f"; for the preset target {target!r} pass --speculative-draft-model-path "
                    f"{preset} (a dummy draft of the published shape)") if preset else ""
            raise ValueError(
                "--speculative-draft-model-path is required for --speculative-algorithm "
                f"DSPARK unless the target checkpoint has a 'dspark/' draft subfolder "
                f"(none in {target!r}){hint}")
    elif is_dspark_preset(draft) and a.load_format != "dummy":
        raise ValueError(dspark_preset_needs_dummy(draft, a.load_format))
    if a.speculative_dspark_block_size is not None:
        int_at_least("--speculative-dspark-block-size", a.speculative_dspark_block_size, 2)
    resolve_verify_mode(a.speculative_dspark_verify_mode,
                        a.speculative_dspark_sps_table_path is not None,
                        not getattr(a, "disable_overlap_schedule", False))
    load_dspark_tables(a.speculative_dspark_sps_table_path,
                       a.speculative_dspark_confidence_sts_path)
