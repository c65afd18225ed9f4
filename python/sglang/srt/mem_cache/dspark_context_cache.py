"""The DSpark draft's context cache: per draft layer, the K/V of the committed tokens' projected
target hidden states (models/dspark.py), in a fixed-shape buffer indexed by request slot and
absolute position.

Fixed shapes keep draft rounds capturable in CUDA graphs: writes take device tensors of slots
and positions (padding rows go to a sink slot), reads take a host-known width and the requests'
context lengths mask the rest inside attention.
"""
from __future__ import annotations

from typing import Tuple, Union

import torch

__all__ = ["DSparkContextCache"]


class DSparkContextCache:
    """Context keys/values ``[layers, num_slots + 1, max_context, kv_heads, head_dim]``.

    Row ``(slot, p)`` holds a draft layer's K/V of the committed token at absolute position
    ``p`` of the request in ``slot``. The extra slot ``num_slots`` is a sink for padding rows
    (``slot < 0``), so writes keep a fixed shape. The buffers start at zero: rows a request has
    not written are masked out by its context length but still enter the attention product, so
    they must be finite. A position ``>= max_context`` is an indexing error (IndexError on CPU).
    """

    def __init__(self, num_layers: int, num_slots: int, max_context: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: Union[str, torch.device] = "cpu"):
        for name, v in (("num_layers", num_layers), ("num_slots", num_slots),
                        ("max_context", max_context), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
            if v < 1:
                raise ValueError(f"DSparkContextCache: {name} must be >= 1, got {v}")
        self.num_slots = num_slots
        self.max_context = max_context
        shape = (num_layers, num_slots + 1, max_context, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V buffers."""
        return 2 * self.k.numel() * self.k.element_size()

    def _slot_index(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.where(slots < 0, torch.full_like(slots, self.num_slots), slots).long()

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store ``k, v [T, kv_heads, head_dim]`` at ``(slots[t], positions[t])``; padding rows
        (``slots < 0``) land in the sink."""
        slot_idx = self._slot_index(slots)
        pos_idx = torch.where(slots < 0, torch.zeros_like(positions), positions).long()
        self.k[layer].index_put_((slot_idx, pos_idx), k.to(self.k.dtype))
        self.v[layer].index_put_((slot_idx, pos_idx), v.to(self.v.dtype))

    def read(self, layer: int, slots: torch.Tensor, width: int
             ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The first ``width`` rows of each slot: ``k, v [B, width, kv_heads, head_dim]``
        (padding requests, ``slot < 0``, read the sink)."""
        slot_idx = self._slot_index(slots)
        return self.k[layer, slot_idx, :width], self.v[layer, slot_idx, :width]
