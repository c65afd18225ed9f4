"""MoE router: sigmoid scores, bias-corrected group-limited top-k (docs/model.md §5.1).

Per token: ``p = sigmoid(x W^T)`` (fp32 logits); selection scores ``s = p + expert_bias``; the
experts are split into ``n_group`` groups, a group's score is the sum of its two best ``s``,
the ``topk_group`` best groups stay eligible; the top-``k`` eligible ``s`` pick the experts.
Their weights come from the *unbiased* ``p``, optionally renormalised (``+1e-20``), then scaled
by ``routed_scaling_factor``.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.linear import copy_checked, small_m_rows
from sglang.srt.model_loader.weight_utils import LazyWeight

__all__ = ["TopKOutput", "select_experts", "MoEGate"]


class TopKOutput(NamedTuple):
    """``topk_weights [T, k]`` fp32 and ``topk_ids [T, k]`` int64 (best selection score first)."""

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    expert_bias: Optional[torch.Tensor] = None,
    num_expert_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> TopKOutput:
    """Sigmoid routing with selection bias and group limiting, from ``router_logits [T, E]``."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    t, e = router_logits.shape
    if e % num_expert_group or not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"bad grouping: {e} experts, {num_expert_group} groups, "
                         f"topk_group {topk_group}")
    scores = torch.sigmoid(router_logits.float())
    choice = scores if expert_bias is None else scores + expert_bias.float()
    if num_expert_group > 1 and topk_group < num_expert_group:
        per_group = e // num_expert_group
        grouped = choice.view(t, num_expert_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)  # [T, G]
        keep = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand(t, num_expert_group, per_group).reshape(t, e)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return TopKOutput(topk_weights, topk_ids)


@functools.lru_cache(maxsize=None)
def _triton_router() -> Callable:
    from sgl_kernel.moe_router import moe_router_topk  # Triton: imported once, on first use

    return moe_router_topk


def _bf16_valued_dummy_init(tensor: torch.Tensor, generator: torch.Generator) -> None:
    """The default dummy rule (``sglang.srt.model_loader.dummy``) drawn in bf16, stored in the
    fp32 parameter: the values a gate stored in bf16 has."""
    from sglang.srt.model_loader.dummy import default_dummy_init

    draw = torch.empty(tensor.shape, dtype=torch.bfloat16, device=tensor.device)
    default_dummy_init("gate.weight", draw, generator)
    tensor.copy_(draw)


def _load_whole(param: nn.Parameter, loaded: LazyWeight, shard_id=None) -> None:
    copy_checked(param, param.data, loaded.load(), loaded.name)


class MoEGate(nn.Module):
    """The router of one MoE layer (HF ``mlp.gate``): weight ``[E, H]`` + ``expert_bias [E]``.

    Replicated on every rank (each rank needs every token's selection). ``router_dtype`` "fp32"
    keeps the weight in fp32 and computes ``x.float() @ W^T``; "bf16" keeps the weight in bf16,
    computes ``x.bfloat16() @ W^T`` and upcasts the logits (half the bytes; docs/model.md §5.2).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, num_expert_group: int,
                 topk_group: int, renormalize: bool, routed_scaling_factor: float,
                 use_expert_bias: bool = True, router_dtype: str = "fp32",
                 params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if router_dtype not in ("fp32", "float32", "bf16", "bfloat16"):
            raise ValueError(f"router_dtype must be 'fp32' or 'bf16', got {router_dtype!r}")
        self.router_fp32 = router_dtype in ("fp32", "float32")
        self.top_k = top_k
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.renormalize = renormalize
        self.routed_scaling_factor = routed_scaling_factor
        # "bf16" means bf16 whatever the model dtype (an fp32 CPU model then measures what the
        # bf16 gate costs in routing decisions: benchmark/batch1/numerics_ab.py).
        w_dtype = torch.float32 if self.router_fp32 else torch.bfloat16
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=w_dtype),
                                   requires_grad=False)
        self.weight.weight_loader = _load_whole
        if self.router_fp32:  # dummy values as a bf16-stored gate has them (set_small_m_gemm)
            self.weight.dummy_init = _bf16_valued_dummy_init
        if use_expert_bias:
            # Selection-only bias; fp32 in checkpoints, kept fp32 here.
            self.expert_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                            requires_grad=False)
            self.expert_bias.weight_loader = _load_whole
        else:
            self.register_parameter("expert_bias", None)
        # The selection as one Triton kernel (sgl_kernel.moe_router); set for the whole model
        # by set_moe_runner_backend (KernelChoices.router).
        self.use_triton = False
        # The logits GEMM through sgl_kernel.small_m_gemm (KernelChoices.small_m_gemm), set by
        # sglang.srt.layers.linear.set_linear_backend (set_small_m_gemm).
        self.small_m_gemm = False
        self._bf16_weight: Optional[torch.Tensor] = None

    def set_small_m_gemm(self, on: bool) -> None:
        """Route decode / verify logits through ``small_m_gemm`` (after the weights are loaded).

        An fp32 gate whose values are all bf16 (a bf16-stored gate, or dummy weights: see
        docs/model.md §5.2) also keeps a bf16 copy for it: a bf16 x times a bf16 weight is
        exact in fp32, so the tensor-core product accumulated in fp32 gives the fp32 gate's
        logits (in its own summation order, fixed by the shape) from half the bytes, where an
        fp32 weight needs the much slower fp32 dot."""
        self.small_m_gemm = on
        self._bf16_weight = None
        if on and self.router_fp32:
            w = self.weight.detach()
            w16 = w.to(torch.bfloat16)
            if torch.equal(w16.float(), w):
                self._bf16_weight = w16

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 ``[T, E]`` logits. With ``small_m_gemm`` (``set_linear_backend``) decode /
        verify sizes take one batch-invariant launch that reads x in its own dtype and writes
        the fp32 accumulator (no cast launch, and bf16 gate logits are not rounded to bf16)."""
        if self.small_m_gemm and small_m_rows(x):
            from sgl_kernel.small_m_gemm import small_m_gemm

            w = self.weight
            if self._bf16_weight is not None and x.dtype == torch.bfloat16:
                w = self._bf16_weight
            return small_m_gemm(x.contiguous(), w, out_dtype=torch.float32)
        if self.router_fp32:
            return F.linear(x.float(), self.weight)
        return F.linear(x.to(self.weight.dtype), self.weight).float()

    def forward(self, x: torch.Tensor) -> TopKOutput:
        """Route ``x [T, H]`` (the post-attention-normed hidden states)."""
        if self.use_triton:
            return TopKOutput(*_triton_router()(
                self.router_logits(x), self.top_k, self.expert_bias, self.num_expert_group,
                self.topk_group, self.renormalize, self.routed_scaling_factor))
        return select_experts(self.router_logits(x), self.top_k, self.expert_bias,
                              self.num_expert_group, self.topk_group, self.renormalize,
                              self.routed_scaling_factor)
