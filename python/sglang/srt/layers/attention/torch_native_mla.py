"""MLA in plain PyTorch over the latent cache (:class:`TorchNativeMLABackend`): the reference
every fast MLA path matches.

Decode, target verify and the chain-shaped draft extend run in absorbed form as one batched
masked attention over each request's first ``bound`` cache rows (``ForwardBatch.
seq_lens_upper_bound``, a host integer the engine computes without reading the device); a
prefill of :data:`MLA_NORMAL_FORM_MIN_TOKENS` tokens or more runs in normal form, one fused
attention call per request (``mla_ops.mla_prefill_attention``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.extend_layout import ExtendLayout, MetadataCache, extend_layout
from sglang.srt.layers.attention.mla_ops import (
    mla_absorbed_attention,
    mla_decode_attention,
    mla_expand_kv,
    mla_prefill_attention,
)

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

__all__ = ["TorchNativeMLABackend", "MLA_NORMAL_FORM_MIN_TOKENS"]

# EXTEND batches (prefill / chunked prefill; never verify or draft extend) of at least this many
# new tokens run MLA in normal form. Per query-key pair and head the normal form costs
# d_n + d_r + d_v = 320 bf16 MACs on tensor cores against the absorbed form's r + d_r + r = 1088
# in fp32; its price is expanding every key row (prefix included) with W_UK / W_UV, r * H *
# (d_n + d_v) MACs, which the absorbed form instead spends on every query. With no prefix the
# normal form always wins; behind a long prefix the expansion pays off once a chunk has some
# tens of queries. Below the threshold (short chunks, tiny prefills) the absorbed form stays.
MLA_NORMAL_FORM_MIN_TOKENS = 64


# ============================================================================================
# MLA
# ============================================================================================
@dataclass
class _MLAPaddedMeta:
    """Decode (``rows = 1``) or a fixed-width speculative chain (``rows = N`` tokens per
    request, request-major): one batched attention over padded per-request cache rows."""

    width: int  # cache rows gathered per request (>= every sequence length of the batch)
    rows: int  # query tokens per request


def _padded_width(forward_batch: "ForwardBatch") -> int:
    """Cache rows to gather per request: the host upper bound the engine sets, else (batches
    built by hand in tests or tools) the longest sequence, read from the device once."""
    bound = forward_batch.seq_lens_upper_bound
    if bound is None:
        bound = int(forward_batch.seq_lens.max()) if forward_batch.batch_size else 0
    pool = forward_batch.req_to_token_pool
    return bound if pool is None else min(bound, pool.req_to_token.shape[1])


class TorchNativeMLABackend(AttentionBackend):
    """MLA (absorbed form) in plain PyTorch; see :class:`~sglang.srt.layers.radix_attention.RadixAttention`
    for the call contract. Prefill-like extends loop over requests; decode, target verify and the
    chain-shaped draft extend are batched over requests."""

    needs_cpu_seq_lens = False
    # Captured with the rest of a decode round: the metadata is the host gather width (the
    # graph runner keys graphs by a bucket of it) and the request-major row count.
    supports_cuda_graph = True
    width_independent = False

    def __init__(self, normal_form_min_tokens: Optional[int] = MLA_NORMAL_FORM_MIN_TOKENS):
        # None: the absorbed form for everything (tests compare the two forms this way).
        self.normal_form_min_tokens = normal_form_min_tokens
        self._cache = MetadataCache()

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices,
                                                 seq_lens, forward_mode, spec_info=None) -> None:
        """Fixed-shape batches only; the capture's batch object builds fresh metadata."""
        if not forward_mode.is_cuda_graph():
            raise ValueError(f"{type(self).__name__} captures decode-round modes, got "
                             f"{forward_mode.name}")
        self._cache = MetadataCache()

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Build the per-forward layout once (every MLA layer of the forward shares it)."""
        self._cache.get(forward_batch, self._build, refresh=True)

    @staticmethod
    def _build(forward_batch: "ForwardBatch"):
        if forward_batch.forward_mode.is_idle():
            return None
        mode = forward_batch.forward_mode
        if mode.is_decode():
            return _MLAPaddedMeta(_padded_width(forward_batch), 1)
        chain = mode.is_target_verify() or mode.is_draft_extend()
        if chain and forward_batch.extend_seq_lens_cpu is None:
            # A speculative chain: every request carries the same N tokens (T = B * N), and
            # the per-request lengths are device values the host must not wait for.
            b, t = forward_batch.batch_size, forward_batch.num_tokens
            if b == 0 or t % b:
                raise ValueError(f"{mode.name} without host lengths needs the same number of "
                                 f"tokens per request; got {t} tokens for {b} requests")
            return _MLAPaddedMeta(_padded_width(forward_batch), t // b)
        return extend_layout(forward_batch)

    @staticmethod
    def _check(q, k, layer, forward_batch, q_dim: Optional[int] = None):
        """``q`` as ``[T, H, q_dim]`` (default: the absorbed width, the cache row's) after
        checking it, the new cache rows ``k [T, head_dim]`` and the pools."""
        t = q.shape[0]
        dk = layer.head_dim
        dq = dk if q_dim is None else q_dim
        if q.numel() != t * layer.tp_q_head_num * dq:
            raise ValueError(f"MLA layer {layer.layer_id}: q must be [T, {layer.tp_q_head_num}, {dq}], "
                             f"got {tuple(q.shape)}")
        if k is None or tuple(k.shape) != (t, dk):
            raise ValueError(f"MLA layer {layer.layer_id}: k must be [{t}, {dk}], "
                             f"got {None if k is None else tuple(k.shape)}")
        if forward_batch.token_to_kv_pool is None or forward_batch.req_to_token_pool is None:
            raise ValueError("MLA attention needs forward_batch.token_to_kv_pool and req_to_token_pool")
        return q.view(t, layer.tp_q_head_num, dq)

    @staticmethod
    def _extend_rows(k, layer, forward_batch, save_kv_cache: bool):
        """``(cache buffer, req->token map, the new tokens' rows)`` of an extend, after writing
        ``k`` to the cache when asked. The new rows come straight from ``k`` cast to the cache
        dtype (exactly what the cache holds), so a result never depends on save_kv_cache."""
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k)
        buf = pool.get_kv_buffer(layer.layer_id)
        return buf, forward_batch.req_to_token_pool.req_to_token, k.to(buf.dtype)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Prefill / chunked prefill / verify: each request attends to its cached prefix and,
        causally, to its new tokens."""
        q = self._check(q, k, layer, forward_batch)
        lay = self._cache.get(forward_batch, self._build)
        if isinstance(lay, _MLAPaddedMeta):
            return self._forward_padded(q, k, layer, forward_batch, lay, save_kv_cache)
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        if q.shape[0] == 0:
            return out
        buf, req_to_token, new_rows = self._extend_rows(k, layer, forward_batch, save_kv_cache)
        for slot, prefix, n, start in zip(lay.slots, lay.prefix_lens, lay.extend_lens, lay.starts):
            if n == 0:
                continue
            prefix_rows = buf[req_to_token[slot, :prefix].long()]
            kv = torch.cat([prefix_rows, new_rows[start:start + n]], dim=0)
            out[start:start + n] = mla_absorbed_attention(
                q[start:start + n], kv, layer.v_head_dim, layer.scaling, q_start=prefix)
        return out

    def mla_normal_form(self, forward_batch: "ForwardBatch") -> bool:
        """Plain EXTEND batches (prefill, chunked prefill) of at least ``normal_form_min_tokens``
        new tokens. Verify and draft extend keep the absorbed form: their chains are short and
        their kernels (and CUDA graphs) are absorbed-form ones."""
        mode = forward_batch.forward_mode
        return (self.normal_form_min_tokens is not None and mode.is_extend()
                and not mode.is_target_verify() and not mode.is_draft_extend()
                and forward_batch.num_tokens >= self.normal_form_min_tokens)

    def mla_normal_form_min_tokens(self) -> Optional[int]:
        """``normal_form_min_tokens``: plain EXTEND batches of at least this many new tokens
        take the normal form (None: none does)."""
        return self.normal_form_min_tokens

    def forward_extend_normal(self, q, k, w_kc, w_vc, layer, forward_batch, save_kv_cache=True):
        """Prefill / chunked prefill in normal form (see the base class for the contract).

        The new cache rows are written as in :meth:`forward_extend`. Each request's key rows
        (its cached prefix from the pool, then its new rows straight from ``k``, so that
        ``save_kv_cache=False`` still sees them) are laid back to back, expanded into per-head
        keys and values by one pair of matmuls for the whole batch, and attended by one SDPA
        call per request with new tokens. On CUDA in half precision the values are zero-padded
        to the q/k head dim so that SDPA may pick its flash kernel (see
        :func:`~sglang.srt.layers.attention.mla_ops.mla_prefill_attention`).
        """
        t, h = q.shape[0], layer.tp_q_head_num
        if w_kc.dim() != 3 or w_vc.dim() != 3 or w_kc.shape[0] != h or w_vc.shape[0] != h \
                or w_kc.shape[2] != layer.kv_lora_rank or w_vc.shape[1] != layer.kv_lora_rank:
            raise ValueError(f"MLA layer {layer.layer_id}: w_kc must be [{h}, d_n, "
                             f"{layer.kv_lora_rank}] and w_vc [{h}, {layer.kv_lora_rank}, d_v], "
                             f"got {tuple(w_kc.shape)} and {tuple(w_vc.shape)}")
        dqk, dv = w_kc.shape[1] + layer.qk_rope_head_dim, w_vc.shape[2]
        q = self._check(q, k, layer, forward_batch, q_dim=dqk)
        lay = self._cache.get(forward_batch, self._build)
        if not isinstance(lay, ExtendLayout):
            raise ValueError(f"MLA layer {layer.layer_id}: the normal form runs EXTEND batches "
                             f"with host lengths, got {forward_batch.forward_mode.name}")
        if t == 0:
            return q.new_empty(0, h, dv)
        buf, req_to_token, new_rows = self._extend_rows(k, layer, forward_batch, save_kv_cache)
        reqs = [r for r in zip(lay.slots, lay.prefix_lens, lay.extend_lens, lay.starts) if r[2]]
        if all(prefix == 0 for _, prefix, _, _ in reqs):
            rows, offsets = new_rows, [start for _, _, _, start in reqs]
        else:
            pieces, offsets, acc = [], [], 0
            for slot, prefix, n, start in reqs:
                if prefix:
                    pieces.append(buf[req_to_token[slot, :prefix].long()])
                pieces.append(new_rows[start:start + n])
                offsets.append(acc)
                acc += prefix + n
            rows = torch.cat(pieces, dim=0)
        # The flash kernel takes half precision on CUDA with one head dim <= 256 for q, k, v.
        flash_ok = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and dqk <= 256
        v_width = dqk if flash_ok else dv
        keys, values = mla_expand_kv(rows.to(q.dtype), w_kc, w_vc, v_width)
        if len(reqs) == 1 and reqs[0][2] == t:
            # One request holds every row (a prefill): its attention output is the layer's, as
            # the strided view SDPA leaves (the head gate reads any token and head strides);
            # copying it into ``out`` wrote [T, H, v] once more (docs/performance.md, "Where an
            # 8192-token prefill copies").
            return mla_prefill_attention(q, keys, values, layer.scaling, q_start=reqs[0][1],
                                         v_dim=dv)
        out = q.new_empty(t, h, dv)
        for (_, prefix, n, start), off in zip(reqs, offsets):
            s = prefix + n
            out[start:start + n] = mla_prefill_attention(
                q[start:start + n], keys[off:off + s], values[off:off + s], layer.scaling,
                q_start=prefix, v_dim=dv)
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """One token per request, batched (see :meth:`_forward_padded`)."""
        q = self._check(q, k, layer, forward_batch)
        meta: _MLAPaddedMeta = self._cache.get(forward_batch, self._build)
        return self._forward_padded(q, k, layer, forward_batch, meta, save_kv_cache)

    @staticmethod
    def _forward_padded(q, k, layer, forward_batch, meta: "_MLAPaddedMeta", save_kv_cache: bool):
        """``meta.rows`` tokens per request at ``forward_batch.positions``, batched: gather every
        request's first ``meta.width`` cache rows, put the new tokens' rows in from ``k`` (so
        that save_kv_cache=False still sees them), mask each query past its own position."""
        b, n = forward_batch.batch_size, meta.rows
        h, dk = layer.tp_q_head_num, q.shape[-1]
        if b == 0:
            return q.new_empty(0, h, layer.v_head_dim)
        buf, req_to_token, new_rows = TorchNativeMLABackend._extend_rows(k, layer, forward_batch,
                                                                         save_kv_cache)
        slots = req_to_token[forward_batch.req_pool_indices, :meta.width]
        kv = buf[slots.long()]  # [B, width, Dk]
        pos = forward_batch.positions.view(b, n)
        kv[torch.arange(b, device=kv.device).unsqueeze(1), pos] = new_rows.view(b, n, dk)
        # Query row (token i, head j) of request b sees keys 0 .. pos[b, i].
        lens = (pos + 1).repeat_interleave(h, dim=1)  # [B, N * H]
        out = mla_decode_attention(q.reshape(b, n * h, dk), kv, lens, layer.v_head_dim,
                                   layer.scaling)
        return out.view(b * n, h, layer.v_head_dim)
