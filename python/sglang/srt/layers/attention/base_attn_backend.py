"""The attention-backend interface (names as in SGLang's ``AttentionBackend``).

A backend owns the per-forward attention metadata and the attention math over the pools that
``ForwardBatch`` points at. Model layers never touch the caches directly; they call
``forward_batch.attn_backend.forward(q, k, v, layer, forward_batch, **kw)`` with a layer
descriptor (:class:`~sglang.srt.layers.radix_attention.RadixAttention` for MLA,
:class:`~sglang.srt.layers.radix_attention.RadixLinearAttention` for KDA).

Every backend declares ``needs_cpu_seq_lens = False``: decode and verify metadata is built from
device tensors only, so the host never waits for the GPU on the per-step path.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


class AttentionBackend(ABC):
    """Base class of attention backends."""

    # The host may launch step k+1 before step k's lengths are known on the host.
    needs_cpu_seq_lens: bool = False

    @abstractmethod
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Prepare whatever the layers of this forward need (called once per forward, eager)."""

    def forward(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: Any,
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Dispatch on the forward mode: DECODE -> :meth:`forward_decode`, else :meth:`forward_extend`."""
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    @abstractmethod
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs) -> torch.Tensor:
        """Several new tokens per request (prefill, chunked prefill, target verify, draft extend)."""

    @abstractmethod
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs) -> torch.Tensor:
        """One new token per request."""

    # ---- MLA prefill in normal (decompressed) form. A backend that offers it says so per
    # ---- forward; the model then hands it per-head queries and the up-projections instead of
    # ---- absorbed queries (RadixAttention.use_normal_form / forward_normal).
    def mla_normal_form(self, forward_batch: "ForwardBatch") -> bool:
        """Whether the MLA layers of this forward run in normal form
        (:meth:`forward_extend_normal`).

        Must depend on the batch alone (every MLA layer of a forward decides alike). Default:
        never; the absorbed form through :meth:`forward` serves every mode.
        """
        return False

    def mla_normal_form_min_tokens(self) -> Optional[int]:
        """The fewest new tokens of an EXTEND batch that :meth:`mla_normal_form` runs in normal
        form (a start-up warm-up compiles both forms' kernels); None: never normal form."""
        return None

    def forward_extend_normal(self, q: torch.Tensor, k: torch.Tensor, w_kc: torch.Tensor,
                              w_vc: torch.Tensor, layer: Any, forward_batch: "ForwardBatch",
                              save_kv_cache: bool = True) -> torch.Tensor:
        """MLA prefill in normal form: ``q [T, H, d_n + d_r]`` per-head queries
        (``q_nope ‖ roped q_rope``), ``k [T, r + d_r]`` the new cache rows (as in the absorbed
        contract), ``w_kc [H, d_n, r]`` / ``w_vc [H, r, d_v]`` the up-projections that expand
        cache rows into keys and values. Returns ``[T, H, d_v]`` (head outputs, not latents;
        possibly a strided view, last dim contiguous). Only called when :meth:`mla_normal_form`
        said so."""
        raise NotImplementedError(f"{type(self).__name__} has no normal-form MLA prefill")

    # ---- CUDA graphs (SGLang's hook names). The graph runner captures a whole decode round,
    # ---- metadata included: ``init_forward_metadata`` runs inside the capture, so metadata
    # ---- computed on the device from the static input buffers is recomputed at every replay,
    # ---- and host values (a gather width) are baked in, hence ``width_independent``.
    supports_cuda_graph: bool = False
    # Whether the captured work depends on ForwardBatch.seq_lens_upper_bound (a host integer):
    # if not, one graph per batch size serves every length; if so, graphs are keyed by a
    # bucket of that bound as well.
    width_independent: bool = False

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate what captured graphs share (scratch buffers) for batches of up to
        ``max_bs`` requests and ``max_num_tokens`` tokens."""
        if not self.supports_cuda_graph:
            raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, num_tokens: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
        forward_mode: "ForwardMode", spec_info: Any = None,
    ) -> None:
        """Before capturing a graph of batch size ``bs``: check that the backend can capture it
        (raise ``ValueError`` if not) and drop cached per-batch metadata."""
        if not self.supports_cuda_graph:
            raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
        forward_mode: "ForwardMode", spec_info: Any = None,
    ) -> None:
        """Before a replay: refill whatever the graph reads that the runner's static inputs do
        not cover (device ops only). Nothing, for backends whose metadata lives in the graph."""
        if not self.supports_cuda_graph:
            raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Sequence length written into padded rows of a captured batch."""
        return 1
