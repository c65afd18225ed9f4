"""The Bailing MoE block: router + stacked routed experts + shared expert, one all-reduce.

Under TP every rank holds every expert, sliced along the intermediate dim (as the dense MLP
is), computes the routed and shared partial sums for all tokens and adds them; a single
all-reduce then completes both (docs/model.md §5.1 step 7: the shared expert is not scaled).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sglang.srt.configs.engine_defaults import KERNEL_BACKEND_CHOICES, resolve_kernel_backend
from sglang.srt.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from sglang.srt.environ import require_triton_runtime
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.linear import (MergedColumnParallelLinear, RowParallelLinear,
                                      normal_dummy_init)
from sglang.srt.layers.moe.fused_moe_triton import SMALL_M_MAX_PAIRS, SharedExpertWeights
from sglang.srt.layers.quantization import WeightShard, get_moe_method
from sglang.srt.layers.moe.topk import MoEGate
from sglang.srt.model_loader.weight_utils import LazyWeight

__all__ = ["BailingMLP", "FusedMoE", "BailingMoE", "set_moe_runner_backend"]


class BailingMLP(nn.Module):
    """SwiGLU MLP ``down(act(gate(x)) * up(x))`` with gate|up fused and the intermediate sharded.

    Used for the dense layers (``reduce_results=True``) and as the shared expert
    (``reduce_results=False``: the MoE block reduces once for routed + shared).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float = 0.0,
                 reduce_results: bool = True, params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], params_dtype=params_dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size,
                                           reduce_results=reduce_results, params_dtype=params_dtype)
        self.act_fn = SiluAndMul(swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H] -> [T, H]`` (a partial sum when ``reduce_results=False``)."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class FusedMoE(nn.Module):
    """Stacked routed-expert weights (SGLang's parameter names ``w13_weight``, ``w2_weight``).

    ``w13_weight [E, 2*I_local, H]`` holds each expert's gate rows then up rows of this rank's
    intermediate slice; ``w2_weight [E, H, I_local]`` the matching down-projection columns.
    Load with ``weight_loader(param, loaded, shard_id, expert_id)``, ``shard_id`` in
    ``{"w1" (gate), "w3" (up), "w2" (down)}``. The parameters, their loading and the product
    belong to ``quant_method`` (unquantized, or block fp8 with ``*_scale_inv`` next to them).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 swiglu_limit: float = 0.0, params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.intermediate_size_per_partition = divide(
            intermediate_size, self.tp_size, "moe_intermediate_size")
        self.swiglu_limit = float(swiglu_limit)
        dtype = params_dtype or torch.get_default_dtype()
        self.quant_method = get_moe_method(self)
        self.quant_method.create_weights(self, num_experts, hidden_size,
                                         self.intermediate_size_per_partition, dtype)
        if not hasattr(self.w2_weight, "dummy_init"):
            # w2's fan-in is the full intermediate width, not the local slice in its last dim.
            self.w2_weight.dummy_init = normal_dummy_init(intermediate_size)
        # "torch_native" or "triton" (small batches through sgl_kernel's grouped mat-vec,
        # larger ones through its grouped GEMM over expert-sorted pairs); set for the whole
        # model by set_moe_runner_backend, as is grouped_mm (the torch-native path's batches
        # above its small-batch path through torch._grouped_mm instead of the expert loop).
        self.runner_backend = "torch_native"
        self.grouped_mm = False
        # KernelChoices.moe_combine: the shared expert as extra pairs and the one-kernel combine.
        self.fused_combine = False
        # KernelChoices.moe_align_kernel: the grouped GEMM path's expert sort as Triton launches.
        self.align_kernel = False
        # KernelChoices.moe_fp8_activations (quantization.fp8.set_fp8_activations): block-fp8
        # experts' grouped GEMMs on fp8 activations.
        self.fp8_activations = False

    def weight_loader(self, param: nn.Parameter, loaded: LazyWeight, shard_id: str,
                      expert_id: int) -> None:
        """Copy one expert's gate (w1), up (w3) or down (w2) projection slice for this rank
        (or the matching slice of its block scales)."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"{loaded.name}: expert id {expert_id} out of range "
                             f"[0, {self.num_experts})")
        i_full, i_local = self.intermediate_size, self.intermediate_size_per_partition
        h, start = self.hidden_size, self.tp_rank * i_local
        if shard_id in ("w1", "w3"):
            piece = 0 if shard_id == "w1" else 1
            shard = WeightShard(piece, piece * i_local, i_local, start, i_full, 0, h, h)
        elif shard_id == "w2":
            shard = WeightShard(0, 0, h, 0, h, start, i_local, i_full)
        else:
            raise ValueError(f"{loaded.name}: unknown expert shard_id {shard_id!r}")
        self.quant_method.load_shard(self, param, loaded, shard, expert_id)

    def small_m(self, topk_ids: torch.Tensor) -> bool:
        """Whether these routes take the Triton small-batch path (model-dtype weights only)."""
        return (self.runner_backend == "triton" and topk_ids.numel() <= SMALL_M_MAX_PAIRS
                and self.quant_method.triton_small_m_ok())

    def large_m(self, topk_ids: torch.Tensor) -> bool:
        """Whether these routes take the Triton grouped GEMM (the Triton backend above
        :data:`SMALL_M_MAX_PAIRS` pairs): no host loop over experts, no per-call dequantised
        copies of fp8 experts, no host sync."""
        return (self.runner_backend == "triton" and topk_ids.numel() > SMALL_M_MAX_PAIRS
                and self.quant_method.triton_small_m_ok())

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                shared: Optional[torch.Tensor] = None,
                shared_weights: Optional[SharedExpertWeights] = None) -> torch.Tensor:
        """Partial (this rank's intermediate slice) output ``[T, H]``, not reduced: the routed
        experts plus the shared expert, given as its output ``shared`` (added in the fp32
        combine) or, on the Triton paths (small-batch grouped mat-vec, grouped GEMM), as
        ``shared_weights`` run in the same launches."""
        return self.quant_method.apply(self, hidden, topk_weights, topk_ids, shared,
                                       shared_weights)

    def extra_repr(self) -> str:
        return (f"backend={self.runner_backend}, grouped_mm={self.grouped_mm}, experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size} (local "
                f"{self.intermediate_size_per_partition}), limit={self.swiglu_limit}")


class BailingMoE(nn.Module):
    """Ling's MoE block (HF ``mlp``): ``gate`` router, ``experts``, ``shared_experts``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 shared_intermediate_size: int, num_expert_group: int, topk_group: int,
                 renormalize: bool, routed_scaling_factor: float, use_expert_bias: bool,
                 router_dtype: str, expert_swiglu_limit: float = 0.0,
                 shared_swiglu_limit: float = 0.0, params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.gate = MoEGate(hidden_size, num_experts, top_k, num_expert_group, topk_group,
                            renormalize, routed_scaling_factor, use_expert_bias, router_dtype,
                            params_dtype)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, expert_swiglu_limit,
                                params_dtype)
        self.shared_experts = (
            BailingMLP(hidden_size, shared_intermediate_size, shared_swiglu_limit,
                       reduce_results=False, params_dtype=params_dtype)
            if shared_intermediate_size > 0 else None
        )

    def max_cuda_graph_tokens(self) -> Optional[int]:
        """Tokens per forward this block can run inside a CUDA graph (None: any number). The
        Triton backend has no limit (its grouped GEMM sorts the pairs on the device). On the
        torch backend, beyond ``GATHER_MAX_PAIRS`` (token, expert) pairs the expert loop reads
        expert counts on the host, unless ``grouped_mm`` (``KernelChoices.moe_grouped_mm``)
        routes those batches to the grouped GEMMs (device-side offsets) and torch's kernel takes
        these weights."""
        pairs = self.experts.quant_method.max_graph_pairs(self.experts)
        return None if pairs is None else max(pairs // self.gate.top_k, 0)

    def shared_as_pairs(self) -> Optional[SharedExpertWeights]:
        """The shared expert's weights when they ride the routed experts' launches
        (``KernelChoices.moe_combine``, and the same per-expert shape and dtype), else None."""
        mlp = self.shared_experts
        if (mlp is None or not self.experts.fused_combine
                or not self.experts.quant_method.triton_small_m_ok()):
            return None
        w13, w2 = mlp.gate_up_proj.weight, mlp.down_proj.weight
        routed = self.experts.w13_weight
        if w13.shape != routed.shape[1:] or w13.dtype != routed.dtype or w2.stride(-1) != 1:
            return None
        # Block-fp8 weights bring their scales (the same layout as the routed experts').
        scales = [getattr(lin, "weight_scale_inv", None) for lin in (mlp.gate_up_proj,
                                                                      mlp.down_proj)]
        if (scales[0] is None) != (getattr(self.experts, "w13_weight_scale_inv", None) is None):
            return None
        return SharedExpertWeights(w13, w2, mlp.act_fn.limit, *scales)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, H] -> [T, H]``: routed + shared experts (summed in fp32, one rounding),
        complete after the one all-reduce."""
        topk = self.gate(hidden)
        ids = topk.topk_ids
        shared_pairs = (self.shared_as_pairs()
                        if self.experts.small_m(ids) or self.experts.large_m(ids) else None)
        shared = None
        if self.shared_experts is not None and shared_pairs is None:
            shared = self.shared_experts(hidden)
        out = self.experts(hidden, topk.topk_weights, topk.topk_ids, shared, shared_pairs)
        return tensor_model_parallel_all_reduce(out)


def set_moe_runner_backend(model: nn.Module, backend: str, device: torch.device, *,
                           router: bool = False, fused_combine: bool = False,
                           grouped_mm: bool = False, align_kernel: bool = False) -> str:
    """Point every :class:`FusedMoE` of ``model`` at ``backend`` and return the one chosen.

    ``auto`` is resolved by ``engine_defaults.resolve_kernel_backend`` (Triton on CUDA).
    ``triton`` needs CUDA, or ``TRITON_INTERPRET=1`` on CPU (tests); batches above
    ``SMALL_M_MAX_PAIRS`` (token, expert) pairs take its grouped GEMM
    (``sgl_kernel.moe_grouped_gemm``). The other switches are a runner's ``KernelChoices``:
    ``grouped_mm`` sends the native backend's large batches through torch's grouped GEMMs;
    ``router`` runs the routers' selection as one kernel (routers whose layout the kernel takes);
    ``fused_combine`` has the Triton backend carry the shared expert and combine in one kernel
    (no effect on the native backend, whose experts never take the Triton path);
    ``align_kernel`` has the Triton backend's grouped GEMM path sort its pairs by expert with
    ``sgl_kernel.moe_align`` (same alignment as the torch ops; same no-effect rule).
    """
    if backend not in KERNEL_BACKEND_CHOICES:
        raise ValueError(f"moe runner backend must be one of {KERNEL_BACKEND_CHOICES}, got "
                         f"{backend!r}")
    chosen = resolve_kernel_backend(backend, device.type)
    if chosen == "triton":
        require_triton_runtime("--moe-runner-backend triton", device.type)
    fused_combine = chosen == "triton" and fused_combine
    align_kernel = chosen == "triton" and align_kernel
    if router:
        require_triton_runtime("KernelChoices(router=True)", device.type)
        from sgl_kernel.moe_router import router_kernel_supports
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.runner_backend, module.grouped_mm = chosen, grouped_mm
            module.fused_combine = fused_combine
            module.align_kernel = align_kernel
        elif isinstance(module, MoEGate):  # routers whose layout the kernel takes
            module.use_triton = router and router_kernel_supports(
                module.weight.shape[0], module.num_expert_group)
    return chosen
