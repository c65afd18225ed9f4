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


def bf16_split(w: torch.Tensor, max_parts: int = 3) -> Optional[torch.Tensor]:
    """``[P, *w.shape]`` bf16 parts whose fp32 sum (in order) is exactly the fp32 ``w``, fewest
    first (one for a bf16-valued ``w``), or None when ``max_parts`` do not reach it. bf16 keeps
    fp32's exponent range and 8 of its 24 significand bits, so three parts (each the bf16
    rounding of what the previous ones left) hold any normal fp32 value; a bf16 ``x`` times a
    part is exact in fp32, so ``sum_p x @ part_p`` in fp32 is the fp32 product up to the
    summation order, at the bf16 tensor cores' rate."""
    w = w.float()
    parts, rest = [], w
    while len(parts) < max_parts:
        part = rest.to(torch.bfloat16)
        parts.append(part)
        rest = rest - part.float()  # exact: part is rest rounded, the difference fits fp32
        if not bool(rest.any()):
            break
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    return torch.stack(parts) if torch.equal(total, w) else None


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
        # An fp32 gate as bf16 parts side by side, [H, P * E] (bf16_split), for the
        # prefill's logits on the bf16 tensor cores (set with small_m_gemm on CUDA).
        self._bf16_parts_t: Optional[torch.Tensor] = None

    def set_small_m_gemm(self, on: bool) -> None:
        """Route decode / verify logits through ``small_m_gemm`` (after the weights are loaded).

        An fp32 gate whose values are all bf16 (a bf16-stored gate, or dummy weights: see
        docs/model.md §5.2) also keeps a bf16 copy for it: a bf16 x times a bf16 weight is
        exact in fp32, so the tensor-core product accumulated in fp32 gives the fp32 gate's
        logits (in its own summation order, fixed by the shape) from half the bytes, where an
        fp32 weight needs the much slower fp32 dot."""
        self.small_m_gemm = on
        self._bf16_weight = None
        self._bf16_parts_t = None
        if on and self.router_fp32:
            w = self.weight.detach()
            parts = bf16_split(w)
            if parts is not None and len(parts) == 1:
                self._bf16_weight = parts[0]
            if parts is not None and w.is_cuda:
                # [P, E, H] -> [H, P * E]: one GEMM gives every part's logits side by side.
                self._bf16_parts_t = parts.reshape(-1, w.shape[1]).t()

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 ``[T, E]`` logits. With ``small_m_gemm`` (``set_linear_backend``) decode /
        verify sizes take one batch-invariant launch that reads x in its own dtype and writes
        the fp32 accumulator (no cast launch, and bf16 gate logits are not rounded to bf16);
        larger bf16 batches on CUDA multiply the fp32 gate's bf16 parts on the tensor cores
        (:meth:`_prefill_logits_bf16_parts`)."""
        if self.small_m_gemm and small_m_rows(x):
            from sgl_kernel.small_m_gemm import small_m_gemm

            w = self.weight
            if self._bf16_weight is not None and x.dtype == torch.bfloat16:
                w = self._bf16_weight
            return small_m_gemm(x.contiguous(), w, out_dtype=torch.float32)
        if self._bf16_parts_t is not None and x.dtype == torch.bfloat16 and x.is_cuda:
            return self._prefill_logits_bf16_parts(x)
        if self.router_fp32:
            return F.linear(x.float(), self.weight)
        return F.linear(x.to(self.weight.dtype), self.weight).float()

    def _prefill_logits_bf16_parts(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32 gate's logits above the small-M rows from its bf16 parts (``bf16_split``):
        one bf16 GEMM with an fp32 output (``torch.mm``'s ``out_dtype``, CUDA) over the parts
        side by side, then their sum: the fp32 product up to the summation order, where
        ``F.linear`` on the fp32 weight runs cuBLAS's fp32 SIMT GEMM (0.42 ms a layer at 8192
        tokens on the H200, docs/performance.md's prefill census)."""
        e = self.weight.shape[0]
        y = torch.mm(x.reshape(-1, x.shape[-1]), self._bf16_parts_t, out_dtype=torch.float32)
        if y.shape[1] != e:
            y = y.view(y.shape[0], -1, e).sum(1)
        return y.view(*x.shape[:-1], e)

    def forward(self, x: torch.Tensor) -> TopKOutput:
        """Route ``x [T, H]`` (the post-attention-normed hidden states)."""
        if self.use_triton:
            return TopKOutput(*_triton_router()(
                self.router_logits(x), self.top_k, self.expert_bias, self.num_expert_group,
                self.topk_group, self.renormalize, self.routed_scaling_factor))
        return select_experts(self.router_logits(x), self.top_k, self.expert_bias,
                              self.num_expert_group, self.topk_group, self.renormalize,
                              self.routed_scaling_factor)
