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
import triton
import triton.language as tl

__all__ = ["QBLOCK", "block_quantize", "block_dequantize", "scale_rows", "check_block_scale",
           "dequant_tile"]

QBLOCK = 128


@triton.jit
def dequant_tile(w, s_rows, k0, K, mask_n, out_dtype: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, QB: tl.constexpr):
    """A block-fp8 weight tile ``w [BLOCK_N, BLOCK_K]`` (columns ``k0 ..``) times its scales,
    rounded to ``out_dtype``; ``s_rows [BLOCK_N]`` points at each row's scale row.

    The scales are loaded once per row and 128-column block (``BLOCK_N x BLOCK_K / QB`` loads,
    or ``BLOCK_N`` when the tile is narrower than a block) and broadcast over the block's
    columns: a per-element gather of the scale costs more than streaming the weight itself."""
    if BLOCK_K >= QB:
        KB: tl.constexpr = BLOCK_K // QB
        kb = k0 // QB + tl.arange(0, KB)
        scale = tl.load(s_rows[:, None] + kb[None, :],
                        mask=mask_n[:, None] & (kb < tl.cdiv(K, QB))[None, :], other=0.0)
        w3 = tl.reshape(w.to(tl.float32), (BLOCK_N, KB, QB)) * scale[:, :, None]
        return tl.reshape(w3, (BLOCK_N, BLOCK_K)).to(out_dtype)
    else:
        scale = tl.load(s_rows + k0 // QB, mask=mask_n, other=0.0)
        return (w.to(tl.float32) * scale[:, None]).to(out_dtype)


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


def block_quantize(w: torch.Tensor, split: Optional[int] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn, scale fp32)`` of ``w [.., N, K]`` in this layout (per block
    ``amax / 448``; the engine's quantiser, ``sglang.srt.layers.quantization.fp8_utils``)."""
    from sglang.srt.layers.quantization.fp8_utils import quantize_block_fp8

    parts = [quantize_block_fp8(piece, (QBLOCK, QBLOCK))
             for piece in torch.split(w, _pieces(w.shape[-2], split), dim=-2)]
    return torch.cat([q for q, _ in parts], -2), torch.cat([sc for _, sc in parts], -2)


def block_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                     split: Optional[int] = None) -> torch.Tensor:
    """The weight ``q * scale`` (fp32 product) rounded to ``dtype``: what the kernels compute
    with, so their references start from it."""
    from sglang.srt.layers.quantization.fp8_utils import block_index, dequantize_indexed

    n, k = q.shape[-2:]
    rows = block_index(_pieces(n, split), QBLOCK, q.device)
    cols = torch.arange(k, device=q.device) // QBLOCK
    return dequantize_indexed(q, scale, rows, cols, dtype)
