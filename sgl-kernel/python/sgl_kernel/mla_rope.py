"""MLA's query and key assembled with RoPE in one launch: ``q = [q_latent ‖ rope(q_rope)]`` per
head and ``k = [latent ‖ rope(k_rope)]`` per token, read at each token's position from the
cos / sin table of ``sglang.srt.layers.rotary_embedding.RotaryEmbedding`` (``[n, rotary_dim]``
= cos half ‖ sin half, fp32).

The torch form (table gather, fp32 upcast, four products, two sums, stack or cat, rounding, then
two concatenations) is about twenty small kernels per MLA layer; here it is one. The rotation
is the same fp32 arithmetic with the same roundings (no multiply-add contraction), so the
result is bit-equal to :func:`mla_rope_reference`. Interleaved (GPT-J) pairs ``(2i, 2i+1)`` or
neox pairs ``(i, i + d/2)`` rotate with frequency ``i``.
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from sgl_kernel import pdl
from sgl_kernel._triton_mode import NO_FP_FUSION

__all__ = ["mla_rope_assemble", "mla_rope_reference"]

BLOCK_H = 8  # heads per program


@triton.jit
def _rotate(x_ptrs_even, x_ptrs_odd, cos, sin, mask, out_even, out_odd):
    # One rotation plane per (even, odd) pair of channels, in fp32, rounded once to the output.
    x1 = tl.load(x_ptrs_even, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs_odd, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_even, (x1 * cos - x2 * sin).to(out_even.dtype.element_ty), mask=mask)
    tl.store(out_odd, (x2 * cos + x1 * sin).to(out_odd.dtype.element_ty), mask=mask)


@triton.jit
def _mla_rope_kernel(pos_ptr, cs_ptr, ql_ptr, qr_ptr, lat_ptr, kr_ptr, q_ptr, k_ptr, H, RQ, RK,
                     D, s_qlt, s_qlh, s_qrt, s_qrh, s_lt, s_krt, s_qt, s_qh, s_kt,
                     NEOX: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_RQ: tl.constexpr, BLOCK_RK: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_RQ)
    offs_i = tl.arange(0, HALF)
    mask_h, mask_r, mask_i = offs_h < H, offs_r < RQ, offs_i < D // 2
    pdl.wait(USE_PDL)  # every input comes from the kernels before
    pdl.launch_dependents(USE_PDL)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * D + offs_i, mask=mask_i, other=0.0)
    sin = tl.load(cs_ptr + pos * D + D // 2 + offs_i, mask=mask_i, other=0.0)
    if NEOX:
        lo, hi = offs_i, offs_i + D // 2
    else:
        lo, hi = 2 * offs_i, 2 * offs_i + 1
    # The query: each head's latent part copied, its rope part rotated.
    t64 = t.to(tl.int64)
    h64 = offs_h.to(tl.int64)
    m_hr = mask_h[:, None] & mask_r[None, :]
    ql = tl.load(ql_ptr + t64 * s_qlt + h64[:, None] * s_qlh + offs_r[None, :], mask=m_hr)
    q_rows = q_ptr + t64 * s_qt + h64[:, None] * s_qh
    tl.store(q_rows + offs_r[None, :], ql.to(q_ptr.dtype.element_ty), mask=m_hr)
    qr_rows = qr_ptr + t64 * s_qrt + h64[:, None] * s_qrh
    m_hi = mask_h[:, None] & mask_i[None, :]
    _rotate(qr_rows + lo[None, :], qr_rows + hi[None, :], cos[None, :], sin[None, :], m_hi,
            q_rows + RQ + lo[None, :], q_rows + RQ + hi[None, :])
    if tl.program_id(1) == 0:  # the key once per token: the normed latent, its rope part
        offs_k = tl.arange(0, BLOCK_RK)
        mask_k = offs_k < RK
        k_row = k_ptr + t64 * s_kt
        lat = tl.load(lat_ptr + t64 * s_lt + offs_k, mask=mask_k)
        tl.store(k_row + offs_k, lat.to(k_ptr.dtype.element_ty), mask=mask_k)
        kr_row = kr_ptr + t64 * s_krt
        _rotate(kr_row + lo, kr_row + hi, cos, sin, mask_i, k_row + RK + lo, k_row + RK + hi)


def mla_rope_assemble(positions: torch.Tensor, cos_sin: torch.Tensor, q_latent: torch.Tensor,
                      q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                      neox: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, H, Rq + D], k [T, Rk + D])`` from ``q_latent [T, H, Rq]``, ``q_rope [T, H, D]``,
    ``latent [T, Rk]``, ``k_rope [T, D]`` (last dims contiguous, any other strides), the
    positions ``[T]`` and the fp32 table ``cos_sin [n, D]`` (rows past the largest position);
    outputs in q_latent's / latent's dtypes, as ``torch.cat`` gives them. The absorbed form
    has ``Rq = Rk`` (the latent rank); the normal form (prefill) puts the per-head
    ``q_nope`` (``Rq = qk_nope_head_dim``) beside the latent cache row (``Rk = kv_lora_rank``)."""
    t, h, r = q_latent.shape
    d = q_rope.shape[-1]
    rk = latent.shape[-1] if latent.dim() == 2 else -1
    if (tuple(q_rope.shape) != (t, h, d) or tuple(latent.shape) != (t, rk)
            or tuple(k_rope.shape) != (t, d) or tuple(positions.shape) != (t,) or d % 2
            or cos_sin.dim() != 2 or cos_sin.shape[1] != d or cos_sin.dtype != torch.float32):
        raise ValueError(f"mla_rope_assemble: expected q_latent [T, H, Rq], q_rope [T, H, D], "
                         f"latent [T, Rk], k_rope [T, D], positions [T], an fp32 [n, D] table "
                         f"with D even; got {tuple(q_latent.shape)}, {tuple(q_rope.shape)}, "
                         f"{tuple(latent.shape)}, {tuple(k_rope.shape)}, "
                         f"{tuple(positions.shape)}, {cos_sin.dtype} {tuple(cos_sin.shape)}")
    if any(x.stride(-1) != 1 for x in (q_latent, q_rope, latent, k_rope)) or \
            not cos_sin.is_contiguous():
        raise ValueError("mla_rope_assemble: inputs need contiguous last dims")
    q = torch.empty(t, h, r + d, dtype=torch.promote_types(q_latent.dtype, q_rope.dtype),
                    device=q_latent.device)
    k = torch.empty(t, rk + d, dtype=torch.promote_types(latent.dtype, k_rope.dtype),
                    device=latent.device)
    if t == 0:
        return q, k
    pdl_on = pdl.use_pdl(t)
    _mla_rope_kernel[(t, triton.cdiv(h, BLOCK_H))](
        positions, cos_sin, q_latent, q_rope, latent, k_rope, q, k, h, r, rk, d,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        latent.stride(0), k_rope.stride(0), q.stride(0), q.stride(1), k.stride(0),
        NEOX=neox, USE_PDL=pdl_on, BLOCK_H=BLOCK_H, BLOCK_RQ=triton.next_power_of_2(r),
        BLOCK_RK=triton.next_power_of_2(rk),
        HALF=triton.next_power_of_2(d // 2), **NO_FP_FUSION, **pdl.launch_options(pdl_on))
    return q, k


def mla_rope_reference(positions: torch.Tensor, rope, q_latent: torch.Tensor,
                       q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The torch form: ``rope`` (a ``RotaryEmbedding``) on the rope parts, then the
    concatenations."""
    q_rope, k_rope = rope(positions, q_rope, k_rope)
    return torch.cat([q_latent, q_rope], dim=-1), torch.cat([latent, k_rope], dim=-1)
