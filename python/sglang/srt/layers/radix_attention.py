"""Layer descriptors that model layers hand to the attention backend.

They hold no weights of their own except the KDA convolution (which the backend applies because
it owns the conv state); they carry the layer id (the key into the pools) and the geometry.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from sglang.srt.layers.attention.kda_ops import KDAGate
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class RadixAttention(nn.Module):
    """MLA in absorbed (latent-cache) form, as a multi-query attention.

    Call contract: ``q [T, num_heads, kv_cache_dim]`` is the absorbed query
    (``W_UK^T q_nope`` ‖ roped ``q_rope``); ``k [T, kv_cache_dim]`` is the new cache entry per token
    (normed latent ‖ roped shared rope key), written at ``forward_batch.out_cache_loc`` when
    ``save_kv_cache``; values are the first ``kv_lora_rank`` channels of the cache. Causal within a
    request; every request attends to its own cached prefix. Returns ``[T, num_heads, kv_lora_rank]``.

    Long prefills may instead take the normal (decompressed) form: when :meth:`use_normal_form`
    says so for a batch, the model calls :meth:`forward_normal` with per-head queries and the
    up-projections, and gets head outputs ``[T, num_heads, v_head_dim]`` back (docs/model.md
    §4.1); the same cache rows are written either way.
    """

    kind = "mla"

    def __init__(self, layer_id: int, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 scaling: float):
        super().__init__()
        self.layer_id = layer_id
        self.tp_q_head_num = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.head_dim = kv_lora_rank + qk_rope_head_dim
        self.v_head_dim = kv_lora_rank
        self.scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, forward_batch: "ForwardBatch",
                save_kv_cache: bool = True) -> torch.Tensor:
        """Absorbed form (the contract above): ``[T, num_heads, kv_lora_rank]`` latent outputs."""
        return forward_batch.attn_backend.forward(q, k, None, self, forward_batch, save_kv_cache)

    def use_normal_form(self, forward_batch: "ForwardBatch") -> bool:
        """Whether this forward's backend runs MLA in normal form (:meth:`forward_normal`); the
        answer depends on the batch only, so every MLA layer of a forward agrees."""
        backend = forward_batch.attn_backend
        return backend is not None and backend.mla_normal_form(forward_batch)

    def forward_normal(self, q: torch.Tensor, k: torch.Tensor, w_kc: torch.Tensor,
                       w_vc: torch.Tensor, forward_batch: "ForwardBatch",
                       save_kv_cache: bool = True) -> torch.Tensor:
        """Normal form: ``q [T, num_heads, qk_nope + qk_rope]`` (``q_nope ‖ roped q_rope``),
        ``k [T, kv_cache_dim]`` the new cache rows (as :meth:`forward`), ``w_kc [num_heads,
        qk_nope, kv_lora_rank]`` and ``w_vc [num_heads, kv_lora_rank, v_head_dim]`` to expand
        cache rows into keys and values. Returns ``[T, num_heads, v_head_dim]``."""
        return forward_batch.attn_backend.forward_extend_normal(q, k, w_kc, w_vc, self,
                                                                forward_batch, save_kv_cache)


class RadixLinearAttention(nn.Module):
    """KDA (gated delta rule) over the KDA state pool.

    Call contract: ``q, k, v [T, num_heads * head_dim]`` are the projections **before** the short
    convolution; ``g [T, num_heads, head_dim]`` is the fp32 log-space decay (≤ 0) and
    ``beta [T, num_heads]`` the fp32 write strength. The backend applies the causal depthwise conv
    (weights ``conv_weight [3 * num_heads * head_dim, kernel]``, channels q | k | v) with the
    request's conv window, SiLU, per-head L2 norm of q and k, the recurrence from the request's
    state, and updates both states (EXTEND/DECODE) or stages them (TARGET_VERIFY).
    Returns ``o [T, num_heads, head_dim]`` (before the gated output norm).
    """

    kind = "kda"

    def __init__(self, layer_id: int, num_heads: int, head_dim: int, conv_kernel: int,
                 scale: Optional[float] = None):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.conv_kernel = conv_kernel
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.conv_weight = nn.Parameter(torch.zeros(3 * num_heads * head_dim, conv_kernel),
                                        requires_grad=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                g: Optional[torch.Tensor], beta: Optional[torch.Tensor],
                forward_batch: "ForwardBatch", gate: Optional["KDAGate"] = None) -> torch.Tensor:
        """``g`` / ``beta`` as the contract above, or ``None`` and their raw inputs ``gate``
        (:class:`~sglang.srt.layers.attention.kda_ops.KDAGate`), which a kernel backend forms
        as it loads them."""
        if gate is not None:
            return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, gate=gate)
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, g=g, beta=beta)
