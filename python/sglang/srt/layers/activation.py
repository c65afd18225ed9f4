"""Gated activations: SwiGLU with the optional clamp of Ling's late layers (docs/model.md
§5.4) and MLA's sigmoid head gate, each in torch or as one Triton launch
(``sgl_kernel.gated_act``, ``KernelChoices.gated_act``: :func:`set_gated_act_backend`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SiluAndMul", "silu_and_mul", "SigmoidHeadGate", "set_gated_act_backend"]


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
        self.use_triton = False  # set_gated_act_backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[.., 2I] -> [.., I]``."""
        if self.use_triton and x.dim() == 2:
            from sgl_kernel.gated_act import silu_and_mul as silu_and_mul_kernel

            return silu_and_mul_kernel(x, self.limit)
        return silu_and_mul(x, self.limit)

    def extra_repr(self) -> str:
        return f"limit={self.limit}" if self.limit else ""


class SigmoidHeadGate(nn.Module):
    """MLA's output gate: ``o [T, h, v] * sigmoid(g [T, h])`` per (token, head), computed in
    fp32 and rounded once to o's dtype (docs/model.md §4: one scalar per head)."""

    def __init__(self) -> None:
        super().__init__()
        self.use_triton = False  # set_gated_act_backend

    def forward(self, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``o [T, h, v]``, ``g [T, h]`` (the gate projection's output) -> ``[T, h, v]``."""
        if self.use_triton:
            from sgl_kernel.gated_act import sigmoid_head_gate

            return sigmoid_head_gate(o, g)
        return (o.float() * torch.sigmoid(g.float()).unsqueeze(-1)).to(o.dtype)


def set_gated_act_backend(model: nn.Module, triton_gates: bool, device: torch.device) -> bool:
    """Point every :class:`SiluAndMul` and :class:`SigmoidHeadGate` of ``model`` at the
    one-launch kernels of ``sgl_kernel.gated_act`` (``KernelChoices.gated_act``) or their torch
    forms; returns the choice. Triton needs CUDA, or ``TRITON_INTERPRET=1`` on CPU (tests)."""
    from sglang.srt.layers.triton_switch import set_use_triton

    return set_use_triton(model, (SiluAndMul, SigmoidHeadGate), triton_gates, "gated_act",
                          device)
