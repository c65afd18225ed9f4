"""The DSpark confidence scheduler: how many drafts of each request the target verifies.

Each of ``R`` requests drafted ``gamma`` tokens with confidences ``c_{r,1..gamma}`` (the head's
probability that draft ``j`` survives given the earlier ones did, STS-calibrated, see
:mod:`~sglang.srt.rounds.dspark.sts`). The prefix survival ``a_{r,j} = c_{r,1} ... c_{r,j}``
is the chance that verifying draft ``j`` commits it. With verify lengths ``l_r`` in
``0 .. gamma`` the target forward holds ``B = sum_r (1 + l_r)`` tokens (anchor + drafts) and the
expected committed tokens are ``tau = sum_r (1 + a_{r,1} + ... + a_{r,l_r})``; the scheduler
maximises the expected throughput ``Theta = tau * SPS(B)`` (:mod:`.sps`).

**Greedy with early stop** (:func:`plan_verify_lens`). Because ``a_{r,j}`` does not increase
with ``j``, the gain of extending request ``r`` from ``j - 1`` to ``j`` drafts is exactly
``a_{r,j}``, and walking all ``(r, j)`` in descending ``a`` (ties: request, then ``j``) admits
every request's drafts in prefix order. Starting from ``l = 0`` each candidate adds one token to
``B`` and ``a_{r,j}`` to ``tau``; it is kept while ``Theta`` strictly improves, and the walk
**stops at the first candidate that does not improve it**. The early stop is what keeps
speculative sampling lossless: ``a_{r,j+1}`` depends on the sampled draft ``x_{r,j}`` (through
the Markov feature), so a search that looked past the stop point could let the value of
``x_{r,j}`` decide whether ``x_{r,j}`` itself gets verified, which biases the output. (Our
verification, :mod:`.verify`, draws the token at the cap by a rejection step on the next
draft, which makes one such step of look-ahead harmless but not two; the tests work through
both cases.) The early stop decides ``l_r`` from ``a_{r,j}``, ``j <= l_r + 1``, only.

**Lagged capacity** (:func:`lagged_capacity` + :func:`top_k_verify_lens`), for the overlap
scheduler, which must know the next batch size before the current round ends: the number of
draft tokens ``K`` is computed from confidences of an earlier round (two rounds old) by an
*unconstrained* search (the best ``Theta`` over every prefix of the sorted candidates; safe
because those confidences cannot depend on the current drafts), then the ``K`` candidates with
the highest *current* prefix survival are admitted. With ``K`` fixed, whether ``x_{r,j}`` is
admitted depends on ``a_{r,j}`` (which does not involve ``x_{r,j}``) and on other candidates
that never outrank it and involve it only after it, so admission does not look ahead.

Two forms agree exactly: a host reference over numpy arrays (plain loops, the specification)
and a fixed-shape torch version for the device (no host reads; the SPS table is a dense device
vector, :meth:`SPSTable.as_tensor`). Exactness: both sort the same float64 values with the same
tie order and accumulate ``tau`` in fixed point (units of ``2**-32`` tokens, exact int64 sums,
so no summation order matters), then form ``Theta`` by one IEEE multiplication.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Union

import numpy as np
import torch

from sglang.srt.rounds.dspark.sps import SPSTable
from sglang.srt.rounds.dspark.sts import prefix_survival

__all__ = [
    "TAU_FIXED_POINT_BITS",
    "plan_verify_lens",
    "lagged_capacity",
    "top_k_verify_lens",
    "plan_verify_lens_reference",
    "lagged_capacity_reference",
    "top_k_verify_lens_reference",
    "prefix_survival_reference",
    "DSparkPlanner",
    "verify_tiers",
    "tier_for_budget",
]

TAU_FIXED_POINT_BITS = 32
_SCALE = 1 << TAU_FIXED_POINT_BITS

IntOrTensor = Union[int, torch.Tensor]


# ============================================================================================
# Device form (fixed shapes, no host reads)
# ============================================================================================
def _check(a: torch.Tensor, active: Optional[torch.Tensor],
           max_lens: Optional[torch.Tensor]) -> None:
    if a.dim() != 2 or not a.is_floating_point():
        raise ValueError(f"prefix survival must be a float [R, gamma] tensor, got {a.dtype} "
                         f"{tuple(a.shape)}")
    r = a.shape[0]
    if active is not None and (tuple(active.shape) != (r,) or active.dtype != torch.bool):
        raise ValueError(f"active must be a bool [R={r}] tensor, got {active.dtype} "
                         f"{tuple(active.shape)}")
    if max_lens is not None and (tuple(max_lens.shape) != (r,) or max_lens.is_floating_point()):
        raise ValueError(f"max_lens must be an integer [R={r}] tensor, got {max_lens.dtype} "
                         f"{tuple(max_lens.shape)}")


def _sorted_candidates(a: torch.Tensor, active: Optional[torch.Tensor],
                       max_lens: Optional[torch.Tensor]):
    """All ``(r, j)`` flattened request-major, sorted by descending ``a`` (stable: ties keep
    request, then ``j`` order). Invalid candidates (inactive request, ``j > max_len``) get -1,
    i.e. sort after every valid one. Returns ``(order, a_sorted, valid_sorted, num_active)``."""
    r, g = a.shape
    dev = a.device
    valid = torch.ones(r, g, dtype=torch.bool, device=dev)
    if max_lens is not None:
        valid &= torch.arange(1, g + 1, device=dev).unsqueeze(0) <= max_lens.unsqueeze(1)
    num_active: IntOrTensor = r
    if active is not None:
        valid &= active.unsqueeze(1)
        num_active = active.to(torch.int64).sum()
    vals = torch.where(valid, a.to(torch.float64), torch.full_like(a, -1.0, dtype=torch.float64))
    a_sorted, order = torch.sort(vals.reshape(-1), descending=True, stable=True)
    return order, a_sorted, valid.reshape(-1)[order], num_active


def _theta_curve(a_sorted: torch.Tensor, valid_sorted: torch.Tensor, num_active: IntOrTensor,
                 sps_dense: torch.Tensor) -> torch.Tensor:
    """``Theta_k`` for admitting the first ``k = 0 .. M`` sorted candidates ``[M + 1]``."""
    m = a_sorted.shape[0]
    dev = a_sorted.device
    fixed = torch.floor(a_sorted.clamp(min=0) * _SCALE).to(torch.int64) * valid_sorted
    tau = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), fixed.cumsum(0)])
    tau = tau + num_active * _SCALE
    b = torch.arange(m + 1, device=dev) + num_active
    sps = sps_dense.to(device=dev, dtype=torch.float64)
    return tau.to(torch.float64) * sps[b.clamp(max=sps.shape[0] - 1)]


def _lens_from_count(order: torch.Tensor, valid_sorted: torch.Tensor, count: IntOrTensor,
                     shape: torch.Size) -> torch.Tensor:
    """Verify lengths ``[R]`` when the first ``count`` sorted valid candidates are admitted."""
    m = order.shape[0]
    admitted_sorted = (torch.arange(m, device=order.device) < count) & valid_sorted
    admitted = torch.zeros(m, dtype=torch.bool, device=order.device)
    admitted = admitted.scatter(0, order, admitted_sorted)
    return admitted.view(shape).to(torch.int64).sum(dim=1)


def _check_sps(sps_dense: torch.Tensor) -> None:
    if sps_dense.dim() != 1 or sps_dense.shape[0] < 2:
        raise ValueError(f"sps_dense must be SPSTable.as_tensor() (a [max_batch_tokens + 2] "
                         f"vector), got {tuple(sps_dense.shape)}")


def plan_verify_lens(a: torch.Tensor, sps_dense: torch.Tensor,
                     active: Optional[torch.Tensor] = None,
                     max_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Greedy with early stop (module docstring) -> verify lengths ``[R]`` int64.

    ``a [R, gamma]``: prefix survival (non-increasing along each row, in [0, 1]);
    ``sps_dense``: :meth:`SPSTable.as_tensor`; ``active [R]`` bool (padding rows: ``False``,
    they add nothing to ``B`` or ``tau`` and get 0); ``max_lens [R]``: per-request cap on the
    verify length (e.g. tokens left before ``max_new_tokens``).
    """
    _check(a, active, max_lens)
    _check_sps(sps_dense)
    order, a_sorted, valid_sorted, num_active = _sorted_candidates(a, active, max_lens)
    theta = _theta_curve(a_sorted, valid_sorted, num_active, sps_dense)
    improves = (theta[1:] > theta[:-1]) & valid_sorted
    count = improves.to(torch.int64).cumprod(0).sum()  # leading run of improvements
    return _lens_from_count(order, valid_sorted, count, a.shape)


def lagged_capacity(a_lagged: torch.Tensor, sps_dense: torch.Tensor,
                    active: Optional[torch.Tensor] = None,
                    max_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Draft-token budget ``K`` (0-dim int64) from an earlier round's prefix survival: the
    ``k`` maximising ``Theta_k`` over all prefixes of the sorted candidates (no early stop;
    the smallest such ``k`` on ties). Arguments as :func:`plan_verify_lens`."""
    _check(a_lagged, active, max_lens)
    _check_sps(sps_dense)
    _, a_sorted, valid_sorted, num_active = _sorted_candidates(a_lagged, active, max_lens)
    theta = _theta_curve(a_sorted, valid_sorted, num_active, sps_dense)
    reachable = torch.cat([torch.ones(1, dtype=torch.bool, device=theta.device), valid_sorted])
    theta = torch.where(reachable, theta, torch.full_like(theta, -math.inf))
    return torch.argmax(theta)  # the first maximum


def top_k_verify_lens(a: torch.Tensor, capacity: IntOrTensor,
                      active: Optional[torch.Tensor] = None,
                      max_lens: Optional[torch.Tensor] = None,
                      max_batch_tokens: Optional[int] = None) -> torch.Tensor:
    """Admit the ``capacity`` candidates with the highest current prefix survival ``a``
    (fewer if fewer are valid; with ``max_batch_tokens``, also no more than fit beside the
    active requests' anchors) -> verify lengths ``[R]`` int64."""
    _check(a, active, max_lens)
    order, _, valid_sorted, num_active = _sorted_candidates(a, active, max_lens)
    if max_batch_tokens is not None:
        limit = max_batch_tokens - num_active
        if isinstance(capacity, torch.Tensor) or isinstance(limit, torch.Tensor):
            # torch.full, not torch.tensor: a fill kernel, no host-to-device copy (capturable).
            capacity, limit = (x if isinstance(x, torch.Tensor) else torch.full(
                (), x, dtype=torch.int64, device=a.device) for x in (capacity, limit))
            capacity = torch.minimum(capacity, limit)
        else:
            capacity = min(capacity, limit)
    return _lens_from_count(order, valid_sorted, capacity, a.shape)


# ============================================================================================
# Host reference (plain loops over numpy arrays; the specification of the device form)
# ============================================================================================
def prefix_survival_reference(confidence_logits: np.ndarray,
                              temperatures: Optional[Sequence[float]] = None) -> np.ndarray:
    """``a[r, k] = prod_{i <= k} 1 / (1 + exp(-z[r, i] / T_i))`` in float64."""
    z = np.asarray(confidence_logits, dtype=np.float64)
    out = np.empty_like(z)
    for r in range(z.shape[0]):
        acc = 1.0
        for k in range(z.shape[1]):
            t = 1.0 if temperatures is None else float(temperatures[k])
            acc *= 1.0 / (1.0 + math.exp(-z[r, k] / t))
            out[r, k] = acc
    return out


def _reference_candidates(a: np.ndarray, active: Optional[np.ndarray],
                          max_lens: Optional[np.ndarray]):
    a = np.asarray(a, dtype=np.float64)
    r, g = a.shape
    cands = []
    for i in range(r):
        if active is not None and not active[i]:
            continue
        cap = g if max_lens is None else max(0, min(g, int(max_lens[i])))
        for j in range(1, cap + 1):
            cands.append((-float(a[i, j - 1]), i * g + j - 1, i))
    cands.sort()  # descending a; ties by flat index = request, then j
    num_active = r if active is None else int(np.count_nonzero(active))
    return [(-neg, i) for neg, _, i in cands], num_active


def _fixed(x: float) -> int:
    return int(math.floor(max(x, 0.0) * _SCALE))


def plan_verify_lens_reference(a: np.ndarray, sps: SPSTable, active: Optional[np.ndarray] = None,
                               max_lens: Optional[np.ndarray] = None) -> np.ndarray:
    """Host reference of :func:`plan_verify_lens` (the walk with early stop, literally)."""
    cands, n = _reference_candidates(a, active, max_lens)
    lens = np.zeros(np.asarray(a).shape[0], dtype=np.int64)
    tau, batch = n * _SCALE, n
    best = float(tau) * sps.steps_per_sec(batch)
    for value, r in cands:
        theta = float(tau + _fixed(value)) * sps.steps_per_sec(batch + 1)
        if not theta > best:
            break  # early stop: never look past the first non-improving candidate
        best, tau, batch = theta, tau + _fixed(value), batch + 1
        lens[r] += 1
    return lens


def lagged_capacity_reference(a_lagged: np.ndarray, sps: SPSTable,
                              active: Optional[np.ndarray] = None,
                              max_lens: Optional[np.ndarray] = None) -> int:
    """Host reference of :func:`lagged_capacity` (every prefix evaluated, first maximum)."""
    cands, n = _reference_candidates(a_lagged, active, max_lens)
    tau = n * _SCALE
    best_k, best = 0, float(tau) * sps.steps_per_sec(n)
    for k, (value, _) in enumerate(cands, start=1):
        tau += _fixed(value)
        theta = float(tau) * sps.steps_per_sec(n + k)
        if theta > best:
            best_k, best = k, theta
    return best_k


def top_k_verify_lens_reference(a: np.ndarray, capacity: int, active: Optional[np.ndarray] = None,
                                max_lens: Optional[np.ndarray] = None,
                                max_batch_tokens: Optional[int] = None) -> np.ndarray:
    """Host reference of :func:`top_k_verify_lens`."""
    cands, n = _reference_candidates(a, active, max_lens)
    if max_batch_tokens is not None:
        capacity = min(capacity, max_batch_tokens - n)
    lens = np.zeros(np.asarray(a).shape[0], dtype=np.int64)
    for _, r in cands[:max(0, capacity)]:
        lens[r] += 1
    return lens


# ============================================================================================
# The planner a worker holds
# ============================================================================================
class DSparkPlanner:
    """SPS table and STS temperatures on the device, with the two planning modes.

    ``plan`` (early stop) serves a non-overlapped round; ``capacity`` + ``plan_top_k`` serve the
    overlap scheduler (the worker keeps the earlier round's confidence logits, e.g. in its
    relay, and passes them to ``capacity``).
    """

    def __init__(self, gamma: int, sps_table: SPSTable,
                 sts_temperatures: Optional[Sequence[float]] = None,
                 device: Union[str, torch.device, None] = None):
        if gamma < 1:
            raise ValueError(f"DSparkPlanner: gamma must be >= 1, got {gamma}")
        if sts_temperatures is not None and len(sts_temperatures) != gamma:
            raise ValueError(f"DSparkPlanner: {len(sts_temperatures)} STS temperatures for "
                             f"gamma = {gamma}")
        self.gamma = gamma
        self.sps_table = sps_table
        self.sps_dense = sps_table.as_tensor(device)
        self.temperatures = None if sts_temperatures is None else torch.tensor(
            list(sts_temperatures), dtype=torch.float64, device=device)

    def survival(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        """Calibrated prefix survival ``[R, gamma]`` float64 of the head's logits."""
        if confidence_logits.dim() != 2 or confidence_logits.shape[1] != self.gamma:
            raise ValueError(f"confidence_logits must be [R, gamma={self.gamma}], got "
                             f"{tuple(confidence_logits.shape)}")
        return prefix_survival(confidence_logits, self.temperatures)

    def plan(self, confidence_logits: torch.Tensor, active: Optional[torch.Tensor] = None,
             max_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Verify lengths ``[R]`` by greedy with early stop."""
        return plan_verify_lens(self.survival(confidence_logits), self.sps_dense, active,
                                max_lens)

    def capacity(self, lagged_confidence_logits: torch.Tensor,
                 active: Optional[torch.Tensor] = None,
                 max_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Budget ``K`` (0-dim) from an earlier round's confidence logits."""
        return lagged_capacity(self.survival(lagged_confidence_logits), self.sps_dense, active,
                               max_lens)

    def plan_top_k(self, confidence_logits: torch.Tensor, capacity: IntOrTensor,
                   active: Optional[torch.Tensor] = None,
                   max_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Verify lengths ``[R]``: the ``capacity`` best current candidates."""
        return top_k_verify_lens(self.survival(confidence_logits), capacity, active, max_lens,
                                 self.sps_table.max_batch_tokens)


# ============================================================================================
# Verify-width tiers (--speculative-dspark-verify-mode compact)
# ============================================================================================
def verify_tiers(gamma: int) -> List[int]:
    """Drafts per request a compact round may verify: a quarter, half and all of the block
    (one CUDA graph each), ascending and distinct."""
    return sorted({max(1, gamma // 4), max(1, gamma // 2), gamma})


def tier_for_budget(tiers: Sequence[int], budget: Optional[int]) -> int:
    """The smallest tier holding ``budget`` drafts (a request verifies at most the batch's
    budget), the largest when the budget is unknown or exceeds them all."""
    if budget is None:
        return tiers[-1]
    return next((t for t in tiers if t >= budget), tiers[-1])
