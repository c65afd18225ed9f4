"""Plain-PyTorch attention backends over the real pools: the reference every fast path matches.

* :class:`TorchNativeMLABackend` — MLA in absorbed form (multi-query attention over the latent
  cache of :class:`~sglang.srt.mem_cache.memory_pool.MLATokenToKVPool`).
* :class:`TorchNativeKDABackend` — KDA over :class:`~sglang.srt.mem_cache.memory_pool.KDAStatePool`
  (short-conv window + fp32 recurrent state per request slot).

Both run on CPU and on CUDA. Decode, target verify and the chain-shaped draft extend work from
device tensors plus one host integer the engine computes without reading the device
(``ForwardBatch.seq_lens_upper_bound``, the width of the padded cache gather): MLA runs them as
one batched masked attention over each request's first ``bound`` cache rows. KDA target verify
(a fixed-width chain per request) stages per-position states in the pool's speculative scratch
and leaves the persistent state alone (stage, then commit).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional

import torch

from sglang.srt.configs.engine_defaults import KDA_PREFILL_IMPL_CHOICES
from sglang.srt.layers.attention import fla_kda
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.kda_ops import (
    KDAGate,
    causal_conv1d,
    causal_conv1d_chain,
    causal_conv1d_update,
    kda_chunked,
    kda_recurrent,
    kda_step,
    l2norm,
)
from sglang.srt.layers.attention.mla_ops import (
    mla_absorbed_attention,
    mla_decode_attention,
    mla_expand_kv,
    mla_prefill_attention,
)

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

KDA_PREFILL_IMPLS = KDA_PREFILL_IMPL_CHOICES
# The decode / target-verify recurrence: "torch" (kda_step, the reference) or "triton"
# (sgl_kernel.kda_recurrent: state read from and written to the pools by one kernel per layer).
KDA_RECURRENT_IMPLS = ("torch", "triton")

# EXTEND batches (prefill / chunked prefill; never verify or draft extend) of at least this many
# new tokens run MLA in normal form. Per query-key pair and head the normal form costs
# d_n + d_r + d_v = 320 bf16 MACs on tensor cores against the absorbed form's r + d_r + r = 1088
# in fp32; its price is expanding every key row (prefix included) with W_UK / W_UV, r * H *
# (d_n + d_v) MACs, which the absorbed form instead spends on every query. With no prefix the
# normal form always wins; behind a long prefix the expansion pays off once a chunk has some
# tens of queries. Below the threshold (short chunks, tiny prefills) the absorbed form stays.
MLA_NORMAL_FORM_MIN_TOKENS = 64

# Extends up to this many tokens run the token-by-token recurrence; longer ones the chunked form
# (the chunked form's fixed per-chunk cost only pays off once a chunk has some length).
RECURRENT_MAX_TOKENS = 16


@dataclass
class _ExtendLayout:
    """Host-side per-request layout of an extend-like batch (one entry per request)."""

    slots: List[int]  # req_pool_indices
    prefix_lens: List[int]
    extend_lens: List[int]
    starts: List[int]  # first row of the request in the flattened T rows


def _extend_layout(forward_batch: "ForwardBatch") -> _ExtendLayout:
    """Per-request lengths from the host mirrors when the scheduler filled them, else from the
    device tensors (verify / draft extend carry no host mirrors)."""
    slots = forward_batch.req_pool_indices.tolist()
    if forward_batch.extend_seq_lens_cpu is not None and forward_batch.extend_prefix_lens_cpu is not None:
        extend_lens = list(forward_batch.extend_seq_lens_cpu)
        prefix_lens = list(forward_batch.extend_prefix_lens_cpu)
    else:
        extend_lens = forward_batch.extend_seq_lens.tolist()
        prefix_lens = forward_batch.extend_prefix_lens.tolist()
    if not len(slots) == len(extend_lens) == len(prefix_lens):
        raise ValueError(f"extend batch: {len(slots)} requests but {len(extend_lens)} extend lengths "
                         f"and {len(prefix_lens)} prefix lengths")
    starts, acc = [], 0
    for n in extend_lens:
        starts.append(acc)
        acc += n
    if acc != forward_batch.num_tokens:
        raise ValueError(f"extend batch: extend lengths sum to {acc} but the batch has "
                         f"{forward_batch.num_tokens} tokens")
    return _ExtendLayout(slots, prefix_lens, extend_lens, starts)


class _MetadataCache:
    """Per-forward metadata kept on the backend (``ForwardBatch.attn_metadata`` is a single slot
    and a hybrid wrapper holds two backends). Built eagerly by ``init_forward_metadata`` and
    rebuilt lazily if a layer is called with a batch the backend has not seen."""

    def __init__(self):
        self._batch: Optional["ForwardBatch"] = None
        self._meta: Any = None

    def get(self, forward_batch: "ForwardBatch", build, refresh: bool = False) -> Any:
        """The metadata of ``forward_batch``; ``refresh`` rebuilds it even for a batch object seen
        before (a runner may refill one batch object between forwards)."""
        if refresh or self._batch is not forward_batch:
            self._meta = build(forward_batch)
            self._batch = forward_batch
        return self._meta


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
        self._cache = _MetadataCache()

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices,
                                                 seq_lens, forward_mode, spec_info=None) -> None:
        """Fixed-shape batches only; the capture's batch object builds fresh metadata."""
        if not forward_mode.is_cuda_graph():
            raise ValueError(f"{type(self).__name__} captures decode-round modes, got "
                             f"{forward_mode.name}")
        self._cache = _MetadataCache()

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
        return _extend_layout(forward_batch)

    @staticmethod
    def _check(q, k, layer, forward_batch):
        t = q.shape[0]
        dk = layer.head_dim
        if q.numel() != t * layer.tp_q_head_num * dk:
            raise ValueError(f"MLA layer {layer.layer_id}: q must be [T, {layer.tp_q_head_num}, {dk}], "
                             f"got {tuple(q.shape)}")
        if k is None or tuple(k.shape) != (t, dk):
            raise ValueError(f"MLA layer {layer.layer_id}: k must be [{t}, {dk}], "
                             f"got {None if k is None else tuple(k.shape)}")
        if forward_batch.token_to_kv_pool is None or forward_batch.req_to_token_pool is None:
            raise ValueError("MLA attention needs forward_batch.token_to_kv_pool and req_to_token_pool")
        return q.view(t, layer.tp_q_head_num, dk)

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
        if tuple(q.shape) != (t, h, dqk):
            raise ValueError(f"MLA layer {layer.layer_id}: normal-form q must be [T, {h}, {dqk}], "
                             f"got {tuple(q.shape)}")
        if k is None or tuple(k.shape) != (t, layer.head_dim):
            raise ValueError(f"MLA layer {layer.layer_id}: k must be [{t}, {layer.head_dim}], "
                             f"got {None if k is None else tuple(k.shape)}")
        if forward_batch.token_to_kv_pool is None or forward_batch.req_to_token_pool is None:
            raise ValueError("MLA attention needs forward_batch.token_to_kv_pool and "
                             "req_to_token_pool")
        lay = self._cache.get(forward_batch, self._build)
        if not isinstance(lay, _ExtendLayout):
            raise ValueError(f"MLA layer {layer.layer_id}: the normal form runs EXTEND batches "
                             f"with host lengths, got {forward_batch.forward_mode.name}")
        out = q.new_empty(t, h, dv)
        if t == 0:
            return out
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
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k)
        buf = pool.get_kv_buffer(layer.layer_id)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        slots = req_to_token[forward_batch.req_pool_indices, :meta.width]
        kv = buf[slots.long()]  # [B, width, Dk]
        pos = forward_batch.positions.view(b, n)
        kv[torch.arange(b, device=kv.device).unsqueeze(1), pos] = k.to(buf.dtype).view(b, n, dk)
        # Query row (token i, head j) of request b sees keys 0 .. pos[b, i].
        lens = (pos + 1).repeat_interleave(h, dim=1)  # [B, N * H]
        out = mla_decode_attention(q.reshape(b, n * h, dk), kv, lens, layer.v_head_dim,
                                   layer.scaling)
        return out.view(b * n, h, layer.v_head_dim)


# ============================================================================================
# KDA
# ============================================================================================
def _qkv_columns(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[T, 3C]`` = ``q | k | v``: a view when the three are consecutive column blocks of one
    tensor (the fused projection's output, as the model passes them), else a concatenation."""
    t = q.shape[0]
    if (q.dim() == k.dim() == v.dim() == 2 and q.shape == k.shape == v.shape
            and q.stride() == k.stride() == v.stride() and q.stride(1) == 1
            and q.dtype == k.dtype == v.dtype):
        step = q.shape[1] * q.element_size()
        if (k.data_ptr() == q.data_ptr() + step and v.data_ptr() == k.data_ptr() + step
                and q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
                and (t <= 1 or q.stride(0) >= 3 * q.shape[1])):
            return q.as_strided((t, 3 * q.shape[1]), (q.stride(0), 1))
    return torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)


class TorchNativeKDABackend(AttentionBackend):
    """KDA in plain PyTorch; see :class:`~sglang.srt.layers.radix_attention.RadixLinearAttention`
    for the call contract.

    ``kda_prefill_impl``: ``"torch"`` (chunked/recurrent torch math), ``"fla"`` (fla-core's
    ``chunk_kda``; needs CUDA and fla) or ``"auto"`` (fla when the tensors are on CUDA and fla
    imports, torch otherwise). ``recurrent_impl``: decode and target verify through the torch
    step (``"torch"``) or the Triton kernel (``"triton"``); one choice for both, so that a verify
    position and the decode of the same token round alike.
    """

    needs_cpu_seq_lens = False
    # Decode and verify read per-slot states by device indices: a graph captures them as is.
    supports_cuda_graph = True
    width_independent = True

    def __init__(self, kda_prefill_impl: str = "auto", recurrent_impl: str = "torch"):
        if kda_prefill_impl not in KDA_PREFILL_IMPLS:
            raise ValueError(f"kda_prefill_impl must be one of {KDA_PREFILL_IMPLS}, got {kda_prefill_impl!r}")
        if recurrent_impl not in KDA_RECURRENT_IMPLS:
            raise ValueError(f"recurrent_impl must be one of {KDA_RECURRENT_IMPLS}, got {recurrent_impl!r}")
        self.recurrent_impl = recurrent_impl
        # sgl_kernel's conv prologue and recurrence, imported (with triton) only when chosen.
        self._recurrent_kernel = self._conv_kernel = None
        if recurrent_impl == "triton":
            from sgl_kernel.kda_conv import kda_conv_qkv
            from sgl_kernel.kda_recurrent import kda_recurrent_update

            self._recurrent_kernel, self._conv_kernel = kda_recurrent_update, kda_conv_qkv
        if kda_prefill_impl == "fla" and not fla_kda.is_available():
            raise ValueError("kda_prefill_impl='fla' needs CUDA and fla-core (pip install fla-core)")
        self.kda_prefill_impl = kda_prefill_impl
        self._cache = _MetadataCache()

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Extend-like batches: the host-side per-request layout; decode needs none."""
        self._cache.get(forward_batch, self._build, refresh=True)

    @staticmethod
    def _build(forward_batch: "ForwardBatch"):
        mode = forward_batch.forward_mode
        # Verify works from shapes and device tensors alone. DRAFT_EXTEND belongs to the draft
        # model (MLA only); a hybrid wrapper still initialises this backend for it, so no error
        # here, only if a KDA layer is actually called (see forward_extend).
        if mode.is_idle() or mode.is_decode() or mode.is_target_verify() or mode.is_draft_extend():
            return None
        return _extend_layout(forward_batch)

    def _prefill_conv_kernel(self, x: torch.Tensor) -> Optional[Any]:
        """``sgl_kernel.kda_prefill_conv`` (one launch per request instead of a dozen over fp32
        temporaries) when the extend's tensors are on CUDA, or in the CPU interpreter when the
        Triton decode kernels are on; None (the torch reference) otherwise."""
        if not x.is_cuda:
            if self._conv_kernel is None:
                return None
            from sgl_kernel._triton_mode import INTERPRETED

            if not INTERPRETED:
                return None
        from sgl_kernel.kda_prefill_conv import kda_prefill_conv

        return kda_prefill_conv

    def _use_fla(self, x: torch.Tensor) -> bool:
        if self.kda_prefill_impl == "torch":
            return False
        return x.is_cuda and fla_kda.is_available()

    @staticmethod
    def _prepare(q, k, v, g, beta, layer, forward_batch, gate: Optional[KDAGate] = None):
        """Validate shapes and return ``(mixed [T, 3C], conv pool, ssm pool)``. The gate comes
        as ``g`` and ``beta`` or as its raw inputs ``gate`` (:class:`KDAGate`)."""
        t = q.shape[0]
        h, d = layer.num_heads, layer.head_dim
        if gate is not None:
            if g is not None or beta is not None:
                raise ValueError(f"KDA layer {layer.layer_id}: pass g and beta, or gate, not both")
            if tuple(gate.f.shape) != (t, h * d) or tuple(gate.b.shape) != (t, h):
                raise ValueError(f"KDA layer {layer.layer_id}: gate.f must be [{t}, {h * d}] and "
                                 f"gate.b [{t}, {h}], got {tuple(gate.f.shape)} and "
                                 f"{tuple(gate.b.shape)}")
        elif g is None or beta is None:
            raise ValueError(f"KDA layer {layer.layer_id}: forward needs g and beta (or gate) "
                             "keyword arguments")
        elif tuple(g.shape) != (t, h, d) or tuple(beta.shape) != (t, h):
            raise ValueError(f"KDA layer {layer.layer_id}: g must be [{t}, {h}, {d}] and beta "
                             f"[{t}, {h}], got {tuple(g.shape)} and {tuple(beta.shape)}")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x is None or x.numel() != t * h * d:
                raise ValueError(f"KDA layer {layer.layer_id}: {name} must be [{t}, {h * d}], "
                                 f"got {None if x is None else tuple(x.shape)}")
        pool = forward_batch.kda_state_pool
        if pool is None:
            raise ValueError("KDA attention needs forward_batch.kda_state_pool")
        return (_qkv_columns(q, k, v), pool.get_conv_state(layer.layer_id),
                pool.get_ssm_state(layer.layer_id))

    @staticmethod
    def _kernel_gate(g, beta, gate: Optional[KDAGate], layer, b: int, n: int):
        """``(g, beta, gate_params)`` for ``sgl_kernel.kda_recurrent``: the raw projections as
        ``[B, N, H, D]`` / ``[B, N, H]`` views with the layer's gate parameters (the kernel forms
        the gate as it loads them: no launches for it), or the formed fp32 g / beta."""
        h, d = layer.num_heads, layer.head_dim
        if gate is not None:
            return (gate.f.view(b, n, h, d), gate.b.view(b, n, h),
                    (gate.A_log, gate.dt_bias, gate.lower_bound))
        return (g.float().contiguous().view(b, n, h, d), beta.float().contiguous().view(b, n, h),
                None)

    @staticmethod
    def _gate(g, beta, gate: Optional[KDAGate], layer):
        """``(g [T, H, D], beta [T, H])`` fp32, formed from ``gate`` when it was given."""
        if gate is None:
            return g.float(), beta.float()
        return gate.decay(layer.num_heads, layer.head_dim), gate.beta()

    @staticmethod
    def _split_heads(y: torch.Tensor, layer):
        """Conv output ``[T, 3C]`` -> fp32 ``q, k`` (L2-normalised) and ``v``, each ``[T, H, D]``."""
        t = y.shape[0]
        qc, kc, vc = y.float().view(t, 3, layer.num_heads, layer.head_dim).unbind(1)
        return l2norm(qc), l2norm(kc), vc

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, g=None, beta=None,
                       gate: Optional[KDAGate] = None, **kwargs):
        """Run each request from its pooled state and write the new conv window and state back
        (EXTEND); TARGET_VERIFY stages instead (:meth:`_forward_target_verify`)."""
        mode = forward_batch.forward_mode
        if mode.is_target_verify():
            return self._forward_target_verify(q, k, v, g, beta, layer, forward_batch, gate)
        if mode.is_draft_extend():
            raise ValueError(f"KDA layer {layer.layer_id} called in DRAFT_EXTEND mode: the NEXTN "
                             "draft (MTP layer) is MLA-only, KDA layers never run in a draft forward")
        mixed, conv_pool, ssm_pool = self._prepare(q, k, v, g, beta, layer, forward_batch, gate)
        t = mixed.shape[0]
        out = q.new_empty(t, layer.num_heads, layer.head_dim)
        if t == 0:
            return out
        lay: _ExtendLayout = self._cache.get(forward_batch, self._build)
        reqs = [(s, st, n) for s, st, n in zip(lay.slots, lay.starts, lay.extend_lens) if n > 0]
        # Short convolution per request (it needs that request's window), state written back.
        y = torch.empty_like(mixed)
        conv = self._prefill_conv_kernel(mixed)
        for slot, start, n in reqs:
            if conv is not None:  # one launch: taps, SiLU, y and the window written in place
                conv(mixed[start:start + n], layer.conv_weight, conv_pool[slot],
                     out=y[start:start + n])
                continue
            y[start:start + n], window = causal_conv1d(mixed[start:start + n], layer.conv_weight,
                                                       conv_pool[slot])
            conv_pool[slot].copy_(window)
        if self._use_fla(mixed):
            self._extend_fla(y, g, beta, gate, layer, reqs, ssm_pool, out)
            return out
        qn, kn, vn = self._split_heads(y, layer)
        gf, bf = self._gate(g, beta, gate, layer)
        for slot, start, n in reqs:
            rows = slice(start, start + n)
            fn = kda_recurrent if n <= RECURRENT_MAX_TOKENS else kda_chunked
            o, state = fn(qn[rows], kn[rows], vn[rows], gf[rows], bf[rows], layer.scale,
                          initial_state=ssm_pool[slot])
            out[rows] = o.to(out.dtype)
            ssm_pool[slot].copy_(state)
        return out

    @staticmethod
    def _extend_fla(y, g, beta, gate: Optional[KDAGate], layer, reqs, ssm_pool, out):
        """All requests in one varlen ``chunk_kda`` call on the conv output ``y [T, 3C]`` as it
        is: fla L2-normalises q and k and, given the raw gate inputs (:class:`KDAGate`), forms
        the decay and beta inside its kernels, so no fp32 copy of q, k, g or beta is written.
        The requests' rows are consecutive (each starts where the previous one ends), so the
        output needs no scatter."""
        t, h, d = y.shape[0], layer.num_heads, layer.head_dim
        qkv = y.view(t, 3, h, d)
        slots = torch.tensor([s for s, _, _ in reqs], dtype=torch.int64, device=y.device)
        lens = [n for _, _, n in reqs]
        if gate is not None:
            g, beta = gate.f.reshape(t, h, d), gate.b
            params = (gate.A_log, gate.dt_bias, gate.lower_bound)
        else:
            params = None
        o, final = fla_kda.chunk_kda_varlen(
            qkv[:, 0], qkv[:, 1], qkv[:, 2], g, beta, layer.scale, ssm_pool[slots], lens,
            l2norm_in_kernel=True, gate_params=params)
        out.copy_(o.view_as(out))
        ssm_pool.index_copy_(0, slots, final)

    def _forward_target_verify(self, q, k, v, g, beta, layer, forward_batch,
                               gate: Optional[KDAGate] = None):
        """Score a chain of ``N`` tokens per request without advancing the persistent state.

        Rows are request-major with the same ``N`` for every request (fixed shape: ``T = B * N``,
        padded requests included). Starting from the slot's persistent conv window and state,
        each chain position ``i`` gets the same conv and delta-rule arithmetic as a decode of that
        token (conv and head split for all positions at once; the recurrence per position in
        torch, or in one kernel with ``recurrent_impl="triton"``), and the window and state *after* it are staged in the pool's
        ``intermediate_conv`` / ``intermediate_ssm`` at ``[slot, i]``. ``commit_after_verify``
        later makes the last accepted position persistent. Device ops only; ``N`` is a shape.
        """
        pool = forward_batch.kda_state_pool
        if pool is not None and not pool.has_spec_scratch:
            raise ValueError("KDA target-verify needs the speculative scratch of the KDA state pool "
                             "(stage-then-commit): build KDAStatePool with spec_num_draft_tokens > 0")
        mixed, conv_pool, ssm_pool = self._prepare(q, k, v, g, beta, layer, forward_batch, gate)
        t = mixed.shape[0]
        slots = forward_batch.req_pool_indices
        b = int(slots.shape[0])
        if b == 0 and t == 0:
            return q.new_empty(0, layer.num_heads, layer.head_dim)
        if b == 0 or t % b != 0:
            raise ValueError(f"KDA target-verify: {t} tokens for {b} requests; every request must "
                             "carry the same number of chain tokens (T = B * N)")
        n = t // b
        if n > pool.spec_num_draft_tokens:
            raise ValueError(f"KDA target-verify: chains of {n} tokens but the KDA state pool stages "
                             f"at most spec_num_draft_tokens={pool.spec_num_draft_tokens}")
        slots = slots.to(device=mixed.device, dtype=torch.int64)
        h, d = layer.num_heads, layer.head_dim
        if self._recurrent_kernel is not None:
            # Two kernels: conv + head split + window staging, then the staged recurrence.
            qn, kn, vn = self._conv_kernel(mixed.view(b, n, -1), layer.conv_weight, conv_pool,
                                           slots, h, d,
                                           staged=pool.get_intermediate_conv(layer.layer_id))
            out = q.new_empty(b, n, h, d)
            gk, bk, params = self._kernel_gate(g, beta, gate, layer, b, n)
            self._recurrent_kernel(qn, kn, vn, gk, bk, layer.scale, ssm_pool, slots, out,
                                   staged=pool.get_intermediate_ssm(layer.layer_id),
                                   gate_params=params)
            return out.view(t, h, d)
        gf, bf = self._gate(g, beta, gate, layer)
        gf, bf = gf.contiguous().reshape(b, n, h, d), bf.contiguous().reshape(b, n, h)
        # The conv and the q/k/v split do not depend on the recurrent state: all N positions at
        # once (the same per-position arithmetic as decode's one-step update). Gathers are
        # copies: the persistent pools are only read.
        y, windows = causal_conv1d_chain(mixed.view(b, n, -1), layer.conv_weight, conv_pool[slots])
        qn, kn, vn = (z.view(b, n, h, -1) for z in self._split_heads(y.reshape(b * n, -1), layer))
        # Staging: one scatter per buffer into rows 0..n-1 of each request's slot (slot 0 for
        # padding rows).
        pool.get_intermediate_conv(layer.layer_id)[:, :n].index_copy_(0, slots, windows)
        out = q.new_empty(b, n, h, d)
        state = ssm_pool[slots]
        states = []
        for i in range(n):  # N is tiny (the chain width); each step is a batched decode step
            o, state = kda_step(qn[:, i], kn[:, i], vn[:, i], gf[:, i], bf[:, i], layer.scale, state)
            out[:, i] = o.to(out.dtype)
            states.append(state)
        pool.get_intermediate_ssm(layer.layer_id)[:, :n].index_copy_(
            0, slots, torch.stack(states, dim=1))
        return out.view(t, h, d)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, g=None, beta=None,
                       gate: Optional[KDAGate] = None, **kwargs):
        """One token per request, batched over the batch: gather states by slot, one step,
        scatter back (device ops only, no host sync)."""
        mixed, conv_pool, ssm_pool = self._prepare(q, k, v, g, beta, layer, forward_batch, gate)
        b = mixed.shape[0]
        if b == 0:
            return q.new_empty(0, layer.num_heads, layer.head_dim)
        slots = forward_batch.req_pool_indices
        if self._recurrent_kernel is not None:  # two kernels: conv + head split, recurrence
            h, d = layer.num_heads, layer.head_dim
            qn, kn, vn = self._conv_kernel(mixed.view(b, 1, -1), layer.conv_weight, conv_pool,
                                           slots, h, d)
            out = q.new_empty(b, 1, h, d)
            gk, bk, params = self._kernel_gate(g, beta, gate, layer, b, 1)
            self._recurrent_kernel(qn, kn, vn, gk, bk, layer.scale, ssm_pool, slots, out,
                                   gate_params=params)
            return out.view(b, h, d)
        y, window = causal_conv1d_update(mixed, layer.conv_weight, conv_pool[slots])
        conv_pool.index_copy_(0, slots, window.to(conv_pool.dtype))
        qn, kn, vn = self._split_heads(y, layer)
        gf, bf = self._gate(g, beta, gate, layer)
        o, state = kda_step(qn, kn, vn, gf, bf, layer.scale, ssm_pool[slots])
        ssm_pool.index_copy_(0, slots, state)
        return o.to(q.dtype)
