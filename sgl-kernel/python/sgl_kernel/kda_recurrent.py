"""KDA gated delta rule over a few tokens per request, state read from and written to the pools:
the decode step (one token, state updated in place) and the NEXTN target verify (a chain of ``N``
tokens, the state after each position staged, the persistent state untouched).

Per request ``b`` (pool slot ``slots[b]``), head ``h`` and a ``BLOCK_V`` slice of the value dim,
one program keeps its ``[K, BLOCK_V]`` fp32 state slice in registers across the chain and per
position does (docs/model.md §3.2; the engine's torch form is ``kda_ops.kda_step``)::

    S <- diag(exp g) S;   S <- S + beta k (v - S^T k)^T;   o = S^T (scale q)

Decode and verify run the same program, so a verify position and the decode of the same token
from the same state round identically. Inputs are the L2-normalised ``q, k`` and ``v``, the
log-space gate ``g`` and ``beta``, all fp32. Decode-sized launches use PDL
(:mod:`sgl_kernel.pdl`). Reference: :func:`kda_recurrent_reference`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from sgl_kernel import pdl
from sgl_kernel._triton_mode import INTERPRETED, NO_FP_FUSION, LaunchConfig, compiler_options

__all__ = ["kda_recurrent_update", "kda_recurrent_reference", "launch_config"]

# Value-dim tile and warps of the GPU launch, one pair for decode and verify alike. Under the
# interpreter every tile gives the same bits; on the GPU the tile changes the register layout
# of the state's reductions over K and with it their rounding (seen on the H200), so what keeps
# a verify position equal to the decode of the same token is that both launch with this one
# tile (test_kda_recurrent checks that at every tile on CUDA);
# ``benchmark/kernels/tune_kda_recurrent.py`` times the choices (cold L2).
BLOCK_V, NUM_WARPS = 32, 4


def launch_config(dv: int, dk: int) -> LaunchConfig:
    """The launch for a value dim ``dv`` and key dim ``dk``: ``block_n`` the value tile,
    ``block_k`` the whole key row (the state's reductions run over it) and ``num_warps``. One
    value tile and Triton's default warps under the CPU interpreter (its cost is per program),
    else :data:`BLOCK_V` / :data:`NUM_WARPS`."""
    block_k = triton.next_power_of_2(dk)
    if INTERPRETED:
        return LaunchConfig(triton.next_power_of_2(dv), block_k)
    return LaunchConfig(BLOCK_V, block_k, NUM_WARPS)


# ``N`` is not specialised: Triton would compile ``N == 1`` (decode) as its own straight-line
# program, free to schedule the arithmetic differently from the chain loop (verify).
@triton.jit(do_not_specialize=["N"])
def _kda_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, slots_ptr, state_ptr, o_ptr,
                          staged_ptr, alog_ptr, dtb_ptr, N, H, K, V, scale, lower,
                          s_qb, s_qn, s_qh, s_gb, s_gn, s_gh, s_vb, s_vn, s_vh, s_bb, s_bn,
                          s_ss, s_sh, s_sk, s_ob, s_on, s_oh, s_ts, s_tn, s_th, s_tk,
                          STAGE: tl.constexpr, RAW_GATE: tl.constexpr, SAFE_GATE: tl.constexpr,
                          USE_PDL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    if RAW_GATE:  # the layer's gate parameters: no kernel of the step writes them
        a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        dt_bias = tl.load(dtb_ptr + h * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    # Every other input (slots, state, q/k/v/g/beta) is written by an earlier kernel of the step.
    pdl.wait(USE_PDL)
    pdl.launch_dependents(USE_PDL)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    kv_off = offs_k[:, None] * s_sk + offs_v[None, :]
    state_rows = state_ptr + slot * s_ss + h * s_sh
    s = tl.load(state_rows + kv_off, mask=mask_kv, other=0.0)
    for i in range(0, N):
        qk_off = b * s_qb + i * s_qn + h * s_qh
        q = tl.load(q_ptr + qk_off + offs_k, mask=mask_k, other=0.0)
        k = tl.load(k_ptr + qk_off + offs_k, mask=mask_k, other=0.0)
        g = tl.load(g_ptr + b * s_gb + i * s_gn + h * s_gh + offs_k, mask=mask_k,
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + b * s_vb + i * s_vn + h * s_vh + offs_v, mask=mask_v, other=0.0)
        beta = tl.load(beta_ptr + b * s_bb + i * s_bn + h).to(tl.float32)
        if RAW_GATE:  # g and beta arrive as the raw projections: form them here (kda_gate)
            u = g + dt_bias
            if SAFE_GATE:
                g = lower * tl.sigmoid(a * u)
            else:  # -exp(A_log) * softplus(u), softplus linear above 20 as torch's
                g = -a * tl.where(u > 20.0, u, tl.log(1.0 + tl.exp(u)))
            beta = tl.sigmoid(beta)
        s = s * tl.exp(g)[:, None]
        pred = tl.sum(s * k[:, None], axis=0)  # [BLOCK_V]
        s = s + (beta * k)[:, None] * (v - pred)[None, :]
        o = tl.sum(s * (q * scale)[:, None], axis=0)
        tl.store(o_ptr + b * s_ob + i * s_on + h * s_oh + offs_v,
                 o.to(o_ptr.dtype.element_ty), mask=mask_v)
        if STAGE:
            tl.store(staged_ptr + slot * s_ts + i * s_tn + h * s_th + offs_k[:, None] * s_tk
                     + offs_v[None, :], s, mask=mask_kv)
    if not STAGE:
        tl.store(state_rows + kv_off, s, mask=mask_kv)


def _check(q, k, v, g, beta, state_pool, slots, raw_gate: bool):
    if q.dim() != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"kda_recurrent_update: q, k, g must be [B, N, H, K] alike, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}")
    b, n, h, dk = q.shape
    if v.dim() != 4 or v.shape[:3] != (b, n, h) or tuple(beta.shape) != (b, n, h):
        raise ValueError(f"kda_recurrent_update: v must be [{b}, {n}, {h}, V] and beta "
                         f"[{b}, {n}, {h}], got {tuple(v.shape)} and {tuple(beta.shape)}")
    dv = v.shape[3]
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (h, dk, dv):
        raise ValueError(f"kda_recurrent_update: state pool must be [S, {h}, {dk}, {dv}], got "
                         f"{tuple(state_pool.shape)}")
    if tuple(slots.shape) != (b,):
        raise ValueError(f"kda_recurrent_update: slots must be [{b}], got {tuple(slots.shape)}")
    if k.stride() != q.stride():
        raise ValueError("kda_recurrent_update: q and k must share strides (e.g. contiguous)")
    # Raw gate inputs come in the model dtype (strided views of the projection output).
    fp32 = ("q", "k", "v", "state pool") + (() if raw_gate else ("g", "beta"))
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                    ("state pool", state_pool)):
        if (name in fp32 and t.dtype != torch.float32) or not t.is_floating_point() \
                or t.stride(-1) != 1:
            raise ValueError(f"kda_recurrent_update: {name} must be {'fp32' if name in fp32 else 'float'}"
                             " with a contiguous last dim")


def kda_recurrent_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, scale: float, state_pool: torch.Tensor,
                         slots: torch.Tensor, out: torch.Tensor,
                         staged: Optional[torch.Tensor] = None,
                         block_v: Optional[int] = None,
                         gate_params: Optional[Tuple[torch.Tensor, torch.Tensor,
                                                     Optional[float]]] = None,
                         num_warps: Optional[int] = None) -> torch.Tensor:
    """Run ``N`` tokens per request from ``state_pool[slots[b]]`` (``[S, H, K, V]`` fp32).

    With ``gate_params = (A_log [H], dt_bias [H * K], lower_bound)`` the gate arrives raw: ``g``
    is the gate projection ``f`` and ``beta`` the beta projection ``b`` (model dtype, any
    strides with a contiguous last dim, e.g. views of the fused projection output), and the
    kernel forms ``g = kda_gate(f)`` and ``beta = sigmoid(b)`` as it loads them (the torch
    form is several launches per layer; values equal to fp32 rounding).

    ``q, k, g [B, N, H, K]``, ``v [B, N, H, V]``, ``beta [B, N, H]`` (fp32); outputs go to
    ``out [B, N, H, V]`` (any float dtype). With ``staged`` (``[S, >= N, H, K, V]`` fp32, the
    pool's speculative scratch) the state after position ``i`` is written to ``staged[slot, i]``
    and ``state_pool`` is only read (verify); without it the final state replaces
    ``state_pool[slot]`` (decode). ``block_v`` / ``num_warps`` override :func:`launch_config`
    (the tuning sweep). Returns ``out``.
    """
    _check(q, k, v, g, beta, state_pool, slots, gate_params is not None)
    b, n, h, dk = q.shape
    dv = v.shape[3]
    if tuple(out.shape) != (b, n, h, dv) or out.stride(-1) != 1:
        raise ValueError(f"kda_recurrent_update: out must be [{b}, {n}, {h}, {dv}] with a "
                         f"contiguous last dim, got {tuple(out.shape)}")
    if staged is not None and (staged.dim() != 5 or staged.shape[1] < n
                               or tuple(staged.shape[2:]) != (h, dk, dv)
                               or staged.dtype != torch.float32 or staged.stride(-1) != 1):
        raise ValueError(f"kda_recurrent_update: staged must be fp32 [S, >= {n}, {h}, {dk}, {dv}], "
                         f"got {tuple(staged.shape)} {staged.dtype}")
    if b == 0 or n == 0:
        return out
    cfg = launch_config(dv, dk)
    block_v = block_v or cfg.block_n
    num_warps = num_warps or cfg.num_warps
    st = staged if staged is not None else state_pool  # unused pointer when not staging
    st_strides = (st.stride(0), st.stride(1), st.stride(2), st.stride(3)) if staged is not None \
        else (0, 0, 0, 0)
    slots = slots.contiguous()  # the kernel indexes slots[b] densely (a column view is not)
    grid = (b, h, triton.cdiv(dv, block_v))
    pdl_on = pdl.use_pdl(b * n)
    if gate_params is not None:
        a_log, dt_bias, lower = gate_params
        if a_log.numel() != h or dt_bias.numel() != h * dk:
            raise ValueError(f"kda_recurrent_update: A_log must have {h} and dt_bias {h * dk} "
                             f"elements, got {a_log.numel()} and {dt_bias.numel()}")
        a_log, dt_bias = a_log.reshape(-1), dt_bias.reshape(-1)  # parameters: contiguous views
    else:
        a_log = dt_bias = g  # unused pointers
        lower = None
    _kda_recurrent_kernel[grid](
        q, k, v, g, beta, slots, state_pool, out, st, a_log, dt_bias, n, h, dk, dv, float(scale),
        float(lower or 0.0), q.stride(0), q.stride(1), q.stride(2), g.stride(0), g.stride(1),
        g.stride(2), v.stride(0), v.stride(1), v.stride(2), beta.stride(0), beta.stride(1),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        out.stride(0), out.stride(1), out.stride(2), *st_strides,
        STAGE=staged is not None, RAW_GATE=gate_params is not None, SAFE_GATE=lower is not None,
        USE_PDL=pdl_on, BLOCK_K=cfg.block_k,
        BLOCK_V=block_v, **pdl.launch_options(pdl_on), **compiler_options(num_warps, None),
        # No mul+add contraction: the decode and verify programs differ in their stores, and a
        # contraction the compiler picks in one and not the other broke their bit equality on
        # the GPU (equal only to a tolerance: docs/performance.md, "Triton kernels (opt-in)").
        # The kernel is bound by the state's bytes, not by its arithmetic.
        **NO_FP_FUSION)
    return out


def _kda_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
              lower: Optional[float]) -> torch.Tensor:
    """Log-space decay ``g [.., H, K]`` (fp32) from the raw gate projection ``f [.., H, K]``:
    ``lower * sigmoid(exp(A_log) * (f + dt_bias))`` with a bound, else
    ``-exp(A_log) * softplus(f + dt_bias)`` (``dt_bias [H * K]``)."""
    h, d = f.shape[-2:]
    u = f.float() + dt_bias.float().view(h, d)
    a = a_log.float().exp().view(h, 1)
    if lower is not None:
        return lower * torch.sigmoid(a * u)
    return -a * torch.nn.functional.softplus(u)


def kda_recurrent_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            g: torch.Tensor, beta: torch.Tensor, scale: float,
                            state_pool: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                            staged: Optional[torch.Tensor] = None,
                            gate_params: Optional[Tuple[torch.Tensor, torch.Tensor,
                                                        Optional[float]]] = None
                            ) -> torch.Tensor:
    """Plain-torch :func:`kda_recurrent_update`, the module docstring's step per position
    (``S <- diag(exp g) S; S <- S + beta k (v - S^T k)^T; o = S^T (scale q)``, fp32); raw gate
    inputs formed by :func:`_kda_gate` and a sigmoid. Same arguments and effects."""
    if gate_params is not None:
        g = _kda_gate(g, *gate_params)
        beta = torch.sigmoid(beta.float())
    rows = slots.long()
    state = state_pool[rows]
    for i in range(q.shape[1]):
        state = state * g[:, i].exp().unsqueeze(-1)
        pred = torch.einsum("bhk,bhkv->bhv", k[:, i], state)
        write = (beta[:, i].unsqueeze(-1) * k[:, i]).unsqueeze(-1)
        state = state + write * (v[:, i] - pred).unsqueeze(-2)
        out[:, i] = torch.einsum("bhk,bhkv->bhv", q[:, i] * scale, state).to(out.dtype)
        if staged is not None:
            staged[rows, i] = state
    if staged is None:
        state_pool[rows] = state
    return out
