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

    # ---- CUDA-graph hooks (SGLang's names). Backends that can be captured override all four;
    # ---- the model runner only captures graphs when the backend reports support.
    supports_cuda_graph: bool = False

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the static metadata buffers a captured graph reads."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, num_tokens: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
        forward_mode: "ForwardMode", spec_info: Any = None,
    ) -> None:
        """Point the metadata at the static buffers before capturing a graph of batch size ``bs``."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
        forward_mode: "ForwardMode", spec_info: Any = None,
    ) -> None:
        """Refill the static buffers from live tensors before a replay (device ops only)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Sequence length written into padded rows of a captured batch."""
        return 1
