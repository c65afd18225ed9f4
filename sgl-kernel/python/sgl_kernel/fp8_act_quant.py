"""Activations to fp8 per token and 128-column group: the "a8" of the block-fp8 w8a8 GEMMs.

``x [M, K]`` (bf16 / fp16 / fp32) becomes ``q [M, K]`` in ``float8_e4m3fn`` and one fp32 scale
per row and group of ``group_size`` columns, ``scale [M, ceil(K / group_size)]``: the real value
is ``q * scale[m, k // group_size]``. The rule is the weights' (:mod:`sgl_kernel.fp8_blocks`)
on a ``1 x group_size`` block: ``scale = amax / 448`` (1 for an all-zero group, so nothing
divides by zero) and ``q = x / scale`` (an IEEE-rounded division) clamped to +-448 and cast to
e4m3 rounding to nearest even. This is the layout the published fp8 checkpoints'
``activation_scheme: "dynamic"`` asks for: with the weight's 128 x 128 blocks, a 128-column
slice of a GEMM's K loop has one activation scale per row and one weight scale per output
column, so its fp8 tensor-core sum is scaled by their outer product.

:func:`per_token_group_quant_fp8` is one Triton launch (one program per block of rows and
group); :func:`per_token_group_quant_fp8_reference` is the plain torch rule the tests hold it
to; the two agree bit for bit. Triton 3.6's CPU interpreter misrounds an fp32 -> e4m3 cast
(124.3 became 64: the rounding's carry into the exponent is lost), so under the interpreter the
kernel first rounds to the e4m3 grid in fp32 arithmetic (:func:`_round_to_e4m3_grid`) and the
cast only converts; compiled, the hardware's cast rounds to nearest even itself.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from sgl_kernel._triton_mode import INTERPRETED, compiler_options
from sgl_kernel.fp8_blocks import FP8_MAX, QBLOCK

__all__ = ["per_token_group_quant_fp8", "per_token_group_quant_fp8_reference",
           "group_dequantize", "quantize_groups"]

# Rows per program: a 16 x 128 tile is 2048 values, 16 per thread at 4 warps. The
# interpreter pays per program, so it takes taller blocks.
_BLOCK_M = 64 if INTERPRETED else 16


@triton.jit
def _round_to_e4m3_grid(v):
    """``v`` (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32: adding
    ``2^(e + 20)`` for ``|v|`` in ``[2^e, 2^(e+1))`` leaves an fp32 whose last place is
    ``2^(e - 3)``, e4m3's step there (``2^-9`` below the normal range, ``e = -6``); the IEEE
    addition rounds, the subtraction is exact. For the interpreter, whose own cast misrounds."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    big = ((e + 20 + 127) << 23).to(tl.float32, bitcast=True)
    big = tl.where(v < 0, -big, big)
    return (v + big) - big


@triton.jit
def quantize_groups(x, FMAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """The module's rule on a tile ``x [rows, group]`` (fp32; columns past the data must be 0):
    ``(q [rows, group] fp32, exactly an e4m3 value when ROUND_IN_FP32 or after the caller's
    cast, scale [rows])``. Shared by this module's kernel and the grouped MoE GEMM's fp8
    epilogue, so both quantise alike."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, tl.div_rn(amax, FMAX), 1.0)
    q = tl.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -FMAX), FMAX)
    if ROUND_IN_FP32:  # then the caller's cast is exact
        q = _round_to_e4m3_grid(q)
    return q, scale


@triton.jit(do_not_specialize=["M"])
def _per_token_group_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_s,
                                  stride_sg,
                                  FMAX: tl.constexpr, GROUP: tl.constexpr,
                                  BLOCK_M: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    q, scale = quantize_groups(x, FMAX, ROUND_IN_FP32)
    tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :],
             q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows64 * stride_s + group * stride_sg, scale, mask=rows < M)


def _check(x: torch.Tensor, group_size: int) -> None:
    if x.dim() != 2 or (x.numel() and x.stride(1) != 1):
        raise ValueError(f"per_token_group_quant_fp8: x must be [M, K] with a contiguous last "
                         f"dim, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"per_token_group_quant_fp8: x must be bf16, fp16 or fp32, got "
                         f"{x.dtype}")
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"per_token_group_quant_fp8: group_size must be a power of two >= 16, "
                         f"got {group_size}")


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = QBLOCK,
                              out: Optional[torch.Tensor] = None,
                              out_scale: Optional[torch.Tensor] = None,
                              block_m: Optional[int] = None, num_warps: int = 4
                              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn [M, K], scale fp32 [M, ceil(K / group_size)])`` of ``x [M, K]`` by the
    module's rule, in one launch, no host sync (capturable in a CUDA graph). ``out`` /
    ``out_scale`` receive the results when given (shapes and dtypes as returned; ``out``
    row-major, ``out_scale`` any strides: an outer-dim-major one, stride ``(1, M')``, is the
    layout the library's block-scaled GEMM reads, written without a transposing copy).
    ``block_m`` (rows per program, a power of two; default the module's) and ``num_warps``
    change only the tiling (``benchmark/kernels/tune_fp8_act_quant.py`` times them): every row
    and group is quantised alone, so the results are the same bits."""
    _check(x, group_size)
    block_m = _BLOCK_M if block_m is None else block_m
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"per_token_group_quant_fp8: block_m must be a power of two, got "
                         f"{block_m}")
    m, k = x.shape
    groups = -(-k // group_size)
    if out is None:
        out = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    if out_scale is None:
        out_scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if (tuple(out.shape) != (m, k) or out.dtype != torch.float8_e4m3fn
            or tuple(out_scale.shape) != (m, groups) or out_scale.dtype != torch.float32
            or (out.numel() and out.stride(1) != 1)):
        raise ValueError(f"per_token_group_quant_fp8: out must be float8_e4m3fn [{m}, {k}] and "
                         f"out_scale fp32 [{m}, {groups}], got {out.dtype} {tuple(out.shape)} "
                         f"and {out_scale.dtype} {tuple(out_scale.shape)}")
    if m == 0 or k == 0:
        return out, out_scale
    grid = (triton.cdiv(m, block_m), groups)
    _per_token_group_quant_kernel[grid](
        x, out, out_scale, m, k, x.stride(0), out.stride(0), out_scale.stride(0),
        out_scale.stride(1),
        FMAX=FP8_MAX, GROUP=group_size, BLOCK_M=block_m, ROUND_IN_FP32=INTERPRETED,
        **compiler_options(num_warps, None))
    return out, out_scale


def per_token_group_quant_fp8_reference(x: torch.Tensor, group_size: int = QBLOCK
                                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain torch :func:`per_token_group_quant_fp8` (the module's rule, written out)."""
    _check(x, group_size)
    m, k = x.shape
    groups = -(-k // group_size)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group_size - k))  # zeros: no new amax
    amax = xf.reshape(m, groups, group_size).abs().amax(-1)
    # A tensor divisor: torch's CUDA division by a Python number multiplies by its reciprocal
    # (measured on the H200: scales one fp32 ulp off the kernel's IEEE division).
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (x.float() / scale.repeat_interleave(group_size, -1)[:, :k]).clamp_(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale


def group_dequantize(q: torch.Tensor, scale: torch.Tensor, group_size: int = QBLOCK
                     ) -> torch.Tensor:
    """The fp32 values ``q * scale`` of a :func:`per_token_group_quant_fp8` result (the
    activations the w8a8 GEMMs' references multiply)."""
    k = q.shape[-1]
    return q.float() * scale.float().repeat_interleave(group_size, -1)[..., :k]
