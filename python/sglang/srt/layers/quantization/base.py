"""The quantisation seam: a config picks, per layer, a method that owns its weights.

A :class:`QuantizationConfig` (SGLang's name; one per model, from ``--quantization`` and the
checkpoint's ``quantization_config``) returns for every linear layer a
:class:`LinearMethodBase` and for every routed-expert block a :class:`FusedMoEMethodBase`. The
method creates the layer's parameters (``create_weights``), copies checkpoint slices into them
(``load_shard``, called by the layer's ``weight_loader`` with the TP geometry already worked out
as :class:`WeightShard` s) and computes the layer's product (``apply``). The unquantized path is
just the methods of ``unquant.py``.

Layers are built inside :func:`quantization_scope` (the model loader opens it around the model's
constructor), so model files need not thread a config argument through every module.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Iterator, List, NamedTuple, Optional

import torch
from torch import nn

if TYPE_CHECKING:  # only for annotations: importing it would cycle via model_loader
    from sglang.srt.model_loader.weight_utils import LazyWeight


__all__ = ["QuantizationConfig", "QuantizeMethodBase", "LinearMethodBase", "FusedMoEMethodBase",
           "WeightShard", "quantization_scope", "current_quantization_config", "expect_dim",
           "shard_source"]


class WeightShard(NamedTuple):
    """Where one checkpoint weight's slice goes, in elements of the weight (not of blocks).

    Rows ``[src_row, src_row + rows)`` and columns ``[src_col, src_col + cols)`` of the
    checkpoint tensor (full shape ``full_rows x full_cols``) land at rows
    ``[dst_row, dst_row + rows)`` of the local parameter, which is row-piece ``piece`` of it
    (logical output ``piece`` of a merged layer; 0 otherwise).
    """

    piece: int
    dst_row: int
    rows: int
    src_row: int
    full_rows: int
    src_col: int
    cols: int
    full_cols: int


def expect_dim(param: nn.Parameter, loaded: LazyWeight, dim: int, size: int, what: str) -> None:
    """Raise ``ValueError`` naming the tensor (and the parameter) unless ``loaded`` is 2-D with
    ``size`` entries along ``dim``."""
    if len(loaded.shape) != 2 or loaded.shape[dim] != size:
        qual = getattr(param, "qualname", None)
        target = f" (parameter {qual!r})" if qual else ""
        raise ValueError(f"{loaded.name}: expected {size} {what}, got shape {loaded.shape}"
                         f"{target}")


def shard_source(loaded: LazyWeight, shard: WeightShard) -> torch.Tensor:
    """Read only the checkpoint slice of ``shard`` (rows through the lazy tensor, so a TP rank
    never reads another rank's rows)."""
    if shard.rows != shard.full_rows:
        src = loaded.narrow(0, shard.src_row, shard.rows)
        if shard.cols != shard.full_cols:
            src = src.narrow(1, shard.src_col, shard.cols)
        return src
    if shard.cols != shard.full_cols:
        return loaded.narrow(1, shard.src_col, shard.cols)
    return loaded.load()


class QuantizeMethodBase(ABC):
    """Owns one layer's parameters: creation, loading and the product."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, *args: Any, **kwargs: Any) -> None:
        """Register the layer's parameters (each with ``weight_loader = layer.weight_loader``)."""

    @abstractmethod
    def load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: LazyWeight,
                   shard: WeightShard, expert_id: Optional[int] = None) -> None:
        """Copy one checkpoint slice into ``param`` (of expert ``expert_id`` for MoE weights)."""


class LinearMethodBase(QuantizeMethodBase):
    """Method of a dense (replicated / column / row parallel) linear layer."""

    #: Whether the checkpoint carries ``weight_scale_inv`` tensors this method loads.
    loads_scales = False

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: List[int], params_dtype: torch.dtype) -> None:
        """``weight [sum(output_partition_sizes), input_size_per_partition]`` (+ scales)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None, gated_norm=None) -> torch.Tensor:
        """``x [.., in_local] -> [.., out_local]`` (+ bias), through ``linear()``; ``gated_norm``
        as :func:`sglang.srt.layers.linear.linear` takes it."""


class FusedMoEMethodBase(QuantizeMethodBase):
    """Method of the stacked routed experts (``FusedMoE``)."""

    loads_scales = False

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype) -> None:
        """``w13_weight [E, 2I, H]``, ``w2_weight [E, H, I]`` (+ scales)."""

    @abstractmethod
    def apply(self, layer: nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared: Optional[torch.Tensor] = None,
              shared_weights: Any = None) -> torch.Tensor:
        """This rank's partial ``[T, H]`` of routed (+ shared) experts, not reduced."""

    def triton_small_m_ok(self) -> bool:
        """Whether the Triton small-batch kernels (``fused_moe_small_m``, with the shared expert
        riding their launches) read these weights: only model-dtype weights."""
        return False

    def max_graph_pairs(self, layer: nn.Module) -> Optional[int]:
        """(token, expert) pairs a CUDA graph may hold (None: any number)."""
        return None


class QuantizationConfig(ABC):
    """A model-wide quantisation choice (SGLang's base class of ``Fp8Config`` etc.)."""

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The ``--quantization`` / ``quant_method`` name."""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module) -> LinearMethodBase:
        """The method of a dense linear layer."""

    @abstractmethod
    def get_moe_method(self, layer: nn.Module) -> FusedMoEMethodBase:
        """The method of a routed-expert block."""


_SCOPE: List[Optional[QuantizationConfig]] = []


@contextlib.contextmanager
def quantization_scope(config: Optional[QuantizationConfig]) -> Iterator[None]:
    """Layers constructed inside take their methods from ``config`` (``None``: unquantized)."""
    _SCOPE.append(config)
    try:
        yield
    finally:
        _SCOPE.pop()


def current_quantization_config() -> Optional[QuantizationConfig]:
    """The config of the innermost :func:`quantization_scope`, or ``None`` outside any."""
    return _SCOPE[-1] if _SCOPE else None
