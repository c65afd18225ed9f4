"""Tensor-parallel linear layers (SGLang's names: Replicated / Column / MergedColumn / Row).

Weights are stored ``[out_features, in_features]`` like the checkpoints. The TP rank and size
are read from :mod:`sglang.srt.distributed` when a layer is built, so a layer holds only its own
shard. Every parameter carries ``weight_loader(param, loaded: LazyWeight, shard_id=None)``: it
narrows the checkpoint tensor to this rank's range (so a rank never reads another rank's rows),
checks the shape and copies with dtype conversion. What a weight is made of (parameters, their
loading, the product) belongs to the layer's ``quant_method`` (``layers/quantization``): the
layer works out the TP geometry as :class:`WeightShard` s, the method does the rest, so the
unquantized and the block-fp8 weights share these classes. ``forward`` returns the output tensor
only (upstream returns ``(output, bias)``; nothing here needs the split bias).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from sglang.srt.layers.quantization import WeightShard, get_linear_method
from sglang.srt.layers.quantization.unquant import new_param
from sglang.srt.model_loader.weight_utils import LazyWeight

__all__ = [
    "LinearBase",
    "ReplicatedLinear",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "RowParallelLinear",
    "copy_checked",
    "normal_dummy_init",
    "linear",
    "small_m_rows",
    "set_linear_backend",
]


def copy_checked(param: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """Copy ``src`` into ``dst`` (a view of ``param``) converting dtype; a shape mismatch is an error.

    ``name`` is the checkpoint tensor's name; the parameter's own name is added when the model
    tagged it (``param.qualname``), so the message says which side disagrees.
    """
    if tuple(dst.shape) != tuple(src.shape):
        qual = getattr(param, "qualname", None)
        target = f"parameter {qual!r}" if qual else "parameter"
        raise ValueError(
            f"{name}: checkpoint slice has shape {tuple(src.shape)} but {target} "
            f"{tuple(param.shape)} expects {tuple(dst.shape)} here"
        )
    with torch.no_grad():
        dst.copy_(src)


_DUMMY_CHUNK = 1 << 26


def normal_dummy_init(fan_in: int):
    """A ``dummy_init`` hook drawing N(0, 1/fan_in), for weights whose last dim is not the fan-in
    (row-parallel shards, transposed or stacked layouts)."""

    def init(tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill ``tensor`` (contiguous) in place, in chunks so that a real-size expert tensor
        needs no full-size temporary."""
        flat = tensor.view(-1)
        with torch.no_grad():
            for start in range(0, flat.numel(), _DUMMY_CHUNK):
                flat[start:start + _DUMMY_CHUNK].normal_(0.0, fan_in ** -0.5, generator=generator)

    return init


def small_m_rows(x: torch.Tensor) -> bool:
    """Whether ``x`` is a decode / verify-sized ``[M, K]`` batch: the rows the small-M Triton
    GEMM takes (``sgl_kernel.small_m_gemm.SMALL_M_MAX_ROWS``; prefill keeps the library GEMM)."""
    if x.dim() != 2:
        return False
    from sgl_kernel.small_m_gemm import SMALL_M_MAX_ROWS

    return x.shape[0] <= SMALL_M_MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           small_m_gemm: bool = False, gated_norm=None) -> torch.Tensor:
    """``F.linear``, or with ``small_m_gemm`` for decode / verify row counts the batch-invariant
    Triton product (``sgl_kernel.small_m_gemm``: a row rounds the same whatever rows share its
    launch, so speculative verify rows equal plain decode rows bit for bit). ``gated_norm`` (a
    ``sgl_kernel.small_m_gemm.GatedNormPrologue``) normalises ``x`` per head first: inside the
    kernel's loads on that path, else with the torch ``GatedRMSNorm``."""
    if small_m_gemm and x.dtype == weight.dtype and weight.stride(1) == 1 and small_m_rows(x):
        from sgl_kernel.small_m_gemm import small_m_gemm as gemm

        return gemm(x.contiguous(), weight, bias, gated_norm=gated_norm)
    if gated_norm is not None:
        from sglang.srt.layers.layernorm import gated_rms_norm_heads  # layernorm imports us

        x = gated_rms_norm_heads(x, gated_norm)
    return F.linear(x, weight, bias)


def set_linear_backend(model: nn.Module, small_m_gemm: bool, device: torch.device) -> bool:
    """Point every linear layer and LM-head product of ``model`` at the small-M Triton GEMM
    (``small_m_gemm``; ``KernelChoices.small_m_gemm``) or ``F.linear``; returns the choice.
    Triton needs CUDA, or ``TRITON_INTERPRET=1`` on CPU (tests)."""
    from sglang.srt.environ import require_triton_runtime

    if small_m_gemm:
        require_triton_runtime("KernelChoices(small_m_gemm=True)", device.type)
    for module in model.modules():
        if hasattr(module, "set_small_m_gemm"):  # a layer that prepares its weights for it
            module.set_small_m_gemm(small_m_gemm)
        elif hasattr(module, "small_m_gemm"):
            module.small_m_gemm = small_m_gemm
    return small_m_gemm


class LinearBase(nn.Module):
    """Common state: full (unsharded) sizes, the TP rank/size seen at construction, dtype, and
    the ``quant_method`` (from the active quantization scope; unquantized outside any).

    ``small_m_gemm`` (set by :func:`set_linear_backend`) routes decode / verify sizes to the
    batch-invariant Triton product."""

    small_m_gemm = False
    # KernelChoices.dense_fp8_activations (quantization.fp8.set_fp8_activations): a block-fp8 layer's
    # products above the small-M range on fp8 activations.
    fp8_activations = False
    # KernelChoices.dense_scaled_mm: the same on torch's block-scaled _scaled_mm, with the
    # layer's row groups and its off-grid groups dequantised once (quantization.fp8).
    dense_scaled_mm = False
    scaled_mm_groups = None

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 params_dtype: Optional[torch.dtype]):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.has_bias = bias
        self.quant_method = get_linear_method(self)

    def _make_params(self, output_partition_sizes: List[int], in_local: int) -> None:
        # Subclasses define ``weight_loader`` with their own slicing rule.
        self.output_partition_sizes = list(output_partition_sizes)
        self.quant_method.create_weights(self, in_local, self.output_partition_sizes,
                                         self.params_dtype)
        if self.has_bias:
            self.bias = new_param((sum(output_partition_sizes),), self.params_dtype)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _load(self, param: nn.Parameter, loaded: LazyWeight, shards: List[WeightShard]) -> None:
        """Hand weight slices to the quant method; the (never quantized) bias takes the same
        row ranges of its 1-D tensor."""
        for shard in shards:
            if param is self.bias:
                if len(loaded.shape) != 1 or loaded.shape[0] != shard.full_rows:
                    raise ValueError(f"{loaded.name}: expected {shard.full_rows} rows, got "
                                     f"shape {loaded.shape}")
                src = (loaded.load() if shard.rows == shard.full_rows
                       else loaded.narrow(0, shard.src_row, shard.rows))
                copy_checked(param, param.data.narrow(0, shard.dst_row, shard.rows), src,
                             loaded.name)
            else:
                self.quant_method.load_shard(self, param, loaded, shard)

    def _product(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return self.quant_method.apply(self, x, bias)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, bias={self.has_bias}, "
                f"tp={self.tp_rank}/{self.tp_size}, quant={type(self.quant_method).__name__}")


class ReplicatedLinear(LinearBase):
    """The full weight on every rank (small projections whose output every rank needs)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None):
        super().__init__(input_size, output_size, bias, params_dtype)
        self.input_size_per_partition = input_size
        self._make_params([output_size], input_size)

    def weight_loader(self, param: nn.Parameter, loaded: LazyWeight, shard_id=None) -> None:
        """Copy the whole checkpoint tensor."""
        n, k = self.output_size, self.input_size
        self._load(param, loaded, [WeightShard(0, 0, n, 0, n, 0, k, k)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [.., in] -> [.., out]``."""
        return self._product(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split evenly over ranks; rank r holds rows ``[r*n, (r+1)*n)``.

    With ``gather_output`` the shards are all-gathered back to the full width.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False, params_dtype: Optional[torch.dtype] = None):
        super().__init__(input_size, output_size, bias, params_dtype)
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, self.tp_size, "output_size")
        self.input_size_per_partition = input_size
        self._make_params(getattr(self, "output_sizes_per_partition",
                                  [self.output_size_per_partition]), input_size)

    def weight_loader(self, param: nn.Parameter, loaded: LazyWeight, shard_id=None) -> None:
        """Narrow the checkpoint rows to this rank's block."""
        n, k = self.output_size_per_partition, self.input_size
        self._load(param, loaded,
                   [WeightShard(0, 0, n, self.tp_rank * n, self.output_size, 0, k, k)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [.., in] -> [.., out / tp]`` (or ``[.., out]`` with ``gather_output``)."""
        y = self._product(x, self.bias)
        return tensor_model_parallel_all_gather(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several logical outputs computed by one matmul, each sharded over ranks on its own.

    The local weight is ``[shard_0 | shard_1 | ...]`` where ``shard_i`` is this rank's slice of
    logical output ``i`` (e.g. gate|up of a SwiGLU, or q|k|v|b|f|g of KDA, each split per head).
    ``weight_loader(param, loaded, shard_id=i)`` fills logical output ``i`` from its own
    checkpoint tensor; ``shard_id=None`` loads an already-fused checkpoint tensor. Each logical
    output is one piece for the quant method (its own scale grid in block fp8).

    ``replicated[i]`` keeps logical output ``i`` whole on every rank (a projection whose output
    every rank needs, as a :class:`ReplicatedLinear` would), so that it can share the matmul
    of projections of the same input that are split per head.
    """

    def __init__(self, input_size: int, output_sizes: List[int], bias: bool = False,
                 gather_output: bool = False, params_dtype: Optional[torch.dtype] = None,
                 replicated: Optional[List[bool]] = None):
        self.output_sizes = list(output_sizes)
        self.replicated = list(replicated) if replicated else [False] * len(self.output_sizes)
        if len(self.replicated) != len(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear: {len(self.replicated)} replicated "
                             f"flags for {len(self.output_sizes)} outputs")
        tp = get_tensor_model_parallel_world_size()
        self.output_sizes_per_partition = [
            s if rep else divide(s, tp, f"merged output {i} size")
            for i, (s, rep) in enumerate(zip(self.output_sizes, self.replicated))
        ]
        # The column-parallel base sizes this rank's block as sum(outputs) / tp; with
        # replicated outputs the local width is their full size plus the others' slices.
        super().__init__(input_size, tp * sum(self.output_sizes_per_partition), bias,
                         gather_output, params_dtype)
        self.output_size = sum(self.output_sizes)
        if gather_output:
            # A gathered fused output would interleave the ranks' pieces of each logical output.
            raise ValueError("MergedColumnParallelLinear does not support gather_output")

    def local_offsets(self) -> List[int]:
        """Start row of each logical output's shard inside the local weight."""
        offs, acc = [], 0
        for n in self.output_sizes_per_partition:
            offs.append(acc)
            acc += n
        return offs

    def split_output(self, y: torch.Tensor) -> List[torch.Tensor]:
        """Split the fused local output into the per-logical-output pieces."""
        return list(torch.split(y, self.output_sizes_per_partition, dim=-1))

    def weight_loader(self, param: nn.Parameter, loaded: LazyWeight, shard_id=None) -> None:
        """Fill logical output ``shard_id`` (or all of them from a fused tensor when ``None``)."""
        ids = range(len(self.output_sizes)) if shard_id is None else [int(shard_id)]
        offs = self.local_offsets()
        full_offs = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        k = self.input_size
        shards = []
        for i in ids:
            if not 0 <= i < len(self.output_sizes):
                raise ValueError(f"{loaded.name}: shard_id {i} out of range for "
                                 f"{len(self.output_sizes)} merged outputs")
            n = self.output_sizes_per_partition[i]
            start = 0 if self.replicated[i] else self.tp_rank * n  # this rank's first row
            if shard_id is None:  # rows of output i inside the fused tensor
                shards.append(WeightShard(i, offs[i], n, full_offs[i] + start,
                                          self.output_size, 0, k, k))
            else:
                shards.append(WeightShard(i, offs[i], n, start, self.output_sizes[i], 0, k, k))
        if shard_id is None and self.quant_method.loads_scales and param is not self.bias:
            # A fused scale tensor would put pieces on one grid; checkpoints store them apart.
            raise ValueError(f"{loaded.name}: a fused tensor cannot load a block-fp8 layer; "
                             "give each merged output its own tensor")
        self._load(param, loaded, shards)


class RowParallelLinear(LinearBase):
    """Input features split over ranks (``[r*n, (r+1)*n)`` columns); outputs are partial sums.

    The partial outputs are all-reduced unless ``reduce_results=False`` (the caller then sums
    several partial results and reduces once, e.g. routed + shared experts). A bias is added
    after the reduction so that it is counted once.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 reduce_results: bool = True, params_dtype: Optional[torch.dtype] = None):
        super().__init__(input_size, output_size, bias, params_dtype)
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size, "input_size")
        self._make_params([output_size], self.input_size_per_partition)
        if not hasattr(self.weight, "dummy_init"):
            # The local last dim is input_size / tp; the variance should follow the full fan-in.
            self.weight.dummy_init = normal_dummy_init(input_size)

    def weight_loader(self, param: nn.Parameter, loaded: LazyWeight, shard_id=None) -> None:
        """Narrow the checkpoint columns to this rank's block (bias: copied whole)."""
        n, out = self.input_size_per_partition, self.output_size
        self._load(param, loaded, [WeightShard(0, 0, out, 0, out, self.tp_rank * n, n,
                                               self.input_size)])

    def forward(self, x: torch.Tensor, gated_norm=None) -> torch.Tensor:
        """``x [.., in / tp]`` (this rank's input block) ``-> [.., out]``; ``gated_norm``: x is
        first normalised per head with its gate (see :func:`linear`)."""
        y = self._product(x, None) if gated_norm is None else \
            self.quant_method.apply(self, x, None, gated_norm=gated_norm)
        if self.reduce_results:
            y = tensor_model_parallel_all_reduce(y)
        # Unreduced partial sums get the bias on one rank only, so the later sum counts it once.
        if self.bias is not None and (self.reduce_results or self.tp_rank == 0):
            y = y + self.bias
        return y
