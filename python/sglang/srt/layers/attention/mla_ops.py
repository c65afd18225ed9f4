"""Plain-PyTorch MLA attention in absorbed (latent-cache) form: the reference for fast paths.

In absorbed form MLA is multi-query attention (docs/model.md §4.3): every head's query
(``W_UK^T q_nope`` ‖ roped ``q_rope``, width ``Dk = kv_lora_rank + qk_rope_head_dim``) scores the
same per-token cache row ``[c ‖ k_rope]`` and reads the latent ``c = row[:v_dim]`` as value.
Matmuls run in the input dtype, the softmax in fp32; score blocks are bounded so a long prefill
never materialises ``T * S * H`` fp32 scores at once.
"""
from __future__ import annotations

import torch

__all__ = ["mla_absorbed_attention", "mla_decode_attention", "SCORE_BLOCK_BYTES"]

# fp32 score bytes per block; with the fp32 probabilities beside them a block stays near 1 GiB.
SCORE_BLOCK_BYTES = 1 << 29


def mla_absorbed_attention(
    q: torch.Tensor, kv: torch.Tensor, v_dim: int, scale: float, q_start: int
) -> torch.Tensor:
    """Causal multi-query attention of one request.

    ``q [Tq, H, Dk]``; ``kv [S, Dk]`` the request's cache rows in token order; value is
    ``kv[:, :v_dim]``. Query ``i`` sits at absolute position ``q_start + i`` and sees keys
    ``0 .. q_start + i``. Returns ``[Tq, H, v_dim]`` in q's dtype.
    """
    if q.dim() != 3 or kv.dim() != 2 or q.shape[-1] != kv.shape[-1]:
        raise ValueError(f"mla_absorbed_attention: expected q [Tq, H, Dk] and kv [S, Dk], got "
                         f"{tuple(q.shape)} and {tuple(kv.shape)}")
    tq, h, dk = q.shape
    if q_start < 0 or kv.shape[0] < q_start + tq:
        raise ValueError(f"mla_absorbed_attention: {kv.shape[0]} cache rows cannot hold "
                         f"{tq} queries starting at position {q_start}")
    if not 0 < v_dim <= dk:
        raise ValueError(f"mla_absorbed_attention: v_dim {v_dim} must be in 1..{dk}")
    out = torch.empty(tq, h, v_dim, dtype=q.dtype, device=q.device)
    if tq == 0:
        return out
    kv = kv.to(q.dtype)
    # Scores in fp32 even for bf16 inputs: rounding the logits to bf16 before the softmax costs
    # ~1% relative error on peaked attention (values stay in the input dtype).
    kv_f = kv.float()
    s_total = q_start + tq
    block = max(1, SCORE_BLOCK_BYTES // (4 * h * s_total))
    for b0 in range(0, tq, block):
        b1 = min(b0 + block, tq)
        s = q_start + b1  # keys visible to the last query of this block
        keys = kv[:s]
        scores = (q[b0:b1].reshape(-1, dk).float() @ kv_f[:s].t()).view(b1 - b0, h, s) * scale
        # Query at absolute position p sees keys 0..p.
        qpos = torch.arange(q_start + b0, q_start + b1, device=q.device).view(-1, 1, 1)
        kpos = torch.arange(s, device=q.device).view(1, 1, -1)
        scores.masked_fill_(kpos > qpos, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out[b0:b1] = (probs.view(-1, s) @ keys[:, :v_dim]).view(b1 - b0, h, v_dim)
    return out


def mla_decode_attention(
    q: torch.Tensor, kv: torch.Tensor, seq_lens: torch.Tensor, v_dim: int, scale: float
) -> torch.Tensor:
    """Batched attention of a few query rows per request over that request's padded cache rows.

    ``q [B, R, Dk]`` (decode: ``R = H`` heads of one token; a speculative chain: ``R = N * H``,
    token-major), ``kv [B, S, Dk]`` (rows padded past each request's length), ``seq_lens``
    device tensor ``[B]`` (every row of request ``b`` sees keys ``0 .. seq_lens[b]-1``) or
    ``[B, R]`` (per row). Returns ``[B, R, v_dim]`` in q's dtype. Requests are processed in
    blocks that bound the fp32 scores to about :data:`SCORE_BLOCK_BYTES`.
    """
    if q.dim() != 3 or kv.dim() != 3 or kv.shape[0] != q.shape[0] or kv.shape[-1] != q.shape[-1]:
        raise ValueError(f"mla_decode_attention: expected q [B, R, Dk] and kv [B, S, Dk], got "
                         f"{tuple(q.shape)} and {tuple(kv.shape)}")
    b, r, dk = q.shape
    if seq_lens.shape not in ((b,), (b, r)):
        raise ValueError(f"mla_decode_attention: seq_lens must be [{b}] or [{b}, {r}], got "
                         f"{tuple(seq_lens.shape)}")
    s = kv.shape[1]
    out = torch.empty(b, r, v_dim, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    kv = kv.to(q.dtype)
    lens = seq_lens.view(b, -1, 1)  # [B, 1 or R, 1]
    kpos = torch.arange(s, device=q.device).view(1, 1, -1)
    block = max(1, SCORE_BLOCK_BYTES // (4 * r * max(s, 1)))
    for b0 in range(0, b, block):
        b1 = min(b0 + block, b)
        # fp32 scores (see mla_absorbed_attention); values stay in the input dtype.
        scores = torch.bmm(q[b0:b1].float(), kv[b0:b1].float().transpose(1, 2)) * scale  # [b, R, S]
        scores.masked_fill_(kpos >= lens[b0:b1], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out[b0:b1] = torch.bmm(probs, kv[b0:b1, :, :v_dim])
    return out
