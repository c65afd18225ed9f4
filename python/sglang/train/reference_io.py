"""Hugging Face checkpoint I/O for the reference model: ``config.json``, safetensors (single
``model.safetensors`` or shards + ``model.safetensors.index.json``), ``generation_config.json``."""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Dict, List, Union

import torch
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from sglang.train.reference import ReferenceBailingMoeV3

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Alternative spelling of the router bias in some checkpoints (docs/model.md §2.1, §9.4).
_BIAS_ALIAS = (".mlp.gate.e_score_correction_bias", ".mlp.gate.expert_bias")


def _keeps_fp32(name: str) -> bool:
    """The router selection bias is stored and used in fp32 whatever the checkpoint dtype."""
    return name.endswith("expert_bias")


def read_state_dict(path: str) -> Dict[str, torch.Tensor]:
    """All tensors of the checkpoint directory ``path`` (single file or sharded)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map'")
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(path, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path!r}")
    tensors: Dict[str, torch.Tensor] = {}
    for name in files:
        shard = os.path.join(path, name)
        if not os.path.exists(shard):
            raise FileNotFoundError(f"shard {name!r} listed in {INDEX_FILE} is missing in {path!r}")
        tensors.update(load_file(shard))
    renamed = {}
    for k, v in tensors.items():
        renamed[k.replace(*_BIAS_ALIAS) if k.endswith(_BIAS_ALIAS[0]) else k] = v
    return renamed


def load_checkpoint(cls: type, path: str, dtype: torch.dtype, device: Union[str, torch.device],
                    **kwargs: Any) -> "ReferenceBailingMoeV3":
    """Build ``cls`` from ``path/config.json`` without random init and load its weights strictly."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no config.json in {path!r}")
    with open(cfg_path) as f:
        raw = json.load(f)
    with torch.device("meta"):
        model = cls(raw, init=False, **kwargs)
    state = read_state_dict(path)
    expected = set(model.state_dict().keys())
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path!r} does not match config.json: "
                         f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    # copy=True: fresh, aligned storage (not views into the file buffers), so the kernels chosen
    # for the loaded weights are the same as for a model built in memory.
    state = {k: v.to(torch.float32 if _keeps_fp32(k) else dtype, copy=True)
             for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=device)


def _shard(tensors: Dict[str, torch.Tensor], max_bytes: int) -> List[Dict[str, torch.Tensor]]:
    """Greedy in-order packing; a tensor larger than ``max_bytes`` gets a shard of its own."""
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def save_checkpoint(model: "ReferenceBailingMoeV3", path: str, dtype: torch.dtype,
                    max_shard_bytes: int) -> str:
    """Write the model as a Hugging Face checkpoint directory (see ``save_pretrained``)."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported checkpoint dtype {dtype}; use one of {list(_DTYPE_NAMES)}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu", torch.float32 if _keeps_fp32(name) else dtype)
        tensors[name] = t.contiguous().clone()
    shards = _shard(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
        stale = os.path.join(path, INDEX_FILE)
        if os.path.exists(stale):
            os.remove(stale)
    else:
        stale = os.path.join(path, SINGLE_FILE)
        if os.path.exists(stale):
            os.remove(stale)
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = dict(model.config_dict)
    config["torch_dtype"] = _DTYPE_NAMES[dtype]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if config.get(k) is not None}
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    return path
