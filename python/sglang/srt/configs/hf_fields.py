"""config.json fields that transformers 4 and 5 spell differently, read in one place.

transformers 5 writes the RoPE base inside ``rope_parameters`` (``{"rope_type": "default",
"rope_theta": ...}``) and the weight dtype as ``dtype``; transformers 4 wrote ``rope_theta`` and
``torch_dtype`` at the top level. A config may carry either layout (or both, when a tool copies
the old keys forward): both are read, and a disagreement or a RoPE variant this engine does not
implement is an error naming the field, never a silent default.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = ["rope_theta_of", "dtype_of", "SUPPORTED_ROPE_TYPES"]

# Plain rotary embeddings only: scaled variants (linear, dynamic, yarn, llama3, ...) change the
# frequencies, which the engine's RoPE tables do not model.
SUPPORTED_ROPE_TYPES = ("default",)


def _check_factor(factor: Any, rotary_fraction: float, where: str) -> None:
    if factor is None:
        return
    if not isinstance(factor, (int, float)) or abs(float(factor) - rotary_fraction) > 1e-9:
        raise ValueError(f"{where} {factor!r} is not supported: the engine rotates "
                         f"{rotary_fraction:g} of the head dim (the config's rope head dims)")


def rope_theta_of(raw: Dict[str, Any], default: float, what: str = "config.json",
                  rotary_fraction: float = 1.0) -> float:
    """The RoPE base of ``raw``: ``rope_parameters.rope_theta`` (transformers 5), else the
    top-level ``rope_theta``, else ``default``. ``rotary_fraction`` is the share of the head dim
    the model rotates (Ling's MLA: ``qk_rope_head_dim / head_dim`` = 64 / 128); a
    ``partial_rotary_factor`` in ``rope_parameters`` must equal it (the top-level one of the
    transformers 4 layout is informative only: the rope head dims are the config's). Raises
    ``ValueError`` naming the field for a ``rope_type`` other than
    :data:`SUPPORTED_ROPE_TYPES`, another rotary factor, or two layouts that disagree."""
    top = raw.get("rope_theta")
    params = raw.get("rope_parameters")
    if params is None:
        return float(default if top is None else top)
    if not isinstance(params, dict):
        raise ValueError(f"{what}: rope_parameters must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{what}: rope_parameters.rope_type {rope_type!r} is not supported "
                         f"(only {list(SUPPORTED_ROPE_TYPES)}: plain rotary embeddings)")
    _check_factor(params.get("partial_rotary_factor"), rotary_fraction,
                  f"{what}: rope_parameters.partial_rotary_factor")
    theta = params.get("rope_theta")
    if theta is None:
        return float(default if top is None else top)
    if top is not None and float(top) != float(theta):
        raise ValueError(f"{what}: rope_theta {top!r} and rope_parameters.rope_theta {theta!r} "
                         "disagree; keep one")
    return float(theta)


def dtype_of(raw: Dict[str, Any], default: str) -> str:
    """The checkpoint's weight dtype name: ``dtype`` (transformers 5) or ``torch_dtype``."""
    value: Optional[Any] = raw.get("dtype") or raw.get("torch_dtype")
    return str(value) if value else default
