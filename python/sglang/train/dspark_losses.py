"""Training losses of a DSpark draft, on the ``[..., gamma]`` slots of anchor blocks.

Slot ``k`` (0-based; the anchor's own slot is ``k = 0``) predicts the token at
``anchor + k + 1``. Every loss takes a boolean ``valid [..., gamma]`` (per block a contiguous
prefix: the slots whose label lies inside the generated response) and the position weights
``w_k = exp(-k / decay)`` of :func:`position_weights` (DeepSpec's ``loss_decay_gamma = 4``:
1, .78, .61, .47, .37, .29, .22 for seven slots). Each term is a weighted mean
``sum(w * valid * loss) / sum(w * valid)`` over the batch.

* :func:`decayed_cross_entropy`: CE of the Markov-corrected draft logits against the target's
  own generated next tokens;
* :func:`l1_distance`: ``||p_d - p_t||_1`` between the draft and target distributions (twice
  the total variation; ``1 - 0.5 * L1`` is the probability that speculative sampling keeps the
  draft token, :func:`acceptance_probability`);
* :func:`confidence_bce`: BCE-with-logits of the confidence head against the *detached* soft
  label ``1 - 0.5 * ||p_d - p_t||_1``;
* :func:`expected_accept_length`: the differentiable expected accepted-prefix length
  ``sum_k prod_{i<=k} alpha_i`` with ``alpha_i = 1 - 0.5 * ||p_d,i - p_t,i||_1``. Unlike the
  per-slot L1, its gradient weighs slot ``k`` by how likely all earlier slots survive, so it
  spends capacity where longer accepted prefixes are actually won. Its loss,
  :func:`acceptance_loss`, is ``-E[A] / gamma`` (in ``[-1, 0]`` whatever the block size).

:func:`dspark_loss` combines them as ``alpha_ce * CE + alpha_tv * L1 + alpha_conf * BCE +
alpha_accept * L_accept``. The defaults are plain CE and the confidence head's BCE (1, 0, 1, 0):
on the bundled target, three training seeds each, they gave a higher held-out accept length
than the DSpark recipe's 0.1 CE + 0.9 L1 with the acceptance term at 0.5 (docs/
speculative_decoding.md, "Training ablation"); the other terms stay available by weight.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.nn.functional as F

__all__ = [
    "LossWeights",
    "position_weights",
    "weighted_mean",
    "token_nll",
    "decayed_cross_entropy",
    "l1_distance",
    "acceptance_probability",
    "confidence_bce",
    "expected_accept_length",
    "acceptance_loss",
    "dspark_loss",
]


@dataclass(frozen=True)
class LossWeights:
    """Weights of the four terms and the position decay (``loss_decay_gamma``)."""

    alpha_ce: float = 1.0
    alpha_tv: float = 0.0
    alpha_conf: float = 1.0
    alpha_accept: float = 0.0
    decay: float = 4.0

    def __post_init__(self) -> None:
        for name in ("alpha_ce", "alpha_tv", "alpha_conf", "alpha_accept"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not (math.isfinite(self.decay) and self.decay > 0):
            raise ValueError(f"the loss decay must be > 0, got {self.decay!r}")


def position_weights(gamma: int, decay: float = 4.0, device: Optional[torch.device] = None
                     ) -> torch.Tensor:
    """``exp(-k / decay)`` for the 0-based slots ``k = 0 .. gamma-1`` (fp32 ``[gamma]``)."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if not decay > 0:
        raise ValueError(f"decay must be > 0, got {decay}")
    return torch.exp(-torch.arange(gamma, dtype=torch.float32, device=device) / decay)


def weighted_mean(values: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor
                  ) -> torch.Tensor:
    """``sum(w * valid * values) / sum(w * valid)`` over ``[..., gamma]``; 0 with no valid slot
    (a batch of only padding blocks must not produce NaN)."""
    if values.shape != valid.shape:
        raise ValueError(f"values {tuple(values.shape)} and valid {tuple(valid.shape)} differ")
    w = weights.to(values.device) * valid.to(values.dtype)
    # where(): an invalid slot's value may be inf/NaN (e.g. a padding row) and 0 * inf = NaN.
    total = torch.where(valid, values, torch.zeros_like(values)) * w
    return total.sum() / w.sum().clamp_min(1e-12)


def token_nll(log_probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``-log_probs[..., label]``: ``[..., V]`` and ``[...]`` -> ``[...]`` (negative labels of
    padding slots read token 0; the validity mask drops them)."""
    return -log_probs.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)


def decayed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor:
    """Position-decayed CE of ``logits [..., gamma, V]`` against ``labels [..., gamma]``."""
    nll = token_nll(torch.log_softmax(logits.float(), dim=-1), labels)
    return weighted_mean(nll, valid, weights)


def l1_distance(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """``||p_d - p_t||_1`` over the last (vocabulary) axis: ``[..., V] -> [...]``."""
    if draft_probs.shape != target_probs.shape:
        raise ValueError(f"draft {tuple(draft_probs.shape)} and target "
                         f"{tuple(target_probs.shape)} distributions differ in shape")
    return (draft_probs - target_probs).abs().sum(-1)


def acceptance_probability(l1: torch.Tensor) -> torch.Tensor:
    """``1 - 0.5 * L1`` clamped to [0, 1] (rounding can leave it a hair outside)."""
    return (1.0 - 0.5 * l1).clamp(0.0, 1.0)


def confidence_bce(confidence_logits: torch.Tensor, l1: torch.Tensor, valid: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """BCE-with-logits of ``confidence_logits [..., gamma]`` against the detached soft label
    ``1 - 0.5 * l1``: the head learns to predict acceptance, it must not move the draft."""
    label = acceptance_probability(l1.detach())
    bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), label, reduction="none")
    return weighted_mean(bce, valid, weights)


def expected_accept_length(alpha: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``sum_k prod_{i<=k} alpha_i`` per block: ``alpha, valid [..., gamma] -> [...]``.

    An invalid slot contributes acceptance 0, which ends the prefix there (valid slots form a
    prefix, so nothing after it counts either).
    """
    if alpha.shape != valid.shape:
        raise ValueError(f"alpha {tuple(alpha.shape)} and valid {tuple(valid.shape)} differ")
    a = torch.where(valid, alpha, torch.zeros_like(alpha))
    return torch.cumprod(a, dim=-1).sum(-1)


def acceptance_loss(alpha: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``-mean(E[A]) / gamma`` over the blocks with at least one valid slot (0 if none)."""
    gamma = alpha.shape[-1]
    has_any = valid.any(-1)
    length = expected_accept_length(alpha, valid)
    n = has_any.sum().clamp_min(1)
    return -(length * has_any.to(length.dtype)).sum() / (n * gamma)


def dspark_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor,
                valid: torch.Tensor, confidence_logits: Optional[torch.Tensor],
                weights: LossWeights) -> Dict[str, torch.Tensor]:
    """All terms for one batch of blocks.

    ``draft_logits [..., gamma, V]`` (Markov-corrected, teacher-forced prev tokens),
    ``target_logits`` alike (the target's distribution for the same next token; no gradient),
    ``labels, valid [..., gamma]``, ``confidence_logits [..., gamma]`` or ``None`` (no head).
    Returns ``loss`` (the weighted total) plus each term and two detached statistics:
    ``alpha`` (mean per-slot acceptance over valid slots, ``[gamma]``) and ``tau`` (mean
    ``1 + E[A]`` per block, the expected tokens per round under sampling).
    """
    gamma = labels.shape[-1]
    w = position_weights(gamma, weights.decay, draft_logits.device)
    # One log-softmax serves the CE and the draft probabilities (the vocabulary-wide passes
    # dominate a step on the CPU).
    log_p_d = torch.log_softmax(draft_logits.float(), dim=-1)
    p_d = log_p_d.exp()
    p_t = torch.softmax(target_logits.detach().float(), dim=-1)
    l1 = l1_distance(p_d, p_t)
    alpha = acceptance_probability(l1)
    out = {
        "ce": weighted_mean(token_nll(log_p_d, labels), valid, w),
        "tv": weighted_mean(l1, valid, w),
        "accept": acceptance_loss(alpha, valid),
    }
    if confidence_logits is not None:
        out["conf"] = confidence_bce(confidence_logits, l1, valid, w)
    else:
        out["conf"] = torch.zeros((), device=draft_logits.device)
    out["loss"] = (weights.alpha_ce * out["ce"] + weights.alpha_tv * out["tv"]
                   + weights.alpha_conf * out["conf"] + weights.alpha_accept * out["accept"])
    with torch.no_grad():
        v = valid.flatten(0, -2).float()
        out["alpha"] = (alpha.detach().flatten(0, -2) * v).sum(0) / v.sum(0).clamp_min(1)
        has_any = valid.any(-1)
        length = expected_accept_length(alpha.detach(), valid)
        out["tau"] = 1 + (length * has_any).sum() / has_any.sum().clamp_min(1)
    return out
