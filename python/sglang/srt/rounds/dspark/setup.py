"""DSPARK's configuration, validated before anything is built: the draft (found beside the
target or by ``--speculative-draft-model-path``), its block size, the planner's tables and the
verify mode (``--speculative-dspark-verify-mode``, :mod:`.args`). Every problem is a
``ValueError`` naming the flag or file it is about; ``ServerArgs`` runs the flag checks at parse
time (:func:`.args.check_args`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from sglang.srt.configs.bailing_moe_v3 import ConfigError
from sglang.srt.configs.dspark import DSparkDraftConfig, find_dspark_draft
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.rounds.dspark.sps import SPSTable
from sglang.srt.rounds.dspark.sts import load_sts_temperatures
from sglang.srt.rounds.registry import check_foreign_flags

__all__ = ["DSparkSetup", "dspark_setup", "load_dspark_tables"]


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


def dspark_setup(server_args: Any, target_config: ModelConfig) -> DSparkSetup:
    """Validate the DSPARK flags and the draft for ``target_config``; every problem is a
    ``ValueError`` naming the flag (or the draft file) it is about."""
    check_foreign_flags("DSPARK", server_args)  # the chain-sizing flags are NEXTN's
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
