"""Memory pools: request->token map, KV-slot allocator, MLA latent KV cache, KDA state.

Index 0 of every pool is a padding entry that is never handed out: padded rows of a fixed-shape
batch (CUDA graphs, speculative buffers) point at it and their writes land there harmlessly.
Request slot ``r`` (a row of the req->token map) is also the KDA state slot of that request.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch


class PoolExhausted(RuntimeError):
    """Not enough free slots; the scheduler answers with an admission error, never a crash."""


class ReqToTokenPool:
    """``req_to_token[r, i]`` = KV slot of token ``i`` of the request in row ``r`` (int32)."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str):
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(size + 1, max_context_len, dtype=torch.int32, device=device)
        self._free: List[int] = list(range(1, size + 1))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1) -> Optional[List[int]]:
        """Take ``n`` request rows, or ``None`` if fewer are free."""
        if n > len(self._free):
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, indices: int | Sequence[int]) -> None:
        if isinstance(indices, int):
            indices = [indices]
        for i in indices:
            assert 1 <= i <= self.size, f"bad request slot {i}"
        self._free.extend(indices)

    def write(self, req_idx: int, start: int, locs: torch.Tensor) -> None:
        """Record KV slots of tokens ``start .. start+len(locs)-1`` of a request."""
        self.req_to_token[req_idx, start:start + locs.numel()] = locs.to(torch.int32)

    def clear(self) -> None:
        self._free = list(range(1, self.size + 1))


class TokenToKVPoolAllocator:
    """Hands out KV slot indices ``1..size`` (page size 1); slot 0 is the padding slot."""

    def __init__(self, size: int, device: torch.device | str):
        self.size = size
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        # Kept on the host: allocation is host bookkeeping; slots go to the device as tensors.
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._n_free = self.size

    def available_size(self) -> int:
        return self._n_free

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        """``n`` free slots as an int64 device tensor, or ``None`` if fewer are free."""
        if n > self._n_free:
            return None
        out = self._free[:n]
        self._free = self._free[n:]
        self._n_free -= n
        return out.to(self.device)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.detach().to("cpu", torch.int64).flatten()
        self._free = torch.cat([self._free, slots])
        self._n_free += int(slots.numel())


class MLATokenToKVPool:
    """Per MLA layer a latent cache ``[size + 1, kv_cache_dim]``: normed latent ‖ roped key."""

    def __init__(
        self,
        size: int,
        layer_ids: Sequence[int],
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.size = size
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.layer_ids = list(layer_ids)
        self.kv_buffer: Dict[int, torch.Tensor] = {
            lid: torch.zeros(size + 1, self.kv_cache_dim, dtype=dtype, device=device)
            for lid in self.layer_ids
        }

    def get_kv_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache: torch.Tensor) -> None:
        """Write ``cache[T, kv_cache_dim]`` at slots ``loc[T]``."""
        self.kv_buffer[layer_id][loc] = cache.to(self.dtype)

    def bytes_per_token(self) -> int:
        return len(self.layer_ids) * self.kv_cache_dim * torch.finfo(self.dtype).bits // 8


class KDAStatePool:
    """Per KDA layer and request slot: the short-conv window and the fp32 recurrent state.

    ``conv_state[l]``: ``[size + 1, 3 * conv_dim, kernel - 1]`` — the last ``kernel - 1`` inputs of
    the q, k and v convolutions (channels q | k | v, ``conv_dim`` = local heads × head dim each).
    ``ssm_state[l]``: ``[size + 1, heads, head_k_dim, head_v_dim]`` fp32 (rows = key channels).
    A slot is zeroed when a request is admitted, so every sequence starts from the zero state.
    """

    def __init__(
        self,
        size: int,
        layer_ids: Sequence[int],
        num_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        conv_dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.size = size
        self.layer_ids = list(layer_ids)
        self.num_heads = num_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.conv_kernel = conv_kernel
        self.conv_dim = num_heads * head_k_dim
        self.device = torch.device(device)
        self._index = {lid: i for i, lid in enumerate(self.layer_ids)}
        n = len(self.layer_ids)
        # Stacked over layers so that slot-wise clears / copies are one op for all layers.
        self.conv_state = torch.zeros(
            n, size + 1, 3 * self.conv_dim, max(conv_kernel - 1, 0), dtype=conv_dtype, device=device
        )
        self.ssm_state = torch.zeros(
            n, size + 1, num_heads, head_k_dim, head_v_dim, dtype=torch.float32, device=device
        )

    def layer_index(self, layer_id: int) -> int:
        return self._index[layer_id]

    def get_conv_state(self, layer_id: int) -> torch.Tensor:
        return self.conv_state[self._index[layer_id]]

    def get_ssm_state(self, layer_id: int) -> torch.Tensor:
        return self.ssm_state[self._index[layer_id]]

    def clear_slots(self, slots: Sequence[int] | torch.Tensor) -> None:
        """Zero the state of the given request slots (on admission)."""
        idx = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        self.conv_state[:, idx] = 0
        self.ssm_state[:, idx] = 0

    def bytes_per_slot(self) -> int:
        conv = self.conv_state[:, 0].numel() * self.conv_state.element_size()
        ssm = self.ssm_state[:, 0].numel() * 4
        return conv + ssm
