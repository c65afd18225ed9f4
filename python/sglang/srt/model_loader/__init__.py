"""Model construction and weight loading (safetensors, lazy TP slices, dummy weights)."""
from sglang.srt.model_loader.dummy import init_dummy_weights
from sglang.srt.model_loader.loader import (
    LOAD_FORMATS,
    CheckpointError,
    SafetensorsCheckpoint,
    build_model,
    find_safetensors_files,
    get_model,
    load_safetensors_weights,
    match_checkpoint,
    model_weight_bytes,
)
from sglang.srt.model_loader.weight_utils import LazyWeight

__all__ = [
    "LOAD_FORMATS",
    "CheckpointError",
    "LazyWeight",
    "SafetensorsCheckpoint",
    "build_model",
    "find_safetensors_files",
    "get_model",
    "init_dummy_weights",
    "load_safetensors_weights",
    "match_checkpoint",
    "model_weight_bytes",
]
