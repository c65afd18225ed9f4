"""DSPARK's configuration, validated before anything is built: the draft (found beside the
target or by ``--speculative-draft-model-path``), its block size, the planner's tables and the
verify mode (``SGLANG_RAGGED_VERIFY_MODE``). Every problem is a ``ValueError`` naming the flag,
variable or file it is about; ``ServerArgs`` runs the flag checks at parse time."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from sglang.srt.configs.bailing_moe_v3 import ConfigError
from sglang.srt.configs.dspark import DSparkDraftConfig, find_dspark_draft
from sglang.srt.configs.engine_defaults import RAGGED_VERIFY_MODES
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.environ import envs
from sglang.srt.rounds.dspark.sps import SPSTable
from sglang.srt.rounds.dspark.sts import load_sts_temperatures

__all__ = ["DSparkSetup", "check_nextn_only_flags", "dspark_setup", "load_dspark_tables",
           "ragged_verify_mode"]

# Flags that size a NEXTN chain; DSPARK's window comes from the block size.
_NEXTN_ONLY = (("--speculative-num-steps", "speculative_num_steps"),
               ("--speculative-num-draft-tokens", "speculative_num_draft_tokens"))


@dataclass(frozen=True)
class DSparkSetup:
    """A validated DSPARK configuration: where the draft is, its config, the planner tables."""

    draft_path: str
    config: DSparkDraftConfig
    sps_table: Optional[SPSTable] = None
    sts_temperatures: Optional[List[float]] = None

    @property
    def gamma(self) -> int:
        """Draft tokens per round."""
        return self.config.gamma


def check_nextn_only_flags(server_args: Any) -> None:
    """``ValueError`` naming a NEXTN-only flag set with DSPARK (the chain-sizing flags, and an
    EAGLE top-k other than 1)."""
    for flag, name in _NEXTN_ONLY:
        if getattr(server_args, name, None) is not None:
            raise ValueError(f"{flag} is NEXTN-only; DSPARK's verify window is the draft's block "
                             "size + 1 (--speculative-dspark-block-size)")
    topk = getattr(server_args, "speculative_eagle_topk", None)
    if topk is not None and topk != 1:
        raise ValueError(f"--speculative-eagle-topk {topk}: NEXTN-only (DSPARK drafts one "
                         "block, a single chain)")


def dspark_setup(server_args: Any, target_config: ModelConfig) -> DSparkSetup:
    """Validate the DSPARK flags and the draft for ``target_config``; every problem is a
    ``ValueError`` naming the flag (or the draft file) it is about."""
    check_nextn_only_flags(server_args)
    draft_flag = getattr(server_args, "speculative_draft_model_path", None)
    try:
        path = find_dspark_draft(target_config.model_path, draft_flag)
    except ConfigError as e:
        raise ValueError(f"--speculative-draft-model-path: {e}") from e
    block = getattr(server_args, "speculative_dspark_block_size", None)
    try:
        config = DSparkDraftConfig.from_path(path, target_config.hf_config, block)
    except ConfigError as e:
        where = " (--speculative-dspark-block-size)" if block is not None else ""
        raise ValueError(f"DSpark draft {path!r}{where}: {e}") from e
    sps_path = getattr(server_args, "speculative_dspark_sps_table_path", None)
    if sps_path is not None and not config.enable_confidence_head:
        raise ValueError(f"--speculative-dspark-sps-table-path: the confidence scheduler needs a "
                         f"draft with a confidence head; {path!r} has none "
                         "(enable_confidence_head is false)")
    table, temps = load_dspark_tables(
        sps_path, getattr(server_args, "speculative_dspark_confidence_sts_path", None),
        config.gamma)
    return DSparkSetup(path, config, table, temps)


def load_dspark_tables(sps_path: Optional[str], sts_path: Optional[str],
                       gamma: Optional[int] = None
                       ) -> Tuple[Optional[SPSTable], Optional[List[float]]]:
    """The planner's SPS table and STS temperatures (``gamma`` of them when given) from
    ``--speculative-dspark-sps-table-path`` / ``--speculative-dspark-confidence-sts-path``;
    a missing or malformed file is a ``ValueError`` naming its flag."""
    if sts_path is not None and sps_path is None:
        raise ValueError("--speculative-dspark-confidence-sts-path calibrates the confidence "
                         "scheduler, which runs only with --speculative-dspark-sps-table-path")
    out: List[Any] = []
    for flag, path, load in (
            ("--speculative-dspark-sps-table-path", sps_path, SPSTable.load),
            ("--speculative-dspark-confidence-sts-path", sts_path,
             lambda p: load_sts_temperatures(p, gamma))):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path!r}: no such file")
        try:
            out.append(None if path is None else load(path))
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from e
    return out[0], out[1]


def ragged_verify_mode(has_sps_table: bool, overlap: bool) -> str:
    """The verify mode ``SGLANG_RAGGED_VERIFY_MODE`` asks for, resolved (``auto``) and checked
    against the planner it needs: ``static`` | ``cap-accept`` | ``compact``."""
    mode = envs.SGLANG_RAGGED_VERIFY_MODE.get().strip().lower()
    if mode not in RAGGED_VERIFY_MODES:
        raise ValueError(f"SGLANG_RAGGED_VERIFY_MODE={mode!r}: choose one of "
                         f"{', '.join(RAGGED_VERIFY_MODES)}")
    if mode == "auto":
        return "cap-accept" if has_sps_table else "static"
    if mode != "static" and not has_sps_table:
        raise ValueError(f"SGLANG_RAGGED_VERIFY_MODE={mode}: the verify lengths come from the "
                         "confidence scheduler, which needs --speculative-dspark-sps-table-path")
    if mode == "compact" and not overlap:
        raise ValueError("SGLANG_RAGGED_VERIFY_MODE=compact: the host picks each round's verify "
                         "width from the lagged planner's budget, which runs with the overlap "
                         "schedule (drop --disable-overlap-schedule, or use cap-accept)")
    return mode
