"""The DSpark draft's context K/V stored per KV slot of the target's pool (paged).

A DSpark draft attends to the projected target hidden states of every committed token of its
request (``srt/models/dspark.py``). :class:`~sglang.srt.mem_cache.dspark_context_cache
.DSparkContextCache` keeps them in a ``[request slot, position]`` grid, which a server would have
to size for every request slot at the full context length (for Ling-3.0-flash: 48 slots x 262k
positions). Here each token's draft K/V lives next to its target KV instead, at the same KV slot
index ``loc``: the request->token map already says which slot holds which position, so the store
costs one row per KV slot of the pool, and a position's row is valid exactly while the target's
KV of that position is (freed and reused with it).

The class has the duck interface the draft model uses (``max_context``, :meth:`write`,
:meth:`read`), so :meth:`DSparkDraftModel.write_context` and :meth:`DSparkDraftModel
.forward_block` run on it unchanged:

* ``write(layer, slots, positions, k, v)``: row ``req_to_token[slot, position]``; padding rows
  (``slot <= 0``: ``-1`` marks a row to drop, ``0`` is the padding request slot of the pools)
  go to KV slot 0, the pools' padding slot, which no request reads as context.
* ``read(layer, slots, width)``: rows ``req_to_token[slot, 0:width]`` (a gather; the caller's
  context lengths mask positions not committed yet, whose rows are stale but finite: the buffers
  start at zero and only ever receive finite values).

The draft's read width is a host integer baked into a captured CUDA graph, so the store also
presents itself to :class:`~sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner` as a
width-dependent "attention backend" (no-op hooks): graphs of the round are then keyed by a
bucket of the sequence-length bound instead of every round reading the full context width.
"""
from __future__ import annotations

from typing import Any, Tuple, Union

import torch

__all__ = ["PagedDSparkContext"]


class PagedDSparkContext:
    """Draft context K/V ``[layers, kv_slots + 1, kv_heads, head_dim]`` indexed by KV slot."""

    # CudaGraphRunner reads these two of an attention backend (see the module docstring).
    supports_cuda_graph = True
    width_independent = False

    def __init__(self, req_to_token: torch.Tensor, num_kv_slots: int, num_layers: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: Union[str, torch.device]):
        for name, v in (("num_kv_slots", num_kv_slots), ("num_layers", num_layers),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if v < 1:
                raise ValueError(f"PagedDSparkContext: {name} must be >= 1, got {v}")
        if req_to_token.dim() != 2:
            raise ValueError(f"PagedDSparkContext: req_to_token must be [slots, context], got "
                             f"{tuple(req_to_token.shape)}")
        self.req_to_token = req_to_token
        shape = (num_layers, num_kv_slots + 1, num_kv_heads, head_dim)  # + padding slot 0
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def max_context(self) -> int:
        """Positions a request can have (the request->token map's width)."""
        return int(self.req_to_token.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V buffers."""
        return 2 * self.k.numel() * self.k.element_size()

    def _locs(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        real = slots > 0
        rows = torch.where(real, slots, torch.zeros_like(slots)).long()
        cols = torch.where(real, positions, torch.zeros_like(positions)).long()
        loc = self.req_to_token[rows, cols].long()
        return torch.where(real, loc, torch.zeros_like(loc))

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store ``k, v [T, kv_heads, head_dim]`` of the tokens at ``positions [T]`` of the
        requests in ``slots [T]`` (``<= 0``: dropped into the padding slot)."""
        if slots.shape != positions.shape or slots.dim() != 1 or k.shape[0] != slots.shape[0]:
            raise ValueError(f"PagedDSparkContext.write: slots {tuple(slots.shape)}, positions "
                             f"{tuple(positions.shape)} and k {tuple(k.shape)} must agree on [T]")
        loc = self._locs(slots, positions)
        self.k[layer].index_copy_(0, loc, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, loc, v.to(self.v.dtype))

    def read(self, layer: int, slots: torch.Tensor, width: int
             ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Positions ``0 .. width-1`` of each request: ``k, v [B, width, kv_heads, head_dim]``."""
        loc = self.req_to_token[slots.long().clamp(min=0), :width].long()
        return self.k[layer][loc], self.v[layer][loc]

    # ---- graph-runner hooks (nothing to prepare: the store lives outside the graphs)
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Nothing to allocate."""

    def init_forward_metadata_capture_cuda_graph(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to check: every read and write is fixed-shape device work."""

    def init_forward_metadata_replay_cuda_graph(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to refill."""
