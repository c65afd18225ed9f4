"""Block-wise fp8 (e4m3) helpers: quantise, dequantise, and map rows/columns to their blocks.

The published fp8 checkpoints store a weight ``W [N, K]`` as ``float8_e4m3fn`` values plus one
fp32 scale per ``128 x 128`` block, ``weight_scale_inv [ceil(N/128), ceil(K/128)]``; the
dequantised weight is ``fp8 value * scale of its block`` (the name says "inverse" because the
quantiser divided by it). Edge blocks may be ragged (``N`` or ``K`` not a multiple of 128).

A tensor whose rows are several independent pieces (gate|up of a SwiGLU, q|k|v|b|f|g of KDA)
keeps one block grid per piece: the scale rows of the pieces are concatenated, so a block
never mixes rows of two pieces even when a piece's size is not a multiple of the block size.
:func:`block_index` builds the row -> scale-row map for such a layout.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

__all__ = ["FP8_DTYPE", "FP8_MAX", "num_blocks", "block_index", "quantize_block_fp8",
           "dequantize_block_fp8", "dequantize_indexed"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def num_blocks(n: int, block: int) -> int:
    """``ceil(n / block)``."""
    return -(-int(n) // int(block))


def block_index(pieces: Sequence[int], block: int, device=None) -> torch.Tensor:
    """Scale row of every row of a tensor made of ``pieces`` (sizes), each on its own grid.

    E.g. pieces ``(96, 96)`` with block 128 -> rows 0..95 use scale row 0, rows 96..191 row 1.
    """
    parts, base = [], 0
    for n in pieces:
        parts.append(torch.arange(int(n), device=device) // block + base)
        base += num_blocks(n, block)
    if not parts:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat(parts)


def _check_block(block: Tuple[int, int]) -> Tuple[int, int]:
    bn, bk = (int(b) for b in block)
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block size must be positive, got {block}")
    return bn, bk


@torch.no_grad()
def quantize_block_fp8(weight: torch.Tensor, block: Tuple[int, int] = (128, 128)
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``W [..., N, K]`` -> ``(fp8 [..., N, K], fp32 scale [..., ceil(N/bn), ceil(K/bk)])``.

    Per block: ``scale = amax(|W|) / 448`` and ``q = round_to_nearest(W / scale)`` in e4m3
    (torch's cast rounds to nearest even). An all-zero block gets scale 1 (any scale would do;
    1 avoids a division by zero).
    """
    bn, bk = _check_block(block)
    if weight.dim() < 2:
        raise ValueError(f"quantize_block_fp8 needs a [..., N, K] tensor, got "
                         f"{tuple(weight.shape)}")
    *lead, n, k = weight.shape
    nb, kb = num_blocks(n, bn), num_blocks(k, bk)
    w = weight.float()
    # Zero-pad to whole blocks; padding never raises an amax.
    padded = torch.nn.functional.pad(w, (0, kb * bk - k, 0, nb * bn - n))
    blocks = padded.reshape(*lead, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :n, :k]
    q = (w / full).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_indexed(q: torch.Tensor, scale: torch.Tensor, row_index: torch.Tensor,
                       col_index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [..., N, K]`` times its block scales ``scale [..., R, C]`` where row ``i`` uses scale
    row ``row_index[i]`` and column ``j`` scale column ``col_index[j]``; the fp32 product is
    rounded once to ``dtype``."""
    s = scale.float().index_select(-2, row_index).index_select(-1, col_index)
    return (q.float() * s).to(dtype)


def dequantize_block_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                         block: Tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Inverse of :func:`quantize_block_fp8` for a single block grid (``[..., N, K]``)."""
    bn, bk = _check_block(block)
    n, k = q.shape[-2:]
    expected = (num_blocks(n, bn), num_blocks(k, bk))
    if tuple(scale.shape[-2:]) != expected:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight "
                         f"{tuple(q.shape)} with block {block} (expected [..., {expected[0]}, "
                         f"{expected[1]}])")
    rows = torch.arange(n, device=q.device) // bn
    cols = torch.arange(k, device=q.device) // bk
    return dequantize_indexed(q, scale, rows, cols, dtype)
