"""Training-time anchor blocks for a DSpark draft: sampling and one batched, differentiable pass.

A training sequence is a prompt followed by the target's own generation, with the target's
per-position features (:class:`sglang.train.dspark_data.FeatureSequence`). Training mirrors a
serving round:

* **anchors**: random positions ``p`` inside the generation (``prompt_len <= p <= T - 2``, so
  that at least one label exists), drawn without replacement per sequence;
* **context strictly before the anchor**: block ``p`` attends to the target features of
  positions ``0 .. p-1`` only (at serving time the anchor's own target state does not exist yet:
  it is produced by the next verify);
* **block** ``[x_p, MASK x (gamma-1)]`` at positions ``p .. p+gamma-1``; slot ``k`` predicts
  ``x_{p+k+1}``; slots whose label falls past the sequence end are invalid (a prefix stays);
* **teacher-forced Markov inputs**: the previous token of slot ``k`` is the true ``x_{p+k}``
  (the anchor for ``k = 0``), so the Markov bias is added to every slot at once;
* **target distribution** of slot ``k``: the target's LM head on its final hidden state at
  ``p + k`` (the target's prediction of the same token ``x_{p+k+1}``).

:func:`forward_blocks` computes, for many blocks of several sequences at once, exactly what
:meth:`ReferenceDSparkDraft.draft_block` computes for one (tested against it): per layer the
block queries attend to ``[context rows < anchor ; the block's own rows]`` with no causal mask
inside the block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F

from sglang.train.reference_dspark import ReferenceDSparkDraft, rope_neox

__all__ = ["BlockBatch", "anchor_range", "sample_blocks", "blocks_at", "forward_blocks",
           "teacher_forced_outputs"]


@dataclass
class BlockBatch:
    """Blocks of ``B`` sequences, ``A`` anchors each (padding blocks have no valid slot)."""

    context: torch.Tensor  # [B, T, m*d] target-layer features, zero past each sequence's end
    anchors: torch.Tensor  # [B, A] anchor positions
    anchor_ids: torch.Tensor  # [B, A] anchor tokens
    labels: torch.Tensor  # [B, A, g] the token each slot predicts (0 where invalid)
    valid: torch.Tensor  # [B, A, g] bool
    target_hidden: torch.Tensor  # [B, A, g, d] target final hidden at anchor + k

    @property
    def num_blocks(self) -> int:
        """Blocks with at least one valid slot."""
        return int(self.valid.any(-1).sum())

    @property
    def prev_tokens(self) -> torch.Tensor:
        """Teacher-forced Markov inputs ``[B, A, g]``: ``[anchor, labels[..., :-1]]``."""
        return torch.cat([self.anchor_ids.unsqueeze(-1), self.labels[..., :-1]], dim=-1)


def anchor_range(prompt_len: int, length: int) -> Tuple[int, int]:
    """``[lo, hi)`` of the anchors of a sequence: inside the generation, one label at least."""
    return prompt_len, max(prompt_len, length - 1)


def blocks_at(seqs: Sequence[object], anchors: Sequence[Sequence[int]], gamma: int
              ) -> BlockBatch:
    """The blocks of ``seqs`` (objects with ``tokens [T]``, ``aux [T, m*d]`` and ``final
    [T, d]``) at the given anchor positions; shorter anchor lists are padded with invalid
    blocks."""
    if len(seqs) != len(anchors) or not seqs:
        raise ValueError(f"need one anchor list per sequence (got {len(seqs)} sequences and "
                         f"{len(anchors)} lists)")
    b = len(seqs)
    a = max(1, max(len(x) for x in anchors))
    t_max = max(int(s.tokens.numel()) for s in seqs)
    m_d, d = seqs[0].aux.shape[1], seqs[0].final.shape[1]
    context = torch.zeros(b, t_max, m_d, dtype=seqs[0].aux.dtype)
    anchor_t = torch.zeros(b, a, dtype=torch.long)
    has = torch.zeros(b, a, dtype=torch.bool)
    for i, (s, pos) in enumerate(zip(seqs, anchors)):
        n = int(s.tokens.numel())
        context[i, :n] = s.aux
        for j, p in enumerate(pos):
            if not 0 <= p < n - 1:
                raise ValueError(f"anchor {p} of sequence {i} (length {n}) has no label")
            anchor_t[i, j], has[i, j] = p, True
    offsets = torch.arange(gamma)
    label_pos = anchor_t.unsqueeze(-1) + offsets + 1  # [B, A, g]
    lengths = torch.tensor([int(s.tokens.numel()) for s in seqs])
    valid = has.unsqueeze(-1) & (label_pos < lengths.view(b, 1, 1))
    tokens = torch.zeros(b, t_max, dtype=torch.long)
    final = torch.zeros(b, t_max, d, dtype=seqs[0].final.dtype)
    for i, s in enumerate(seqs):
        tokens[i, :s.tokens.numel()] = s.tokens
        final[i, :s.tokens.numel()] = s.final
    gather_pos = label_pos.clamp_max(t_max - 1)
    rows = torch.arange(b).view(b, 1, 1)
    labels = torch.where(valid, tokens[rows, gather_pos], torch.zeros_like(gather_pos))
    # Slot k's target distribution comes from the target's state at p + k (= label_pos - 1).
    target_hidden = final[rows, (label_pos - 1).clamp_max(t_max - 1)]
    return BlockBatch(context, anchor_t, tokens[torch.arange(b).view(b, 1), anchor_t], labels,
                      valid, target_hidden)


def sample_blocks(seqs: Sequence[object], anchors_per_seq: int, gamma: int,
                  generator: torch.Generator) -> BlockBatch:
    """Up to ``anchors_per_seq`` random anchors per sequence (without replacement)."""
    if anchors_per_seq < 1:
        raise ValueError(f"anchors_per_seq must be >= 1, got {anchors_per_seq}")
    chosen: List[List[int]] = []
    for s in seqs:
        lo, hi = anchor_range(int(s.prompt_len), int(s.tokens.numel()))
        perm = torch.randperm(hi - lo, generator=generator)[:anchors_per_seq] + lo
        chosen.append(sorted(perm.tolist()))
    return blocks_at(seqs, chosen, gamma)


def _heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """``[..., n, heads * hd] -> [..., heads, n, hd]``."""
    return x.unflatten(-1, (heads, head_dim)).transpose(-2, -3)


def forward_blocks(draft: ReferenceDSparkDraft, batch: BlockBatch, embed: torch.Tensor
                   ) -> torch.Tensor:
    """The backbone over every block of ``batch``: the final-normed hidden states
    ``h [B, A, g, d]`` (``embed`` is the target's table; the base logits are ``h @ head.T``)."""
    cfg = draft.config
    g, hd = cfg.gamma, cfg.head_dim
    dev = draft.fc.weight.device
    context = batch.context.to(dev, draft.fc.weight.dtype)
    anchors = batch.anchors.to(dev)
    b, t = context.shape[:2]
    ids = torch.full((*anchors.shape, g), cfg.mask_token_id, dtype=torch.long, device=dev)
    ids[..., 0] = batch.anchor_ids.to(dev)
    block_pos = anchors.unsqueeze(-1) + torch.arange(g, device=dev)  # [B, A, g]
    ctx_pos = torch.arange(t, device=dev)
    # Context row t is visible to block (b, a) iff t < anchor: strictly before the anchor.
    visible = ctx_pos.view(1, 1, t) < anchors.unsqueeze(-1)  # [B, A, T]
    ctx = draft.hidden_norm(draft.fc(context))  # [B, T, d]
    h = F.embedding(ids, embed.to(dev))  # [B, A, g, d]
    for layer in draft.layers:
        attn = layer.self_attn
        rep = attn.heads // attn.kv_heads
        x = layer.input_layernorm(h)
        q = attn.q_norm(attn.q_proj(x).unflatten(-1, (attn.heads, hd))).transpose(-2, -3)
        q = rope_neox(q, block_pos.unsqueeze(-2), attn.theta).to(x.dtype)  # [B, A, H, g, hd]
        kb = attn.k_norm(attn.k_proj(x).unflatten(-1, (attn.kv_heads, hd))).transpose(-2, -3)
        kb = rope_neox(kb, block_pos.unsqueeze(-2), attn.theta).to(x.dtype)  # [B, A, KV, g, hd]
        vb = _heads(attn.v_proj(x), attn.kv_heads, hd)
        kc = attn.k_norm(attn.k_proj(ctx).unflatten(-1, (attn.kv_heads, hd))).transpose(1, 2)
        kc = rope_neox(kc, ctx_pos, attn.theta).to(x.dtype)  # [B, KV, T, hd]
        vc = _heads(attn.v_proj(ctx), attn.kv_heads, hd)
        if rep > 1:
            kb, vb = kb.repeat_interleave(rep, dim=2), vb.repeat_interleave(rep, dim=2)
            kc, vc = kc.repeat_interleave(rep, dim=1), vc.repeat_interleave(rep, dim=1)
        scale = 1.0 / math.sqrt(hd)
        s_ctx = torch.einsum("bahgd,bhtd->bahgt", q, kc) * scale
        s_ctx = s_ctx.masked_fill(~visible[:, :, None, None, :], float("-inf"))
        s_blk = torch.einsum("bahgd,bahjd->bahgj", q, kb) * scale
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1).float(), dim=-1).to(q.dtype)
        o = (torch.einsum("bahgt,bhtd->bahgd", p[..., :t], vc)
             + torch.einsum("bahgj,bahjd->bahgd", p[..., t:], vb))
        h = h + attn.o_proj(o.transpose(-2, -3).flatten(-2))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return draft.norm(h)


def teacher_forced_outputs(draft: ReferenceDSparkDraft, batch: BlockBatch, embed: torch.Tensor,
                           head: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor,
                                                        torch.Tensor]:
    """``(draft_logits, target_logits, confidence_logits or None)`` for the loss.

    ``draft_logits [B, A, g, V]``: base logits plus the Markov bias of the teacher-forced
    previous tokens; ``target_logits``: the target's LM head on ``batch.target_hidden`` (no
    gradient); ``confidence_logits [B, A, g]`` from ``[h ; W1[prev]]``.
    """
    dev = draft.fc.weight.device
    head = head.to(dev)
    h = forward_blocks(draft, batch, embed)
    prev = batch.prev_tokens.to(dev)
    bias = draft.markov_bias(prev)  # [B, A, g, V]
    # base + bias as one addmm: the [N, V] sum is the costliest elementwise pass of a step.
    logits = torch.addmm(bias.flatten(0, -2), h.flatten(0, -2), head.t()).view(bias.shape)
    with torch.no_grad():
        target = (batch.target_hidden.to(dev, head.dtype) @ head.t()).float()
    conf = (draft.confidence_logits(h, prev) if draft.config.enable_confidence_head else None)
    return logits, target, conf
