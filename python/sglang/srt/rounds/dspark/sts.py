"""Sequential Temperature Scaling (STS) of the DSpark confidence head.

The confidence head predicts ``c_k = sigmoid(z_k)``: the probability that draft ``k`` survives
verification given that drafts ``1 .. k-1`` did. The scheduler ranks drafts by the prefix
survival ``a_k = c_1 * ... * c_k``, so what must be calibrated is that *cumulative product*
against the observed event "the first ``k`` drafts were all accepted". STS gives every block
position its own temperature, ``c_k = sigmoid(z_k / T_k)``, fitted on held-out rounds one
position after another: ``T_1`` first, then ``T_2`` with ``T_1`` fixed, and so on, each by a 1-D
search minimising the expected calibration error (ECE) of ``a_k``. A positive temperature keeps
the order of the logits at each position.

File format (``--speculative-dspark-confidence-sts-path``): a JSON list of ``gamma`` positive
numbers, position 1 first, e.g. ``[1.0, 1.35, 1.6, 1.8, 1.9, 2.0, 2.2]``.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from sglang.srt.rounds.dspark.sps import read_json_file

__all__ = [
    "STSError",
    "validate_sts_temperatures",
    "load_sts_temperatures",
    "save_sts_temperatures",
    "prefix_survival",
    "observed_prefix_acceptance",
    "expected_calibration_error",
    "default_temperature_grid",
    "fit_sts",
]

ArrayLike = Union[torch.Tensor, Sequence[Any]]


class STSError(ValueError):
    """A malformed STS temperature table or fitting input; the message names the source."""


# ------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------
def validate_sts_temperatures(values: Any, gamma: Optional[int] = None,
                              source: str = "STS temperatures") -> List[float]:
    """Check a parsed table: a list of finite numbers ``> 0``, of length ``gamma`` when given."""
    if not isinstance(values, list) or not values:
        raise STSError(f"{source}: expected a non-empty JSON list of per-position "
                       f"temperatures, got {type(values).__name__}")
    if gamma is not None and len(values) != gamma:
        raise STSError(f"{source}: has {len(values)} temperatures, the draft's block size "
                       f"(gamma) is {gamma}; one temperature per block position is needed")
    out = []
    for i, t in enumerate(values):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                or t <= 0:
            raise STSError(f"{source}: entry [{i}] must be a finite number > 0, got {t!r}")
        out.append(float(t))
    return out


def load_sts_temperatures(path: Union[str, os.PathLike],
                          gamma: Optional[int] = None) -> List[float]:
    """Read and validate a JSON temperature list (length ``gamma`` when given)."""
    what = f"STS temperatures {os.fspath(path)}"
    return validate_sts_temperatures(read_json_file(path, what, STSError), gamma, source=what)


def save_sts_temperatures(path: Union[str, os.PathLike], temperatures: Sequence[float]) -> None:
    """Write a validated temperature list as JSON."""
    temps = validate_sts_temperatures(list(temperatures), source="save_sts_temperatures")
    with open(os.fspath(path), "w", encoding="utf-8") as f:
        json.dump(temps, f)
        f.write("\n")


# ------------------------------------------------------------------------------------------
# Applying it
# ------------------------------------------------------------------------------------------
def prefix_survival(confidence_logits: torch.Tensor,
                    temperatures: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a[:, k] = prod_{i <= k} sigmoid(z[:, i] / T_i)`` as float64 ``[R, g]``.

    ``confidence_logits [R, g]``; ``temperatures [g]`` (``None``: all 1). Device ops only. The
    product runs left to right, one column at a time, so that every backend (and the host
    reference of the planner) forms exactly the same floating-point values; a parallel scan
    could associate the factors differently.
    """
    if confidence_logits.dim() != 2:
        raise STSError(f"confidence_logits must be [R, gamma], got "
                       f"{tuple(confidence_logits.shape)}")
    z = confidence_logits.to(torch.float64)
    if temperatures is not None:
        if tuple(temperatures.shape) != (z.shape[1],):
            raise STSError(f"temperatures must be [gamma={z.shape[1]}], got "
                           f"{tuple(temperatures.shape)}")
        z = z / temperatures.to(device=z.device, dtype=torch.float64)
    c = torch.sigmoid(z)
    cols = [c[:, 0]] if z.shape[1] else []
    for k in range(1, z.shape[1]):
        cols.append(cols[-1] * c[:, k])
    return torch.stack(cols, dim=1) if cols else c


# ------------------------------------------------------------------------------------------
# Fitting
# ------------------------------------------------------------------------------------------
def observed_prefix_acceptance(accepted_prefix_len: ArrayLike, gamma: int,
                               verify_lens: Optional[ArrayLike] = None
                               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Labels and observation mask ``[N, gamma]`` (bool) of "drafts 1..k were all accepted".

    ``accepted_prefix_len [N]``: accepted drafts per round. ``verify_lens [N]`` (default
    ``gamma``): how many drafts the round verified. Position ``k`` counts as observed only when
    it was verified (``k <= l``). A shorter round whose prefix broke early also *implies* the
    later labels (all failures), but keeping exactly those rounds while dropping the short
    rounds that accepted everything would select on the outcome and bias the fit toward 0.
    """
    acc = torch.as_tensor(accepted_prefix_len).to(torch.int64).reshape(-1)
    n = acc.shape[0]
    lens = (torch.full((n,), gamma, dtype=torch.int64) if verify_lens is None
            else torch.as_tensor(verify_lens).to(torch.int64).reshape(-1))
    if lens.shape[0] != n:
        raise STSError(f"verify_lens has {lens.shape[0]} rounds, accepted_prefix_len {n}")
    if n and (int(lens.min()) < 0 or int(lens.max()) > gamma):
        raise STSError(f"verify_lens must lie in 0..{gamma}")
    if n and (int(acc.min()) < 0 or bool((acc > lens).any())):
        raise STSError("accepted_prefix_len must lie in 0..verify_len of its round")
    k = torch.arange(1, gamma + 1).unsqueeze(0)
    labels = acc.unsqueeze(1) >= k
    observed = k <= lens.unsqueeze(1)
    return labels, observed


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor,
                               num_bins: int = 20) -> torch.Tensor:
    """ECE with ``num_bins`` equal-width bins over [0, 1], batched over leading dims.

    ``probs, labels [..., N]`` -> ``[...]``: ``sum_b (n_b / N) |mean p_b - mean y_b|``.
    """
    if probs.shape != labels.shape or probs.dim() < 1:
        raise STSError(f"probs {tuple(probs.shape)} and labels {tuple(labels.shape)} must "
                       "have the same non-scalar shape")
    if num_bins < 1:
        raise STSError(f"num_bins must be >= 1, got {num_bins}")
    p = probs.to(torch.float64)
    y = labels.to(torch.float64)
    n = p.shape[-1]
    if n == 0:
        return torch.zeros(p.shape[:-1], dtype=torch.float64)
    lead = p.shape[:-1]
    p2, y2 = p.reshape(-1, n), y.reshape(-1, n)
    bins = (p2 * num_bins).floor().clamp_(0, num_bins - 1).to(torch.int64)
    # One bincount over (row, bin) cells: |sum (p - y)| / N per bin is
    # (n_b / N) |mean p_b - mean y_b|.
    cells = bins + num_bins * torch.arange(p2.shape[0], device=p.device).unsqueeze(1)
    gap = torch.bincount(cells.reshape(-1), weights=(p2 - y2).reshape(-1),
                         minlength=p2.shape[0] * num_bins)
    return (gap.view(-1, num_bins).abs().sum(-1) / n).view(lead)


def default_temperature_grid() -> torch.Tensor:
    """Geometric grid 0.05 .. 20 with ratio 10**(1/40) (1.0 included), float64."""
    return torch.pow(10.0, torch.arange(-52, 53, dtype=torch.float64) / 40)


def fit_sts(confidence_logits: ArrayLike, accepted_prefix_len: ArrayLike,
            verify_lens: Optional[ArrayLike] = None, grid: Optional[torch.Tensor] = None,
            num_bins: int = 20) -> List[float]:
    """Fit per-position temperatures by sequential 1-D grid search (module docstring).

    ``confidence_logits [N, gamma]``: the head's logits of ``N`` held-out rounds;
    ``accepted_prefix_len [N]``: drafts accepted in each round (with ``verify_lens``, the
    number verified, see :func:`observed_prefix_acceptance`). For ``k = 1 .. gamma`` the
    temperature ``T_k`` minimises the ECE of ``a_k`` over the rounds where position ``k`` was
    observed, with ``T_1 .. T_{k-1}`` already fixed; ties go to the temperature nearest 1, and
    a position with no observation keeps 1. Returns ``gamma`` floats.
    """
    z = torch.as_tensor(confidence_logits).to(torch.float64).cpu()
    if z.dim() != 2 or z.shape[1] < 1:
        raise STSError(f"confidence_logits must be [N, gamma], got {tuple(z.shape)}")
    if not bool(torch.isfinite(z).all()):
        raise STSError("confidence_logits must be finite")
    gamma = z.shape[1]
    labels, observed = observed_prefix_acceptance(accepted_prefix_len, gamma, verify_lens)
    if labels.shape[0] != z.shape[0]:
        raise STSError(f"accepted_prefix_len has {labels.shape[0]} rounds, confidence_logits "
                       f"{z.shape[0]}")
    temps = default_temperature_grid() if grid is None else \
        torch.as_tensor(grid).to(torch.float64).reshape(-1)
    if temps.numel() == 0 or not bool((temps > 0).all()):
        raise STSError("the temperature grid must be non-empty and positive")
    # Prefer the temperature nearest 1 among equal ECEs: sort the grid by |log T| and let
    # argmin pick the first minimum.
    temps = temps[torch.argsort(temps.log().abs(), stable=True)]
    fitted: List[float] = []
    prefix = torch.ones(z.shape[0], dtype=torch.float64)
    for k in range(gamma):
        rows = observed[:, k]
        best = 1.0
        if bool(rows.any()):
            cand = prefix[rows] * torch.sigmoid(z[rows, k].unsqueeze(0) / temps.unsqueeze(1))
            ece = expected_calibration_error(cand, labels[rows, k].expand_as(cand), num_bins)
            best = float(temps[int(torch.argmin(ece))])
        fitted.append(best)
        prefix = prefix * torch.sigmoid(z[:, k] / best)
    return fitted
