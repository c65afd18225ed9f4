"""Weight quantisation (``--quantization``): configs, per-layer methods, and how a choice is
resolved against the checkpoint's ``quantization_config``.

``None`` / ``unquant`` -> the unquantized methods; ``fp8`` -> block fp8 (``fp8.py``).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Type

from sglang.srt.configs.engine_defaults import QUANTIZATION_CHOICES
from sglang.srt.layers.quantization.base import (FusedMoEMethodBase, LinearMethodBase,
                                                 QuantizationConfig, QuantizeMethodBase,
                                                 WeightShard, current_quantization_config,
                                                 quantization_scope)
from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod, Fp8MoEMethod
from sglang.srt.layers.quantization.unquant import (UnquantizedFusedMoEMethod,
                                                    UnquantizedLinearMethod)

__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "QuantizeMethodBase",
           "LinearMethodBase", "FusedMoEMethodBase", "WeightShard", "Fp8Config",
           "Fp8LinearMethod", "Fp8MoEMethod", "UnquantizedLinearMethod",
           "UnquantizedFusedMoEMethod", "quantization_scope", "current_quantization_config",
           "get_linear_method", "get_moe_method", "resolve_quant_config"]

QUANTIZATION_METHODS: Dict[str, Type[QuantizationConfig]] = {"fp8": Fp8Config}


def get_linear_method(layer) -> LinearMethodBase:
    """The method of a linear layer being built (from the active :func:`quantization_scope`)."""
    config = current_quantization_config()
    return UnquantizedLinearMethod() if config is None else config.get_linear_method(layer)


def get_moe_method(layer) -> FusedMoEMethodBase:
    """The method of a routed-expert block being built."""
    config = current_quantization_config()
    return UnquantizedFusedMoEMethod() if config is None else config.get_moe_method(layer)


def resolve_quant_config(quantization: Optional[str],
                         checkpoint_config: Optional[Dict[str, Any]],
                         flag: str = "--quantization") -> Optional[QuantizationConfig]:
    """The config to build a model with, from the flag and the checkpoint's
    ``quantization_config`` (``None``: unquantized).

    * flag unset: whatever the checkpoint is (fp8 -> loaded as is; none -> unquantized);
    * ``fp8``: the fp8 checkpoint as is, or a bf16/fp32 one quantised at load;
    * ``unquant``: unquantized (an fp8 checkpoint is dequantised at load).

    A checkpoint quantized with another method is an error naming both.
    """
    if quantization is not None and quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"{flag} must be one of {', '.join(QUANTIZATION_CHOICES)}, got "
                         f"{quantization!r}")
    ckpt_method = None
    if checkpoint_config is not None:
        if not isinstance(checkpoint_config, dict):
            raise ValueError("config.json: quantization_config must be an object, got "
                             f"{type(checkpoint_config).__name__}")
        ckpt_method = checkpoint_config.get("quant_method")
        if ckpt_method not in QUANTIZATION_METHODS:
            if quantization in (None, "fp8"):
                asked = "" if quantization is None else f"{flag} {quantization} was given but "
                raise ValueError(f"{asked}the checkpoint is quantized with quant_method "
                                 f"{ckpt_method!r}, which this engine cannot load (supported: "
                                 f"{', '.join(QUANTIZATION_METHODS)})")
            raise ValueError(f"{flag} unquant cannot dequantise a checkpoint quantized with "
                             f"quant_method {ckpt_method!r}")
    if quantization == "unquant":
        return None
    if ckpt_method is not None:
        return QUANTIZATION_METHODS[ckpt_method].from_config(checkpoint_config)
    if quantization is None:
        return None
    return QUANTIZATION_METHODS[quantization](is_checkpoint_fp8_serialized=False)
