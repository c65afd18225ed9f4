"""Resolve ``--model-path`` (a checkpoint folder, a shipped preset name, or nothing) to a config.

A preset (e.g. ``ling-3.0-flash``) is a config.json that ships in the package: it lets
``--load-format dummy`` build the real architecture without any checkpoint on disk.
``--json-model-override-args`` is applied on top of the raw dict before parsing, so derived
quantities (layer pattern, per-layer lists) stay consistent with the overridden fields.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Union

from sglang.srt.configs.bailing_moe_v3 import BailingMoeV3Config, ConfigError
from sglang.srt.configs.dspark import is_dspark_config_file

PRESET_DIR = Path(__file__).parent / "presets"
# The bundled tiny model (trained by sglang.train); used when no --model-path is given.
BUNDLED_MODEL_DIR = Path(__file__).resolve().parents[2] / "assets" / "tiny-bailing-v3"


def list_presets() -> list:
    """Names usable as ``--model-path`` without files on disk. DSpark draft presets
    (``configs/dspark.py``) are ``--speculative-draft-model-path`` values: not listed."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json") if not is_dspark_config_file(p))


def resolve_model_path(model_path: Optional[str]) -> str:
    """Map ``None`` to the bundled model; leave folders and preset names unchanged."""
    if model_path:
        return model_path
    if not (BUNDLED_MODEL_DIR / "config.json").exists():
        raise ConfigError(
            "no --model-path given and the bundled model is not present at "
            f"{BUNDLED_MODEL_DIR}; pass --model-path (a checkpoint folder or a preset: "
            f"{', '.join(list_presets())})"
        )
    return str(BUNDLED_MODEL_DIR)


def is_preset(model_path: str) -> bool:
    """Whether ``model_path`` names a target preset (a folder of that name wins)."""
    path = PRESET_DIR / f"{model_path}.json"
    return not os.path.isdir(model_path) and path.exists() and not is_dspark_config_file(path)


# ``owner/name`` as the Hugging Face Hub spells a repo id (letters, digits, ``-``, ``_``, ``.``).
_HF_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def looks_like_repo_id(model_path: str) -> bool:
    """Whether ``model_path`` (known not to be a folder here) reads as a Hub repo id."""
    return bool(_HF_REPO_ID.fullmatch(model_path)) and ".." not in model_path


def missing_model_message(model_path: str) -> str:
    """What to do when ``--model-path`` is neither a folder nor a preset.

    A repo id is the usual mistake of a user coming from upstream SGLang, which downloads it;
    this engine reads local files only, so the message says how to get them and which files a
    checkpoint folder needs, and offers the presets (random weights, nothing to download).
    """
    presets = ", ".join(list_presets())
    files = ("config.json, the *.safetensors shards with model.safetensors.index.json, and "
             "the tokenizer files tokenizer.json and tokenizer_config.json")
    alternative = (f"or, for random weights without any download, pass a preset ({presets}) "
                   "with --load-format dummy")
    if looks_like_repo_id(model_path):
        local = "./" + model_path.split("/")[-1]
        return (f"--model-path {model_path!r} looks like a Hugging Face repo id, but this "
                "engine never downloads models: download the checkpoint folder first, e.g. "
                f"`huggingface-cli download {model_path} --local-dir {local}` (the folder "
                f"needs {files}), then pass --model-path {local}; {alternative}")
    return (f"--model-path {model_path!r} is neither a checkpoint folder nor a preset; this "
            f"engine never downloads models: pass a local folder holding {files}; "
            f"{alternative}")


def load_raw_config(model_path: str) -> Dict[str, Any]:
    """Read config.json from a folder, or a preset by name."""
    if os.path.isdir(model_path):
        path = Path(model_path) / "config.json"
        if not path.exists():
            raise ConfigError(f"{model_path!r} has no config.json")
    elif is_preset(model_path):
        path = PRESET_DIR / f"{model_path}.json"
    elif (PRESET_DIR / f"{model_path}.json").exists():
        raise ConfigError(
            f"--model-path {model_path!r} is a DSpark draft preset, not a target: pass it as "
            "--speculative-draft-model-path with --speculative-algorithm DSPARK and "
            f"--load-format dummy (targets: {', '.join(list_presets())})")
    else:
        raise ConfigError(missing_model_message(model_path))
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e


def parse_override_args(override: Union[None, str, Dict[str, Any]]) -> Dict[str, Any]:
    """Parse ``--json-model-override-args`` (a JSON object string, or an already-parsed dict)."""
    if not override:
        return {}
    if isinstance(override, dict):
        return dict(override)
    try:
        value = json.loads(override)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--json-model-override-args is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ConfigError("--json-model-override-args must be a JSON object")
    return value


def apply_overrides(raw: Dict[str, Any], overrides: Dict[str, Any]) -> Dict[str, Any]:
    """Overlay overrides; per-layer lists are truncated to a smaller ``num_hidden_layers``."""
    out = dict(raw)
    out.update(overrides)
    n = out.get("num_hidden_layers")
    if isinstance(n, int) and "num_hidden_layers" in overrides:
        for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            if key not in overrides and isinstance(out.get(key), list):
                out[key] = out[key][:n]
    return out


@dataclass
class ModelConfig:
    """What the engine needs to know about the model: the parsed config plus where it came from."""

    model_path: str
    hf_config: BailingMoeV3Config
    raw: Dict[str, Any]
    is_preset: bool

    @classmethod
    def from_path(
        cls,
        model_path: Optional[str],
        json_model_override_args: Union[None, str, Dict[str, Any]] = None,
    ) -> "ModelConfig":
        path = resolve_model_path(model_path)
        raw = apply_overrides(load_raw_config(path), parse_override_args(json_model_override_args))
        return cls(path, BailingMoeV3Config.from_dict(raw), raw, is_preset(path))

    @property
    def quantization_config(self) -> Optional[Dict[str, Any]]:
        """The checkpoint's ``quantization_config`` (how its weights are stored), or ``None``."""
        return self.raw.get("quantization_config")

    @property
    def context_len(self) -> int:
        return int(self.hf_config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size
