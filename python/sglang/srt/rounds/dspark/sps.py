"""The SPS table of the DSpark scheduler: target steps per second at a forward of B tokens.

The confidence scheduler (:mod:`sglang.srt.rounds.dspark.planner`) maximises the expected
token throughput ``tau * SPS(B)``, so it needs the target's verify speed as a function of the
number of tokens in the batch. The curve is profiled once per deployment and stored as JSON
(``--speculative-dspark-sps-table-path``)::

    {"sample_batch_tokens": [1, 2, 4, 8, 16],
     "sample_steps_per_sec": [950.0, 940.0, 900.0, 610.0, 400.0],
     "max_batch_tokens": 16}

``sample_batch_tokens``: the probes, integers >= 1, strictly increasing; ``sample_steps_per_sec``:
one finite value > 0 per probe; ``max_batch_tokens`` (optional, default the last probe, not
below it): the largest batch the deployment runs. Unknown fields are ignored; the fields of
upstream's additive cost model are refused rather than silently ignored.

Lookup rule (a step function, no interpolation): ``SPS(B)`` is the value of the largest probe
``<= B``; below the first probe it is the first probe's value (a smaller batch is assumed no
slower); above ``max_batch_tokens`` it is ``0`` (the batch cannot run, so a plan never goes
there). Real curves are jagged (kernel tiles, CUDA-graph buckets), which is why the rule keeps
the measured steps instead of smoothing them. A table with a single probe is flat: every
admitted token then raises the objective, i.e. the scheduler verifies whole blocks.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple, Union

import torch

__all__ = ["SPSTableError", "SPSTable", "MAX_TABLE_TOKENS"]

# Upper bound on max_batch_tokens: the device form is a dense vector of that length.
MAX_TABLE_TOKENS = 1 << 20
# Fields of upstream's additive cost model; this table is the sampled form only.
_ADDITIVE_FIELDS = ("bias_seconds", "bs_probes", "alpha_seconds", "m_probes", "theta_seconds")



def read_json_file(path: Union[str, os.PathLike], what: str, error: type) -> Any:
    """The JSON value in ``path``; a missing file or bad JSON raises ``error`` naming ``what``."""
    try:
        with open(os.fspath(path), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise error(f"{what}: file not found") from None
    except json.JSONDecodeError as e:
        raise error(f"{what}: not valid JSON ({e})") from None

class SPSTableError(ValueError):
    """A malformed SPS table; the message names the file (or source) and the field."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SPSTable:
    """A validated SPS curve (see the module docstring for the format and the lookup rule)."""

    sample_batch_tokens: Tuple[int, ...]
    sample_steps_per_sec: Tuple[float, ...]
    max_batch_tokens: int

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Any, source: str = "SPS table") -> "SPSTable":
        """Validate a parsed JSON object; errors name ``source`` and the offending field."""
        if not isinstance(data, dict):
            raise SPSTableError(f"{source}: expected a JSON object with sample_batch_tokens and "
                                f"sample_steps_per_sec, got {type(data).__name__}")
        additive = [k for k in _ADDITIVE_FIELDS if k in data]
        if additive:
            raise SPSTableError(f"{source}: field {additive[0]!r} belongs to the additive cost "
                                "model, which is not supported; give sample_batch_tokens and "
                                "sample_steps_per_sec")
        for key in ("sample_batch_tokens", "sample_steps_per_sec"):
            if key not in data:
                raise SPSTableError(f"{source}: missing field {key!r}")
            if not isinstance(data[key], list) or not data[key]:
                raise SPSTableError(f"{source}: field {key!r} must be a non-empty list, got "
                                    f"{data[key]!r}")
        tokens, sps = data["sample_batch_tokens"], data["sample_steps_per_sec"]
        if len(tokens) != len(sps):
            raise SPSTableError(f"{source}: sample_batch_tokens has {len(tokens)} entries but "
                                f"sample_steps_per_sec has {len(sps)}")
        for i, b in enumerate(tokens):
            if not _is_int(b) or b < 1:
                raise SPSTableError(f"{source}: sample_batch_tokens[{i}] must be an integer "
                                    f">= 1, got {b!r}")
            if i and b <= tokens[i - 1]:
                raise SPSTableError(f"{source}: sample_batch_tokens must be strictly "
                                    f"increasing, but [{i - 1}] = {tokens[i - 1]} and [{i}] = {b}")
        for i, s in enumerate(sps):
            if not _is_number(s) or not math.isfinite(s) or s <= 0:
                raise SPSTableError(f"{source}: sample_steps_per_sec[{i}] must be a finite "
                                    f"number > 0, got {s!r}")
        max_tokens = data.get("max_batch_tokens", tokens[-1])
        if not _is_int(max_tokens) or not tokens[-1] <= max_tokens <= MAX_TABLE_TOKENS:
            raise SPSTableError(f"{source}: max_batch_tokens must be an integer in "
                                f"[{tokens[-1]} (the last probe), {MAX_TABLE_TOKENS}], got "
                                f"{max_tokens!r}")
        return cls(tuple(tokens), tuple(float(s) for s in sps), int(max_tokens))

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "SPSTable":
        """Read and validate a JSON table file."""
        what = f"SPS table {os.fspath(path)}"
        return cls.from_dict(read_json_file(path, what, SPSTableError), source=what)

    @classmethod
    def constant(cls, max_batch_tokens: int, steps_per_sec: float = 1.0) -> "SPSTable":
        """A flat table up to ``max_batch_tokens`` (the scheduler then verifies whole blocks)."""
        return cls.from_dict({"sample_batch_tokens": [1], "sample_steps_per_sec":
                              [steps_per_sec], "max_batch_tokens": max_batch_tokens},
                             source="constant SPS table")

    @classmethod
    def from_samples(cls, samples: Sequence[Tuple[int, float]],
                     max_batch_tokens: Union[int, None] = None) -> "SPSTable":
        """Build from ``(batch_tokens, steps_per_sec)`` pairs (any order; e.g. a profiler's)."""
        pairs = sorted(samples)
        data: Dict[str, Any] = {"sample_batch_tokens": [int(b) for b, _ in pairs],
                                "sample_steps_per_sec": [float(s) for _, s in pairs]}
        if max_batch_tokens is not None:
            data["max_batch_tokens"] = max_batch_tokens
        return cls.from_dict(data, source="SPS samples")

    # ------------------------------------------------------------------ output
    def to_dict(self) -> Dict[str, Any]:
        """The JSON object :meth:`from_dict` accepts."""
        return {"sample_batch_tokens": list(self.sample_batch_tokens),
                "sample_steps_per_sec": list(self.sample_steps_per_sec),
                "max_batch_tokens": self.max_batch_tokens}

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the table as JSON (readable back with :meth:`load`)."""
        with open(os.fspath(path), "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    # ------------------------------------------------------------------ lookup
    def steps_per_sec(self, batch_tokens: int) -> float:
        """``SPS(B)`` by the step rule of the module docstring."""
        if batch_tokens > self.max_batch_tokens:
            return 0.0
        value = self.sample_steps_per_sec[0]
        for b, s in zip(self.sample_batch_tokens, self.sample_steps_per_sec):
            if b > batch_tokens:
                break
            value = s
        return value

    def dense(self) -> List[float]:
        """``SPS(B)`` for ``B = 0 .. max_batch_tokens + 1`` (the last entry is the ``0`` of an
        oversized batch), so that a lookup is one clamped index."""
        out, probe = [], 0
        for b in range(self.max_batch_tokens + 1):
            while probe + 1 < len(self.sample_batch_tokens) and \
                    self.sample_batch_tokens[probe + 1] <= b:
                probe += 1
            out.append(self.sample_steps_per_sec[probe])
        out.append(0.0)
        return out

    def as_tensor(self, device: Union[str, torch.device, None] = None) -> torch.Tensor:
        """:meth:`dense` as a float64 device tensor (what the device planner reads)."""
        return torch.tensor(self.dense(), dtype=torch.float64, device=device)
