"""SwiGLU activation with the optional clamp of Ling's late layers (docs/model.md §5.4)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SiluAndMul", "silu_and_mul"]


def silu_and_mul(x: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """``x = [gate | up]`` on the last dim -> ``silu(gate) * up``.

    With ``limit > 0``: ``min(silu(gate), limit) * clamp(up, -limit, limit)``. Computed in fp32
    (so the clamp compares exact values), returned in x's dtype.
    """
    d = x.shape[-1] // 2
    if x.shape[-1] != 2 * d:
        raise ValueError(f"silu_and_mul: last dim must be even, got {tuple(x.shape)}")
    gate, up = x[..., :d].float(), x[..., d:].float()
    act = F.silu(gate)
    if limit > 0:
        act = act.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return (act * up).to(x.dtype)


class SiluAndMul(nn.Module):
    """Module form of :func:`silu_and_mul`; ``limit = 0`` is the plain SwiGLU."""

    def __init__(self, limit: float = 0.0):
        super().__init__()
        if limit < 0:
            raise ValueError(f"SiluAndMul: limit must be >= 0, got {limit}")
        self.limit = float(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[.., 2I] -> [.., I]``."""
        return silu_and_mul(x, self.limit)

    def extra_repr(self) -> str:
        return f"limit={self.limit}" if self.limit else ""
