"""Triton MLA backend: decode, target verify and the chain-shaped draft extend through
``sgl_kernel.mla_decode`` (split-K attention that reads the sequence lengths on the device).

:class:`TritonMLABackend` is
:class:`~sglang.srt.layers.attention.torch_native_backend.TorchNativeMLABackend` except for the
fixed-shape batches (one token per request, or the same ``N`` chain tokens per request): there it
writes the new cache rows and runs one kernel pair per layer over the pools, without gathering
the cache. The kernel's launch depends on shapes only, so the result does not
depend on ``ForwardBatch.seq_lens_upper_bound`` (``width_independent``) and one CUDA graph per
batch size serves every sequence length. Prefill-like extends, ``save_kv_cache=False`` (the new
rows must be attended without being stored, which the kernel cannot see) and inputs the kernel
cannot run (CPU tensors without Triton's interpreter, bf16 under it) take the torch path; long
EXTEND batches take the inherited normal form (``forward_extend_normal``: decompressed keys and
values through SDPA's fused kernels), short ones the torch absorbed form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Tuple

import torch

from sgl_kernel._triton_mode import INTERPRETED
from sgl_kernel.mla_decode import (
    mla_decode_batch_invariant_split,
    mla_decode_fwd,
    mla_decode_num_splits,
    mla_decode_scratch_numel,
)
from sglang.srt.layers.attention.extend_layout import extend_layout
from sglang.srt.layers.attention.torch_native_mla import (
    TorchNativeMLABackend,
    _MLAPaddedMeta,
    _padded_width,
)

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

__all__ = ["TritonMLABackend"]


@dataclass
class _ChainMeta:
    """A fixed-shape batch: ``rows`` query tokens per request (decode: 1). Unlike the torch
    backend's metadata it has no gather width: nothing here is read from the device."""

    rows: int


def _kernel_runs(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether :func:`mla_decode_fwd` can take these tensors in this process."""
    if INTERPRETED:
        return torch.bfloat16 not in (q.dtype, kv.dtype)
    return q.is_cuda and kv.is_cuda


class TritonMLABackend(TorchNativeMLABackend):
    """MLA (absorbed form) with the fixed-shape batches on the Triton kernel; see the module
    docstring. CUDA-graph capture is supported: the captured launches read positions, request
    rows and the req->token map from the device, and the split scratch is allocated once."""

    supports_cuda_graph = True
    # The result does not depend on ForwardBatch.seq_lens_upper_bound (the kernel never gathers).
    width_independent = True

    def __init__(self, batch_invariant: bool = False, invariant_span: Optional[int] = None):
        super().__init__()
        # Fixed split boundaries (--enable-deterministic-inference): a token's attention rounds
        # the same in a decode, a verify and any batch (sgl_kernel.mla_decode's docstring),
        # set by invariant_span (the context length) rather than the request map's width, which
        # a speculative runner widens by its round's position headroom.
        self.batch_invariant = batch_invariant
        self.invariant_span = invariant_span
        self._graph_max_bs = 0  # 0: init_cuda_graph_state not called
        self._graph_max_tokens = 0
        self._scratch: Optional[torch.Tensor] = None

    # ---- metadata ---------------------------------------------------------------------------
    @staticmethod
    def _build(forward_batch: "ForwardBatch"):
        """As the torch backend's, but a fixed-shape batch records only its tokens per request."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            return None
        if mode.is_decode():
            return _ChainMeta(1)
        if (mode.is_target_verify() or mode.is_draft_extend()) \
                and forward_batch.extend_seq_lens_cpu is None:
            b, t = forward_batch.batch_size, forward_batch.num_tokens
            if b == 0 or t % b:
                raise ValueError(f"{mode.name} without host lengths needs the same number of "
                                 f"tokens per request; got {t} tokens for {b} requests")
            return _ChainMeta(t // b)
        return extend_layout(forward_batch)

    # ---- forwards ---------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """One token per request: the kernel (or the torch path, see the module docstring)."""
        q = self._check(q, k, layer, forward_batch)
        meta = self._cache.get(forward_batch, self._build)
        return self._forward_chain(q, k, layer, forward_batch, meta.rows, save_kv_cache)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Chain-shaped verify / draft extend on the kernel; prefill-like extends as the torch
        backend does them."""
        meta = self._cache.get(forward_batch, self._build)
        if isinstance(meta, _ChainMeta):
            q = self._check(q, k, layer, forward_batch)
            return self._forward_chain(q, k, layer, forward_batch, meta.rows, save_kv_cache)
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _forward_chain(self, q, k, layer, forward_batch, rows: int, save_kv_cache: bool):
        """``rows`` tokens per request at ``forward_batch.positions`` (``q [B * rows, H, Dk]``)."""
        b, h = forward_batch.batch_size, layer.tp_q_head_num
        dk, dv = layer.head_dim, layer.v_head_dim
        if b == 0:
            return q.new_empty(0, h, dv)
        if q.shape[0] != b * rows:
            raise ValueError(f"MLA layer {layer.layer_id}: {q.shape[0]} query tokens for {b} "
                             f"requests of {rows} tokens")
        pool = forward_batch.token_to_kv_pool
        buf = pool.get_kv_buffer(layer.layer_id)
        if not save_kv_cache or not _kernel_runs(q, buf):
            meta = _MLAPaddedMeta(_padded_width(forward_batch), rows)
            return self._forward_padded(q, k, layer, forward_batch, meta, save_kv_cache)
        # The kernel reads every key from the cache, the new tokens' rows included.
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        cap = req_to_token.shape[1]
        splits, split_len = self._split_plan(b, rows * h, cap, dk, q.device)
        scratch = self._graph_scratch(q.device, h, dv, cap, dk)
        if scratch is not None \
                and scratch.numel() < mla_decode_scratch_numel(b, rows * h, splits, dv):
            scratch = None  # larger than any captured batch: a temporary one for this call
        out = mla_decode_fwd(q.reshape(b, rows * h, dk), buf, req_to_token,
                             forward_batch.req_pool_indices, forward_batch.positions.view(b, rows),
                             dv, layer.scaling, num_splits=splits, scratch=scratch,
                             split_len=split_len)
        return out.view(b * rows, h, dv)

    def _split_plan(self, batch: int, rows: int, cap: int, dk: int,
                    device: torch.device) -> Tuple[int, Optional[int]]:
        """``(num_splits, split_len)`` of a launch: the batch-invariant plan, or the adaptive
        split count (``split_len`` None: chosen on the device from each request's length)."""
        if self.batch_invariant:
            return mla_decode_batch_invariant_split(cap, dk, span=self.invariant_span)
        return mla_decode_num_splits(batch, rows, cap, dk, device), None

    # ---- CUDA graphs ------------------------------------------------------------------------
    def _graph_scratch(self, device: torch.device, heads: int, v_dim: int, cap: int,
                       dk: int) -> Optional[torch.Tensor]:
        """The split scratch shared by every layer and every captured batch size (``None``
        before :meth:`init_cuda_graph_state`). Allocated at the first kernel call, when the
        layer geometry is known, for the largest batch a graph may hold; never replaced
        afterwards, since captured graphs keep its address."""
        if self._graph_max_bs == 0:
            return None
        if self._scratch is None:
            need = 0
            for bs in range(1, self._graph_max_bs + 1):
                for n in range(1, self._graph_max_tokens // bs + 1):
                    splits = self._split_plan(bs, n * heads, cap, dk, device)[0]
                    need = max(need, mla_decode_scratch_numel(bs, n * heads, splits, v_dim))
            self._scratch = torch.empty(need, dtype=torch.float32, device=device)
        return self._scratch if self._scratch.device == device else None

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Size the split scratch for up to ``max_bs`` requests and ``max_num_tokens`` query
        tokens per captured forward (allocated once, at the first kernel call: the number of
        heads and the latent width are known only then). Output tensors are allocated per
        layer, inside the graph's memory pool, so that no layer's output aliases another's."""
        if max_bs < 1 or max_num_tokens < max_bs:
            raise ValueError(f"init_cuda_graph_state: need 1 <= max_bs <= max_num_tokens, got "
                             f"max_bs={max_bs}, max_num_tokens={max_num_tokens}")
        old = (self._graph_max_bs, self._graph_max_tokens)
        if self._scratch is not None and (max_bs, max_num_tokens) != old:
            # Graphs captured since then keep the old scratch's address: it cannot be replaced.
            raise ValueError(f"init_cuda_graph_state: the scratch is already in use for "
                             f"max_bs={old[0]}, max_num_tokens={old[1]}; build a new backend")
        self._graph_max_bs, self._graph_max_tokens = max_bs, max_num_tokens

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, num_tokens: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
        forward_mode: "ForwardMode", spec_info: Any = None,
    ) -> None:
        """Check that the batch fits the graph state; the captured forward builds its metadata
        from shapes alone (nothing to point at static buffers)."""
        if self._graph_max_bs == 0:
            raise ValueError("init_forward_metadata_capture_cuda_graph: call "
                             "init_cuda_graph_state first")
        if not forward_mode.is_cuda_graph():
            raise ValueError(f"TritonMLABackend captures DECODE, TARGET_VERIFY and IDLE, got "
                             f"{forward_mode.name}")
        if not 1 <= bs <= self._graph_max_bs or num_tokens % bs \
                or num_tokens > self._graph_max_tokens:
            raise ValueError(f"capture of {num_tokens} tokens for {bs} requests does not fit "
                             f"max_bs={self._graph_max_bs}, max_num_tokens="
                             f"{self._graph_max_tokens} with the same tokens per request")
        self._cache = type(self._cache)()  # the capture's batch object builds fresh metadata

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
        forward_mode: "ForwardMode", spec_info: Any = None,
    ) -> None:
        """Nothing to refill: the captured kernels read positions, request rows and the
        req->token map from the device tensors the runner refills."""
        if not 1 <= bs <= self._graph_max_bs:
            raise ValueError(f"replay of batch size {bs} outside 1..{self._graph_max_bs}")
