"""KDA in plain PyTorch over the state pools (:class:`TorchNativeKDABackend`): short-conv window
and fp32 recurrent state per request slot; the reference every fast KDA path matches.

A prefill runs each request from its pooled state (fla-core's ``chunk_kda`` on CUDA when
installed); decode is one batched step; a target verify (a fixed-width chain per request)
stages per-position states in the pool's speculative scratch and leaves the persistent state
alone (stage, then commit).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from sglang.srt.configs.engine_defaults import KDA_PREFILL_IMPL_CHOICES
from sglang.srt.layers.attention import fla_kda
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.extend_layout import ExtendLayout, MetadataCache, extend_layout
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

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, PrefillPadding

__all__ = ["TorchNativeKDABackend", "KDA_PREFILL_IMPLS", "KDA_RECURRENT_IMPLS",
           "RECURRENT_MAX_TOKENS"]

KDA_PREFILL_IMPLS = KDA_PREFILL_IMPL_CHOICES
# The decode / target-verify recurrence: "torch" (kda_step, the reference) or "triton"
# (sgl_kernel.kda_recurrent: state read from and written to the pools by one kernel per layer).
KDA_RECURRENT_IMPLS = ("torch", "triton")

# Extends up to this many tokens run the token-by-token recurrence; longer ones the chunked form
# (the chunked form's fixed per-chunk cost only pays off once a chunk has some length).
RECURRENT_MAX_TOKENS = 16



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
        self._cache = MetadataCache()
        self._varlen: Optional[tuple] = None  # (key, FlaVarlen) of the last fla extend

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
        return extend_layout(forward_batch)

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
        if t == 0:
            return q.new_empty(0, layer.num_heads, layer.head_dim)
        if forward_batch.padding is not None:
            return self._extend_padded(mixed, g, beta, gate, layer, forward_batch.padding,
                                       conv_pool, ssm_pool)
        lay: ExtendLayout = self._cache.get(forward_batch, self._build)
        reqs = [(s, st, n) for s, st, n in zip(lay.slots, lay.starts, lay.extend_lens) if n > 0]
        conv = self._prefill_conv_kernel(mixed)
        if conv is not None and self._use_fla(mixed):
            y3 = self._conv_qkv_planes(conv, mixed, layer, conv_pool, reqs)
            return self._extend_fla(y3, g, beta, gate, layer,
                                    self._fla_varlen(lay, reqs, y3.device), ssm_pool,
                                    qk_normalized=True)
        # Short convolution per request (it needs that request's window), state written back.
        y = torch.empty_like(mixed)
        for slot, start, n in reqs:
            if conv is not None:  # one launch: taps, SiLU, y and the window written in place
                conv(mixed[start:start + n], layer.conv_weight, conv_pool[slot],
                     out=y[start:start + n])
                continue
            y[start:start + n], window = causal_conv1d(mixed[start:start + n], layer.conv_weight,
                                                       conv_pool[slot])
            conv_pool[slot].copy_(window)
        if self._use_fla(mixed):
            return self._extend_fla(y, g, beta, gate, layer,
                                    self._fla_varlen(lay, reqs, y.device), ssm_pool)
        out = q.new_empty(t, layer.num_heads, layer.head_dim)
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

    def _extend_padded(self, mixed, g, beta, gate: Optional[KDAGate], layer,
                       pad: "PrefillPadding", conv_pool, ssm_pool) -> torch.Tensor:
        """One fresh request (no prefix) padded at its end (:class:`PrefillPadding`), with no
        host value that depends on its length or slot, so that a captured graph replays it.

        The conv runs over every row from a zero window and the recurrence from the zero state,
        as for any fresh request. Padded rows get decay 1 and write strength 0, so the state
        after the last row equals the state after the request's last token (every padded
        update adds exact zeros), and the conv window is re-read from the request's last
        ``K - 1`` inputs. Both go to the request's slot by device index. Real rows never see a
        later row, so their outputs are those of the unpadded request.
        """
        t, h, d = mixed.shape[0], layer.num_heads, layer.head_dim
        if pad.valid.shape[0] != t:
            raise ValueError(f"KDA layer {layer.layer_id}: padding mask of "
                             f"{pad.valid.shape[0]} rows for a {t}-row batch")
        fresh_window = conv_pool.new_zeros(1, *conv_pool.shape[1:])
        conv = self._prefill_conv_kernel(mixed)
        fla = conv is not None and self._use_fla(mixed)
        if fla:
            y = self._conv_qkv_planes(conv, mixed, layer, fresh_window, [(0, 0, t)])
        elif conv is not None:
            y = conv(mixed, layer.conv_weight, fresh_window[0])
        else:
            y, _ = causal_conv1d(mixed, layer.conv_weight, fresh_window[0])
        self._write_window(mixed, pad, conv_pool)
        pad_rows = ~pad.valid
        if fla:
            if gate is not None:  # the kernels form decay -exp(A) * softplus(-inf) = 0, sigmoid 0
                gate = gate._replace(f=gate.f.masked_fill(pad_rows[:, None], float("-inf")),
                                     b=gate.b.masked_fill(pad_rows[:, None], float("-inf")))
            else:
                g = g.masked_fill(pad_rows[:, None, None], 0.0)
                beta = beta.masked_fill(pad_rows[:, None], 0.0)
            varlen = self._forward_varlen(pad, lambda: fla_kda.fla_varlen_captured(t, pad.slot))
            return self._extend_fla(y, g, beta, gate, layer, varlen, ssm_pool,
                                    qk_normalized=True)
        qn, kn, vn = self._split_heads(y, layer)
        gf, bf = self._gate(g, beta, gate, layer)
        gf = gf.masked_fill(pad_rows[:, None, None], 0.0)
        bf = bf.masked_fill(pad_rows[:, None], 0.0)
        fn = kda_recurrent if t <= RECURRENT_MAX_TOKENS else kda_chunked
        o, state = fn(qn, kn, vn, gf, bf, layer.scale, initial_state=None)
        ssm_pool.index_copy_(0, pad.slot, state.unsqueeze(0))
        return o.to(mixed.dtype).view(t, h, d)

    @staticmethod
    def _write_window(mixed: torch.Tensor, pad: "PrefillPadding", conv_pool) -> None:
        """The conv window after the request's last token, ``[C, K-1]`` = its last ``K - 1``
        inputs (zeros before its first, as from a fresh window), into its slot."""
        width = conv_pool.shape[-1]
        if width == 0:
            return
        idx = pad.real_len - width + torch.arange(width, device=mixed.device)
        rows = mixed.index_select(0, idx.clamp(min=0)).masked_fill((idx < 0)[:, None], 0)
        conv_pool.index_copy_(0, pad.slot, rows.t().to(conv_pool.dtype).unsqueeze(0))

    @staticmethod
    def _conv_qkv_planes(conv, mixed: torch.Tensor, layer, conv_pool: torch.Tensor,
                         reqs) -> torch.Tensor:
        """The short conv of every request as three launches, one per q / k / v column block,
        each writing its own contiguous plane of ``y [3, T, C]``: the planes are the
        contiguous q, k and v that fla's ``chunk_kda`` takes, where one launch over ``[T, 3C]``
        left three strided views that ``chunk_kda_varlen`` copied. Same taps, same order, same
        windows (each block's channels of the request's pool slot), so the same values; the q
        and k launches also L2-normalise each head (fla's formula), which spares fla a launch
        per plane that reads and writes it again (``_extend_fla(qk_normalized=True)``)."""
        t, c = mixed.shape[0], mixed.shape[1] // 3
        y = mixed.new_empty(3, t, c)
        for slot, start, n in reqs:
            rows = slice(start, start + n)
            for i in range(3):
                cols = slice(i * c, (i + 1) * c)
                conv(mixed[rows, cols], layer.conv_weight[cols], conv_pool[slot][cols],
                     out=y[i, rows], l2norm_head_dim=layer.head_dim if i < 2 else None)
        return y

    def _fla_varlen(self, lay: ExtendLayout, reqs, device: torch.device) -> fla_kda.FlaVarlen:
        """The forward's :class:`~sglang.srt.layers.attention.fla_kda.FlaVarlen` for its
        requests, keyed by the layout object (which ``MetadataCache`` builds once per forward)."""
        return self._forward_varlen(lay, lambda: fla_kda.fla_varlen(
            [n for _, _, n in reqs], [s for s, _, _ in reqs], device))

    def _forward_varlen(self, key: object, build: Callable[[], "fla_kda.FlaVarlen"]
                        ) -> "fla_kda.FlaVarlen":
        """``build()``'s FlaVarlen, made by the forward's first KDA layer and reused by the
        others: ``key`` is an object made once per forward (an :class:`ExtendLayout`, a padded
        prefill's ``PrefillPadding``). fla keys its chunk-index cache by tensor identity, and
        in a captured prefill the description's device kernel runs once, not once a layer."""
        if self._varlen is None or self._varlen[0] is not key:
            self._varlen = (key, build())
        return self._varlen[1]

    @staticmethod
    def _extend_fla(y, g, beta, gate: Optional[KDAGate], layer, varlen: "fla_kda.FlaVarlen",
                    ssm_pool, qk_normalized: bool = False) -> torch.Tensor:
        """All requests in one varlen ``chunk_kda`` call on the conv output as it is, ``y [T,
        3C]`` or the planes ``[3, T, C]`` (:meth:`_conv_qkv_planes`: q, k, v contiguous, q and
        k L2-normalised there: ``qk_normalized``): fla L2-normalises q and k unless
        ``qk_normalized`` and, given the raw gate inputs (:class:`KDAGate`), forms the
        decay and beta inside its kernels, so no fp32 copy of q, k, g or beta is written. The
        requests' rows are consecutive (each starts where the previous one ends), so fla's
        output ``[T, H, D]`` is the layer's as it is (no copy). One request reads and writes its
        state slot as a slice of the pool (no gather)."""
        h, d = layer.num_heads, layer.head_dim
        if y.dim() == 3:  # planes: q, k, v each contiguous [T, H, D]
            t = y.shape[1]
            qkv = y.view(3, t, h, d).transpose(0, 1)
        else:
            t = y.shape[0]
            qkv = y.view(t, 3, h, d)
        if varlen.captured:  # fresh sequences; their slots written by device index below
            state = ssm_pool.new_zeros(len(varlen.lens), *ssm_pool.shape[1:])
        elif len(varlen.host_slots) == 1:  # a view of the slot, no gather / scatter launches
            s = varlen.host_slots[0]
            state = ssm_pool[s:s + 1]
        else:
            state = ssm_pool[varlen.slots]
        if gate is not None:
            g, beta = gate.f.reshape(t, h, d), gate.b
            params = (gate.A_log, gate.dt_bias, gate.lower_bound)
        else:
            params = None
        o, final = fla_kda.chunk_kda_varlen(
            qkv[:, 0], qkv[:, 1], qkv[:, 2], g, beta, layer.scale, state, varlen.lens,
            cu_seqlens=varlen.cu_seqlens, cu_seqlens_cpu=varlen.cu_seqlens_cpu,
            l2norm_in_kernel=not qk_normalized, gate_params=params, captured=varlen.captured)
        if len(varlen.host_slots) == 1:
            state.copy_(final)
        else:
            ssm_pool.index_copy_(0, varlen.slots, final)
        return o.view(t, h, d)

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
