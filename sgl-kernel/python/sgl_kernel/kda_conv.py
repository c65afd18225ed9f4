"""KDA's short convolution and head split for decode and NEXTN verify, in one kernel: the
prologue of :mod:`sgl_kernel.kda_recurrent`.

For ``N`` tokens per request (decode: 1; verify: the chain) and every channel ``c`` of the
``[q | k | v]`` projections (``3 * H * D``), as
:func:`sglang.srt.layers.attention.kda_ops.causal_conv1d_chain` and the backend's head split::

    u = [window (K-1 values from the pool slot), x_0 .. x_{N-1}]
    y_i = silu(sum_j w_j * u_{i+j})          (fp32, rounded to x's dtype as the torch path is)
    q, k = y / sqrt(sum_D y^2 + 1e-6) per head;  v = y           (fp32 outputs)

The window after position ``i`` (``u_{i+1} .. u_{i+K-1}``) goes to ``staged[slot, i]`` (verify)
or, after the last position, back to the pool slot (decode). One program per (request, head,
q/k/v) block of ``D`` channels. The torch path is over a dozen kernels per KDA layer (casts, products, sum, silu,
copies, two L2 norms, the window write). Decode and verify run the same program: ``N``
is not specialised and mul+add contraction is off, so a verify position rounds as the decode of
that token does. (Under Triton's interpreter a program takes all blocks of its request.)
Decode-sized launches use PDL (:mod:`sgl_kernel.pdl`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from sgl_kernel import pdl
from sgl_kernel._triton_mode import INTERPRETED, NO_FP_FUSION

__all__ = ["kda_conv_qkv", "REFERENCE_NOTE"]

# No torch reference in this package: the math is the engine's own decode conv
# (kda_ops.causal_conv1d_chain, then the head split and l2norm), which test/kernels/test_kda_conv.py
# compares against; a copy here would only restate that engine code.
REFERENCE_NOTE = ("reference: sglang.srt.layers.attention.kda_ops.causal_conv1d_chain / "
                  "causal_conv1d_update + l2norm, compared in test/kernels/test_kda_conv.py")


@triton.jit(do_not_specialize=["N"])
def _kda_conv_kernel(x_ptr, w_ptr, pool_ptr, slots_ptr, out_ptr, staged_ptr, N, H, D,
                     s_xb, s_xn, s_wc, s_ps, s_pc, s_ob, s_on, s_ow, s_oh,
                     s_ts, s_tn, s_tc, eps,
                     KW: tl.constexpr, STAGE: tl.constexpr, USE_PDL: tl.constexpr,
                     BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    b = tl.program_id(0)
    blk = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # channel blocks: which * H + head
    which = (blk // H)[:, None]
    head = (blk % H)[:, None]
    offs = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs < D) & (blk < 3 * H)[:, None]
    ch = blk[:, None] * D + offs  # [ROWS, BLOCK_D] channels in [q | k | v]
    # Slots, projections and windows all come from earlier kernels; the conv weight is read
    # per tap inside the chain loop, so it waits too.
    pdl.wait(USE_PDL)
    pdl.launch_dependents(USE_PDL)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    win = pool_ptr + slot * s_ps + ch.to(tl.int64) * s_pc
    xrow = x_ptr + b.to(tl.int64) * s_xb + ch
    for i in range(0, N):
        acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        for tap in tl.static_range(KW):
            u = i + tap  # index into [window, x_0 .. x_{N-1}]
            from_win = u < KW - 1
            wv = tl.load(win + u, mask=mask & from_win, other=0.0).to(tl.float32)
            xv = tl.load(xrow + (u - (KW - 1)) * s_xn, mask=mask & (u >= KW - 1),
                         other=0.0).to(tl.float32)
            wt = tl.load(w_ptr + ch * s_wc + tap, mask=mask, other=0.0).to(tl.float32)
            acc += tl.where(from_win, wv, xv) * wt
        y = acc * tl.sigmoid(acc)
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # the torch path's rounding
        y = tl.where(which < 2, y * tl.rsqrt(tl.sum(y * y, axis=1)[:, None] + eps), y)  # q, k
        tl.store(out_ptr + b.to(tl.int64) * s_ob + i * s_on + which * s_ow + head * s_oh + offs,
                 y, mask=mask)
        if STAGE:  # the window after position i: u[i+1 .. i+KW-1]
            dst = staged_ptr + slot * s_ts + i * s_tn + ch.to(tl.int64) * s_tc
            for t in tl.static_range(KW - 1):
                u = i + 1 + t
                from_win = u < KW - 1
                wv = tl.load(win + u, mask=mask & from_win, other=0.0)
                xv = tl.load(xrow + (u - (KW - 1)) * s_xn, mask=mask & (u >= KW - 1), other=0.0)
                tl.store(dst + t, tl.where(from_win, wv.to(tl.float32), xv.to(tl.float32))
                         .to(staged_ptr.dtype.element_ty), mask=mask)
    if not STAGE:  # decode: the window after the last position replaces the pool's
        # Entry t takes u[N + t]; in ascending t that entry of the old window (N + t > t) is
        # read before any write reaches it (each channel is one thread's, in program order).
        for t in tl.static_range(KW - 1):
            u = N + t
            from_win = u < KW - 1
            wv = tl.load(win + u, mask=mask & from_win, other=0.0)
            xv = tl.load(xrow + (u - (KW - 1)) * s_xn, mask=mask & (u >= KW - 1), other=0.0)
            tl.store(win + t, tl.where(from_win, wv.to(tl.float32), xv.to(tl.float32))
                     .to(pool_ptr.dtype.element_ty), mask=mask)


def kda_conv_qkv(mixed: torch.Tensor, conv_weight: torch.Tensor, conv_pool: torch.Tensor,
                 slots: torch.Tensor, num_heads: int, head_dim: int,
                 staged: Optional[torch.Tensor] = None, rows: Optional[int] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)``, each fp32 contiguous ``[B, N, H, D]`` (q and k L2-normalised),
    from ``mixed [B, N, 3HD]`` (the q/k/v projections, model dtype), ``conv_weight [3HD, K]``
    and ``conv_pool [S, 3HD, K-1]`` read at ``slots [B]``. Without ``staged`` the pool slot gets
    the window after the last token (decode); with ``staged [S, >= N, 3HD, K-1]`` the window
    after each position ``i`` goes to ``staged[slot, i]`` and the pool is only read (verify).
    ``rows`` (a power of two): ``D``-channel blocks per program (default 1 on the GPU, all of a
    request's under the interpreter).
    """
    if mixed.dim() != 3:
        raise ValueError(f"kda_conv_qkv: mixed must be [B, N, 3HD], got {tuple(mixed.shape)}")
    b, n, c3 = mixed.shape
    if c3 != 3 * num_heads * head_dim or mixed.stride(2) != 1:
        raise ValueError(f"kda_conv_qkv: mixed's last dim must be contiguous 3 * {num_heads} * "
                         f"{head_dim}, got {c3}")
    kw = conv_weight.shape[-1]
    if tuple(conv_weight.shape) != (c3, kw) or conv_weight.stride(1) != 1:
        raise ValueError(f"kda_conv_qkv: conv_weight must be [{c3}, K] with unit last stride, "
                         f"got {tuple(conv_weight.shape)}")
    if conv_pool.dim() != 3 or tuple(conv_pool.shape[1:]) != (c3, kw - 1) \
            or conv_pool.stride(2) != 1:
        raise ValueError(f"kda_conv_qkv: conv_pool must be [S, {c3}, {kw - 1}], got "
                         f"{tuple(conv_pool.shape)}")
    if tuple(slots.shape) != (b,):
        raise ValueError(f"kda_conv_qkv: slots must be [{b}], got {tuple(slots.shape)}")
    if staged is not None and (staged.dim() != 4 or staged.shape[1] < n
                               or tuple(staged.shape[2:]) != (c3, kw - 1)
                               or staged.stride(3) != 1):
        raise ValueError(f"kda_conv_qkv: staged must be [S, >= {n}, {c3}, {kw - 1}], got "
                         f"{tuple(staged.shape)}")
    # [q | k | v] outermost: each of q, k, v is a contiguous [B, N, H, D] block, strided like
    # the gate g that kda_recurrent_update takes beside them.
    out = torch.empty(3, b, n, num_heads, head_dim, dtype=torch.float32, device=mixed.device)
    if b and n:
        st = staged if staged is not None else conv_pool  # unused pointer when not staging
        st_strides = (st.stride(0), st.stride(1), st.stride(2)) if staged is not None \
            else (0, 0, 0)
        # One (head, q/k/v) block per program on the GPU; the interpreter's cost is per program
        # and per op, so there one program takes every block of its request.
        if rows is None:
            rows = triton.next_power_of_2(3 * num_heads) if INTERPRETED else 1
        pdl_on = pdl.use_pdl(b * n)
        _kda_conv_kernel[(b, triton.cdiv(3 * num_heads, rows))](
            mixed, conv_weight, conv_pool, slots.contiguous(), out, st, n, num_heads, head_dim,
            mixed.stride(0), mixed.stride(1), conv_weight.stride(0), conv_pool.stride(0),
            conv_pool.stride(1), out.stride(1), out.stride(2), out.stride(0), out.stride(3),
            *st_strides, 1e-6, KW=kw, STAGE=staged is not None, USE_PDL=pdl_on,
            BLOCK_D=triton.next_power_of_2(head_dim), ROWS=rows, **NO_FP_FUSION,
            **pdl.launch_options(pdl_on))
    return out[0], out[1], out[2]
