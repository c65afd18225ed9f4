"""One backend for a hybrid model: MLA layers go to the full-attention backend, KDA layers to the
linear-attention backend (routing by the layer descriptor's ``kind``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


class HybridLinearAttnBackend(AttentionBackend):
    """Routes ``layer.kind == "mla"`` to ``full_attn_backend`` and ``"kda"`` to ``linear_attn_backend``.

    Metadata initialisation and CUDA-graph hooks go to both; graphs are supported only when both
    sub-backends support them.
    """

    needs_cpu_seq_lens = False

    def __init__(self, full_attn_backend: AttentionBackend, linear_attn_backend: AttentionBackend):
        self.full_attn_backend = full_attn_backend
        self.linear_attn_backend = linear_attn_backend
        self.attn_backend_list = [full_attn_backend, linear_attn_backend]
        self.supports_cuda_graph = all(b.supports_cuda_graph for b in self.attn_backend_list)
        # Only the full-attention side gathers by a host width (KDA reads per-slot states).
        self.width_independent = full_attn_backend.width_independent

    def _route(self, layer: Any) -> AttentionBackend:
        kind = getattr(layer, "kind", None)
        if kind == "mla":
            return self.full_attn_backend
        if kind == "kda":
            return self.linear_attn_backend
        raise ValueError(f"HybridLinearAttnBackend: layer {getattr(layer, 'layer_id', '?')} has kind "
                         f"{kind!r}; expected 'mla' or 'kda'")

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Both sub-backends prepare their metadata for this forward."""
        for backend in self.attn_backend_list:
            backend.init_forward_metadata(forward_batch)

    def forward(self, q: torch.Tensor, k, v, layer, forward_batch: "ForwardBatch",
                save_kv_cache: bool = True, **kwargs) -> torch.Tensor:
        """Hand the call to the layer's backend, which dispatches on the forward mode itself."""
        return self._route(layer).forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Extend of the layer's backend."""
        return self._route(layer).forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Decode of the layer's backend."""
        return self._route(layer).forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def mla_normal_form(self, forward_batch: "ForwardBatch") -> bool:
        """The full-attention backend decides (MLA layers are its own)."""
        return self.full_attn_backend.mla_normal_form(forward_batch)

    def mla_normal_form_min_tokens(self) -> Optional[int]:
        """The full-attention backend's threshold (it decides :meth:`mla_normal_form`)."""
        return self.full_attn_backend.mla_normal_form_min_tokens()

    def forward_extend_normal(self, q, k, w_kc, w_vc, layer, forward_batch, save_kv_cache=True):
        """Normal-form MLA prefill of the full-attention backend (MLA layers only)."""
        if getattr(layer, "kind", None) != "mla":
            raise ValueError(f"forward_extend_normal is for MLA layers; layer "
                             f"{getattr(layer, 'layer_id', '?')} has kind "
                             f"{getattr(layer, 'kind', None)!r}")
        return self.full_attn_backend.forward_extend_normal(q, k, w_kc, w_vc, layer,
                                                            forward_batch, save_kv_cache)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Both sub-backends allocate their static buffers."""
        for backend in self.attn_backend_list:
            backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, num_tokens: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
        forward_mode: "ForwardMode", spec_info: Any = None,
    ) -> None:
        """Both sub-backends point their metadata at the static buffers."""
        for backend in self.attn_backend_list:
            backend.init_forward_metadata_capture_cuda_graph(
                bs, num_tokens, req_pool_indices, seq_lens, forward_mode, spec_info)

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
        forward_mode: "ForwardMode", spec_info: Any = None,
    ) -> None:
        """Both sub-backends refill their static buffers."""
        for backend in self.attn_backend_list:
            backend.init_forward_metadata_replay_cuda_graph(
                bs, req_pool_indices, seq_lens, forward_mode, spec_info)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The full-attention backend decides (the linear one does not read sequence lengths)."""
        return self.full_attn_backend.get_cuda_graph_seq_len_fill_value()
