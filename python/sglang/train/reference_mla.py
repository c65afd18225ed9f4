"""Gated MLA of the reference BailingMoeV3 in its naive (decompressed) form (docs/model.md
§4.1-4.2).

q (optionally through a q_lora bottleneck), a compressed latent ``c`` normalised with
``kv_a_layernorm``, one rope key shared by all heads, ``kv_b_proj`` decompressing ``c`` into
per-head ``[k_nope | v]``, causal softmax with scale ``1/sqrt(qk_nope + qk_rope)``, interleaved
(GPT-J) RoPE on the rope dims only, a head-wise sigmoid output gate, output projection ``dense``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.train.reference_kda import fp32_region


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * w``, computed in fp32, returned in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fp32_region(x):
            x32 = x.float()
            y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (y * self.weight.float()).to(x.dtype)


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """GPT-J RoPE: channels (2i, 2i+1) rotate by ``pos * theta^(-2i/d)``; ``x [..., T, d]`` with
    ``positions [T]`` (docs/model.md §4.2). Computed in fp32."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d)
    angles = (positions.to(torch.float64).unsqueeze(-1) * inv_freq).float()  # [T, d/2]
    cos, sin = angles.cos(), angles.sin()
    x32 = x.float().unflatten(-1, (d // 2, 2))
    x0, x1 = x32[..., 0], x32[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2)


class MLAAttention(nn.Module):
    """The gated MLA block of a full-attention layer and of the MTP layer (prefix ``.attention.``)."""

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: Optional[int],
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, rope_theta: float, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.rope_theta = rope_theta
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
        q_width = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_width, bias=False)
        self.q_lora = q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim,
                                            bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim),
                                   bias=False)
        self.g_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.dense = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` [B, T, hidden] (already input-normed), causal over T -> [B, T, hidden].

        ``positions`` [T] are the absolute token positions (default ``0..T-1``)."""
        b, t, _ = x.shape
        h = self.num_heads
        if positions is None:
            positions = torch.arange(t, device=x.device)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(b, t, h, self.nope + self.rope).transpose(1, 2)  # [B, H, T, 192]
        ckv = self.kv_a_proj_with_mqa(x)
        c, k_rope = ckv.split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(b, t, h, self.nope + self.v_dim)
        kv = kv.transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rope = rope_interleaved(q[..., self.nope:], positions, self.rope_theta).to(q.dtype)
        k_rope = rope_interleaved(k_rope, positions, self.rope_theta).to(q.dtype)  # [B, T, r]
        query = torch.cat([q[..., :self.nope], q_rope], dim=-1)
        key = torch.cat([k_nope, k_rope.unsqueeze(1).expand(b, h, t, self.rope)], dim=-1)
        o = F.scaled_dot_product_attention(query, key.to(query.dtype), v.to(query.dtype),
                                           is_causal=True, scale=self.scale)  # [B, H, T, v]
        gate_logits = self.g_proj(x)
        with fp32_region(x):
            gate = torch.sigmoid(gate_logits.float())  # one scalar per head
            o = (o.float() * gate.transpose(1, 2).unsqueeze(-1)).transpose(1, 2)
        return self.dense(o.reshape(b, t, h * self.v_dim).to(x.dtype))
