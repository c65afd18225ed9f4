"""How this process runs Triton: compiled, or in the CPU interpreter (``TRITON_INTERPRET=1``,
fixed when triton is first imported, so read once here), the launch options that follow, the
one launch-configuration type (:class:`LaunchConfig`) and the device's SM count
(:func:`sm_count`).

Every tiled kernel whose launch is a choice (a table, a shape rule, a tuning sweep) describes it
as a :class:`LaunchConfig`. Two kinds of launch keep something else, on purpose:

* ``mla_decode`` keeps its private ``_Config``: attention over a split key range has no K tile
  (a whole latent row is one tile) and carries a split policy (``split_min``) and a merge width
  (``block_s``) that no GEMM has; see its docstring.
* element-wise and row-wise kernels with one fixed block per axis (``moe_combine``, ``mla_rope``,
  ``kda_conv``, ``kda_prefill_conv``, ``rmsnorm``, ``round_prep``, ``moe_router``, the fp8
  dequantisation pass of ``fp8_gemm``) keep module constants: there is nothing to choose
  between launches, so a config object would only rename the constant.

This module imports nothing but the standard library and torch: ``sgl_kernel`` stands alone
(``test/kernels/test_kernel_package.py``).
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional, Union

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Launch option for kernels whose decode and verify programs must round alike: no mul+add
# contraction chosen differently by the compiler in one and not the other (the interpreter
# runs plain numpy and takes no compiler options).
NO_FP_FUSION = {} if INTERPRETED else {"enable_fp_fusion": False}


class LaunchConfig(NamedTuple):
    """Tile sizes and compiler options of one launch (``None`` = Triton's default); for the
    kernels that take them, ``split_k`` ranges of K summed in range order and ``swap_ab``
    (the weight as the tensor-core product's first operand); for the tiled GEMMs over many rows
    (the grouped MoE GEMM, the block-fp8 GEMM), ``block_m`` rows per tile and ``group_m`` row
    blocks per swizzle group (fields last, so the shorter positional forms keep their meaning).
    A kernel reads the fields it has axes for: the KDA recurrence's value tile is ``block_n``
    and its whole key row ``block_k``.

    ``fp8_prescale`` (block-fp8 weights of the grouped MoE GEMM and the block-fp8 GEMM; ignored
    for other weights): each e4m3 weight tile is multiplied in fp32 by its rows' block scales
    and rounded to x's dtype before one running ``tl.dot`` over K (the dequantise-then-GEMM
    values), instead of scaling each 128-column block's ``tl.dot`` result ("per-block product
    scaling", the default until a sweep on the GPU has timed the two: docs/performance.md,
    "Not measured yet").

    ``swiglu_interleave`` (the grouped MoE GEMM's SwiGLU up-projection; ignored elsewhere): the
    tile's ``block_n`` columns alternate gate and up rows of ``block_n / 2`` output columns, so
    one ``tl.dot`` and one fp32 accumulator serve both halves, where the default keeps a gate
    and an up accumulator of ``block_n`` columns each.

    ``weight_tma`` (the grouped MoE GEMM; ignored elsewhere): weight tiles loaded by the Hopper
    tensor-memory accelerator through a host-built descriptor of the ``[E, N, K]`` weight
    instead of per-thread pointer loads (the gathered activation rows keep pointer loads: a
    TMA box reads consecutive rows). Only where a tile never straddles two experts' rows and
    the weight is used as stored (no interleaved SwiGLU tile, no pre-scaled fp8 tile)."""

    block_n: int
    block_k: int
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    split_k: int = 1
    swap_ab: bool = False
    block_m: Optional[int] = None
    group_m: int = 1
    fp8_prescale: bool = False
    swiglu_interleave: bool = False
    weight_tma: bool = False


def compiler_options(num_warps: Optional[int], num_stages: Optional[int]) -> dict:
    """The launch's compiler options that were given (the interpreter takes none)."""
    if INTERPRETED:
        return {}
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    return {key: val for key, val in opts.items() if val is not None}


# Programs that fill the device under the interpreter or off CUDA: small, so that a rule built on
# the SM count still exercises several programs (and splits) in a CPU test.
_FALLBACK_SMS = 8


def sm_count(device: Union[torch.device, str, None] = None) -> int:
    """Streaming multiprocessors of ``device`` (the current CUDA device when ``None``): the
    kernels' "programs that fill the GPU in one wave". 8 under the interpreter or off CUDA."""
    if INTERPRETED:
        return _FALLBACK_SMS
    if device is None:
        if not torch.cuda.is_available():
            return _FALLBACK_SMS
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return _FALLBACK_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sm_count(index)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    # Cached per device index: the property query costs microseconds on every launch otherwise.
    return torch.cuda.get_device_properties(index).multi_processor_count


_PLACEHOLDERS: dict = {}
_ARRIVAL_COUNTS: dict = {}
_REPLACED_COUNTS: list = []


def arrival_counts(owner: str, device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` int32 arrival counters, zero between launches, for a kernel (named by
    ``owner``) whose last program to arrive at an output tile finishes it (the small-M GEMM's K
    split sum): each program raises its tile's count, and the one that sees the last arrival
    does the work and sets the count back to zero. One buffer per kernel and device (at least
    4096 counters), so two such kernels never share a count, and launches of one kernel on a
    device must not overlap: the engine launches its kernels on one stream (the side stream of
    ``sglang.srt.rounds.relay`` only copies). A larger grid gets a larger buffer; a replaced one
    stays allocated, since a captured CUDA graph may still point at it."""
    key = (owner, device)  # a tensor's device (always indexed); no str() on every launch
    counts = _ARRIVAL_COUNTS.get(key)
    if counts is None or counts.numel() < count:
        if counts is not None:
            _REPLACED_COUNTS.append(counts)
        counts = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _ARRIVAL_COUNTS[key] = counts
    return counts


def placeholder(device: torch.device) -> torch.Tensor:
    """A one-element fp32 ``[1, 1, 1]`` tensor on ``device`` to pass for a pointer argument the
    launch never reads (a kernel's scale when the weight is not block fp8); one per device."""
    key = str(device)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros(1, 1, 1, dtype=torch.float32, device=device)
    return _PLACEHOLDERS[key]
