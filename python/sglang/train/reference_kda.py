"""Kimi Delta Attention (KDA) of the plain-PyTorch reference BailingMoeV3 (docs/model.md §3).

Everything here is differentiable and batched over ``[B, T, ...]``. The core math (gate, L2 norm,
recurrence) runs in fp32 with autocast switched off, because the state of a delta rule accumulates
over the whole sequence and the serving kernels keep it in fp32 as well.

Three interchangeable implementations of the recurrence are offered (``kda_mode``):

* ``"recurrent"`` — the token-by-token delta rule of §3.2 (slow, the definition);
* ``"chunk"`` — the chunked form of §3.4 (same result, a Python loop over chunks only);
* ``"fla"`` — fla-core's ``chunk_kda`` (CUDA only, imported lazily); ``"auto"`` picks it on CUDA
  when fla is importable and falls back to ``"chunk"`` otherwise.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

KDA_MODES = ("recurrent", "chunk", "fla", "auto")


def fp32_region(x: torch.Tensor) -> torch.autocast:
    """A context that disables autocast on ``x``'s device, so math inside stays in fp32."""
    return torch.autocast(device_type=x.device.type, enabled=False)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's ``l2norm``; docs/model.md §3.1
    step 3)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float,
             safe_gate: bool) -> torch.Tensor:
    """Log-space forget gate ``g`` [B, T, H, D] from the forget logits ``f`` (docs/model.md
    §3.1 step 6).

    ``safe_gate``: ``g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))`` in (lower_bound, 0);
    otherwise the original Kimi form ``g = -exp(A_log[h]) * softplus(f + dt_bias)``.
    ``dt_bias`` is added before the multiplication by ``exp(A_log)``.
    """
    num_heads, head_dim = f.shape[-2], f.shape[-1]
    u = f.float() + dt_bias.float().view(num_heads, head_dim)
    a = a_log.float().exp().view(num_heads, 1)
    if safe_gate:
        return lower_bound * torch.sigmoid(a * u)
    return -a * F.softplus(u)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, scale: float,
                  initial_state: Optional[torch.Tensor] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token (docs/model.md §3.2), fp32.

    Shapes: ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``, ``beta [B, T, H]``, state ``[B, H, K, V]``.
    Per step: ``S <- diag(exp(g_t)) S``; ``S <- S + beta_t k_t (v_t - S^T k_t)^T``;
    ``o_t = S^T (scale * q_t)``. Returns ``(o [B, T, H, V], final_state)``.
    """
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    s = (initial_state.float() if initial_state is not None
         else q.new_zeros(b, h, dk, dv, dtype=torch.float32))
    outs = []
    for i in range(t):
        s = s * g[:, i].exp().unsqueeze(-1)
        k_i = k[:, i]
        pred = torch.einsum("bhk,bhkv->bhv", k_i, s)
        delta = beta[:, i].unsqueeze(-1) * (v[:, i] - pred)
        s = s + k_i.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i] * scale, s))
    return torch.stack(outs, dim=1), s


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, scale: float, chunk_size: int = 32,
                initial_state: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunked form of the gated delta rule (docs/model.md §3.4), fp32; same result as
    :func:`kda_recurrent` up to rounding.

    Decay factors are only ever formed as ``exp(G_i - G_j)`` with ``i >= j`` (a non-positive
    exponent), so nothing overflows however strong the gates are. The pairwise tensor is
    ``[B, H, N, C, C, K]``: memory grows with ``chunk_size``, time with the number of chunks.
    """
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = (-t) % c
    if pad:
        # Padding at the end with k = v = g = beta = 0 leaves outputs and the state unchanged.
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = (t + pad) // c
    # [B, H, N, C, D] layout: heads and chunks become batch dims.
    q, k, v, g = (x.view(b, n, c, h, x.shape[-1]).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))
    beta = beta.view(b, n, c, h).permute(0, 3, 1, 2)
    q = q * scale
    cum = g.cumsum(dim=-2)  # G_i, inclusive

    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = cum.unsqueeze(-2) - cum.unsqueeze(-3)  # [.., i, j, K] = G_i - G_j
    decay = diff.masked_fill(~causal.unsqueeze(-1), float("-inf")).exp()
    strict = causal.tril(-1)  # A is strictly lower triangular
    a_kk = torch.einsum("...ik,...jk,...ijk->...ij", k, k, decay)
    a_kk = (a_kk * beta.unsqueeze(-1)).masked_fill(~strict, 0.0)
    a_qk = torch.einsum("...ik,...jk,...ijk->...ij", q, k, decay)

    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    # T = (I + A)^-1 diag(beta); W = T (k * exp(G)); U = T v.
    rhs = torch.cat([k * cum.exp(), v], dim=-1) * beta.unsqueeze(-1)
    wu = torch.linalg.solve_triangular(eye + a_kk, rhs, upper=False, unitriangular=True)
    w, u = wu[..., :dk], wu[..., dk:]
    q_dec = q * cum.exp()
    last = cum[..., -1:, :]  # G_last  [B, H, N, 1, K]
    k_tail = k * (last - cum).exp()

    s = (initial_state.float() if initial_state is not None
         else q.new_zeros(b, h, dk, dv))
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s
        outs.append(q_dec[:, :, i] @ s + a_qk[:, :, i] @ v_new)
        s = s * last[:, :, i].transpose(-1, -2).exp() + k_tail[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2)  # [B, H, N, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(b, n * c, h, dv)[:, :t]
    return o, s


def kda_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fla-core's ``chunk_kda`` on CUDA (q, k already L2-normalised, g natural-log).

    q, k, v, beta are handed over in ``dtype`` (the autocast dtype when training in bf16; the
    kernel accumulates the state in fp32 anyway); g stays fp32. Returns fp32 ``o``."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("kda_mode='fla' needs fla-core (pip install fla-core)") from exc
    if not q.is_cuda:
        raise RuntimeError("kda_mode='fla' runs on CUDA only; use 'chunk' on CPU")
    q, k, v, beta = (x.to(dtype).contiguous() for x in (q, k, v, beta))
    o, _ = chunk_kda(q, k, v, g.contiguous(), beta, scale=scale, initial_state=None,
                     output_final_state=False)
    return o.float()


def fla_available(device: torch.device) -> bool:
    """True when ``chunk_kda`` can run on ``device`` (CUDA and fla-core importable)."""
    if device.type != "cuda":
        return False
    try:
        import fla.ops.kda  # noqa: F401
    except ImportError:
        return False
    return True


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm with a sigmoid output gate: ``RMSNorm_D(o) * w * sigmoid(z)`` (§3.3)."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        with fp32_region(o):
            o32 = o.float()
            y = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.eps)
            return y * self.weight.float() * torch.sigmoid(z.float())


class KDAAttention(nn.Module):
    """The KDA attention block of a linear-attention layer (checkpoint prefix ``.attention.``)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int,
                 lower_bound: float, safe_gate: bool, eps: float):
        super().__init__()
        width = num_heads * head_dim
        self.num_heads, self.head_dim = num_heads, head_dim
        self.lower_bound, self.safe_gate = lower_bound, safe_gate
        self.scale = head_dim ** -0.5
        self.q_proj = nn.Linear(hidden_size, width, bias=False)
        self.k_proj = nn.Linear(hidden_size, width, bias=False)
        self.v_proj = nn.Linear(hidden_size, width, bias=False)
        # Depthwise causal convs; nn.Conv1d's weight layout [C, 1, K] is the checkpoint layout.
        self.q_conv1d = nn.Conv1d(width, width, conv_kernel, groups=width, bias=False)
        self.k_conv1d = nn.Conv1d(width, width, conv_kernel, groups=width, bias=False)
        self.v_conv1d = nn.Conv1d(width, width, conv_kernel, groups=width, bias=False)
        self.f_proj = nn.Linear(hidden_size, width, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.g_proj = nn.Linear(hidden_size, width, bias=False)
        self.o_norm = GatedRMSNorm(head_dim, eps)
        self.o_proj = nn.Linear(width, hidden_size, bias=False)

    @staticmethod
    def _short_conv(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
        """SiLU(causal depthwise conv) over time: left zero padding K-1, first T outputs."""
        t = x.shape[1]
        k = conv.weight.shape[-1]
        y = F.conv1d(x.transpose(1, 2), conv.weight, padding=k - 1, groups=conv.weight.shape[0])
        return F.silu(y[..., :t].transpose(1, 2))

    def forward(self, x: torch.Tensor, kda_mode: str = "chunk", chunk_size: int = 32
                ) -> torch.Tensor:
        """``x`` [B, T, hidden] (already input-normed) -> attention output [B, T, hidden]."""
        b, t, _ = x.shape
        h, d = self.num_heads, self.head_dim
        q = self._short_conv(self.q_proj(x), self.q_conv1d).view(b, t, h, d)
        k = self._short_conv(self.k_proj(x), self.k_conv1d).view(b, t, h, d)
        v = self._short_conv(self.v_proj(x), self.v_conv1d).view(b, t, h, d)
        f = self.f_proj(x).view(b, t, h, d)
        beta_logits = self.b_proj(x)
        z = self.g_proj(x).view(b, t, h, d)
        dev = x.device.type
        low_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        with fp32_region(x):
            g = kda_gate(f, self.A_log, self.dt_bias, self.lower_bound, self.safe_gate)
            beta = torch.sigmoid(beta_logits.float())
            q, k = l2_normalize(q.float()), l2_normalize(k.float())
            v = v.float()
            mode = kda_mode
            if mode == "auto":
                mode = "fla" if fla_available(x.device) else "chunk"
            if mode == "recurrent":
                o, _ = kda_recurrent(q, k, v, g, beta, self.scale)
            elif mode == "chunk":
                o, _ = kda_chunked(q, k, v, g, beta, self.scale, chunk_size)
            elif mode == "fla":
                o = kda_fla(q, k, v, g, beta, self.scale, low_dtype)
            else:
                raise ValueError(f"unknown kda_mode {kda_mode!r}; expected one of {KDA_MODES}")
            y = self.o_norm(o, z).reshape(b, t, h * d)
        return self.o_proj(y.to(x.dtype))

    @torch.no_grad()
    def init_gate_params(self, gen: torch.Generator, a_range: Tuple[float, float],
                         dt_range: Tuple[float, float]) -> None:
        """``A = exp(A_log) ~ U(a_range)`` and ``dt_bias = softplus^-1(dt)``, ``dt`` log-uniform in
        ``dt_range`` (the Mamba-style initialisation)."""
        a = torch.empty(self.A_log.shape).uniform_(*a_range, generator=gen)
        self.A_log.copy_(a.log())
        lo, hi = math.log(dt_range[0]), math.log(dt_range[1])
        dt = torch.empty(self.dt_bias.shape).uniform_(lo, hi, generator=gen).exp()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
