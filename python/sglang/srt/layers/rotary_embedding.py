"""Rotary position embedding on the rope channels of MLA queries and keys (docs/model.md §4.2).

Two pairings of the ``rotary_dim`` channels into rotation planes:

* interleaved / GPT-J (``is_neox_style=False``, Ling's ``rope_interleave: true``): channels
  ``(2i, 2i+1)`` rotate together with frequency ``i``;
* neox (``is_neox_style=True``): channels ``(i, i + rotary_dim/2)``.

Frequency ``i`` is ``base^(-2i/rotary_dim)``; positions are absolute 0-based token indices. The
cos/sin table is computed in fp64 (exact angles even at 256k positions) and stored in fp32, on
the device of the positions, and grown when a longer position shows up on the host (CPU
positions are checked every call; device positions are trusted to be below the table size,
which covers ``max_position_embeddings`` — checking them would cost a device sync per step).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "get_rope", "set_rope_backend"]


class RotaryEmbedding(nn.Module):
    """Applies RoPE to tensors whose last dim is exactly ``rotary_dim``."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool):
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_size:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_size {head_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = float(base)
        self.is_neox_style = is_neox_style
        # Plain attribute (not a buffer): one table per device, built lazily, never saved.
        # Each table is [n, rotary_dim] = cos half ‖ sin half.
        self._cos_sin: Dict[torch.device, torch.Tensor] = {}
        # MLA's rotation and concatenations as one Triton launch (sgl_kernel.mla_rope), set by
        # set_rope_backend (KernelChoices.mla_rope).
        self.use_triton = False

    def _build(self, n: int, device: torch.device) -> torch.Tensor:
        half = self.rotary_dim // 2
        inv_freq = self.base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / self.rotary_dim)
        angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
        return torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.float32).to(device)

    def cos_sin_cache(self, device: torch.device, min_size: int = 0) -> torch.Tensor:
        """The table on ``device`` with at least ``max(min_size, max_position_embeddings)`` rows."""
        device = torch.device(device)
        cache = self._cos_sin.get(device)
        need = max(min_size, self.max_position_embeddings)
        if cache is None or cache.shape[0] < need:
            # Geometric growth when a longer position shows up: few rebuilds.
            size = need if cache is None else max(need, 2 * cache.shape[0])
            cache = self._build(size, device)
            self._cos_sin[device] = cache
        return cache

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query [T, ..., rotary_dim]`` and ``key [T, ..., rotary_dim]`` at ``positions [T]``.

        The middle dims broadcast (e.g. ``[T, H, r]`` queries with a shared ``[T, 1, r]`` key).
        Math in fp32; outputs in the inputs' dtypes.
        """
        for name, x in (("query", query), ("key", key)):
            if x.shape[-1] != self.rotary_dim or x.shape[0] != positions.shape[0]:
                raise ValueError(f"RotaryEmbedding: {name} of shape {tuple(x.shape)} needs "
                                 f"[{positions.shape[0]}, ..., {self.rotary_dim}]")
        # Positions are never read on the host (a forward must not wait for the device); the
        # table covers max_position_embeddings, and ModelRunner grows it once to the longest
        # position it can see (NEXTN headroom). Past the table, CPU indexing raises IndexError.
        cos_sin = self.cos_sin_cache(positions.device)[positions]
        cos, sin = cos_sin.chunk(2, dim=-1)  # [T, r/2] each
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def assemble_mla(self, positions: torch.Tensor, q_latent: torch.Tensor,
                     q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
        """MLA's ``q = [q_latent ‖ rope(q_rope)]`` (``[T, H, R + r]``) and ``k = [latent ‖
        rope(k_rope)]`` (``[T, R + r]``): :meth:`forward` and two concatenations, or with
        ``use_triton`` the same values (bit for bit) from one launch."""
        if self.use_triton:
            from sgl_kernel.mla_rope import mla_rope_assemble

            return mla_rope_assemble(positions, self.cos_sin_cache(positions.device), q_latent,
                                     q_rope, latent, k_rope, self.is_neox_style)
        q_rope, k_rope = self(positions, q_rope, k_rope)
        return torch.cat([q_latent, q_rope], dim=-1), torch.cat([latent, k_rope], dim=-1)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos.view(shape), sin.view(shape)
        xf = x.float()
        if self.is_neox_style:
            x1, x2 = xf.chunk(2, dim=-1)
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.flatten(-2).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"rotary_dim={self.rotary_dim}, base={self.base}, "
                f"style={'neox' if self.is_neox_style else 'interleaved'}")


_ROPE_CACHE: Dict[Tuple, RotaryEmbedding] = {}


def get_rope(head_size: int, rotary_dim: int, max_position: int, base: float,
             is_neox_style: bool = True, rope_scaling: Optional[dict] = None) -> RotaryEmbedding:
    """A shared :class:`RotaryEmbedding` per distinct configuration (one table for all layers)."""
    if rope_scaling:
        raise ValueError(f"rope_scaling {rope_scaling!r} is not supported (Ling ships null)")
    key = (head_size, rotary_dim, max_position, float(base), is_neox_style)
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style)
    return _ROPE_CACHE[key]


def set_rope_backend(model: nn.Module, triton_rope: bool, device: torch.device) -> bool:
    """Point every :class:`RotaryEmbedding` of ``model`` at the one-launch MLA assembly
    (``KernelChoices.mla_rope``) or the torch form; returns the choice. Triton needs CUDA, or
    ``TRITON_INTERPRET=1`` on CPU (tests)."""
    from sglang.srt.layers.triton_switch import set_use_triton

    return set_use_triton(model, (RotaryEmbedding,), triton_rope, "mla_rope", device)
