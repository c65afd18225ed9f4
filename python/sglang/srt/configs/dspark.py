"""Configuration of a DSpark draft model, parsed from the draft checkpoint's ``config.json``.

A DSpark draft (described in ``srt/models/dspark.py``) is a small Qwen3-style block drafter:
decoder layers over ``[anchor, MASK x (gamma - 1)]`` conditioned on projected hidden states of
chosen target layers, a low-rank Markov head and a confidence head. Its ``config.json`` is a copy
of a text config (the attention / MLP sizes of the draft layers) plus the drafter's own keys,
which published checkpoints spell in several places. Each drafter key is looked up in this order
(first hit wins):

1. the target-config spelling with a ``dspark_`` prefix at the top level (``dspark_block_size``,
   ``dspark_markov_rank``, ``dspark_markov_head_type``, ``dspark_noise_token_id`` for the mask
   token, ``dspark_target_layer_ids``);
2. a ``dspark_config`` dict;
3. a ``dflash_config`` dict (DFlash-style checkpoints keep ``target_layer_ids``,
   ``mask_token_id``, ``block_size`` there);
4. the top level (DeepSpec's layout: ``block_size``, ``mask_token_id``, ``target_layer_ids``,
   ``num_target_layers``, ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``,
   ``confidence_head_with_markov``).

Defaults: ``block_size`` (= gamma, the number of draft tokens per round) 7, ``markov_rank`` 256,
``markov_head_type`` ``"vanilla"``, confidence head on and fed the Markov feature. Anything the
engine cannot serve is a :class:`ConfigError` naming the field.

Draft presets: ``configs/presets/<name>.json`` files whose ``architectures[0]`` is a DSpark
draft are drafts without weights, usable as ``--speculative-draft-model-path <name>`` with
``--load-format dummy`` (random weights of the real shape, as a target preset is for
``--model-path``). ``ling-3.0-flash-dspark`` has the shape of the published Ling-3.0-flash draft:
5 layers of hidden 2560 (the target's), SwiGLU 6144, 32 query heads, Markov rank 256, the
confidence head, target layers ``[1, 11, 23, 29, 35]`` and the target's vocabulary. Its KV heads
(32) and head_dim (128) are the target's ``num_key_value_heads`` / ``head_dim``: DeepSpec writes
a draft config as a copy of the target's text config with the drafter keys on top, and the
draft's MLP width 6144 is the target's ``intermediate_size``, which that copy explains; the
reference facts give no other value. ``block_size`` is 15: the published "block 16" counts the
anchor (DFlash's convention), i.e. 15 drafts and a verify window of 16, which is gamma 15 here
(``--speculative-dspark-block-size 7`` gives the DeepSpec block-7 round). Its ``mask_token_id``
is the last id of the padded vocabulary (a spare id, as Qwen3 drafts use one); with dummy
weights any id costs the same. ``rope_theta`` and ``max_position_embeddings`` are the target's,
by the same copy.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from sglang.srt.configs.bailing_moe_v3 import ConfigError
from sglang.srt.configs.hf_fields import dtype_of, rope_theta_of

__all__ = [
    "DSPARK_ARCHITECTURES",
    "DEFAULT_DSPARK_GAMMA",
    "DEFAULT_MARKOV_RANK",
    "DSPARK_SUBFOLDER",
    "DSparkDraftConfig",
    "default_target_layer_ids",
    "dspark_preset_file",
    "dspark_preset_for_target",
    "dspark_preset_needs_dummy",
    "find_dspark_draft",
    "is_dspark_config_file",
    "is_dspark_preset",
    "list_dspark_presets",
]

# Upstream's names for the same model: a DFlash draft plus Markov and confidence heads.
DSPARK_ARCHITECTURES = ("DSparkDraftModel", "LingDSparkModel", "Qwen3DSparkModel")
DEFAULT_DSPARK_GAMMA = 7
DEFAULT_MARKOV_RANK = 256
DSPARK_SUBFOLDER = "dspark"
_MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")

# Drafter keys: name -> the target-config (prefixed) spelling, when there is one.
_PREFIXED = {
    "block_size": "dspark_block_size",
    "markov_rank": "dspark_markov_rank",
    "markov_head_type": "dspark_markov_head_type",
    "mask_token_id": "dspark_noise_token_id",
    "target_layer_ids": "dspark_target_layer_ids",
}

# Text-config fields of the draft layers that have no default.
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "vocab_size")


def _drafter_value(raw: Dict[str, Any], key: str, default: Any = None) -> Any:
    """``key`` looked up in the order of the module docstring."""
    prefixed = _PREFIXED.get(key)
    if prefixed is not None and raw.get(prefixed) is not None:
        return raw[prefixed]
    for section in ("dspark_config", "dflash_config"):
        sub = raw.get(section)
        if sub is None:
            continue
        if not isinstance(sub, dict):
            raise ConfigError(f"{section} must be a JSON object, got {type(sub).__name__}")
        if sub.get(key) is not None:
            return sub[key]
    value = raw.get(key)
    return default if value is None else value


def _int(name: str, value: Any, minimum: int) -> int:
    # bool is an int in Python; a true/false here is a typo, not a number.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def _rope_theta(raw: Dict[str, Any]) -> float:
    """The draft's RoPE base from either config layout (``hf_fields.rope_theta_of``)."""
    try:
        return rope_theta_of(raw, 10000.0, "the DSpark draft config")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def default_target_layer_ids(num_target_layers: int, count: int) -> List[int]:
    """The DFlash default choice of ``count`` target layers when a checkpoint names none: one
    layer -> the middle one; more -> evenly spaced from layer 1 to layer ``L - 3``, rounded."""
    _int("num_target_layers", num_target_layers, 1)
    _int("number of target layers to choose", count, 1)
    if count == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ConfigError(
            f"cannot choose {count} default target layers from a {num_target_layers}-layer "
            "target; set target_layer_ids in the draft config")
    span = end - start
    return [int(round(start + i * span / (count - 1))) for i in range(count)]


@dataclass
class DSparkDraftConfig:
    """Parsed draft config: the draft layers' text config plus the drafter's fields."""

    hidden_size: int
    num_hidden_layers: int  # draft decoder layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: List[int]
    block_size: int = DEFAULT_DSPARK_GAMMA  # gamma: query slots = draft tokens per round
    num_target_layers: Optional[int] = None
    markov_rank: int = DEFAULT_MARKOV_RANK
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    torch_dtype: str = "bfloat16"
    architectures: List[str] = field(default_factory=lambda: [DSPARK_ARCHITECTURES[0]])

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, raw: Dict[str, Any], target_config: Any = None,
                  block_size: Optional[int] = None) -> "DSparkDraftConfig":
        """Parse a draft ``config.json`` dict.

        ``target_config`` (a :class:`~sglang.srt.configs.bailing_moe_v3.BailingMoeV3Config` or
        anything with ``hidden_size``, ``vocab_size``, ``num_hidden_layers``) enables the checks
        against the target and the default target layers. ``block_size`` overrides the
        checkpoint's gamma (``--speculative-dspark-block-size``).
        """
        if not isinstance(raw, dict):
            raise ConfigError(f"a draft config must be a JSON object, got {type(raw).__name__}")
        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or not archs or archs[0] not in DSPARK_ARCHITECTURES:
            got = archs[0] if isinstance(archs, list) and archs else archs or None
            raise ConfigError(f"architectures[0] = {got!r} is not a DSpark draft; expected one of "
                              f"{', '.join(DSPARK_ARCHITECTURES)}")
        if raw.get("speculators_model_type") == "dspark":
            # Those checkpoints train slot j to predict anchor + j with slot 0 unused; served with
            # this engine's convention (slot k predicts anchor + k + 1) every draft is off by one.
            raise ConfigError(
                "speculators_model_type 'dspark': checkpoints trained with the speculators slot "
                "convention (slot j predicts anchor+j) are not supported; this engine serves the "
                "DeepSpec convention (slot k predicts anchor+k+1)")
        missing = [k for k in _REQUIRED if raw.get(k) is None]
        if missing:
            raise ConfigError(f"draft config.json is missing required field(s): "
                              f"{', '.join(missing)}")
        cls._refuse_unsupported(raw)
        hidden = _int("hidden_size", raw["hidden_size"], 1)
        heads = _int("num_attention_heads", raw["num_attention_heads"], 1)
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(f"head_dim is absent and hidden_size {hidden} is not divisible "
                                  f"by num_attention_heads {heads}")
            head_dim = hidden // heads
        mask = _drafter_value(raw, "mask_token_id")
        if mask is None:
            raise ConfigError("the draft config has no mask_token_id (also looked for "
                              "dspark_noise_token_id, dspark_config and dflash_config)")
        gamma = block_size if block_size is not None else _drafter_value(
            raw, "block_size", DEFAULT_DSPARK_GAMMA)
        cfg = cls(
            hidden_size=hidden,
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            mask_token_id=mask,
            target_layer_ids=_drafter_value(raw, "target_layer_ids"),
            block_size=gamma,
            num_target_layers=_drafter_value(raw, "num_target_layers"),
            markov_rank=_drafter_value(raw, "markov_rank", DEFAULT_MARKOV_RANK),
            markov_head_type=_drafter_value(raw, "markov_head_type", "vanilla"),
            enable_confidence_head=_drafter_value(raw, "enable_confidence_head", True),
            confidence_head_with_markov=_drafter_value(raw, "confidence_head_with_markov", True),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            torch_dtype=dtype_of(raw, "bfloat16"),
            architectures=list(archs),
        )
        if cfg.target_layer_ids is None:
            layers = (target_config.num_hidden_layers if target_config is not None
                      else cfg.num_target_layers)
            if layers is None:
                raise ConfigError("the draft config has no target_layer_ids and the target's "
                                  "layer count is unknown (num_target_layers absent)")
            # DFlash's rule: as many target layers as draft layers.
            cfg.target_layer_ids = default_target_layer_ids(int(layers), cfg.num_hidden_layers)
        cfg.validate()
        if target_config is not None:
            cfg.validate_for_target(target_config)
        return cfg

    @staticmethod
    def _refuse_unsupported(raw: Dict[str, Any]) -> None:
        """Text-config features the draft layers do not implement."""
        if raw.get("rope_scaling"):
            raise ConfigError(f"rope_scaling {raw['rope_scaling']!r} is not supported for DSpark "
                              "draft layers")
        if raw.get("attention_bias"):
            raise ConfigError("attention_bias=true is not supported: DSpark draft attention "
                              "projections have no bias")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        types = raw.get("layer_types")
        if types is not None and any(t != "full_attention" for t in types):
            raise ConfigError(f"layer_types {types!r}: only 'full_attention' draft layers are "
                              "supported (no sliding window)")

    @classmethod
    def from_path(cls, path: str, target_config: Any = None,
                  block_size: Optional[int] = None) -> "DSparkDraftConfig":
        """Read ``path/config.json``, or the preset's json when ``path`` names a draft preset
        (see :meth:`from_dict`)."""
        preset = dspark_preset_file(path)
        cfg_path = str(preset) if preset is not None else os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"DSpark draft folder {path!r} has no config.json")
        try:
            with open(cfg_path) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from e
        return cls.from_dict(raw, target_config, block_size)

    def to_dict(self) -> Dict[str, Any]:
        """A DeepSpec-layout config.json dict (round-trips through :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check the draft's own invariants; raise :class:`ConfigError` naming the field."""
        for name in _REQUIRED + ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            _int(name, getattr(self, name), 1)
        _int("block_size", self.block_size, 1)
        _int("mask_token_id", self.mask_token_id, 0)
        if self.mask_token_id >= self.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                              f"(vocab_size {self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads {self.num_attention_heads} must be a multiple "
                              f"of num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even (RoPE pairs channels), got {self.head_dim}")
        _int("markov_rank", self.markov_rank, 0)
        if self.markov_rank == 0:
            raise ConfigError("markov_rank must be > 0 for DSPARK (markov_rank 0 is a plain "
                              "DFlash draft, which DSPARK does not serve)")
        if self.markov_head_type not in _MARKOV_HEAD_TYPES:
            raise ConfigError(f"markov_head_type {self.markov_head_type!r} is unknown; DSpark "
                              f"defines {', '.join(_MARKOV_HEAD_TYPES)}")
        if self.markov_head_type != "vanilla":
            raise ConfigError(f"markov_head_type {self.markov_head_type!r} is not supported yet; "
                              "only 'vanilla' (the published default) is implemented")
        _bool("enable_confidence_head", self.enable_confidence_head)
        _bool("confidence_head_with_markov", self.confidence_head_with_markov)
        ids = self.target_layer_ids
        if not isinstance(ids, list) or not ids:
            raise ConfigError(f"target_layer_ids must be a non-empty list, got {ids!r}")
        for i, layer in enumerate(ids):
            if layer == -1:
                raise ConfigError(
                    f"target_layer_ids[{i}] is -1, which in DeepSpec's convention selects the "
                    "embedding output; this engine captures decoder-layer outputs only (ids "
                    "0 .. num_target_layers - 2)")
            _int(f"target_layer_ids[{i}]", layer, 0)
        if self.num_target_layers is not None:
            _int("num_target_layers", self.num_target_layers, 1)
            self._check_layer_ids(self.num_target_layers, "num_target_layers")

    def _check_layer_ids(self, num_layers: int, source: str) -> None:
        last = num_layers - 1
        for i, layer in enumerate(self.target_layer_ids):
            if layer >= last:
                # The final layer's output is the post-norm state in HF caches, while the draft
                # was trained on raw decoder-layer outputs: it must never be selected.
                what = "the final layer" if layer == last else "past the last layer"
                raise ConfigError(
                    f"target_layer_ids[{i}] = {layer} is {what} of a {num_layers}-layer target "
                    f"({source}); allowed: 0..{last - 1}")

    def validate_for_target(self, target_config: Any) -> None:
        """Checks against the target the draft will run with (hidden size, vocabulary, layers)."""
        if self.hidden_size != target_config.hidden_size:
            raise ConfigError(f"draft hidden_size {self.hidden_size} must equal the target's "
                              f"hidden_size {target_config.hidden_size} (the draft shares the "
                              "target's embedding and LM head)")
        if self.vocab_size != target_config.vocab_size:
            raise ConfigError(f"draft vocab_size {self.vocab_size} must equal the target's "
                              f"vocab_size {target_config.vocab_size}")
        layers = target_config.num_hidden_layers
        if self.num_target_layers is not None and self.num_target_layers != layers:
            raise ConfigError(f"num_target_layers {self.num_target_layers}: the draft was trained "
                              f"for a {self.num_target_layers}-layer target, this target has "
                              f"{layers} layers")
        self._check_layer_ids(layers, "target num_hidden_layers")

    # ------------------------------------------------------------------ derived
    @property
    def gamma(self) -> int:
        """Draft tokens per round (= query slots of the block); the verify window is gamma + 1."""
        return self.block_size

    @property
    def num_context_features(self) -> int:
        """How many target layers' hidden states are concatenated into the context input."""
        return len(self.target_layer_ids)

    @property
    def context_input_size(self) -> int:
        """Width of the concatenated target hidden states ``fc`` projects (``m * hidden``)."""
        return self.num_context_features * self.hidden_size

    @property
    def confidence_input_size(self) -> int:
        """``[h_k ; W1[x_{k-1}]]`` width, or ``hidden`` without the Markov feature."""
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)


# ---------------------------------------------------------------------------------------------
# Draft presets (configs without weights, beside the target presets)
# ---------------------------------------------------------------------------------------------
def _preset_dir() -> Path:
    # Read at call time (model_config imports this module; tests point the presets elsewhere).
    from sglang.srt.configs import model_config

    return Path(model_config.PRESET_DIR)


def is_dspark_config_file(path: Path) -> bool:
    """Whether the config json at ``path`` describes a DSpark draft (``architectures[0]``)."""
    return _architecture_of(path) in DSPARK_ARCHITECTURES


def dspark_preset_file(name: Optional[str]) -> Optional[Path]:
    """The json of draft preset ``name``, or ``None`` when ``name`` is a folder (folders win, as
    for ``--model-path``), not a preset, or a preset of something other than a DSpark draft."""
    if not name or os.path.isdir(name) or os.sep in name or "/" in name:
        return None
    path = _preset_dir() / f"{name}.json"
    return path if path.is_file() and is_dspark_config_file(path) else None


def is_dspark_preset(name: Optional[str]) -> bool:
    """Whether ``name`` (a ``--speculative-draft-model-path`` value) is a DSpark draft preset."""
    return dspark_preset_file(name) is not None


def dspark_preset_needs_dummy(name: str, load_format: Optional[str]) -> str:
    """The refusal of draft preset ``name`` under ``--load-format load_format`` (not dummy)."""
    return (f"--speculative-draft-model-path {name!r} is a DSpark draft preset (a config "
            f"without weights): pass --load-format dummy (got {load_format!r}), or point "
            "--speculative-draft-model-path at a draft checkpoint folder")


def list_dspark_presets() -> List[str]:
    """Names usable as ``--speculative-draft-model-path`` without files (with dummy weights)."""
    return sorted(p.stem for p in _preset_dir().glob("*.json") if is_dspark_config_file(p))


def dspark_preset_for_target(target: Optional[str]) -> Optional[str]:
    """The draft preset named ``<target>-dspark`` for target preset ``target``, if one ships."""
    if not target:
        return None
    name = f"{target}-dspark"
    return name if is_dspark_preset(name) else None


# ---------------------------------------------------------------------------------------------
# Locating the draft checkpoint
# ---------------------------------------------------------------------------------------------
def _architecture_of(config_file: Path) -> Optional[str]:
    """``architectures[0]`` of a config json file, or ``None`` when unreadable/absent."""
    try:
        with open(config_file) as f:
            archs = json.load(f).get("architectures") or [None]
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return archs[0] if isinstance(archs, list) else None


def _architecture(folder: str) -> Optional[str]:
    """``architectures[0]`` of ``folder/config.json``, or ``None`` when unreadable/absent."""
    return _architecture_of(Path(folder) / "config.json")


def _bundles_draft_keys(folder: str) -> Sequence[str]:
    """``dspark_*`` drafter keys in a target's config.json (the marker of a bundled draft)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError):
        return ()
    return sorted(k for k in _PREFIXED.values() if isinstance(raw, dict) and k in raw)


def find_dspark_draft(target_path: Optional[str], draft_path: Optional[str]) -> str:
    """The folder holding the DSpark draft checkpoint.

    ``draft_path`` (``--speculative-draft-model-path``) wins when its config.json is a DSpark
    draft; when it is a target folder instead, its ``dspark/`` subfolder is used. A draft preset
    name is returned as it is (:meth:`DSparkDraftConfig.from_path` reads it; its weights must be
    dummy). Without ``draft_path`` the target's ``dspark/`` subfolder is used. Anything else is
    an error that says where it looked.
    """
    candidates: List[str] = []
    if draft_path and is_dspark_preset(draft_path):
        return draft_path
    if draft_path:
        if not os.path.isdir(draft_path):
            presets = ", ".join(list_dspark_presets()) or "none"
            raise ConfigError(f"--speculative-draft-model-path {draft_path!r} is not a folder "
                              "(models are not downloaded) nor a DSpark draft preset "
                              f"({presets}, with --load-format dummy)")
        candidates += [draft_path, os.path.join(draft_path, DSPARK_SUBFOLDER)]
    elif target_path:
        candidates.append(os.path.join(target_path, DSPARK_SUBFOLDER))
    else:
        raise ConfigError("no DSpark draft: pass --speculative-draft-model-path")
    for folder in candidates:
        if _architecture(folder) in DSPARK_ARCHITECTURES:
            return folder
    base = draft_path or target_path
    bundled = _bundles_draft_keys(base)
    if bundled:
        raise ConfigError(f"{base!r} declares a draft bundled in the target checkpoint "
                          f"({', '.join(bundled)}); only a separate draft folder or a "
                          f"'{DSPARK_SUBFOLDER}/' subfolder is supported")
    looked = ", ".join(os.path.join(c, "config.json") for c in candidates)
    raise ConfigError(f"no DSpark draft config found (looked at {looked}); architectures[0] "
                      f"must be one of {', '.join(DSPARK_ARCHITECTURES)}")
