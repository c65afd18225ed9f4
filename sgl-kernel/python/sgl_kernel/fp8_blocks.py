"""Block-fp8 weights as the published fp8 checkpoints store them, for the kernels that read them.

A weight ``[.., N, K]`` is ``float8_e4m3fn`` with one fp32 scale per ``128 x 128`` block,
``scale [.., ceil(N/128), ceil(K/128)]`` (the checkpoints' ``weight_scale_inv``): the real weight
is ``q * scale[n // 128, k // 128]``. A fused ``[gate; up]`` weight (``2I`` rows) keeps each half
on its own grid, ``scale [.., 2 * ceil(I/128), ceil(K/128)]`` with the up half's block rows after
the gate half's, so the halves stay apart when ``I`` is not a multiple of 128; when it is, this
is the plain grid of the ``[2I, K]`` matrix.

The kernels compute in fp32 with the weight ``q * scale`` (never rounded to the activation
dtype) and never form it: the grouped GEMV scales the activations (a tile's rows share one
scale row), the small-M GEMM scales each 128-column block's tensor-core sum. Either way a weight
element costs one conversion and one multiply-add: scaling every element first costs more
instructions than the byte is worth to stream. Their torch references start from
:func:`block_dequantize` in fp32; the summation orders differ, within fp32 rounding.

Plain torch, written from the layout above: the engine's quantiser
(``sglang.srt.layers.quantization.fp8_utils``) implements the same rule, and
``test/kernels/test_kernel_package.py`` checks that the two agree bit for bit.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["QBLOCK", "FP8_MAX", "block_quantize", "block_dequantize", "scale_rows",
           "check_block_scale"]

QBLOCK = 128
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: the largest finite e4m3 value


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_rows(n: int, split: Optional[int] = None) -> int:
    """Block rows of the scale of an ``n``-row weight (two grids when ``split`` rows open it)."""
    if split is None:
        return _cdiv(n, QBLOCK)
    return _cdiv(split, QBLOCK) + _cdiv(n - split, QBLOCK)


def check_block_scale(w: torch.Tensor, scale: torch.Tensor, split: Optional[int] = None,
                      name: str = "weight") -> None:
    """Raise ``ValueError`` unless ``w`` is float8_e4m3fn and ``scale`` is its fp32 block grid."""
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: expected float8_e4m3fn, got {w.dtype}")
    want = (*w.shape[:-2], scale_rows(w.shape[-2], split), _cdiv(w.shape[-1], QBLOCK))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want:
        raise ValueError(f"{name}: block scale must be fp32 {want} for {tuple(w.shape)} "
                         f"({QBLOCK} x {QBLOCK} blocks), got {scale.dtype} {tuple(scale.shape)}")


def _pieces(n: int, split: Optional[int]) -> list:
    return [n] if split is None else [split, n - split]


def _quantize_grid(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One weight ``[.., N, K]`` on one ``QBLOCK x QBLOCK`` grid: per block ``scale = amax /
    FP8_MAX`` (1 for an all-zero block, to avoid a division by zero) and ``q = w / scale``
    clamped and cast to e4m3 (torch's cast rounds to nearest even)."""
    *lead, n, k = w.shape
    nb, kb = _cdiv(n, QBLOCK), _cdiv(k, QBLOCK)
    wf = w.float()
    # Zero padding to whole blocks never raises a block's amax.
    padded = torch.nn.functional.pad(wf, (0, kb * QBLOCK - k, 0, nb * QBLOCK - n))
    amax = padded.reshape(*lead, nb, QBLOCK, kb, QBLOCK).abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(QBLOCK, -2).repeat_interleave(QBLOCK, -1)[..., :n, :k]
    q = (wf / full).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def block_quantize(w: torch.Tensor, split: Optional[int] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn, scale fp32)`` of ``w [.., N, K]`` in this layout (per block
    ``amax / 448``, each piece of a ``split`` weight on its own grid)."""
    with torch.no_grad():
        parts = [_quantize_grid(piece)
                 for piece in torch.split(w, _pieces(w.shape[-2], split), dim=-2)]
    return torch.cat([q for q, _ in parts], -2), torch.cat([sc for _, sc in parts], -2)


def _scale_row_index(n: int, split: Optional[int], device: torch.device) -> torch.Tensor:
    """The scale row of every weight row: each piece counts its own blocks after the last
    piece's."""
    parts, base = [], 0
    for rows in _pieces(n, split):
        parts.append(torch.arange(rows, device=device) // QBLOCK + base)
        base += _cdiv(rows, QBLOCK)
    return torch.cat(parts)


def block_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                     split: Optional[int] = None,
                     rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The weight ``q * scale`` (fp32 product) rounded to ``dtype`` (in fp32: the weight the
    kernels compute with, so their references start from it). ``rows [N]`` gives every weight
    row's scale row for a weight of several pieces each on its own grid (else from ``split``)."""
    n, k = q.shape[-2:]
    if rows is None:
        rows = _scale_row_index(n, split, q.device)
    cols = torch.arange(k, device=q.device) // QBLOCK
    s = scale.float().index_select(-2, rows.long()).index_select(-1, cols)
    return (q.float() * s).to(dtype)
