"""Block-fp8 weights as the published fp8 checkpoints store them, for the kernels that read them.

A weight ``[.., N, K]`` is ``float8_e4m3fn`` with one fp32 scale per ``128 x 128`` block,
``scale [.., ceil(N/128), ceil(K/128)]`` (the checkpoints' ``weight_scale_inv``): the real weight
is ``q * scale[n // 128, k // 128]``. A fused ``[gate; up]`` weight (``2I`` rows) keeps each half
on its own grid, ``scale [.., 2 * ceil(I/128), ceil(K/128)]`` with the up half's block rows after
the gate half's, so the halves stay apart when ``I`` is not a multiple of 128; when it is, this
is the plain grid of the ``[2I, K]`` matrix.

The kernels dequantise a tile as they load it and round it to the activation dtype, then run the
unquantized math: their torch reference is :func:`block_dequantize` followed by the unquantized
reference.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["QBLOCK", "FP8_MAX", "block_quantize", "block_dequantize", "scale_rows",
           "check_block_scale"]

QBLOCK = 128
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


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


def _row_blocks(n: int, split: Optional[int], device: torch.device) -> torch.Tensor:
    """The scale row of each of ``n`` weight rows."""
    rows = torch.arange(n, device=device)
    if split is None:
        return rows // QBLOCK
    # the second half's blocks follow the first half's
    return torch.where(rows < split, rows // QBLOCK, _cdiv(split, QBLOCK) + (rows - split) // QBLOCK)


def _expanded(scale: torch.Tensor, n: int, k: int, split: Optional[int]) -> torch.Tensor:
    """The per-element scale ``[.., n, k]``."""
    cols = torch.arange(k, device=scale.device) // QBLOCK
    return scale[..., _row_blocks(n, split, scale.device), :][..., cols]


def block_quantize(w: torch.Tensor, split: Optional[int] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn, scale fp32)`` of ``w [.., N, K]``: per block ``amax / 448`` (1 for an
    all-zero block), values rounded to nearest."""
    n, k = w.shape[-2:]
    wf = w.float()
    rows = _row_blocks(n, split, w.device)
    cols = torch.arange(k, device=w.device) // QBLOCK
    nb, kb = scale_rows(n, split), _cdiv(k, QBLOCK)
    block_id = (rows[:, None] * kb + cols[None, :]).expand_as(wf).reshape(*wf.shape[:-2], -1)
    amax = torch.zeros(*wf.shape[:-2], nb * kb, device=w.device).scatter_reduce(
        -1, block_id, wf.abs().reshape(*wf.shape[:-2], -1), "amax", include_self=True)
    scale = (amax / FP8_MAX).view(*wf.shape[:-2], nb, kb)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (wf / _expanded(scale, n, k, split)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def block_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                     split: Optional[int] = None) -> torch.Tensor:
    """The weight ``q * scale`` (fp32 product) rounded to ``dtype``."""
    n, k = q.shape[-2:]
    return (q.float() * _expanded(scale, n, k, split)).to(dtype)
