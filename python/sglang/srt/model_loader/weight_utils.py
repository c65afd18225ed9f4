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
        # Bytes materialised so far: lets the loader report I/O and tests check that a TP rank
        # read only its slice.
        self.bytes_read = 0

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
        code = handle.get_dtype()
        if code not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: unsupported safetensors dtype {code!r}")
        dtype = _SAFETENSORS_DTYPES[code]

        def slicer(spec):
            if spec is None:
                return handle[...]  # ``[:]`` fails on 0-d tensors
            dim, start, length = spec
            index = [slice(None)] * len(shape)
            index[dim] = slice(start, start + length)
            return handle[tuple(index)]

        return cls(name, shape, dtype, slicer)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Size of the whole tensor in its stored dtype."""
        return self.numel * _itemsize(self.dtype)

    def load(self) -> torch.Tensor:
        """The whole tensor."""
        return self._count(self._slicer(None))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows ``start .. start+length-1`` along ``dim`` (like ``torch.Tensor.narrow``)."""
        dim = dim % len(self.shape)
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"{self.name}: slice [{start}, {start + length}) out of range for dim {dim} "
                f"of shape {self.shape}"
            )
        return self._count(self._slicer((dim, start, length)))

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes_read += t.numel() * t.element_size()
        return t

    def reshape_to(self, shape: Tuple[int, ...]) -> "LazyWeight":
        """The same tensor seen with extra or missing size-1 dims (e.g. ``A_log`` stored
        ``[1, 1, H, 1]`` but consumed as ``[H]``); slices still read only the requested rows.

        Raises ``ValueError`` unless both shapes have the same non-1 dims in the same order.
        """
        shape = tuple(int(s) for s in shape)
        if shape == self.shape:
            return self
        if not same_up_to_unit_dims(shape, self.shape):
            raise ValueError(f"{self.name}: cannot view shape {self.shape} as {shape}")
        # Map each non-1 dim of the new view to the matching dim of the stored tensor.
        src_dims = [d for d, s in enumerate(self.shape) if s != 1]
        dst_dims = [d for d, s in enumerate(shape) if s != 1]
        dim_map = dict(zip(dst_dims, src_dims))
        base = self

        def slicer(spec):
            if spec is None:
                return base._slicer(None).reshape(shape)
            dim, start, length = spec
            if dim not in dim_map:  # a size-1 dim: the slice is the whole (tiny) tensor
                return base._slicer(None).reshape(shape)
            part = base._slicer((dim_map[dim], start, length))
            out_shape = list(shape)
            out_shape[dim] = length
            return part.reshape(out_shape)

        return LazyWeight(self.name, shape, self.dtype, slicer)
    def __repr__(self) -> str:
        return f"LazyWeight({self.name!r}, shape={self.shape}, dtype={self.dtype})"


def same_up_to_unit_dims(a: Tuple[int, ...], b: Tuple[int, ...]) -> bool:
    """True if ``a`` and ``b`` differ only by size-1 dims (``[32]`` vs ``[1, 1, 32, 1]``)."""
    return [s for s in a if s != 1] == [s for s in b if s != 1]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
