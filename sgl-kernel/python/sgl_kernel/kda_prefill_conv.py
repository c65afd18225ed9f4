"""KDA's short convolution over one request's prefill (or chunk of one), in one launch.

For the ``T`` new tokens of a request and every channel ``c`` of the ``[q | k | v]``
projections, as :func:`sglang.srt.layers.attention.kda_ops.causal_conv1d` computes them::

    u = [window (K-1 values from the pool slot, oldest first), x_0 .. x_{T-1}]
    y_t = silu(sum_j w_j * u_{t+j})              (fp32, rounded once to x's dtype)
    window <- u_T .. u_{T+K-2}                   (the last K-1 of u, so T < K-1 works too)

The torch path spends about a dozen launches on full ``[T, 3C]`` fp32 temporaries (the cast and
concatenation with the window, a product and a sum per tap, SiLU, the cast back, the window
copy); here each program reads its ``[BLOCK_T, BLOCK_C]`` tile of ``x`` (and the ``K-1`` rows
before it) once from memory and writes ``y`` once.

Rounding. The taps are summed as the reference sums them: from zero, ``acc += u * w`` for
``j = 0 .. K-1``, each product rounded before its add (mul+add contraction is off), so the
pre-activation is bit-equal to the torch path's. SiLU is ``acc / (1 + exp(-acc))`` with an
IEEE-rounded division, the formula torch's SiLU kernels use; on the GPU ``exp`` is libdevice's
``expf`` (the function torch's CUDA SiLU calls), under the interpreter numpy's. Torch's CPU SiLU
uses its own vectorised ``exp``, so against the CPU reference fp32 results may differ in the
last bit; the rounding to fp16 / bf16 hides that almost always.

Head and body. Only the first ``K-1`` tokens read the window. Every program computes its tile's
rows from ``K-1`` on with ``x`` loads alone (the body); the programs of token block 0 also
compute the ``K-1`` head rows as a small ``[BLOCK_W, BLOCK_C]`` tile whose taps read the window
or ``x``. Window loads in the body tile (one more pointer tensor per tap, masked off outside
block 0) took the kernel to 255 registers with 1.5 KB of spills per thread at the 32 x 256
tile, compiled for sm_90 (``ptxas -v``), where the bytes alone need a tenth of the time the
census measured (docs/performance.md, "Prefill census").

Heads' L2 norm (``l2norm_head_dim``). KDA's q and k go into the chunked recurrence L2-normalised
per head; fla's ``chunk_kda`` can do that itself (``use_qk_l2norm_in_kernel``), as one more
launch per operand that reads and writes the whole plane again. Here it happens on the tile
before the store: each head's values are rounded to the output dtype (the conv's output as it
would be stored), then scaled by ``1 / sqrt(sum(x^2) + eps)`` in fp32, fla's formula, and
rounded once more. A channel block then spans whole heads.

Window ordering (no second launch). Token blocks are at least ``K-1`` tokens tall, so only the
programs of token block 0 read the window, each for its own channel block. That program also
writes the new window for its channels: it first loads the ``K-1`` new entries (from ``x`` or,
when ``T < K-1``, from the old window), then waits at a CTA barrier until all of its threads
have done every read of the old window, then stores. No other program touches those channels'
window, so nothing else can race with the write.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from sgl_kernel._triton_mode import INTERPRETED, NO_FP_FUSION, compiler_options

__all__ = ["kda_prefill_conv", "REFERENCE_NOTE"]

REFERENCE_NOTE = ("reference: sglang.srt.layers.attention.kda_ops.causal_conv1d (the engine's "
                  "prefill conv, summed in the same tap order), compared in "
                  "test/kernels/test_kda_prefill_conv.py")

# Tiles: on the GPU 16 tokens x 256 channels over 8 warps, the fastest of
# benchmark/kernels/tune_kda_prefill_conv.py's sweep on a 4096-channel plane (docs/performance.md,
# "KDA's q / k L2 norm inside the prefill conv"); with the heads' L2 norm, one head per block (a
# row reduction instead of a reshaped tile's) over 4 warps. The interpreter pays per program and
# per op, and tests run small widths there.
_BLOCK_T = 16
_BLOCK_C = 64 if INTERPRETED else 256
_NUM_WARPS = 8
_NORM_WARPS = 4


@triton.jit
def _conv_silu(acc, PRECISE_EXP: tl.constexpr):
    """SiLU as torch writes it: ``x / (1 + exp(-x))``, the division rounded to nearest."""
    if PRECISE_EXP:
        e = libdevice.exp(-acc)
    else:
        e = tl.exp(-acc)
    return tl.div_rn(acc, 1.0 + e)


@triton.jit
def _heads_l2norm(y, eps, ROWS: tl.constexpr, BLOCK_C: tl.constexpr, NORM_D: tl.constexpr,
                  OUT_DT: tl.constexpr):
    """Each ``NORM_D``-wide head of the tile's rows scaled to unit L2 norm, as fla's
    ``l2norm_fwd`` does it to the rounded conv output: ``x * (1 / sqrt(sum(x^2) + eps))`` in
    fp32 on ``x`` rounded to the output dtype (the block's channels are whole heads)."""
    x = y.to(OUT_DT).to(tl.float32)
    if BLOCK_C == NORM_D:  # one head per block: a row reduction, no layout change
        return x * (1 / tl.sqrt(tl.sum(x * x, axis=1) + eps))[:, None]
    x = tl.reshape(x, [ROWS, BLOCK_C // NORM_D, NORM_D])
    rstd = 1 / tl.sqrt(tl.sum(x * x, axis=2) + eps)
    return tl.reshape(x * rstd[:, :, None], [ROWS, BLOCK_C])


# T only bounds masks: one compiled variant for every prefill length (no T == 1 or T % 16 ones).
@triton.jit(do_not_specialize=["T"])
def _kda_prefill_conv_kernel(x_ptr, w_ptr, win_ptr, y_ptr, T, C, eps,
                             s_xt, s_wc, s_wk, s_vc, s_vk, s_yt,
                             KW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                             BLOCK_W: tl.constexpr, PRECISE_EXP: tl.constexpr,
                             NORM_D: tl.constexpr):
    pid_t = tl.program_id(0)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # output tokens of this block
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < C
    rmask = rows < T
    # The body: rows from K-1 on, whose taps all read x (no window loads: those, with their
    # own pointer tensors, doubled the registers and made the tile spill).
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KW):
        xr = rows + j - (KW - 1)
        xv = tl.load(x_ptr + xr.to(tl.int64)[:, None] * s_xt + ch[None, :],
                     mask=((xr >= 0) & rmask)[:, None] & cmask[None, :], other=0.0)
        tap = tl.load(w_ptr + ch * s_wc + j * s_wk, mask=cmask, other=0.0).to(tl.float32)
        acc += xv.to(tl.float32) * tap[None, :]
    y = _conv_silu(acc, PRECISE_EXP)
    if NORM_D > 0:
        y = _heads_l2norm(y, eps, BLOCK_T, BLOCK_C, NORM_D, y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * s_yt + ch[None, :],
             y.to(y_ptr.dtype.element_ty),
             mask=(rmask & (rows >= KW - 1))[:, None] & cmask[None, :])
    if KW > 1:
        if pid_t == 0:  # the head rows (before K-1) and the only reader of the window
            i = tl.arange(0, BLOCK_W)
            hmask = (i < KW - 1) & (i < T)
            win_ch = win_ptr + ch.to(tl.int64)[None, :] * s_vc
            acc_h = tl.zeros([BLOCK_W, BLOCK_C], dtype=tl.float32)
            for j in tl.static_range(KW):
                u = i + j  # index into window ‖ x: below KW-1 it is a window entry
                hr = u - (KW - 1)
                from_x = (hr >= 0)[:, None]
                m = hmask[:, None] & cmask[None, :]
                hxv = tl.load(x_ptr + hr.to(tl.int64)[:, None] * s_xt + ch[None, :],
                              mask=from_x & m, other=0.0)
                hwv = tl.load(win_ch + u[:, None] * s_vk, mask=(hr < 0)[:, None] & m, other=0.0)
                htap = tl.load(w_ptr + ch * s_wc + j * s_wk, mask=cmask, other=0.0).to(tl.float32)
                acc_h += tl.where(from_x, hxv.to(tl.float32), hwv.to(tl.float32)) * htap[None, :]
            y_h = _conv_silu(acc_h, PRECISE_EXP)
            if NORM_D > 0:
                y_h = _heads_l2norm(y_h, eps, BLOCK_W, BLOCK_C, NORM_D, y_ptr.dtype.element_ty)
            tl.store(y_ptr + i.to(tl.int64)[:, None] * s_yt + ch[None, :],
                     y_h.to(y_ptr.dtype.element_ty), mask=hmask[:, None] & cmask[None, :])
            # The new window: entry i takes u[T + i].
            src = T + i
            wr = src - (KW - 1)
            w_from_x = (wr >= 0)[:, None]
            wmask = (i < KW - 1)[:, None] & cmask[None, :]
            wxv = tl.load(x_ptr + wr.to(tl.int64)[:, None] * s_xt + ch[None, :],
                          mask=w_from_x & wmask, other=0.0)
            ov = tl.load(win_ch + src[:, None] * s_vk, mask=(wr < 0)[:, None] & wmask, other=0.0)
            # Through x's dtype, as the reference returns the window before the pool copy.
            new = tl.where(w_from_x, wxv.to(tl.float32), ov.to(tl.float32))
            new = new.to(x_ptr.dtype.element_ty).to(win_ptr.dtype.element_ty)
            # Every thread of this program has read the old window (the head's taps, entries
            # kept when T < K-1 just now) before any thread overwrites it.
            tl.debug_barrier()
            tl.store(win_ch + i[:, None] * s_vk, new, mask=wmask)


def kda_prefill_conv(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor,
                     out: Optional[torch.Tensor] = None, block_t: Optional[int] = None,
                     block_c: Optional[int] = None, num_warps: Optional[int] = None,
                     l2norm_head_dim: Optional[int] = None,
                     l2norm_eps: float = 1e-6) -> torch.Tensor:
    """Causal depthwise conv + SiLU of one request's ``T`` new tokens, in one launch.

    ``x [T, Cx]`` (rows may be strided, the last dim must be contiguous: e.g. a column block of
    the fused projection output), ``weight [Cx, K]`` (index ``K-1`` multiplies the current
    token), ``window [Cx, K-1]`` the request's pool slot (the previous ``K-1`` inputs, oldest
    first): read, then overwritten in place with the last ``K-1`` inputs of ``window ‖ x``,
    rounded through x's dtype into the window's. Returns ``y [T, Cx]`` in x's dtype, written
    into ``out`` when given (same shape and dtype, last dim contiguous). ``T == 0`` launches
    nothing and leaves the window as it is. ``block_t`` / ``block_c`` / ``num_warps`` override
    the tile (rounded up to powers of two; ``block_t`` to at least ``K-1``) and the warps, for
    ``benchmark/kernels/tune_kda_prefill_conv.py``. ``l2norm_head_dim`` (a power of two
    dividing ``Cx``): every head of that many channels of ``y`` is L2-normalised before the
    store (module docstring, "Heads' L2 norm"). No host synchronisation.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"kda_prefill_conv: x must be [T, Cx] with a contiguous last dim, got "
                         f"shape {tuple(x.shape)} strides {tuple(x.stride())}")
    t, c = x.shape
    if weight.dim() != 2 or weight.shape[0] != c or weight.shape[1] < 1:
        raise ValueError(f"kda_prefill_conv: weight must be [{c}, K], got {tuple(weight.shape)}")
    kw = weight.shape[1]
    if tuple(window.shape) != (c, kw - 1):
        raise ValueError(f"kda_prefill_conv: window must be [{c}, {kw - 1}], got "
                         f"{tuple(window.shape)}")
    if out is None:
        out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (t, c) or out.dtype != x.dtype or (t and out.stride(1) != 1):
        raise ValueError(f"kda_prefill_conv: out must be [{t}, {c}] {x.dtype} with a contiguous "
                         f"last dim, got {tuple(out.shape)} {out.dtype}")
    if not (x.device == weight.device == window.device == out.device):
        raise ValueError("kda_prefill_conv: x, weight, window and out must share a device")
    norm_d = l2norm_head_dim or 0
    if norm_d and (norm_d & (norm_d - 1) or c % norm_d):
        raise ValueError(f"kda_prefill_conv: l2norm_head_dim must be a power of two dividing "
                         f"{c} channels, got {l2norm_head_dim}")
    if t == 0 or c == 0:
        return out
    bt = triton.next_power_of_2(max(block_t or _BLOCK_T, kw - 1, 1))
    # A channel block holds whole heads when they are normalised (by default exactly one).
    bc = max(triton.next_power_of_2(block_c or (norm_d or min(_BLOCK_C, c))), norm_d)
    warps = num_warps or (_NORM_WARPS if norm_d and not INTERPRETED else _NUM_WARPS)
    grid = (triton.cdiv(t, bt), triton.cdiv(c, bc))
    _kda_prefill_conv_kernel[grid](
        x, weight, window, out, t, c, l2norm_eps, x.stride(0), weight.stride(0), weight.stride(1),
        window.stride(0), window.stride(1), out.stride(0), KW=kw, BLOCK_T=bt, BLOCK_C=bc,
        BLOCK_W=triton.next_power_of_2(max(kw - 1, 1)), PRECISE_EXP=not INTERPRETED,
        NORM_D=norm_d,
        **NO_FP_FUSION, **compiler_options(warps, None))
    return out
