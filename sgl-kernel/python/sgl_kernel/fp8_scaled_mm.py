"""Block-fp8 linear layers on the library's fp8 GEMM: torch's ``_scaled_mm`` with block scales.

``x [M, K] @ dequant(w).T`` where ``w [N, K]`` is e4m3 with one fp32 scale per 128 x 128 block
(:mod:`sgl_kernel.fp8_blocks`) and ``x`` is quantised per row and 128-column group
(:mod:`sgl_kernel.fp8_act_quant`): the "DeepSeek recipe" that cuBLASLt runs on sm_90 (CUDA
12.9 and later) behind ``torch._scaled_mm``. Torch infers the scheme from the scale tensors'
shapes and strides; its checks, in our words:

* ``mat_a`` row-major ``[M, K]`` e4m3 with ``scale_a [M, ceil(K/128)]`` fp32 *outer-dim-major*
  (stride ``(1, M)``: column-major, which the quantiser writes directly into such a buffer);
* ``mat_b = w.t()`` (``[K, N]`` column-major, which sm_90 requires) with ``scale_b`` such that
  ``scale_b.t()`` is ``[ceil(N/128), ceil(K/128)]`` row-major: the checkpoint's
  ``weight_scale_inv`` as stored, passed transposed;
* ``K`` and ``N`` multiples of 16.

A fused weight (``MergedColumnParallelLinear``: q | k | v | b | f | g of a KDA layer) gives every
piece its own scale grid (``quantization.fp8_utils.block_index``), so a piece that is not a
multiple of 128 rows (KDA's ``b``: one row per head) breaks the uniform 128-row grid the
library assumes. :func:`row_groups` cuts the weight into groups that each have one grid; each
group is one call on the activations quantised once, written into its columns of one output:
in place where the library's ``out=`` was seen to honour the row stride and the columns are
16-byte aligned (cuBLASLt refuses others: ``CUBLAS_STATUS_NOT_SUPPORTED`` on the H100), else
copied there, never concatenated; the calls run on x's quantised rows padded to a multiple of
16 (cuBLASLt refused other row counts in a server). A group the library cannot take (rows not
a multiple of 16) runs weight-only on its weight dequantised once (:func:`weight_only_groups`),
so no call dequantises a weight. On the H100 at 8192 rows every group of Ling-3.0-flash's dense
projections, 32 rows to 12288, ran faster on the library this way than its weight on cuBLAS
after a dequantisation (docs/performance.md, "Dense fp8 on the library").

The library is the GPU's: whether a group runs, and whether it computes what the scales mean,
is checked once per weight shape against the dequantised product (:func:`blockwise_linear`,
outside CUDA-graph capture); a shape that fails keeps the dequantised path, with one warning.
:func:`scaled_mm_reference` is the contract above in plain torch, strides checked as torch
checks them; CPU tests run the layer path against it.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from sgl_kernel.fp8_act_quant import group_dequantize, per_token_group_quant_fp8
from sgl_kernel.fp8_blocks import QBLOCK, block_dequantize
from sgl_kernel.fp8_gemm import block_fp8_dequantize

__all__ = ["RowGroup", "row_groups", "scaled_mm_operands", "scaled_mm_reference",
           "blockwise_linear", "scaled_mm_eligible", "library_status", "weight_only_groups"]

logger = logging.getLogger(__name__)

# (first weight row, end row, first scale row) of a run of rows on one 128-row scale grid.
RowGroup = Tuple[int, int, int]

# (device index, N, K, x dtype) -> whether the library's product passed its check.
_CHECKED: Dict[Tuple[int, int, int, torch.dtype], bool] = {}
# Relative error (max |diff| / max |ref|) above which the library's product is refused: both
# sides sum the same e4m3 products in fp32 and round once to x's dtype.
_CHECK_TOL = 1e-2
_CHECK_ROWS = 64  # rows of the first call that the check recomputes
# (device index, N, K, x dtype) -> whether the library wrote its product into a column slice of
# a wider output in place (its ``out=`` honouring the row stride; checked once per shape).
_SLICE_OUT: Dict[Tuple[int, int, int, torch.dtype], bool] = {}
_SENTINEL_COLS = 16  # columns either side of the slice the check watches (32 bytes in bf16)
_ALIGN_BYTES = 16  # cuBLASLt's fp8 GEMMs want the output's pointer and row stride so aligned
# Rows of the library's calls: in a server on the H100 cuBLASLt refused every group of the
# model at the start-up warm-up's small batches (CUBLAS_STATUS_NOT_SUPPORTED; the 256 to 8192-row
# calls of the tests and benchmarks, all multiples of 16, ran), so x is quantised into rows
# padded to a multiple of 16 and the extra rows of the product are dropped.
_ROW_ALIGN = 16


def row_groups(pieces: Sequence[int], block: int = QBLOCK) -> List[RowGroup]:
    """The row groups of a weight made of ``pieces`` (row counts), each piece on its own
    ``block``-row scale grid: consecutive pieces that are multiples of ``block`` share one grid
    and form one group; any other piece is a group of its own (the next piece starts a new
    scale row, so the grid breaks after it)."""
    groups: List[RowGroup] = []
    row = scale_row = 0
    start: Optional[Tuple[int, int]] = None  # (row, scale row) of the open run
    for n in (int(p) for p in pieces):
        if n % block == 0:
            if start is None:
                start = (row, scale_row)
        else:
            if start is not None:
                groups.append((start[0], row, start[1]))
                start = None
            groups.append((row, row + n, scale_row))
        row += n
        scale_row += -(-n // block)
    if start is not None:
        groups.append((start[0], row, start[1]))
    return [g for g in groups if g[1] > g[0]]


def _key(device: torch.device, n: int, k: int, dtype: torch.dtype
         ) -> Tuple[int, int, int, torch.dtype]:
    return (device.index if device.index is not None else -1, n, k, dtype)


def library_status(device: torch.device, n: int, k: int, dtype: torch.dtype) -> Optional[bool]:
    """Whether a ``[n, k]`` weight group on ``device`` with ``dtype`` activations runs on the
    library (True), keeps the dequantised path (False) or has not been checked yet (None)."""
    return _CHECKED.get(_key(device, n, k, dtype))


def scaled_mm_eligible(n: int, k: int) -> bool:
    """Whether ``_scaled_mm`` takes a ``[n, k]`` weight group (its multiple-of-16 checks)."""
    return n > 0 and n % 16 == 0 and k % 16 == 0


def _group_weight(w: torch.Tensor, w_scale: torch.Tensor, group: RowGroup
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``group`` and their block-scale rows."""
    r0, r1, s0 = group
    return w[r0:r1], w_scale[s0:s0 + -(-(r1 - r0) // QBLOCK)]


def weight_only_groups(w: torch.Tensor, w_scale: torch.Tensor, groups: Sequence[RowGroup],
                       dtype: torch.dtype) -> Dict[int, torch.Tensor]:
    """``{group index: weight}``: the groups of ``groups`` that the library cannot take
    (:func:`scaled_mm_eligible` false) dequantised to ``dtype`` once, for
    :func:`blockwise_linear`'s ``dequantized``."""
    return {i: block_fp8_dequantize(*_group_weight(w, w_scale, g), None, dtype)
            for i, g in enumerate(groups) if not scaled_mm_eligible(g[1] - g[0], w.shape[1])}


def _aligned(out: torch.Tensor) -> bool:
    """Whether ``out``'s first element and row stride sit on the library's alignment."""
    return (out.data_ptr() % _ALIGN_BYTES == 0
            and out.stride(0) * out.element_size() % _ALIGN_BYTES == 0)


def scaled_mm_operands(q: torch.Tensor, q_scale: torch.Tensor, w: torch.Tensor,
                       w_scale: torch.Tensor
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mat_a, mat_b, scale_a, scale_b)`` for ``torch._scaled_mm`` from the quantised rows
    ``q [M, K]`` with their row-major group scales ``q_scale [M, ceil(K/128)]`` and a weight
    group ``w [N, K]`` with its row-major block scales ``w_scale [ceil(N/128), ceil(K/128)]``
    (module docstring: the activations' scales go column-major, the weight and its scales are
    passed transposed, no copy; scales already outer-dim-major are not copied either)."""
    return q, w.t(), _outer_dim_major(q_scale), w_scale.t()


def _outer_dim_major(scale: torch.Tensor) -> torch.Tensor:
    """``scale [M, G]`` with stride ``(1, M)`` (a copy only when it is not laid out so)."""
    return scale.t().contiguous().t()


def _stride_ok(scale: torch.Tensor, dim: int, size: int, stride: int) -> bool:
    return scale.shape[dim] == size and (size <= 1 or scale.stride(dim) == stride)


def scaled_mm_reference(mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor,
                        scale_b: torch.Tensor, out_dtype: torch.dtype,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch._scaled_mm`` with 1 x 128 scales on ``mat_a`` and 128 x 128 on ``mat_b`` in plain
    torch: the same layout checks (module docstring; a ``ValueError`` names the one that
    fails) and ``out[m, n] = sum_k a[m, k] * scale_a[m, k // 128] * b[k, n] *
    scale_b[k // 128, n // 128]`` in fp32, rounded once to ``out_dtype``; written into ``out``
    (``[M, N]``, any row stride) and returned when given."""
    m, k = mat_a.shape
    n = mat_b.shape[1]
    kb, nb = -(-k // QBLOCK), -(-n // QBLOCK)
    if mat_b.shape[0] != k:
        raise ValueError(f"scaled_mm: shapes {tuple(mat_a.shape)} and {tuple(mat_b.shape)}")
    if k % 16 or n % 16:
        raise ValueError(f"scaled_mm: K ({k}) and N ({n}) must be multiples of 16")
    if mat_a.stride(1) != 1 or mat_b.stride(0) != 1:
        raise ValueError("scaled_mm: mat_a must be row-major and mat_b column-major")
    if not (scale_a.dim() == 2 and _stride_ok(scale_a, 0, m, 1)
            and _stride_ok(scale_a, 1, kb, m)):
        raise ValueError(f"scaled_mm: scale_a must be [{m}, {kb}] outer-dim-major, got "
                         f"{tuple(scale_a.shape)} stride {scale_a.stride()}")
    sbt = scale_b.t()
    if not (sbt.dim() == 2 and _stride_ok(sbt, 0, nb, kb) and _stride_ok(sbt, 1, kb, 1)):
        raise ValueError(f"scaled_mm: scale_b.t() must be [{nb}, {kb}] row-major, got "
                         f"{tuple(sbt.shape)} stride {sbt.stride()}")
    a = group_dequantize(mat_a, scale_a)
    b = block_dequantize(mat_b.t(), sbt, torch.float32)  # [N, K]
    product = (a @ b.t()).to(out_dtype)
    return product if out is None else out.copy_(product)


def _library_scaled_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor,
                       scale_b: torch.Tensor, out_dtype: torch.dtype,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    if out is None:
        return torch._scaled_mm(mat_a, mat_b, scale_a=scale_a, scale_b=scale_b,
                                out_dtype=out_dtype)
    return torch._scaled_mm(mat_a, mat_b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                            out=out)


def _dequantized_any(q: torch.Tensor, q_scale: torch.Tensor, w: torch.Tensor,
                     w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The product of the dequantised operands (fp32 sums, one rounding): the reference of the
    once-per-shape check, for any shape."""
    a = group_dequantize(q, q_scale)
    return (a @ block_dequantize(w, w_scale, torch.float32).t()).to(out_dtype)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def _group_uses_library(key: Tuple[int, int, int, torch.dtype], q: torch.Tensor,
                        q_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        out: torch.Tensor) -> bool:
    """Whether the group's shape may use the library: checked once (``out`` the library's
    product of this call) against the dequantised product of the first rows; never decided
    during CUDA-graph capture (a check reads a value on the host)."""
    if key in _CHECKED:
        return _CHECKED[key]
    rows = min(q.shape[0], _CHECK_ROWS)
    err = _rel_err(out[:rows], _dequantized_any(q[:rows], q_scale[:rows], w, w_scale,
                                                torch.float32))
    ok = err <= _CHECK_TOL
    if not ok:
        logger.warning("fp8 scaled_mm: the library's block-scaled product of a [%d, %d] weight "
                       "is %.2e off the dequantised one; this shape keeps the dequantised path",
                       w.shape[0], w.shape[1], err)
    _CHECKED[key] = ok
    return ok


def _writes_column_slice(mm: Callable[..., torch.Tensor], q: torch.Tensor,
                         q_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         expected: torch.Tensor) -> bool:
    """Whether ``mm(..., out=view)`` writes a product into a column slice of a wider tensor in
    place: the first rows into a slice with sentinel columns (NaN) either side, which must stay
    untouched, and the slice within the once-per-shape tolerance of ``expected`` (this call's
    own product). torch's CPU ``_scaled_mm`` was seen writing such a slice as if it were
    contiguous, over its neighbours, so it is checked rather than assumed."""
    rows, n, pad = min(q.shape[0], _CHECK_ROWS), w.shape[0], _SENTINEL_COLS
    scratch = torch.full((rows, n + 2 * pad), float("nan"), dtype=expected.dtype,
                         device=expected.device)
    view = scratch[:, pad:pad + n]
    try:
        mm(*scaled_mm_operands(q[:rows], q_scale[:rows], w, w_scale), out_dtype=expected.dtype,
           out=view)
    except (RuntimeError, ValueError, TypeError):
        return False
    untouched = bool(scratch[:, :pad].isnan().all() and scratch[:, pad + n:].isnan().all())
    return untouched and _rel_err(view, expected[:rows]) <= _CHECK_TOL


def _library_product(key: Tuple[int, int, int, torch.dtype], q: torch.Tensor,
                     q_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     dtype: torch.dtype, mm: Callable[..., torch.Tensor],
                     dst: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """One group's product on the library: written into ``dst`` (a column slice of the layer's
    output) and returned, or returned as a new tensor when ``dst`` is None; None when the
    group keeps the weight-only path: the library refused it (at any call; the shape stays off
    it from then on, one warning) or computed it wrongly at its first call, when the checks
    run."""
    operands = scaled_mm_operands(q, q_scale, w, w_scale)
    checked = key in _CHECKED  # and passed: the caller asks only then, or outside capture
    try:
        if checked and dst is not None and _SLICE_OUT.get(key) and _aligned(dst):
            return mm(*operands, out_dtype=dtype, out=dst)
        out = mm(*operands, out_dtype=dtype)
    except (RuntimeError, ValueError) as exc:  # the library refuses this layout
        logger.warning("fp8 scaled_mm: a [%d, %d] weight group is refused at %d rows (%s); it "
                       "keeps the dequantised path", w.shape[0], w.shape[1], q.shape[0],
                       str(exc).splitlines()[0])
        _CHECKED[key] = False
        return None
    if checked:
        return out if dst is None else dst.copy_(out)
    if not _group_uses_library(key, q, q_scale, w, w_scale, out):
        return None
    _SLICE_OUT[key] = _writes_column_slice(mm, q, q_scale, w, w_scale, out)
    return out if dst is None else dst.copy_(out)


def _quantized_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """``(q, q_scale, rows)``: x quantised per row and 128-column group into ``rows`` rows (M
    rounded up to :data:`_ROW_ALIGN`; the extra rows zero, their scales 1), the scales written
    outer-dim-major by the quantiser itself, as every group's library call takes them."""
    m, k = x.shape
    rows = -(-m // _ROW_ALIGN) * _ROW_ALIGN
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    q_scale = torch.empty(-(-k // QBLOCK), rows, dtype=torch.float32, device=x.device).t()
    per_token_group_quant_fp8(x if x.stride(1) == 1 else x.contiguous(), out=q[:m],
                              out_scale=q_scale[:m])
    if rows > m:
        q[m:].view(torch.uint8).zero_()
        q_scale[m:].fill_(1.0)
    return q, q_scale, rows


def blockwise_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     groups: Sequence[RowGroup], bias: Optional[torch.Tensor] = None,
                     mm: Optional[Callable[..., torch.Tensor]] = None,
                     dequantized: Optional[Dict[int, torch.Tensor]] = None) -> torch.Tensor:
    """``x [M, K] @ dequant(w).T (+ bias)`` in x's dtype with x quantised per row and
    128-column group and each row group of ``w`` (:func:`row_groups`, covering all its rows)
    on ``mm`` (default ``torch._scaled_mm``; tests pass :func:`scaled_mm_reference`), each
    group's product written into its columns of one output.

    A group the library does not take (rows not a multiple of 16, a shape whose check failed or
    that it refused, or one not yet checked while a CUDA graph is being captured) runs as the
    engine's weight-only path does: x as it is times the group's weight in x's dtype, from
    ``dequantized`` (:func:`weight_only_groups`, by group index) when it holds the group in
    that dtype, else dequantised now (:func:`sgl_kernel.fp8_gemm.block_fp8_dequantize`)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"blockwise_linear: expected x [M, K], w [N, K]; got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}")
    if not groups or groups[0][0] != 0 or groups[-1][1] != w.shape[0] or any(
            a[1] != b[0] for a, b in zip(groups, groups[1:])):
        raise ValueError(f"blockwise_linear: row groups {list(groups)} do not cover the weight's "
                         f"{w.shape[0]} rows in order")
    mm = mm or _library_scaled_mm
    dequantized = dequantized or {}
    on_library = [scaled_mm_eligible(g[1] - g[0], w.shape[1]) for g in groups]
    m = x.shape[0]
    rows = m  # the library's calls run on rows padded to _ROW_ALIGN (module docstring)
    if any(on_library):
        q, q_scale, rows = _quantized_rows(x)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    single = len(groups) == 1
    y = None if single else torch.empty(rows, w.shape[0], dtype=x.dtype, device=x.device)
    for i, group in enumerate(groups):
        wg, sg = _group_weight(w, w_scale, group)
        dst = None if single else y[:, group[0]:group[1]]
        key = _key(x.device, wg.shape[0], w.shape[1], x.dtype)
        out = None
        if on_library[i] and _CHECKED.get(key, not capturing):
            out = _library_product(key, q, q_scale, wg, sg, x.dtype, mm, dst)
        if out is None:
            wd = dequantized.get(i)
            if wd is None or wd.dtype != x.dtype:
                wd = block_fp8_dequantize(wg, sg, None, x.dtype)
            out = x @ wd.t() if dst is None else torch.mm(x, wd.t(), out=dst[:m])
        if single:
            y = out
    y = y[:m]
    return y if bias is None else y + bias
