"""The unquantized methods: weights in the model dtype, loaded by copy, products as before."""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import torch
from torch import nn

from sglang.srt.layers.quantization.base import (FusedMoEMethodBase, LinearMethodBase,
                                                 WeightShard, expect_dim, shard_source)

if TYPE_CHECKING:  # only for annotations: importing it would cycle via model_loader
    from sglang.srt.model_loader.weight_utils import LazyWeight

__all__ = ["UnquantizedLinearMethod", "UnquantizedFusedMoEMethod", "new_param",
           "check_shard_shape", "FP8_STORAGE_DTYPES"]

# Stored fp8 tensors must never be silently upcast without their scales.
FP8_STORAGE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def new_param(shape, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised inference-only parameter (no autograd bookkeeping)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def check_shard_shape(param: nn.Parameter, loaded: LazyWeight, shard: WeightShard) -> None:
    """The checkpoint tensor must be the full ``[full_rows, full_cols]`` of the shard."""
    expect_dim(param, loaded, 0, shard.full_rows, "rows")
    expect_dim(param, loaded, 1, shard.full_cols, "columns")


def _copy_unquantized(param: nn.Parameter, loaded: LazyWeight, shard: WeightShard,
                      expert_id: Optional[int]) -> None:
    from sglang.srt.layers.linear import copy_checked

    if loaded.dtype in FP8_STORAGE_DTYPES:
        raise ValueError(
            f"{loaded.name} is stored as {loaded.dtype} but the model is unquantized and the "
            "checkpoint has no weight_scale_inv for it (a quantized checkpoint needs a "
            "'quantization_config' in config.json)")
    check_shard_shape(param, loaded, shard)
    target = param.data if expert_id is None else param.data[expert_id]
    dst = target.narrow(0, shard.dst_row, shard.rows)
    copy_checked(param, dst, shard_source(loaded, shard), loaded.name)


class UnquantizedLinearMethod(LinearMethodBase):
    """``weight [out_local, in_local]`` in the model dtype; ``apply`` = :func:`linear`."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: List[int], params_dtype: torch.dtype) -> None:
        """Register ``layer.weight``."""
        layer.weight = new_param((sum(output_partition_sizes), input_size_per_partition),
                                 params_dtype)
        layer.weight.weight_loader = layer.weight_loader

    def load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: LazyWeight,
                   shard: WeightShard, expert_id: Optional[int] = None) -> None:
        """Copy the slice, converting dtype."""
        _copy_unquantized(param, loaded, shard, expert_id)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None, gated_norm=None) -> torch.Tensor:
        """``linear(x, weight, bias)`` (the small-M GEMM when the layer asks for it)."""
        from sglang.srt.layers.linear import linear

        return linear(x, layer.weight, bias, layer.small_m_gemm, gated_norm)


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Routed experts in the model dtype through the native / Triton strategies."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype) -> None:
        """Register ``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]``."""
        i = intermediate_size_per_partition
        layer.w13_weight = new_param((num_experts, 2 * i, hidden_size), params_dtype)
        layer.w2_weight = new_param((num_experts, hidden_size, i), params_dtype)
        layer.w13_weight.weight_loader = layer.weight_loader
        layer.w2_weight.weight_loader = layer.weight_loader

    def load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: LazyWeight,
                   shard: WeightShard, expert_id: Optional[int] = None) -> None:
        """Copy one expert's slice, converting dtype."""
        _copy_unquantized(param, loaded, shard, expert_id)

    def triton_small_m_ok(self) -> bool:
        """Model-dtype weights: the Triton kernels read them."""
        return True

    def max_graph_pairs(self, layer: nn.Module) -> Optional[int]:
        """Pairs of the small-batch path (None when grouped GEMMs take every larger batch: the
        Triton backend's always, torch's with ``grouped_mm`` where its kernel takes them)."""
        from sglang.srt.layers.moe.fused_moe_native import GATHER_MAX_PAIRS, grouped_mm_supported

        if layer.runner_backend == "triton":
            return None
        if layer.grouped_mm:
            probe = layer.w13_weight.new_empty(0, layer.w13_weight.shape[2])
            if grouped_mm_supported(probe, layer.w13_weight, layer.w2_weight):
                return None
        return GATHER_MAX_PAIRS

    def apply(self, layer: nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared: Optional[torch.Tensor] = None,
              shared_weights=None) -> torch.Tensor:
        """Triton small-batch path or grouped GEMM when the layer picks them, else
        :func:`fused_moe`."""
        from sglang.srt.layers.moe.fused_moe_native import fused_moe
        from sglang.srt.layers.moe.fused_moe_triton import fused_moe_grouped, fused_moe_small_m

        if layer.small_m(topk_ids):
            return fused_moe_small_m(hidden, layer.w13_weight, layer.w2_weight, topk_weights,
                                     topk_ids, layer.swiglu_limit, shared_weights, shared,
                                     combine_kernel=layer.fused_combine)
        if layer.large_m(topk_ids):
            return fused_moe_grouped(hidden, layer.w13_weight, layer.w2_weight, topk_weights,
                                     topk_ids, layer.swiglu_limit, shared,
                                     combine_kernel=layer.fused_combine,
                                     align_kernel=layer.align_kernel,
                                     shared_weights=shared_weights)
        if shared_weights is not None:
            raise ValueError("FusedMoE: shared_weights only ride the Triton paths")
        return fused_moe(hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                         layer.swiglu_limit, grouped_mm=layer.grouped_mm, shared=shared)
