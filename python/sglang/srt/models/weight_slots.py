"""Checkpoint name -> parameter tables for the BailingMoeV3 models.

A :class:`WeightSlot` says where one checkpoint tensor goes (the parameter whose
``weight_loader`` takes it) and its full unsharded shape. The models build their tables from
their own modules, so the names :meth:`checkpoint_spec` reports and the names the loader accepts
cannot disagree.

Layers whose quant method reads block scales from the checkpoint (``loads_scales``: an fp8
checkpoint) also get ``<prefix>.weight_scale_inv`` slots, of shape ``[ceil(N/128),
ceil(K/128)]`` for the weight ``[N, K]`` next to them.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, NamedTuple, Optional, Set, Tuple

from torch import nn

from sglang.srt.layers.linear import LinearBase, MergedColumnParallelLinear
from sglang.srt.layers.moe.moe_layer import BailingMLP, BailingMoE
from sglang.srt.layers.quantization.fp8_utils import num_blocks
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


SCALE_SUFFIX = "_scale_inv"
_BLOCK = 128  # block fp8: the only block size Fp8Config accepts


def scale_shape(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The ``weight_scale_inv`` shape of a weight of ``shape`` (last two dims blocked)."""
    return tuple(shape[:-2]) + (num_blocks(shape[-2], _BLOCK), num_blocks(shape[-1], _BLOCK))


def _with_scale(name: str, slot: WeightSlot, scale_param: Optional[nn.Parameter]) -> Slots:
    """``{name: slot}`` plus the slot of ``name + "_scale_inv"`` when ``scale_param`` is set."""
    slots = {name: slot}
    if scale_param is not None:
        slots[name + SCALE_SUFFIX] = WeightSlot(scale_shape(slot.shape), scale_param,
                                                slot.shard_id, slot.expert_id)
    return slots


def _scale_param(layer: nn.Module, weight_name: str) -> Optional[nn.Parameter]:
    """The layer's scale parameter of ``weight_name`` if its checkpoint carries scales."""
    if not getattr(layer.quant_method, "loads_scales", False):
        return None
    return getattr(layer, weight_name + SCALE_SUFFIX)


def linear_slot(name: str, layer: LinearBase) -> Slots:
    """The slot of a (replicated / column / row parallel) linear layer's weight (+ scale)."""
    return _with_scale(name, WeightSlot((layer.output_size, layer.input_size), layer.weight),
                       _scale_param(layer, "weight"))


def merged_slots(prefix: str, names: Iterable[str], layer: MergedColumnParallelLinear) -> Slots:
    """One slot per logical output of a merged layer (+ one scale slot each)."""
    scale = _scale_param(layer, "weight")
    slots: Slots = {}
    for i, (n, size) in enumerate(zip(names, layer.output_sizes)):
        slots.update(_with_scale(f"{prefix}{n}.weight",
                                 WeightSlot((size, layer.input_size), layer.weight, i), scale))
    return slots


def norm_slot(name: str, norm: nn.Module) -> Slots:
    """The slot of a norm's weight."""
    return {name: WeightSlot((norm.hidden_size,), norm.weight)}


def mlp_slots(prefix: str, mlp: BailingMLP) -> Slots:
    """Gate / up / down of a SwiGLU MLP."""
    slots = merged_slots(prefix, ("gate_proj", "up_proj"), mlp.gate_up_proj)
    slots.update(linear_slot(f"{prefix}down_proj.weight", mlp.down_proj))
    return slots


def moe_slots(prefix: str, moe: BailingMoE) -> Slots:
    """Router, per-expert gate / up / down (+ scales) and the shared expert."""
    gate, experts = moe.gate, moe.experts
    slots = {f"{prefix}gate.weight": WeightSlot(tuple(gate.weight.shape), gate.weight)}
    if gate.expert_bias is not None:
        slots[f"{prefix}gate.expert_bias"] = WeightSlot(tuple(gate.expert_bias.shape),
                                                        gate.expert_bias)
    h, i = experts.hidden_size, experts.intermediate_size
    s13, s2 = _scale_param(experts, "w13_weight"), _scale_param(experts, "w2_weight")
    for e in range(experts.num_experts):
        p = f"{prefix}experts.{e}."
        slots.update(_with_scale(p + "gate_proj.weight",
                                 WeightSlot((i, h), experts.w13_weight, "w1", e), s13))
        slots.update(_with_scale(p + "up_proj.weight",
                                 WeightSlot((i, h), experts.w13_weight, "w3", e), s13))
        slots.update(_with_scale(p + "down_proj.weight",
                                 WeightSlot((h, i), experts.w2_weight, "w2", e), s2))
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
