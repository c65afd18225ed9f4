"""RMS norms: the plain one (optionally fused with the residual add) and the KDA output norm.

Both normalise in fp32 and cast the result back to the input dtype (docs/model.md §8). The torch
code here is the reference; :func:`set_norm_backend` switches a model's norms to one Triton
launch each (``sgl_kernel.rmsnorm``; ``KernelChoices.rmsnorm``, on by default on CUDA).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple, Union

import torch
from torch import nn

from sglang.srt.layers.triton_switch import set_use_triton
from sglang.srt.layers.linear import copy_checked
from sglang.srt.model_loader.weight_utils import LazyWeight

__all__ = ["RMSNorm", "GatedRMSNorm", "rms_norm", "gated_rms_norm", "gated_rms_norm_heads",
           "set_norm_backend"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, in fp32, returned in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   activation: str = "sigmoid") -> torch.Tensor:
    """``rmsnorm(x) * weight * act(gate)`` over the last dim in fp32 (``act`` = sigmoid, or
    swish / silu), returned in x's dtype: the torch form of :class:`GatedRMSNorm`."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    gf = gate.float()
    act = torch.sigmoid(gf) if activation == "sigmoid" else gf * torch.sigmoid(gf)
    return (y * weight.float() * act).to(x.dtype)


def gated_rms_norm_heads(x: torch.Tensor, prologue) -> torch.Tensor:
    """``x [M, K]`` through :func:`gated_rms_norm` per ``head_dim``-wide head, as a small-M
    GEMM's gated-norm prologue (``sgl_kernel.small_m_gemm.GatedNormPrologue``: ``gate [M, K]``,
    ``weight [head_dim]``, ``eps``, ``head_dim``, ``activation``) describes it: the torch path
    for the rows that do not run that kernel."""
    gate, weight, eps, d, activation = prologue
    m, k = x.shape
    return gated_rms_norm(x.reshape(m, k // d, d), gate.reshape(m, k // d, d), weight, eps,
                          activation).reshape(m, k)


@functools.lru_cache(maxsize=None)
def _triton_rmsnorm() -> Callable:
    from sgl_kernel.rmsnorm import rmsnorm  # Triton: imported once, on first use

    return rmsnorm


def set_norm_backend(model: nn.Module, triton_norms: bool, device: torch.device) -> bool:
    """Point every :class:`RMSNorm` / :class:`GatedRMSNorm` of ``model`` at the Triton kernel
    (``triton_norms``) or the torch reference; returns the choice. Triton needs CUDA, or
    ``TRITON_INTERPRET=1`` on CPU (tests)."""
    return set_use_triton(model, (RMSNorm, GatedRMSNorm), triton_norms, "rmsnorm", device)


def _norm_weight(size: int, dtype: Optional[torch.dtype]) -> nn.Parameter:
    w = nn.Parameter(torch.ones(size, dtype=dtype or torch.get_default_dtype()),
                     requires_grad=False)
    w.weight_loader = _load_whole
    return w


def _load_whole(param: nn.Parameter, loaded: LazyWeight, shard_id=None) -> None:
    copy_checked(param, param.data, loaded.load(), loaded.name)


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale. ``forward(x, residual)`` fuses the residual add.

    Without ``residual`` it returns the normed ``x``. With it, it returns
    ``(norm(x + residual), x + residual)`` — the decoder layers carry the un-normed stream in
    ``residual`` so that each add happens once, next to the norm that consumes it.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = _norm_weight(hidden_size, params_dtype)
        self.use_triton = False  # set for the whole model by set_norm_backend

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """``norm(x)``, or ``(norm(x + residual), x + residual)`` when ``residual`` is given."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"RMSNorm({self.hidden_size}) got input of shape {tuple(x.shape)}")
        if self.use_triton:
            return _triton_rmsnorm()(x, self.weight, self.variance_epsilon, residual=residual)
        if residual is None:
            return rms_norm(x, self.weight, self.variance_epsilon)
        x = x + residual
        return rms_norm(x, self.weight, self.variance_epsilon), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm times an activated output gate (KDA output, docs/model.md §3.3).

    ``forward(x [..., D], gate [..., D]) = rmsnorm_D(x) * weight * act(gate)`` with ``act`` =
    sigmoid (Ling) or ``swish`` (silu; other FLA models). The weight ``[D]`` is shared by all
    heads; the whole computation runs in fp32.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, activation: str = "sigmoid",
                 params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if activation not in ("sigmoid", "swish", "silu"):
            raise ValueError(f"GatedRMSNorm: unsupported activation {activation!r}")
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.activation = activation
        self.weight = _norm_weight(hidden_size, params_dtype)
        self.use_triton = False  # set for the whole model by set_norm_backend

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``rmsnorm(x) * weight * act(gate)`` over the last dim, in x's dtype."""
        if x.shape != gate.shape or x.shape[-1] != self.hidden_size:
            raise ValueError(f"GatedRMSNorm({self.hidden_size}): x {tuple(x.shape)} and gate "
                             f"{tuple(gate.shape)} must match with last dim {self.hidden_size}")
        if self.use_triton:
            return _triton_rmsnorm()(x, self.weight, self.variance_epsilon, gate=gate,
                                     activation=self.activation)
        return gated_rms_norm(x, gate, self.weight, self.variance_epsilon, self.activation)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}, act={self.activation}"
