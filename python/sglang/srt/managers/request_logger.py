"""``--log-requests``: one log line when a request arrives and one when it finishes.

How much each line holds is ``--log-requests-level`` (upstream's levels):

* 0: metadata: the rid, token counts, whether it streams; on finish the finish reason and the
  end-to-end latency;
* 1: also the sampling parameters as the client sent them;
* 2: also the input (text, or token ids) and the output text, each cut to its first
  :data:`PARTIAL_CHARS` characters;
* 3: also the input and output in full.

Texts are written with ``repr`` so that a line break in a prompt cannot start a fake log line.
Health probes (``log_metrics=False``) are not logged. Lines go to this module's logger at level
info, so ``--log-level warning`` hides them.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List

logger = logging.getLogger(__name__)

# Characters of the input and of the output kept at level 2.
PARTIAL_CHARS = 2048


class RequestLogger:
    """Formats and writes the request log lines at one verbosity level (0-3)."""

    def __init__(self, level: int) -> None:
        if level not in (0, 1, 2, 3):
            raise ValueError(f"--log-requests-level must be 0, 1, 2 or 3, got {level!r}")
        self.level = level

    def _cut(self, text: str) -> str:
        if self.level >= 3 or len(text) <= PARTIAL_CHARS:
            return text
        return f"{text[:PARTIAL_CHARS]}... ({len(text)} characters in all)"

    def received_line(self, obj: Any, input_ids: List[int]) -> str:
        """The line for a single (normalized) request ``obj`` whose prompt is ``input_ids``."""
        parts = [f"Receive: rid={obj.rid}", f"prompt_tokens={len(input_ids)}",
                 f"stream={bool(obj.stream)}"]
        if self.level >= 1:
            parts.append(f"sampling_params={obj.sampling_params!r}")
        if self.level >= 2:
            prompt = repr(obj.text) if obj.text is not None else repr(list(input_ids))
            parts.append(f"input={self._cut(prompt)}")
        return " ".join(parts)

    def finished_line(self, rid: str, out: Dict[str, Any]) -> str:
        """The line for a finished request's output dict (``ReqState.to_output``)."""
        meta = out.get("meta_info", {})
        parts = [f"Finish: rid={rid}", f"prompt_tokens={meta.get('prompt_tokens')}",
                 f"completion_tokens={meta.get('completion_tokens')}",
                 f"finish_reason={meta.get('finish_reason')!r}"]
        latency = meta.get("e2e_latency")
        if latency is not None:
            parts.append(f"e2e_latency={latency:.3f}s")
        if self.level >= 2:
            parts.append(f"output={self._cut(repr(out.get('text', '')))}")
        return " ".join(parts)

    def log_received(self, obj: Any, input_ids: List[int]) -> None:
        """Log a request as it is handed to the scheduler (not health probes)."""
        if getattr(obj, "log_metrics", True):
            logger.info("%s", self.received_line(obj, input_ids))

    def log_finished(self, obj: Any, out: Dict[str, Any]) -> None:
        """Log a request's final output (not health probes)."""
        if getattr(obj, "log_metrics", True):
            logger.info("%s", self.finished_line(obj.rid, out))
