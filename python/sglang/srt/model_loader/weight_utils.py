"""Lazy checkpoint tensors: read only the slice a tensor-parallel rank needs.

A :class:`LazyWeight` wraps one tensor of a safetensors file (or an in-memory tensor). Model
``weight_loader`` functions call :meth:`LazyWeight.narrow` with their rank's range, so a rank
never materialises another rank's shard of a large tensor.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch


class LazyWeight:
    """A checkpoint tensor that is materialised on demand, whole or as a slice along one dim."""

    def __init__(
        self,
        name: str,
        shape: Tuple[int, ...],
        dtype: torch.dtype,
        slicer: Callable[[Optional[Tuple[int, int, int]]], torch.Tensor],
    ):
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        # slicer(None) -> whole tensor; slicer((dim, start, length)) -> that slice.
        self._slicer = slicer

    @classmethod
    def from_tensor(cls, name: str, tensor: torch.Tensor) -> "LazyWeight":
        """Wrap an in-memory tensor (tests, converted checkpoints)."""

        def slicer(spec):
            if spec is None:
                return tensor
            dim, start, length = spec
            return tensor.narrow(dim, start, length)

        return cls(name, tuple(tensor.shape), tensor.dtype, slicer)

    @classmethod
    def from_safetensors_slice(cls, name: str, handle: Any) -> "LazyWeight":
        """Wrap ``safe_open(...).get_slice(name)`` (only the requested rows are read)."""
        shape = tuple(handle.get_shape())
        dtype = _SAFETENSORS_DTYPES[handle.get_dtype()]

        def slicer(spec):
            if spec is None:
                return handle[:]
            dim, start, length = spec
            index = [slice(None)] * len(shape)
            index[dim] = slice(start, start + length)
            return handle[tuple(index)]

        return cls(name, shape, dtype, slicer)

    def load(self) -> torch.Tensor:
        """The whole tensor."""
        return self._slicer(None)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows ``start .. start+length-1`` along ``dim`` (like ``torch.Tensor.narrow``)."""
        dim = dim % len(self.shape)
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"{self.name}: slice [{start}, {start + length}) out of range for dim {dim} "
                f"of shape {self.shape}"
            )
        return self._slicer((dim, start, length))

    def __repr__(self) -> str:
        return f"LazyWeight({self.name!r}, shape={self.shape}, dtype={self.dtype})"


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
