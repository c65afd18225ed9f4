"""Plain-PyTorch MLA attention: absorbed (latent-cache) form, and the normal form for prefill.

In absorbed form MLA is multi-query attention (docs/model.md §4.3): every head's query
(``W_UK^T q_nope`` ‖ roped ``q_rope``, width ``Dk = kv_lora_rank + qk_rope_head_dim``) scores the
same per-token cache row ``[c ‖ k_rope]`` and reads the latent ``c = row[:v_dim]`` as value.
Matmuls run in the input dtype, the softmax in fp32; score blocks are bounded so a long prefill
never materialises ``T * S * H`` fp32 scores at once.

The normal (decompressed) form (docs/model.md §4.1) is what long prefills use: the cache rows are
expanded into per-head keys ``[c W_UK[h]^T ‖ k_rope]`` (width ``qk_nope + qk_rope``, 192 on
Flash) and values ``c W_UV[h]^T`` (:func:`mla_expand_kv`), and ordinary multi-head causal
attention runs through ``torch.nn.functional.scaled_dot_product_attention``
(:func:`mla_prefill_attention`), i.e. a fused flash kernel in bf16 on CUDA. Same scale, same
cache rows, same result up to rounding: the absorbed form spends ``kv_lora_rank + rope`` = 576
MACs per query-key pair and head in fp32, the normal form 192 + 128 in bf16 on tensor cores.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["mla_absorbed_attention", "mla_decode_attention", "mla_expand_kv",
           "mla_prefill_attention", "SCORE_BLOCK_BYTES"]

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
    # Scores in fp32 even for bf16 inputs: bf16 keeps 8 significant bits, and the softmax
    # exponentiates a logit's rounding error, which on peaked attention (a few large logits)
    # shifts the weights visibly (docs/performance.md, "Kernel design measurements (moved from
    # code comments)"). Values stay in the input dtype.
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


def mla_expand_kv(rows: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
                  v_width: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Normal-form keys and values of latent cache rows (docs/model.md §4.1 step 4).

    ``rows [S, r + d_r]`` (normed latent ‖ roped ``k_rope``, as the cache holds them),
    ``w_kc [H, d_n, r]`` (W_UK), ``w_vc [H, r, d_v]`` (W_UV^T). Returns ``k [S, H, d_n + d_r]``
    (``[c W_UK[h]^T ‖ k_rope]``, the rope key shared by all heads) and ``v [S, H, v_width]``
    (``c W_UV[h]^T``, zero-padded to ``v_width`` channels when that exceeds ``d_v``; see
    :func:`mla_prefill_attention` for why). Matmuls in ``rows``' dtype (the weights are cast).
    """
    if rows.dim() != 2 or w_kc.dim() != 3 or w_vc.dim() != 3:
        raise ValueError(f"mla_expand_kv: expected rows [S, r + d_r], w_kc [H, d_n, r], "
                         f"w_vc [H, r, d_v]; got {tuple(rows.shape)}, {tuple(w_kc.shape)}, "
                         f"{tuple(w_vc.shape)}")
    h, dn, r = w_kc.shape
    dv = w_vc.shape[-1]
    dr = rows.shape[-1] - r
    if dr <= 0 or tuple(w_vc.shape[:2]) != (h, r):
        raise ValueError(f"mla_expand_kv: rows of width {rows.shape[-1]}, w_kc "
                         f"{tuple(w_kc.shape)} and w_vc {tuple(w_vc.shape)} do not agree")
    width = dv if v_width is None else v_width
    if width < dv:
        raise ValueError(f"mla_expand_kv: v_width {width} < v head dim {dv}")
    s = rows.shape[0]
    latent, k_rope = rows.split([r, dr], dim=-1)
    # All heads in one matmul each: [S, r] @ [r, H * d]. The key's weight gets d_r zero rows
    # after each head's d_n, so the product lands in k's layout with zeros where the rope part
    # goes, and one broadcast copy fills those: a concatenation would write the whole key a
    # second time (the largest copy of an MLA layer's prefill, docs/performance.md).
    w_k = F.pad(w_kc.to(rows.dtype), (0, 0, 0, dr)).reshape(h * (dn + dr), r)
    k = (latent @ w_k.t()).view(s, h, dn + dr)
    k[..., dn:] = k_rope.unsqueeze(1)
    w_v = w_vc.to(rows.dtype).transpose(0, 1)  # [r, H, d_v]
    if width > dv:
        # Zero weight columns give exactly zero value channels: padding V costs no extra copy.
        w_v = F.pad(w_v, (0, width - dv))
    v = (latent @ w_v.reshape(r, h * width)).view(s, h, width)
    return k, v


def mla_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          q_start: int, v_dim: Optional[int] = None) -> torch.Tensor:
    """Causal multi-head attention of one request in normal form, one fused SDPA call.

    ``q [Tq, H, D]`` (``q_nope ‖ roped q_rope``), ``k [S, H, D]`` and ``v [S, H, Dv]`` from
    :func:`mla_expand_kv` with ``S = q_start + Tq``: the request's cached prefix then its new
    tokens. Query ``i`` sits at position ``q_start + i`` and sees keys ``0 .. q_start + i``
    (causal mask aligned bottom-right). Returns ``[Tq, H, v_dim]`` (``v_dim`` defaults to
    ``Dv``; channels past it are dropped, for a zero-padded ``v``) in q's dtype, a view.

    Kernel choice (CUDA, bf16/fp16): torch's flash kernel needs q, k and v to share one head
    dim (<= 256), which MLA's 192 (q/k) vs 128 (v) does not; the memory-efficient kernel takes
    the unequal dims. The caller zero-pads ``v`` to ``D`` (192: a 1.5x wider P @ V inside an
    already fused kernel) so that flash is eligible. No prefix: ``is_causal=True`` (square: the
    usual mask, no mask tensor); torch 2.11 on the H200 (sm90) then runs cuDNN's fused flash
    kernel padded or not, so there the padding costs little, and either form is far faster than
    the absorbed one.
    With a prefix: ``causal_lower_right``, which SDPA hands to flash (its causal mask is
    bottom-right aligned) when the dims agree, else to the efficient kernel's bottom-right mask,
    which is markedly slower, and builds a boolean mask only for the math fallback (CPU, fp32).
    Hence the padding: it keeps a prefilled prefix on flash (timings: docs/performance.md,
    "Prefill: the grouped MoE GEMM, MLA in normal form, fp8 at large M").
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or q.shape[1:] != k.shape[1:] \
            or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"mla_prefill_attention: expected q [Tq, H, D], k [S, H, D], "
                         f"v [S, H, Dv]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    tq, s = q.shape[0], k.shape[0]
    if q_start < 0 or s != q_start + tq:
        raise ValueError(f"mla_prefill_attention: {s} keys for {tq} queries starting at "
                         f"position {q_start}; expected {q_start + tq}")
    dv = v.shape[-1] if v_dim is None else v_dim
    if not 0 < dv <= v.shape[-1]:
        raise ValueError(f"mla_prefill_attention: v_dim {dv} must be in 1..{v.shape[-1]}")
    if tq == 0:
        return q.new_empty(0, q.shape[1], dv)
    # [1, H, L, D] views of the token-major tensors: SDPA needs only the last dim contiguous.
    qh, kh, vh = (x.to(q.dtype).transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if q_start == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        # Imported here: torch.nn.attention.bias imports torch._dynamo, over a second of every
        # process start that never prefills after a cached prefix.
        from torch.nn.attention.bias import causal_lower_right

        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(tq, s),
                                           scale=scale)
    return o[0].transpose(0, 1)[..., :dv]
