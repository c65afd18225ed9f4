"""Block fp8 (``quant_method: "fp8"``, e4m3 weights, one fp32 scale per 128x128 block).

Weights are stored ``float8_e4m3fn`` with ``<name>_scale_inv`` next to them (SGLang's names:
``weight_scale_inv``, ``w13_weight_scale_inv``, ``w2_weight_scale_inv``). A checkpoint already
in fp8 (its config has ``quantization_config``) is copied as is; a bf16/fp32 checkpoint or
``--load-format dummy`` is quantised slice by slice while it loads (``amax / 448`` per block).

Fused layouts keep one block grid per logical piece (see ``fp8_utils``): ``w13_weight`` of an
expert is ``[gate; up]`` and its scale ``[gate blocks; up blocks]``, ``ceil(I/128)`` rows each,
so with ``I = 96`` (the bundled model) gate rows 0..95 use scale row 0 and up rows use row 1 --
the two never share a block. With ``I`` a multiple of 128 this is exactly the published
``[E, ceil(2I/128), ceil(H/128)]``.

Under TP a rank's slice must start on a block boundary (else a block's scale would be split
between ranks); the load fails naming the tensor and the TP sizes that work.

``apply`` is the reference: dequantise (fp32 product, one rounding to the activation dtype) and
run the unquantized math -- :func:`~sglang.srt.layers.linear.linear` for dense layers, the
native MoE strategies for experts, where only the experts a batch selects are dequantised
(per pair on the gather path, per active expert on the loop path). The Triton paths
(``sgl_kernel.grouped_gemv``, ``sgl_kernel.small_m_gemm`` for decode / verify batches,
``sgl_kernel.moe_grouped_gemm`` for the experts of a prefill) read the fp8 weights and their
scales directly and dequantise each tile as they load it, to the same values; a dense layer at
prefill sizes dequantises its weight in one Triton pass and runs the library GEMM
(``sgl_kernel.fp8_gemm.block_fp8_linear``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from sglang.srt.layers.quantization.base import (FusedMoEMethodBase, LinearMethodBase,
                                                 QuantizationConfig, WeightShard,
                                                 shard_source)
from sglang.srt.layers.quantization.fp8_utils import (FP8_DTYPE, block_index, dequantize_indexed,
                                                      num_blocks, quantize_block_fp8)
from sglang.srt.layers.quantization.unquant import check_shard_shape, new_param

if TYPE_CHECKING:  # only for annotations: importing it would cycle via model_loader
    from sglang.srt.model_loader.weight_utils import LazyWeight

__all__ = ["Fp8Config", "Fp8LinearMethod", "Fp8MoEMethod", "DequantizedExperts"]

_TP_SIZES = (1, 2, 4, 8, 16)


class Fp8Config(QuantizationConfig):
    """Block fp8. ``is_checkpoint_fp8_serialized``: the checkpoint stores fp8 + scales (else
    the weights are quantised at load)."""

    def __init__(self, is_checkpoint_fp8_serialized: bool = False,
                 weight_block_size: Sequence[int] = (128, 128)):
        block = tuple(int(b) for b in weight_block_size)
        if block != (128, 128):
            raise ValueError(f"fp8: only weight_block_size [128, 128] is supported, got "
                             f"{list(weight_block_size)}")
        self.is_checkpoint_fp8_serialized = bool(is_checkpoint_fp8_serialized)
        self.weight_block_size = block

    @classmethod
    def get_name(cls) -> str:
        """``"fp8"``."""
        return "fp8"

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "Fp8Config":
        """From a checkpoint's ``quantization_config`` (block fp8, dynamic activations, e4m3)."""
        method = config.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config: quant_method {method!r} is not fp8")
        block = config.get("weight_block_size")
        if block is None or list(block) != [128, 128]:
            raise ValueError(f"quantization_config: weight_block_size {block!r} is not supported "
                             "(block fp8 with [128, 128] only)")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"quantization_config: activation_scheme {scheme!r} is not "
                             "supported (only 'dynamic')")
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config: fmt {fmt!r} is not supported (only 'e4m3')")
        for key in ("ignored_layers", "modules_to_not_convert"):
            if config.get(key):
                raise ValueError(f"quantization_config: {key} is not supported (every linear "
                                 "and expert weight is block fp8 here)")
        return cls(is_checkpoint_fp8_serialized=True, weight_block_size=block)

    def get_linear_method(self, layer: nn.Module) -> "Fp8LinearMethod":
        """Block fp8 for every linear layer."""
        return Fp8LinearMethod(self)

    def get_moe_method(self, layer: nn.Module) -> "Fp8MoEMethod":
        """Block fp8 for the routed experts."""
        return Fp8MoEMethod(self)


def _tp_hint(full: int, block: int) -> str:
    ok = [t for t in _TP_SIZES if t == 1 or full % (t * block) == 0]
    return ", ".join(str(t) for t in ok)


def _check_alignment(loaded: LazyWeight, shard: WeightShard, block: Tuple[int, int],
                     layer: nn.Module) -> None:
    """A rank's slice must begin on a block and end on one (or at the tensor's end)."""
    checks = ((shard.src_row, shard.rows, shard.full_rows, block[0], "row"),
              (shard.src_col, shard.cols, shard.full_cols, block[1], "column"))
    for start, n, full, b, what in checks:
        if n == full:
            continue
        if start % b or (n % b and start + n != full):
            raise ValueError(
                f"{loaded.name}: block fp8 under TP needs every rank's {what} slice on "
                f"{b}-{what} block boundaries, but {type(layer).__name__} rank "
                f"{getattr(layer, 'tp_rank', '?')} of {getattr(layer, 'tp_size', '?')} holds "
                f"{what}s [{start}, {start + n}) of {full}; use a TP size in "
                f"{{{_tp_hint(full, b)}}}")


def _scale_base(pieces: Sequence[int], piece: int, block: int) -> int:
    return sum(num_blocks(p, block) for p in pieces[:piece])


def _load_fp8(cfg: Fp8Config, layer: nn.Module, weight: nn.Parameter, scale: nn.Parameter,
              pieces: Sequence[int], param: nn.Parameter, loaded: LazyWeight,
              shard: WeightShard, expert_id: Optional[int]) -> None:
    """Fill ``weight`` (fp8) or ``scale`` from one checkpoint slice (see the module docstring)."""
    from sglang.srt.layers.linear import copy_checked

    bn, bk = cfg.weight_block_size
    _check_alignment(loaded, shard, cfg.weight_block_size, layer)
    pick = (lambda p: p.data) if expert_id is None else (lambda p: p.data[expert_id])
    s_row = _scale_base(pieces, shard.piece, bn)
    if param is scale:
        # Scale tensors come with the fp8 checkpoint; shapes and slices are in blocks.
        blocks = WeightShard(shard.piece, s_row, num_blocks(shard.rows, bn), shard.src_row // bn,
                             num_blocks(shard.full_rows, bn), shard.src_col // bk,
                             num_blocks(shard.cols, bk), num_blocks(shard.full_cols, bk))
        check_shard_shape(param, loaded, blocks)
        dst = pick(scale).narrow(0, blocks.dst_row, blocks.rows)
        copy_checked(param, dst, shard_source(loaded, blocks).float(), loaded.name)
        return
    if param is not weight:
        raise ValueError(f"{loaded.name}: parameter is not a weight of this fp8 layer")
    check_shard_shape(param, loaded, shard)
    src = shard_source(loaded, shard)
    dst = pick(weight).narrow(0, shard.dst_row, shard.rows)
    if cfg.is_checkpoint_fp8_serialized:
        if loaded.dtype != FP8_DTYPE:
            raise ValueError(f"{loaded.name}: the checkpoint's quantization_config says block "
                             f"fp8 but this weight is stored as {loaded.dtype}")
        copy_checked(param, dst, src, loaded.name)
        return
    if not src.is_floating_point() or src.dtype.itemsize == 1:
        raise ValueError(f"{loaded.name}: cannot quantise a {src.dtype} tensor to fp8")
    q, s = quantize_block_fp8(src.to(dst.device), cfg.weight_block_size)
    copy_checked(param, dst, q, loaded.name)
    pick(scale).narrow(0, s_row, s.shape[0]).copy_(s)


def _make_dummy_init(cfg: Fp8Config, weight: nn.Parameter, scale: nn.Parameter,
                     pieces: Sequence[int], fan_in: int, dtype: torch.dtype):
    """``dummy_init`` of an fp8 weight: N(0, 1/fan_in) drawn in the model dtype per expert and
    piece, then quantised into the weight and its scale (which keeps a no-op hook)."""

    def init(tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill ``weight`` and ``scale`` in place."""
        w3 = weight.data if weight.dim() == 3 else weight.data.unsqueeze(0)
        s3 = scale.data if scale.dim() == 3 else scale.data.unsqueeze(0)
        bn = cfg.weight_block_size[0]
        for e in range(w3.shape[0]):
            row = 0
            for i, n in enumerate(pieces):
                w = torch.empty(n, w3.shape[2], dtype=dtype, device=tensor.device)
                w.normal_(0.0, fan_in ** -0.5, generator=generator)
                q, s = quantize_block_fp8(w, cfg.weight_block_size)
                w3[e].narrow(0, row, n).copy_(q)
                s3[e].narrow(0, _scale_base(pieces, i, bn), s.shape[0]).copy_(s)
                row += n

    return init


def _no_dummy_init(tensor: torch.Tensor, generator: torch.Generator) -> None:
    """Scales are written by their weight's ``dummy_init``."""


def _fp8_pair(cfg: Fp8Config, layer: nn.Module, lead: Tuple[int, ...], pieces: List[int],
              cols: int, fan_in: int, dtype: torch.dtype,
              name: str) -> Tuple[nn.Parameter, nn.Parameter]:
    """Register ``<name>`` (fp8) and ``<name>_scale_inv`` (fp32) plus the row/column -> block
    maps used by the dequantisation (non-persistent buffers)."""
    bn, bk = cfg.weight_block_size
    weight = new_param(lead + (sum(pieces), cols), FP8_DTYPE)
    scale = new_param(lead + (sum(num_blocks(p, bn) for p in pieces), num_blocks(cols, bk)),
                      torch.float32)
    setattr(layer, name, weight)
    setattr(layer, f"{name}_scale_inv", scale)
    for p in (weight, scale):
        p.weight_loader = layer.weight_loader
    weight.dummy_init = _make_dummy_init(cfg, weight, scale, pieces, fan_in, dtype)
    scale.dummy_init = _no_dummy_init
    layer.register_buffer(f"{name}_row_block", block_index(pieces, bn), persistent=False)
    setattr(layer, f"{name}_pieces", tuple(int(p) for p in pieces))  # the scale grids, on host
    layer.register_buffer(f"{name}_col_block", torch.arange(cols) // bk, persistent=False)
    return weight, scale


class Fp8LinearMethod(LinearMethodBase):
    """``weight`` fp8 ``[out_local, in_local]`` + ``weight_scale_inv`` (one grid per merged
    output piece); ``apply`` dequantises and calls :func:`linear`."""

    def __init__(self, config: Fp8Config):
        self.config = config
        self.loads_scales = config.is_checkpoint_fp8_serialized

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: List[int], params_dtype: torch.dtype) -> None:
        """Register ``weight`` and ``weight_scale_inv``."""
        self.pieces = list(output_partition_sizes)
        _fp8_pair(self.config, layer, (), self.pieces, input_size_per_partition,
                  layer.input_size, params_dtype, "weight")

    def load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: LazyWeight,
                   shard: WeightShard, expert_id: Optional[int] = None) -> None:
        """Copy (fp8 checkpoint) or quantise (otherwise) one slice."""
        _load_fp8(self.config, layer, layer.weight, layer.weight_scale_inv, self.pieces, param,
                  loaded, shard, expert_id)

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight in ``dtype``."""
        return dequantize_indexed(layer.weight, layer.weight_scale_inv, layer.weight_row_block,
                                  layer.weight_col_block, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None, gated_norm=None) -> torch.Tensor:
        """The product with the fp8 weight. The layer's ``small_m_gemm`` flag (set by
        ``linear.set_linear_backend`` only where Triton runs: CUDA, or ``TRITON_INTERPRET=1``;
        ``auto`` turns it on for fp8 models on CUDA) is the one switch for "this layer's fp8
        product runs on Triton kernels", at every row count: a decode / verify batch takes the
        batch-invariant small-M kernel, more rows (prefill), by default on CUDA
        (``KernelChoices.dense_scaled_mm``), the w8a8 product on the library's block-scaled
        fp8 GEMM (``sgl_kernel.fp8_scaled_mm``: x quantised per token and 128-column group, a
        row group the library cannot take weight-only on its weight dequantised once; values
        within the activations' e4m3 rounding of the reference path's); without that choice
        ``sgl_kernel.fp8_gemm``'s ``block_fp8_linear``: a one-pass Triton dequantisation and
        the library GEMM (bit for bit this reference path's values; faster than the tiled
        block-fp8 GEMM at every prefill size measured: docs/performance.md, the prefill
        section's "Dense fp8 at prefill sizes"), or with the layer's ``fp8_activations``
        (``KernelChoices.dense_fp8_activations``, :func:`set_fp8_activations`; off by default)
        "w8a8": x quantised per token and
        128-column group to e4m3 and multiplied by the fp8 weight on the fp8 tensor cores by
        the tiled GEMM, no dequantised weight (values within the activations' e4m3 rounding of
        the reference path's; ``dense_scaled_mm`` goes first when both are on). Without
        ``small_m_gemm``, the reference path: ``linear(x, dequant(weight), bias)``,
        which forms the whole weight in x's dtype in several fp32 torch passes at every call.
        The small-M kernel keeps x in its dtype either way. A ``gated_norm`` prologue above the
        small-M range is the torch GatedRMSNorm first, as in :func:`linear`."""
        from sglang.srt.layers.linear import linear, small_m_rows

        if layer.small_m_gemm and small_m_rows(x):
            from sgl_kernel.small_m_gemm import small_m_gemm

            return small_m_gemm(x.contiguous(), layer.weight, bias,
                                w_scale=layer.weight_scale_inv,
                                w_scale_rows=layer.weight_row_block, gated_norm=gated_norm)
        if layer.small_m_gemm:
            from sgl_kernel import fp8_gemm
            from sglang.srt.layers.layernorm import gated_rms_norm_heads

            if gated_norm is not None:
                x = gated_rms_norm_heads(x, gated_norm)
            x2 = x.reshape(-1, x.shape[-1])
            if layer.dense_scaled_mm:  # one call per run of pieces on one 128-row scale grid
                from sgl_kernel.fp8_scaled_mm import blockwise_linear

                groups, weight_only = layer.scaled_mm_groups  # set_fp8_activations made them
                y = blockwise_linear(x2, layer.weight, layer.weight_scale_inv, groups, bias,
                                     dequantized=weight_only)
            else:
                y = fp8_gemm.block_fp8_linear(x2, layer.weight, layer.weight_scale_inv,
                                              layer.weight_row_block, bias,
                                              fp8_activations=layer.fp8_activations)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return linear(x, self.dequantized_weight(layer, x.dtype), bias, gated_norm=gated_norm)


def set_fp8_activations(model: nn.Module, *, moe: bool, dense: bool,
                        dense_scaled_mm: bool = False) -> None:
    """``KernelChoices.moe_fp8_activations`` / ``dense_fp8_activations``: the block-fp8 MoE
    experts (``moe``) and dense layers (``dense``) of ``model`` quantise their activations per
    token and 128-column group above the small-M range and multiply on the fp8 tensor cores
    ("w8a8"), or keep them in the model dtype. Only the layers' Triton paths read it (the Triton
    MoE backend's grouped GEMM; ``small_m_gemm`` for a dense layer): the torch reference paths
    stay weight-only. ``dense_scaled_mm`` (``KernelChoices.dense_scaled_mm``): a dense
    layer's w8a8 product on torch's block-scaled ``_scaled_mm`` instead."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, Fp8MoEMethod):
            module.fp8_activations = bool(moe)
        elif isinstance(method, Fp8LinearMethod):
            module.fp8_activations = bool(dense)
            module.dense_scaled_mm = bool(dense_scaled_mm)
            module.scaled_mm_groups = _scaled_mm_groups(module) if dense_scaled_mm else None


def _scaled_mm_groups(layer: nn.Module) -> Tuple[list, Dict[int, torch.Tensor]]:
    """A block-fp8 layer's row groups for ``sgl_kernel.fp8_scaled_mm.blockwise_linear`` and the
    groups the library cannot take (rows not a multiple of 16) dequantised once to the layer's
    dtype, so that no call dequantises a weight."""
    from sgl_kernel import fp8_scaled_mm

    groups = fp8_scaled_mm.row_groups(layer.weight_pieces)
    return groups, fp8_scaled_mm.weight_only_groups(layer.weight, layer.weight_scale_inv, groups,
                                                    layer.params_dtype)


class DequantizedExperts:
    """Stacked fp8 experts seen as ``[E, N, K]`` weights in ``dtype``: indexing (an expert id
    or a tensor of ids) dequantises only the experts asked for, so the native MoE strategies
    run unchanged and never materialise all experts."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, row_block: torch.Tensor,
                 col_block: torch.Tensor, dtype: torch.dtype):
        self.q, self.scale, self.dtype = q, scale, dtype
        self.row_block, self.col_block = row_block, col_block
        self.shape = q.shape

    def __getitem__(self, index) -> torch.Tensor:
        return dequantize_indexed(self.q[index], self.scale[index], self.row_block,
                                  self.col_block, self.dtype)


class Fp8MoEMethod(FusedMoEMethodBase):
    """``w13_weight`` / ``w2_weight`` fp8 with ``*_scale_inv``; gate and up on their own grids."""

    def __init__(self, config: Fp8Config):
        self.config = config
        self.loads_scales = config.is_checkpoint_fp8_serialized

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype) -> None:
        """Register the fp8 expert weights and their scales."""
        i = intermediate_size_per_partition
        self.pieces = {"w13": [i, i], "w2": [hidden_size]}
        _fp8_pair(self.config, layer, (num_experts,), self.pieces["w13"], hidden_size,
                  hidden_size, params_dtype, "w13_weight")
        _fp8_pair(self.config, layer, (num_experts,), self.pieces["w2"], i,
                  layer.intermediate_size, params_dtype, "w2_weight")

    def load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: LazyWeight,
                   shard: WeightShard, expert_id: Optional[int] = None) -> None:
        """Copy or quantise one expert's gate / up / down slice (or its scale)."""
        which = "w13" if param is layer.w13_weight or param is layer.w13_weight_scale_inv else "w2"
        _load_fp8(self.config, layer, getattr(layer, f"{which}_weight"),
                  getattr(layer, f"{which}_weight_scale_inv"), self.pieces[which], param, loaded,
                  shard, expert_id)

    def experts(self, layer: nn.Module, dtype: torch.dtype
                ) -> Tuple[DequantizedExperts, DequantizedExperts]:
        """Lazily dequantising views of ``w13`` and ``w2``."""
        return (DequantizedExperts(layer.w13_weight, layer.w13_weight_scale_inv,
                                   layer.w13_weight_row_block, layer.w13_weight_col_block, dtype),
                DequantizedExperts(layer.w2_weight, layer.w2_weight_scale_inv,
                                   layer.w2_weight_row_block, layer.w2_weight_col_block, dtype))

    def triton_small_m_ok(self) -> bool:
        """The grouped mat-vec reads block-fp8 experts (their scales beside them)."""
        return True

    def max_graph_pairs(self, layer: nn.Module) -> Optional[int]:
        """None on the Triton backend (its grouped GEMM takes every larger batch without a
        host sync); else the pairs of the native gather: above them the native loop reads
        expert counts on the host."""
        from sglang.srt.layers.moe.fused_moe_native import GATHER_MAX_PAIRS

        return None if layer.runner_backend == "triton" else GATHER_MAX_PAIRS

    def apply(self, layer: nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared: Optional[torch.Tensor] = None,
              shared_weights=None) -> torch.Tensor:
        """The Triton small-batch path or grouped GEMM on the fp8 experts when the layer picks
        them (tiles dequantised as loaded, never a dequantised copy), else :func:`fused_moe`
        (gather or loop) over the dequantising expert views."""
        from sglang.srt.layers.moe.fused_moe_native import fused_moe
        from sglang.srt.layers.moe.fused_moe_triton import fused_moe_grouped, fused_moe_small_m

        if layer.small_m(topk_ids):
            return fused_moe_small_m(hidden, layer.w13_weight, layer.w2_weight, topk_weights,
                                     topk_ids, layer.swiglu_limit, shared_weights, shared,
                                     combine_kernel=layer.fused_combine,
                                     w13_scale=layer.w13_weight_scale_inv,
                                     w2_scale=layer.w2_weight_scale_inv)
        if layer.large_m(topk_ids):
            return fused_moe_grouped(hidden, layer.w13_weight, layer.w2_weight, topk_weights,
                                     topk_ids, layer.swiglu_limit, shared,
                                     w13_scale=layer.w13_weight_scale_inv,
                                     w2_scale=layer.w2_weight_scale_inv,
                                     combine_kernel=layer.fused_combine,
                                     align_kernel=layer.align_kernel,
                                     shared_weights=shared_weights,
                                     fp8_activations=layer.fp8_activations)
        if shared_weights is not None:
            raise ValueError("FusedMoE: shared_weights only ride the Triton paths")
        w13, w2 = self.experts(layer, hidden.dtype)
        return fused_moe(hidden, w13, w2, topk_weights, topk_ids, layer.swiglu_limit,
                         grouped_mm=False, shared=shared)
