"""Feed-forward blocks of the reference BailingMoeV3: dense SwiGLU MLP and the routed MoE
(docs/model.md §5: fp32 sigmoid router, group-limited top-k with a selection-only bias, renormalised
weights scaled by ``routed_scaling_factor``, one unscaled shared expert, clamped SwiGLU §5.4).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from sglang.train.reference_kda import fp32_region


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """``silu(gate) * up``; with ``limit > 0`` the clamped form
    ``min(silu(gate), limit) * clamp(up, -limit, limit)`` (docs/model.md §5.4)."""
    act = F.silu(gate)
    if limit > 0:
        act = act.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return act * up


class MLP(nn.Module):
    """SwiGLU MLP ``down(act(gate(x)) * up(x))``: dense layers, experts and the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float = 0.0):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.limit = float(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Router(nn.Module):
    """``mlp.gate``: router weight ``[E, hidden]`` and the fp32 selection bias ``expert_bias``.

    ``expert_bias`` is a persistent buffer (in the state dict, no gradient): aux-loss-free
    balancing updates it from expert counts. It stays fp32 whatever dtype the module is cast to.
    """

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        # Module.to(dtype) would round the bias to bf16 and change which experts get selected;
        # keep its fp32 values and follow only the device change.
        bias = self._buffers["expert_bias"]
        super()._apply(fn, recurse)
        moved = self._buffers["expert_bias"]
        if bias is not None and moved is not None and moved.dtype != torch.float32:
            self._buffers["expert_bias"] = bias.to(device=moved.device, dtype=torch.float32)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits in fp32 (docs/model.md §5.1 step 1): x and W are both upcast."""
        with fp32_region(x):
            return F.linear(x.float(), self.weight.float())


def grouped_topk(logits: torch.Tensor, bias: Optional[torch.Tensor], top_k: int, n_group: int,
                 topk_group: int, renormalize: bool, scaling: float
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Noaux-tc routing (docs/model.md §5.1 steps 2-6) on fp32 ``logits [N, E]``.

    Returns ``(weights [N, top_k] fp32, ids [N, top_k] int64)``. The bias only picks experts; the
    weights come from the un-biased sigmoid scores.
    """
    n, e = logits.shape
    scores = torch.sigmoid(logits)
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        per_group = e // n_group
        grouped = choice.view(n, n_group, per_group)
        group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)
        keep = group_score.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros(n, n_group, dtype=torch.bool, device=logits.device)
        group_mask.scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand(n, n_group, per_group).reshape(n, e)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class MoE(nn.Module):
    """Routed experts + shared expert (checkpoint prefix ``.mlp.``).

    Each expert runs only on the tokens routed to it. Expert counts of every forward accumulate in
    ``expert_counts`` until :meth:`pop_expert_counts` is called (for aux-loss-free balancing).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 shared_intermediate_size: int, num_shared_experts: int, n_group: int,
                 topk_group: int, renormalize: bool, scaling: float, use_bias: bool,
                 expert_limit: float = 0.0, shared_limit: float = 0.0):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.renormalize, self.scaling, self.use_bias = renormalize, scaling, use_bias
        self.gate = Router(hidden_size, num_experts)
        self.experts = nn.ModuleList(
            MLP(hidden_size, intermediate_size, expert_limit) for _ in range(num_experts))
        self.shared_experts = (MLP(hidden_size, shared_intermediate_size, shared_limit)
                               if num_shared_experts > 0 else None)
        self.expert_counts: Optional[torch.Tensor] = None

    def route(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x [N, hidden]`` -> ``(weights [N, k] fp32, ids [N, k])``."""
        bias = self.gate.expert_bias if self.use_bias else None
        return grouped_topk(self.gate(x), bias, self.top_k, self.n_group, self.topk_group,
                            self.renormalize, self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.route(flat)
        with torch.no_grad():
            counts = torch.bincount(ids.flatten(), minlength=self.num_experts)
            self.expert_counts = counts if self.expert_counts is None else self.expert_counts + counts
        # Sort the (token, slot) pairs by expert so each expert sees one contiguous slice.
        order = ids.flatten().argsort(stable=True)
        token_of = order // self.top_k
        pair_weight = weights.flatten()[order]
        out = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
        start = 0
        for e, cnt in enumerate(counts.tolist()):
            if cnt == 0:
                continue
            tok = token_of[start:start + cnt]
            y = self.experts[e](flat[tok]).float() * pair_weight[start:start + cnt, None]
            out = out.index_add(0, tok, y)
            start += cnt
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat).float()  # not scaled by routed_scaling_factor
        return out.to(x.dtype).view(shape)

    def pop_expert_counts(self) -> Optional[torch.Tensor]:
        """Routed-token counts per expert [E] (int64) since the last call, then reset."""
        counts, self.expert_counts = self.expert_counts, None
        return counts
