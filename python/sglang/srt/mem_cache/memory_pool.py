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
    """Hands out KV slot indices ``1..size`` (page size 1); slot 0 is the padding slot.

    The free slots live in a device-resident ring buffer: allocation takes from its head and
    freeing appends at its tail, both as device slice copies. The host only tracks counts, so
    neither ``alloc`` nor ``free`` ever waits for the GPU (a blocking host<->device copy here
    would pin the scheduler to GPU progress every step and defeat run-ahead).
    """

    def __init__(self, size: int, device: torch.device | str):
        self.size = size
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        self._ring = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._head = 0  # ring index of the first free slot
        self._n_free = self.size

    def available_size(self) -> int:
        return self._n_free

    def alloc(self, n: int, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """``n`` free slots as a new int64 device tensor (or written into ``out``, ``n``
        contiguous int64 elements on the device, e.g. a CUDA graph's static input), or ``None``
        if fewer are free."""
        if n > self._n_free:
            return None
        if out is not None and (out.numel() != n or out.dtype != torch.int64
                                or out.device != self.device or not out.is_contiguous()):
            raise ValueError(f"alloc: out must be {n} contiguous int64 elements on "
                             f"{self.device}, got {tuple(out.shape)} {out.dtype} on {out.device}")
        end = self._head + n
        if end <= self.size:
            src = self._ring[self._head:end]
            out = src.clone() if out is None else out.view(-1).copy_(src).view(out.shape)
        else:  # wraps around the end of the ring
            first = self.size - self._head
            if out is None:
                out = torch.cat([self._ring[self._head:], self._ring[:end - self.size]])
            else:
                flat = out.view(-1)
                flat[:first].copy_(self._ring[self._head:])
                flat[first:].copy_(self._ring[:end - self.size])
        self._head = end % self.size
        self._n_free -= n
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Return slots (any shape, host or device tensor; neither waits for the GPU)."""
        k = slots.numel()
        if k == 0:
            return
        if k > self.size - self._n_free:
            raise ValueError(f"freeing {k} slots but only {self.size - self._n_free} are in use")
        slots = slots.detach().reshape(-1).to(torch.int64)
        if slots.device != self.device:
            if self.device.type == "cuda":
                # A pageable host->device copy would wait for the stream; pinned + non_blocking
                # does not (the caching host allocator keeps the buffer alive until it is done).
                slots = slots.pin_memory().to(self.device, non_blocking=True)
            else:
                slots = slots.to(self.device)
        tail = (self._head + self._n_free) % self.size
        first = min(k, self.size - tail)
        self._ring[tail:tail + first] = slots[:first]
        if first < k:
            self._ring[:k - first] = slots[first:]
        self._n_free += k


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

    ``conv_state``: ``[L, size + 1, 3 * conv_dim, kernel - 1]`` — the last ``kernel - 1`` inputs of
    the q, k and v convolutions (channels q | k | v, ``conv_dim`` = local heads × head dim each).
    ``ssm_state``: ``[L, size + 1, heads, head_k_dim, head_v_dim]`` fp32 (rows = key channels).
    ``L`` runs over ``layer_ids``; :meth:`get_conv_state` / :meth:`get_ssm_state` give one layer.
    A slot is zeroed when a request is admitted, so every sequence starts from the zero state.

    Speculative scratch (only when ``spec_num_draft_tokens = N > 0``), for stage-then-commit:
    a TARGET_VERIFY forward over a chain of ``N`` tokens never writes the persistent state above;
    it writes, for each chain position ``i``, the state *after* token ``i`` into

    * ``intermediate_ssm``: ``[L, size + 1, N, heads, head_k_dim, head_v_dim]`` fp32 and
    * ``intermediate_conv``: ``[L, size + 1, N, 3 * conv_dim, kernel - 1]`` (conv window after
      token ``i``, in the conv-state dtype),

    indexed by the request's slot. :meth:`commit_after_verify` then copies position
    ``accept_len - 1`` of every request into the persistent state, for all layers in one gather /
    scatter on the device. A verify over ``n <= N`` tokens writes rows ``0 .. n-1`` of its slots
    before the commit reads one of them, so scratch needs no clearing on admission.
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
        spec_num_draft_tokens: int = 0,
    ):
        if spec_num_draft_tokens < 0:
            raise ValueError(f"spec_num_draft_tokens must be >= 0, got {spec_num_draft_tokens}")
        self.size = size
        self.layer_ids = list(layer_ids)
        self.num_heads = num_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.conv_kernel = conv_kernel
        self.conv_dim = num_heads * head_k_dim
        self.device = torch.device(device)
        self.spec_num_draft_tokens = spec_num_draft_tokens
        self._index = {lid: i for i, lid in enumerate(self.layer_ids)}
        n = len(self.layer_ids)
        conv_shape = (3 * self.conv_dim, max(conv_kernel - 1, 0))
        ssm_shape = (num_heads, head_k_dim, head_v_dim)
        # Stacked over layers so that slot-wise clears / copies are one op for all layers.
        self.conv_state = torch.zeros(n, size + 1, *conv_shape, dtype=conv_dtype, device=device)
        self.ssm_state = torch.zeros(n, size + 1, *ssm_shape, dtype=torch.float32, device=device)
        self.intermediate_ssm: Optional[torch.Tensor] = None
        self.intermediate_conv: Optional[torch.Tensor] = None
        if spec_num_draft_tokens > 0:
            # Zeroed once so that even a padded row's commit copies finite values into slot 0.
            self.intermediate_ssm = torch.zeros(
                n, size + 1, spec_num_draft_tokens, *ssm_shape, dtype=torch.float32, device=device)
            self.intermediate_conv = torch.zeros(
                n, size + 1, spec_num_draft_tokens, *conv_shape, dtype=conv_dtype, device=device)

    def layer_index(self, layer_id: int) -> int:
        return self._index[layer_id]

    def get_conv_state(self, layer_id: int) -> torch.Tensor:
        return self.conv_state[self._index[layer_id]]

    def get_ssm_state(self, layer_id: int) -> torch.Tensor:
        return self.ssm_state[self._index[layer_id]]

    @property
    def has_spec_scratch(self) -> bool:
        """Whether the pool was built with speculative scratch (``spec_num_draft_tokens > 0``)."""
        return self.intermediate_ssm is not None

    def _require_scratch(self, what: str) -> None:
        if not self.has_spec_scratch:
            raise ValueError(f"{what} needs the KDA speculative scratch; build KDAStatePool with "
                             "spec_num_draft_tokens > 0 (a speculative worker's verify width)")

    def get_intermediate_ssm(self, layer_id: int) -> torch.Tensor:
        """Staged post-states of one layer: ``[size + 1, N, heads, head_k_dim, head_v_dim]`` fp32."""
        self._require_scratch("get_intermediate_ssm")
        return self.intermediate_ssm[self._index[layer_id]]

    def get_intermediate_conv(self, layer_id: int) -> torch.Tensor:
        """Staged conv windows of one layer: ``[size + 1, N, 3 * conv_dim, kernel - 1]``."""
        self._require_scratch("get_intermediate_conv")
        return self.intermediate_conv[self._index[layer_id]]

    def commit_after_verify(self, req_pool_indices: torch.Tensor,
                            last_accepted_pos: torch.Tensor) -> None:
        """Make the staged state of chain position ``last_accepted_pos[b]`` the persistent state
        of slot ``req_pool_indices[b]``, for every KDA layer at once.

        Both are ``[B]`` integer device tensors; ``last_accepted_pos`` is ``accept_len - 1`` and
        must lie in ``[0, N)`` (values are not checked: that would need a host sync). Padded rows
        may point at slot 0 (the padding slot), whose state nobody reads. Device gather + scatter
        only, so it can sit inside a CUDA graph and never waits for the host.
        """
        self._require_scratch("commit_after_verify")
        shapes = (tuple(req_pool_indices.shape), tuple(last_accepted_pos.shape))
        if req_pool_indices.dim() != 1 or shapes[0] != shapes[1]:
            raise ValueError("commit_after_verify: req_pool_indices and last_accepted_pos must both "
                             f"be [B], got {shapes[0]} and {shapes[1]}")
        if req_pool_indices.is_floating_point() or last_accepted_pos.is_floating_point():
            raise ValueError("commit_after_verify: req_pool_indices and last_accepted_pos must be "
                             "integer tensors")
        slots = req_pool_indices.to(device=self.device, dtype=torch.int64)
        pos = last_accepted_pos.to(device=self.device, dtype=torch.int64)
        # [L, B, ...] gathers of (slot, position) pairs, then one scatter along the slot axis.
        self.ssm_state.index_copy_(1, slots, self.intermediate_ssm[:, slots, pos])
        self.conv_state.index_copy_(1, slots, self.intermediate_conv[:, slots, pos])

    def clear_slots(self, slots: Sequence[int] | torch.Tensor) -> None:
        """Zero the state of the given request slots (on admission)."""
        idx = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        self.conv_state[:, idx] = 0
        self.ssm_state[:, idx] = 0

    def bytes_per_slot(self) -> int:
        """Persistent state bytes of one request slot over all layers (scratch excluded)."""
        conv = self.conv_state[:, 0].numel() * self.conv_state.element_size()
        ssm = self.ssm_state[:, 0].numel() * 4
        return conv + ssm

    def spec_bytes_per_slot(self) -> int:
        """Speculative scratch bytes of one request slot over all layers (0 without scratch)."""
        if not self.has_spec_scratch:
            return 0
        return (self.intermediate_ssm[:, 0].numel() * 4
                + self.intermediate_conv[:, 0].numel() * self.intermediate_conv.element_size())
