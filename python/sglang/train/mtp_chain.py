"""The MTP (NextN) layer run as a NEXTN round drafts, for training: the real pass over a
window and the teacher-forced ``K``-step chain from sampled anchors, the chain's analytic
per-step acceptance against the target, and the acceptance-aware training loss
(:mod:`sglang.train.mtp` has the command and the definitions).
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from sglang.train.dspark_losses import (acceptance_loss, acceptance_probability,
                                        expected_accept_length, l1_distance)
from sglang.train.reference_kda import fp32_region
from sglang.train.reference_mla import rope_interleaved
from sglang.train.target import mtp_distill_loss

__all__ = ["RealPass", "mtp_real_pass", "mtp_chain", "chain_target_logits", "chain_alpha",
           "sample_anchors", "mtp_accept_loss"]


# ------------------------------------------------------------------ the MTP layer, step by step
def _mtp_input(model: Any, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``eh_proj([enorm(embed(ids)); hnorm(hidden)])``: the MTP block's residual input."""
    layer = model.mtp_layer
    emb = model.model.word_embeddings(ids)
    u = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(hidden)], dim=-1))
    return u.to(emb.dtype)


def _attention_qkv(attn: Any, x: torch.Tensor, positions: torch.Tensor
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decompressed MLA ``(query, key [B, H, N, nope+rope], value [B, H, N, v])`` of the
    input-normed ``x [B, N, hidden]`` at ``positions [B, N]`` (each row its own positions: chain
    steps of different anchors sit at different places)."""
    b, n, _ = x.shape
    h = attn.num_heads
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))) if attn.q_lora else attn.q_proj(x)
    q = q.view(b, n, h, attn.nope + attn.rope).transpose(1, 2)
    c, k_rope = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, attn.rope], dim=-1)
    kv = attn.kv_b_proj(attn.kv_a_layernorm(c)).view(b, n, h, attn.nope + attn.v_dim)
    k_nope, v = kv.transpose(1, 2).split([attn.nope, attn.v_dim], dim=-1)
    q_rope = rope_interleaved(q[..., attn.nope:], positions.unsqueeze(1), attn.rope_theta)
    k_rope = rope_interleaved(k_rope, positions, attn.rope_theta).to(q.dtype)  # [B, N, r]
    query = torch.cat([q[..., :attn.nope], q_rope.to(q.dtype)], dim=-1)
    key = torch.cat([k_nope, k_rope.unsqueeze(1).expand(b, h, n, attn.rope)], dim=-1)
    return query, key.to(q.dtype), v.to(q.dtype)


def _attention_out(attn: Any, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """Head-wise sigmoid gate and ``dense`` on the attention output ``o [B, H, N, v]``."""
    b, h, n, vd = o.shape
    gate_logits = attn.g_proj(x)
    with fp32_region(x):
        gate = torch.sigmoid(gate_logits.float())  # [B, N, H]
        o = (o.float() * gate.transpose(1, 2).unsqueeze(-1)).transpose(1, 2)
    return attn.dense(o.reshape(b, n, h * vd).to(x.dtype))


def _mtp_finish(model: Any, u: torch.Tensor, attn_out: torch.Tensor
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Residual, MoE, ``final_layernorm`` and the LM head: ``(logits fp32, chain hidden)``."""
    layer = model.mtp_layer
    h = u + attn_out
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    out = layer.final_layernorm(h)
    return model.lm_head(out).float(), out


class RealPass(NamedTuple):
    """The MTP layer over every pair ``(h_t, x_{t+1})`` of a batch (the teacher-forced step 1)."""

    logits: torch.Tensor  # [B, N, V] fp32
    hidden: torch.Tensor  # [B, N, d]: final_layernorm output, the next chain step's input
    key: torch.Tensor  # [B, H, N, nope+rope]: the MTP cache a NEXTN round drafts on
    value: torch.Tensor  # [B, H, N, v]


def mtp_real_pass(model: Any, hidden: torch.Tensor, next_ids: torch.Tensor) -> RealPass:
    """``model.mtp_forward(hidden, next_ids)`` that also returns the attention keys and values
    (the chain steps attend over them)."""
    layer = model.mtp_layer
    attn = layer.attention
    b, n = next_ids.shape
    u = _mtp_input(model, hidden, next_ids)
    x = layer.input_layernorm(u)
    positions = torch.arange(n, device=x.device).expand(b, n)
    q, k, v = _attention_qkv(attn, x, positions)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
    logits, out = _mtp_finish(model, u, _attention_out(attn, x, o))
    return RealPass(logits, out, k, v)


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[b, idx[b, a]]`` for ``x [B, N, ...]``, ``idx [B, A]`` -> ``[B, A, ...]``."""
    flat = idx.reshape(idx.shape[0], -1, *([1] * (x.dim() - 2)))
    return x.gather(1, flat.expand(-1, -1, *x.shape[2:]))


def mtp_chain(model: Any, real: RealPass, input_ids: torch.Tensor, anchors: torch.Tensor,
              steps: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``steps``-long teacher-forced NEXTN chain at ``anchors [B, A]`` (pair indices ``t``).

    ``input_ids [B, T]`` are the target's inputs (``real`` covers their ``N = T - 1`` pairs).
    Returns ``(logits [B, A, steps, V] fp32, valid [B, A, steps])``; step ``k`` (1-based)
    predicts ``x_{t+k+1}`` and is valid while ``t + k <= N`` (its target distribution exists).
    """
    if steps < 1:
        raise ValueError(f"the chain needs at least one step, got {steps}")
    layer = model.mtp_layer
    attn = layer.attention
    n = real.logits.shape[1]
    if input_ids.shape[1] != n + 1:
        raise ValueError(f"input_ids has {input_ids.shape[1]} tokens, the real pass {n} pairs "
                         "(expected one token more)")
    logits = [_gather_rows(real.logits, anchors)]
    g = _gather_rows(real.hidden, anchors)
    # Real key s is visible to anchor t iff s <= t: the MTP cache holds the committed pairs.
    visible = torch.arange(n, device=anchors.device).view(1, 1, 1, n) <= anchors[:, None, :, None]
    keys: List[torch.Tensor] = []
    values: List[torch.Tensor] = []
    for k in range(2, steps + 1):
        ids = input_ids.gather(1, (anchors + k).clamp_max(n))  # x_{t+k} (clamped where invalid)
        u = _mtp_input(model, g, ids)
        x = layer.input_layernorm(u)
        q, key, val = _attention_qkv(attn, x, anchors + k - 1)
        keys.append(key)
        values.append(val)
        s_real = (q @ real.key.transpose(-1, -2)) * attn.scale  # [B, H, A, N]
        s_real = s_real.masked_fill(~visible, float("-inf"))
        s_own = torch.stack([(q * kj).sum(-1) for kj in keys], dim=-1) * attn.scale
        p = torch.softmax(torch.cat([s_real, s_own], dim=-1).float(), dim=-1).to(q.dtype)
        o = p[..., :n] @ real.value + (p[..., n:].unsqueeze(-1)
                                        * torch.stack(values, dim=-2)).sum(-2)
        step_logits, g = _mtp_finish(model, u, _attention_out(attn, x, o))
        logits.append(step_logits)
    valid = (anchors.unsqueeze(-1) + torch.arange(1, steps + 1, device=anchors.device)) <= n
    return torch.stack(logits, dim=2), valid


def chain_target_logits(target_logits: torch.Tensor, anchors: torch.Tensor, steps: int
                        ) -> torch.Tensor:
    """The target's logits for chain step ``k`` at anchor ``t``: position ``t + k``
    (``target_logits [B, T, V]`` -> ``[B, A, steps, V]``; clamped where the step is invalid)."""
    t = target_logits.shape[1]
    pos = (anchors.unsqueeze(-1) + torch.arange(1, steps + 1, device=anchors.device))
    return _gather_rows(target_logits, pos.clamp_max(t - 1).flatten(1)).unflatten(
        1, (anchors.shape[1], steps))


def sample_anchors(batch: int, pairs: int, count: int,
                   generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``[batch, count]`` distinct sorted pair indices per row (every pair when ``count`` is 0 or
    at least ``pairs``)."""
    if pairs < 1:
        raise ValueError("a window needs at least one MTP pair (seq_len >= 2)")
    if count <= 0 or count >= pairs:
        return torch.arange(pairs).expand(batch, pairs).clone()
    rows = [torch.randperm(pairs, generator=generator)[:count].sort().values
            for _ in range(batch)]
    return torch.stack(rows)


def chain_alpha(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Per-slot acceptance ``1 - 0.5 * ||p_draft - p_target||_1`` (the target side detached)."""
    p_d = torch.softmax(draft_logits.float(), dim=-1)
    p_t = torch.softmax(target_logits.detach().float(), dim=-1)
    return acceptance_probability(l1_distance(p_d, p_t))


def mtp_accept_loss(model: Any, batch: torch.Tensor, distill: float, alpha_accept: float,
                    chain: int, anchors_per_seq: int, generator: torch.Generator
                    ) -> Dict[str, torch.Tensor]:
    """The training loss on a ``[B, T + 1]`` batch (see the module docstring).

    Returns ``loss``, ``mtp`` (the MTP phase's loss) and, when ``alpha_accept > 0``, ``accept``
    (the acceptance loss) and the detached ``expected_accept`` (``1 + E[A]`` per anchor, mean).
    """
    t = batch.shape[1] - 1
    with torch.no_grad():
        logits, hidden = model(batch[:, :-1])
    real = mtp_real_pass(model, hidden[:, :t - 1], batch[:, 1:t])
    base = mtp_distill_loss(real.logits, logits[:, 1:t], batch[:, 2:], distill)
    terms: Dict[str, torch.Tensor] = {"mtp": base, "loss": base}
    if alpha_accept > 0:
        anchors = sample_anchors(batch.shape[0], t - 1, anchors_per_seq, generator)
        anchors = anchors.to(batch.device)
        draft, valid = mtp_chain(model, real, batch[:, :-1], anchors, chain)
        alpha = chain_alpha(draft, chain_target_logits(logits, anchors, chain))
        terms["accept"] = acceptance_loss(alpha, valid)
        terms["loss"] = base + alpha_accept * terms["accept"]
        terms["expected_accept"] = 1 + expected_accept_length(alpha.detach(), valid).mean()
    return terms
