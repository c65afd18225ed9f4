"""Plain-PyTorch KDA (Kimi Delta Attention) math for one sequence: the reference for fast paths.

Everything follows docs/model.md §3: a short causal depthwise convolution with SiLU, per-head
L2 norm, the lower-bound (or softplus) forget gate, and the gated delta rule in its
token-by-token form (§3.2) and its chunked form (§3.4). All math runs in fp32 whatever the input
dtype; outputs come back in the query's dtype and recurrent states are always fp32
``[H, K, V]`` (rows = key channels, the FLA layout).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = [
    "causal_conv1d",
    "causal_conv1d_update",
    "l2norm",
    "kda_gate",
    "KDAGate",
    "kda_step",
    "kda_recurrent",
    "kda_chunked",
]


# --------------------------------------------------------------------------------------------
# Short convolution
# --------------------------------------------------------------------------------------------
def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU over one sequence.

    ``x [T, C]``, ``weight [C, K]`` (index ``K-1`` multiplies the current token),
    ``conv_state [C, K-1]`` = the previous ``K-1`` inputs, oldest first (``None`` = a fresh,
    zero-padded sequence). Returns ``(y [T, C] in x's dtype, new_state [C, K-1] in x's dtype)``;
    the new state is the last ``K-1`` inputs of ``state ‖ x``, so ``T < K-1`` works too.
    """
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"causal_conv1d: expected x [T, C] and weight [C, K], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    t, c = x.shape
    kernel = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(c, kernel - 1)
    if tuple(conv_state.shape) != (c, kernel - 1):
        raise ValueError(f"causal_conv1d: conv_state must be [{c}, {kernel - 1}], "
                         f"got {tuple(conv_state.shape)}")
    # Time-major window: the K-1 remembered inputs followed by the new ones.
    xs = torch.cat([conv_state.t().float(), x.float()], dim=0)  # [K-1+T, C]
    w = weight.float()
    y = torch.zeros(t, c, dtype=torch.float32, device=x.device)
    for i in range(kernel):  # K is tiny (4): a shifted multiply-add per tap beats unfold copies
        y += xs[i:i + t] * w[:, i]
    new_state = xs[xs.shape[0] - (kernel - 1):].t()
    return F.silu(y).to(x.dtype), new_state.to(x.dtype).contiguous()


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One decode step of :func:`causal_conv1d` for a batch of sequences.

    ``x [B, C]``, ``weight [C, K]``, ``conv_state [B, C, K-1]``. Returns
    ``(y [B, C] in x's dtype, new_state [B, C, K-1] in conv_state's dtype)``.
    """
    if x.dim() != 2 or conv_state.dim() != 3 or conv_state.shape[:2] != x.shape:
        raise ValueError(f"causal_conv1d_update: expected x [B, C] and conv_state [B, C, K-1], got "
                         f"{tuple(x.shape)} and {tuple(conv_state.shape)}")
    window = torch.cat([conv_state.float(), x.float().unsqueeze(-1)], dim=-1)  # [B, C, K]
    y = (window * weight.float()).sum(-1)
    return F.silu(y).to(x.dtype), window[..., 1:].to(conv_state.dtype)


def causal_conv1d_chain(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``N`` consecutive :func:`causal_conv1d_update` steps at once (a speculative chain).

    ``x [B, N, C]``, ``weight [C, K]``, ``conv_state [B, C, K-1]``. Returns ``(y [B, N, C]``
    contiguous in x's dtype, ``windows [B, N, C, K-1]`` in conv_state's dtype)``: position ``i``'s output and
    the conv state after it. Each position multiplies and sums the same ``K``-window as the
    one-step update, so the results are those of the step-by-step loop.
    """
    if x.dim() != 3 or conv_state.dim() != 3 or conv_state.shape[:2] != (x.shape[0], x.shape[2]):
        raise ValueError(f"causal_conv1d_chain: expected x [B, N, C] and conv_state [B, C, K-1], "
                         f"got {tuple(x.shape)} and {tuple(conv_state.shape)}")
    kernel = conv_state.shape[-1] + 1
    seq = torch.cat([conv_state.float(), x.float().transpose(1, 2)], dim=-1)  # [B, C, K-1+N]
    windows = seq.unfold(-1, kernel, 1)  # [B, C, N, K]: the window ending at each position
    y = (windows * weight.float().unsqueeze(1)).sum(-1)  # [B, C, N]
    return (F.silu(y).transpose(1, 2).contiguous().to(x.dtype),
            windows[..., 1:].transpose(1, 2).to(conv_state.dtype))


# --------------------------------------------------------------------------------------------
# Normalisation and gate
# --------------------------------------------------------------------------------------------
def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, computed in fp32, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def kda_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: Optional[float]
) -> torch.Tensor:
    """Log-space per-channel decay ``g [T, H, D]`` (fp32) from the gate projection ``f [T, H, D]``.

    Safe form (``lower_bound`` given): ``lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))``,
    otherwise Kimi's ``-exp(A_log[h]) * softplus(f + dt_bias)``. ``dt_bias`` is ``[H * D]``.
    """
    if f.dim() != 3:
        raise ValueError(f"kda_gate: f must be [T, H, D], got {tuple(f.shape)}")
    _, h, d = f.shape
    if A_log.numel() != h or dt_bias.numel() != h * d:
        raise ValueError(f"kda_gate: A_log must have {h} and dt_bias {h * d} elements, got "
                         f"{A_log.numel()} and {dt_bias.numel()}")
    u = f.float() + dt_bias.float().view(h, d)
    a = A_log.float().exp().view(h, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * u)
    return -a * F.softplus(u)


class KDAGate(NamedTuple):
    """The raw inputs of a KDA layer's decay and write strength, as the projections give them.

    ``f [T, H * D]`` and ``b [T, H]`` are the gate and beta projections (model dtype, possibly
    strided column views of the fused projection output); ``A_log [H]`` and ``dt_bias [H * D]``
    the layer's parameters; ``lower_bound`` the safe gate's bound (None: Kimi's softplus form).
    A backend either forms ``g`` / ``beta`` with :meth:`decay` / :meth:`beta` (the torch
    reference, :func:`kda_gate`) or hands the raw pieces to a kernel that forms them as it loads
    them (no separate launches).
    """

    f: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    lower_bound: Optional[float]

    def decay(self, num_heads: int, head_dim: int) -> torch.Tensor:
        """``g [T, H, D]`` fp32 (:func:`kda_gate`)."""
        t = self.f.shape[0]
        return kda_gate(self.f.reshape(t, num_heads, head_dim), self.A_log, self.dt_bias,
                        self.lower_bound)

    def beta(self) -> torch.Tensor:
        """``beta [T, H]`` fp32: ``sigmoid(b)``."""
        return torch.sigmoid(self.b.float())


# --------------------------------------------------------------------------------------------
# Recurrence
# --------------------------------------------------------------------------------------------
def _check_qkv(q, k, v, g, beta) -> None:
    if q.dim() != 3 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"KDA: q, k, g must share shape [T, H, K], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(g.shape)}")
    if v.dim() != 3 or v.shape[:2] != q.shape[:2] or tuple(beta.shape) != tuple(q.shape[:2]):
        raise ValueError(f"KDA: v must be [T, H, V] and beta [T, H] matching q {tuple(q.shape)}, "
                         f"got {tuple(v.shape)} and {tuple(beta.shape)}")


def _initial_state(initial_state, h, dk, dv, device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(h, dk, dv, dtype=torch.float32, device=device)
    if tuple(initial_state.shape) != (h, dk, dv):
        raise ValueError(f"KDA: initial_state must be [{h}, {dk}, {dv}], "
                         f"got {tuple(initial_state.shape)}")
    # Clone so the caller's (pool) tensor is never updated behind its back.
    return initial_state.to(torch.float32).clone()


def kda_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float, state: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for any leading batch shape (fp32 in, fp32 out).

    ``q, k, g [..., K]``, ``v [..., V]``, ``beta [...]``, ``state [..., K, V]``. Returns
    ``(o [..., V], new_state [..., K, V])`` with (docs/model.md §3.2)
    ``S <- diag(exp g) S;  S <- S + beta k (v - S^T k)^T;  o = S^T (scale q)``.
    """
    s = state * g.exp().unsqueeze(-1)
    pred = torch.einsum("...k,...kv->...v", k, s)
    s = s + (beta.unsqueeze(-1) * k).unsqueeze(-1) * (v - pred).unsqueeze(-2)
    o = torch.einsum("...k,...kv->...v", q * scale, s)
    return o, s


def kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float, initial_state: Optional[torch.Tensor] = None, return_all_states: bool = False,
):
    """Token-by-token KDA over one sequence (docs/model.md §3.2); q and k already L2-normalised.

    ``q, k, g [T, H, K]``, ``v [T, H, V]``, ``beta [T, H]``, ``initial_state [H, K, V]`` fp32.
    Returns ``(o [T, H, V] in q's dtype, final_state [H, K, V] fp32)`` and, with
    ``return_all_states``, also the state after every token ``[T, H, K, V]`` fp32.
    """
    _check_qkv(q, k, v, g, beta)
    t, h, dk = q.shape
    dv = v.shape[-1]
    state = _initial_state(initial_state, h, dk, dv, q.device)
    qf, kf, vf, gf, bf = (x.float() for x in (q, k, v, g, beta))
    out = torch.empty(t, h, dv, dtype=torch.float32, device=q.device)
    states = [] if return_all_states else None
    for i in range(t):
        out[i], state = kda_step(qf[i], kf[i], vf[i], gf[i], bf[i], scale, state)
        if states is not None:
            states.append(state)
    o = out.to(q.dtype)
    if states is None:
        return o, state
    all_states = torch.stack(states) if states else state.new_zeros(0, h, dk, dv)
    return o, state, all_states


def kda_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float, initial_state: Optional[torch.Tensor] = None, return_all_states: bool = False,
    chunk_size: int = 64,
):
    """Chunked KDA (docs/model.md §3.4), equal to :func:`kda_recurrent` up to fp32 rounding.

    Same arguments and results as :func:`kda_recurrent`. Numerically safe for any ``g <= 0``:
    decays enter only as ``exp(G_i - G_j)`` with ``i >= j`` inside a chunk (masked to ``-inf``
    before the exponential otherwise) and ``exp(G_i)`` / ``exp(G_last - G_i)``, all ``<= 1``,
    so nothing overflows even when the cumulative decay of a chunk reaches -320.
    """
    _check_qkv(q, k, v, g, beta)
    if chunk_size < 1:
        raise ValueError(f"kda_chunked: chunk_size must be positive, got {chunk_size}")
    t, h, dk = q.shape
    dv = v.shape[-1]
    state = _initial_state(initial_state, h, dk, dv, q.device)
    # Head-major fp32 copies: [H, T, *].
    qf = (q.float() * scale).transpose(0, 1)
    kf, vf, gf = (x.float().transpose(0, 1) for x in (k, v, g))
    bf = beta.float().t()
    out = torch.empty(h, t, dv, dtype=torch.float32, device=q.device)
    states = [] if return_all_states else None
    for start in range(0, t, chunk_size):
        end = min(start + chunk_size, t)
        o_c, state, st_c = _chunk(qf[:, start:end], kf[:, start:end], vf[:, start:end],
                                  gf[:, start:end], bf[:, start:end], state, return_all_states)
        out[:, start:end] = o_c
        if states is not None:
            states.append(st_c)
    o = out.transpose(0, 1).to(q.dtype)
    if states is None:
        return o, state
    all_states = torch.cat(states) if states else state.new_zeros(0, h, dk, dv)
    return o, state, all_states


def _chunk(q, k, v, g, beta, state, want_states):
    """One chunk, head-major fp32: q (pre-scaled), k, g ``[H, c, K]``, v ``[H, c, V]``,
    beta ``[H, c]``, state ``[H, K, V]``. Returns (o [H, c, V], new state, per-token states or None).
    """
    c = q.shape[1]
    G = g.cumsum(dim=1)  # inclusive cumulative log decay, <= 0 and non-increasing
    # Pairwise decay exp(G_i - G_j) for j <= i; the upper triangle (which could overflow) is
    # masked to -inf *before* the exponential so it becomes an exact 0.
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = (G.unsqueeze(2) - G.unsqueeze(1)).masked_fill(~causal.view(1, c, c, 1), float("-inf"))
    decay = diff.exp()  # [H, c(i), c(j), K]
    decay_kj = decay * k.unsqueeze(1)  # k_j[d] exp(G_i[d] - G_j[d]), reused by both products
    kk = (k.unsqueeze(2) * decay_kj).sum(-1)
    qk = (q.unsqueeze(2) * decay_kj).sum(-1)  # includes the diagonal (j == i)
    strict = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
    A = (beta.unsqueeze(-1) * kk) * strict
    eye = torch.eye(c, dtype=torch.float32, device=q.device)
    # (I + A) is unit lower triangular: solve (I + A) [W | U] = diag(beta) [k*exp(G) | v].
    eG = G.exp()
    rhs = beta.unsqueeze(-1) * torch.cat([k * eG, v], dim=-1)
    wu = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    W, U = wu[..., : k.shape[-1]], wu[..., k.shape[-1]:]
    v_new = U - W @ state  # [H, c, V]
    o = (q * eG) @ state + qk @ v_new
    states = None
    if want_states:
        # State after token i: diag(exp G_i) S0 + sum_{j<=i} (k_j * exp(G_i - G_j)) v'_j^T.
        states = eG.unsqueeze(-1) * state.unsqueeze(1) + torch.einsum(
            "hijk,hjv->hikv", decay_kj, v_new)
        states = states.transpose(0, 1)  # [c, H, K, V]
    G_last = G[:, -1:]  # [H, 1, K]
    new_state = G_last.transpose(1, 2).exp() * state + (k * (G_last - G).exp()).transpose(1, 2) @ v_new
    return o, new_state, states
