"""Tiny random DSpark draft checkpoints for tests, in the published layout.

The draft matches a target's hidden size, vocabulary and layer count: by default the bundled
model's (``python/sglang/assets/tiny-bailing-v3``), or any BailingMoeV3 config dict such as
:func:`sglang.test.random_checkpoint.tiny_config`. Weights come from the reference draft
(:class:`~sglang.train.reference_dspark.ReferenceDSparkDraft`) plus :func:`randomize_for_tests`.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Dict, Optional

import torch

from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR
from sglang.train.reference_dspark import ReferenceDSparkDraft
from sglang.train.reference_mla import RMSNorm

__all__ = ["bundled_target_config", "tiny_dspark_config", "randomize_for_tests",
           "write_random_dspark_checkpoint"]

# Where each published layout keeps the drafter keys (configs/dspark.py reads all of them).
LAYOUTS = ("deepspec", "dflash", "dspark_config", "prefixed")


def bundled_target_config() -> Dict[str, Any]:
    """The bundled target's config.json dict."""
    with open(BUNDLED_MODEL_DIR / "config.json") as f:
        return json.load(f)


def tiny_dspark_config(target: Optional[Dict[str, Any]] = None, layout: str = "deepspec",
                       **overrides: Any) -> Dict[str, Any]:
    """A small draft config.json dict for ``target`` (default: the bundled model's config).

    Defaults: 2 draft layers, 4 query / 2 KV heads of 16, SwiGLU 96, gamma 4, Markov rank 16,
    confidence head with the Markov feature, mask token = the last vocabulary id, target layers
    chosen by the DFlash rule. ``layout`` places the drafter keys as DeepSpec (top level),
    DFlash (``dflash_config``), ``dspark_config`` or the target-config ``dspark_*`` spelling;
    keyword arguments override top-level fields (before the layout move).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    target = bundled_target_config() if target is None else target
    layers = int(target["num_hidden_layers"])
    cfg: Dict[str, Any] = {
        "architectures": ["LingDSparkModel"],
        "model_type": "qwen3",
        "hidden_size": target["hidden_size"],
        "vocab_size": target["vocab_size"],
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * 2,
        "num_target_layers": layers,
        "block_size": 4,
        "mask_token_id": target["vocab_size"] - 1,
        "target_layer_ids": [1, layers - 3] if layers > 4 else [0],
        "num_anchors": 512,  # a training field, present in published configs and ignored
        "markov_rank": 16,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    return _move_keys(cfg, layout)


def _move_keys(cfg: Dict[str, Any], layout: str) -> Dict[str, Any]:
    cfg = copy.deepcopy(cfg)
    if layout == "dflash":
        cfg["dflash_config"] = {k: cfg.pop(k) for k in ("target_layer_ids", "mask_token_id",
                                                        "block_size")}
    elif layout == "dspark_config":
        cfg["dspark_config"] = {k: cfg.pop(k) for k in ("markov_rank", "markov_head_type",
                                                        "mask_token_id")}
    elif layout == "prefixed":
        for key, prefixed in (("block_size", "dspark_block_size"),
                              ("markov_rank", "dspark_markov_rank"),
                              ("markov_head_type", "dspark_markov_head_type"),
                              ("mask_token_id", "dspark_noise_token_id"),
                              ("target_layer_ids", "dspark_target_layer_ids")):
            cfg[prefixed] = cfg.pop(key)
    return cfg


@torch.no_grad()
def randomize_for_tests(model: ReferenceDSparkDraft, seed: int = 0) -> None:
    """Make every weight matter in a parity test: norm weights ``1 + 0.2 N(0, 1)``, a non-zero
    confidence bias, and a Markov table large enough to change the argmax."""
    gen = torch.Generator().manual_seed(seed + 1)
    for mod in model.modules():
        if isinstance(mod, RMSNorm):
            mod.weight.copy_(1.0 + 0.2 * torch.randn(mod.weight.shape, generator=gen))
    w1 = model.markov_head.markov_w1.weight
    w1.copy_(torch.randn(w1.shape, generator=gen))
    if model.config.enable_confidence_head:
        model.confidence_head.proj.bias.fill_(0.7)


def write_random_dspark_checkpoint(path: str, config: Optional[Dict[str, Any]] = None,
                                   seed: int = 0, dtype: torch.dtype = torch.float32,
                                   extra_tensors: Optional[Dict[str, torch.Tensor]] = None
                                   ) -> str:
    """Write a random draft checkpoint of ``config`` (default :func:`tiny_dspark_config`) to
    ``path``; ``extra_tensors`` are stored too (e.g. ``embed_tokens.weight`` / ``lm_head.weight``
    copies, as DeepSpec saves them)."""
    cfg = tiny_dspark_config() if config is None else copy.deepcopy(config)
    model = ReferenceDSparkDraft(cfg, seed=seed)
    randomize_for_tests(model, seed)
    return model.save_pretrained(path, dtype=dtype, extra_tensors=extra_tensors)
