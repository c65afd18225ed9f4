"""Checkpoint name -> parameter tables for the BailingMoeV3 models.

A :class:`WeightSlot` says where one checkpoint tensor goes (the parameter whose
``weight_loader`` takes it) and its full unsharded shape. The models build their tables from
their own modules, so the names :meth:`checkpoint_spec` reports and the names the loader accepts
cannot disagree.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, NamedTuple, Optional, Set, Tuple

from torch import nn

from sglang.srt.layers.linear import LinearBase, MergedColumnParallelLinear
from sglang.srt.layers.moe.moe_layer import BailingMLP, BailingMoE
from sglang.srt.model_loader.weight_utils import LazyWeight

class WeightSlot(NamedTuple):
    """One checkpoint tensor: its full (unsharded) shape and where it goes."""

    shape: Tuple[int, ...]
    param: nn.Parameter
    shard_id: Any = None
    expert_id: Optional[int] = None

    def load(self, loaded: LazyWeight) -> None:
        """Hand the tensor to the parameter's ``weight_loader``."""
        if self.expert_id is None:
            self.param.weight_loader(self.param, loaded, self.shard_id)
        else:
            self.param.weight_loader(self.param, loaded, self.shard_id, self.expert_id)


Slots = Dict[str, WeightSlot]


def linear_slot(name: str, layer: LinearBase) -> Slots:
    """The slot of a (replicated / column / row parallel) linear layer's weight."""
    return {name: WeightSlot((layer.output_size, layer.input_size), layer.weight)}


def merged_slots(prefix: str, names: Iterable[str], layer: MergedColumnParallelLinear) -> Slots:
    return {f"{prefix}{n}.weight": WeightSlot((size, layer.input_size), layer.weight, i)
            for i, (n, size) in enumerate(zip(names, layer.output_sizes))}


def norm_slot(name: str, norm: nn.Module) -> Slots:
    """The slot of a norm's weight."""
    return {name: WeightSlot((norm.hidden_size,), norm.weight)}


def mlp_slots(prefix: str, mlp: BailingMLP) -> Slots:
    slots = merged_slots(prefix, ("gate_proj", "up_proj"), mlp.gate_up_proj)
    slots.update(linear_slot(f"{prefix}down_proj.weight", mlp.down_proj))
    return slots


def moe_slots(prefix: str, moe: BailingMoE) -> Slots:
    gate, experts = moe.gate, moe.experts
    slots = {f"{prefix}gate.weight": WeightSlot(tuple(gate.weight.shape), gate.weight)}
    if gate.expert_bias is not None:
        slots[f"{prefix}gate.expert_bias"] = WeightSlot(tuple(gate.expert_bias.shape),
                                                        gate.expert_bias)
    h, i = experts.hidden_size, experts.intermediate_size
    for e in range(experts.num_experts):
        p = f"{prefix}experts.{e}."
        slots[p + "gate_proj.weight"] = WeightSlot((i, h), experts.w13_weight, "w1", e)
        slots[p + "up_proj.weight"] = WeightSlot((i, h), experts.w13_weight, "w3", e)
        slots[p + "down_proj.weight"] = WeightSlot((h, i), experts.w2_weight, "w2", e)
    if moe.shared_experts is not None:
        slots.update(mlp_slots(f"{prefix}shared_experts.", moe.shared_experts))
    return slots


_ALIASES = ((".mlp.gate.e_score_correction_bias", ".mlp.gate.expert_bias"),)


def canonical_alias(name: str) -> Optional[str]:
    """Shared name normalisation: ``None`` for tensors never loaded, aliases to canonical names."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    for old, new in _ALIASES:
        if name.endswith(old):
            return name[: -len(old)] + new
    return name


def tag_parameter_names(module: nn.Module) -> None:
    """Record each parameter's qualified name on it, for error messages of weight loaders."""
    for name, param in module.named_parameters():
        param.qualname = name


def load_into_slots(slots: Slots, weights: Iterable[Tuple[str, LazyWeight]],
                    canonical) -> Set[str]:
    """Route ``(name, LazyWeight)`` pairs through ``canonical`` and into ``slots``; returns the
    canonical names loaded. A name that is neither ignorable nor in the table is an error."""
    loaded: Set[str] = set()
    for name, weight in weights:
        cname = canonical(name)
        if cname is None:
            continue
        slot = slots.get(cname)
        if slot is None:
            raise ValueError(f"unexpected checkpoint tensor {name!r}: the model has no parameter "
                             "for it (wrong architecture or config?)")
        slot.load(weight)
        loaded.add(cname)
    return loaded
