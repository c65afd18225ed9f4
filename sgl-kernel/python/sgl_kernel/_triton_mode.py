"""How this process runs Triton: compiled, or in the CPU interpreter (``TRITON_INTERPRET=1``,
fixed when triton is first imported, so read once here), and the launch options that follow."""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Launch option for kernels whose decode and verify programs must round alike: no mul+add
# contraction chosen differently by the compiler in one and not the other (the interpreter
# runs plain numpy and takes no compiler options).
NO_FP_FUSION = {} if INTERPRETED else {"enable_fp_fusion": False}


class LaunchConfig(NamedTuple):
    """Tile sizes and compiler options of one launch (``None`` = Triton's default); for the
    kernels that take them, ``split_k`` ranges of K summed in range order and ``swap_ab``
    (the weight as the tensor-core product's first operand); for the grouped MoE GEMM,
    ``block_m`` rows of the expert-sorted pair list per tile and ``group_m`` row blocks per
    swizzle group (fields last, so the shorter positional forms keep their meaning).

    ``fp8_prescale`` (block-fp8 weights of the grouped MoE GEMM; ignored for other weights):
    each e4m3 weight tile is multiplied in fp32 by its rows' block scales and rounded to x's
    dtype before one running ``tl.dot`` over K (the dequantise-then-GEMM values), instead of
    scaling each 128-column block's ``tl.dot`` result ("per-block product scaling", the
    default until an H200 sweep says otherwise)."""

    block_n: int
    block_k: int
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    split_k: int = 1
    swap_ab: bool = False
    block_m: Optional[int] = None
    group_m: int = 1
    fp8_prescale: bool = False


def compiler_options(num_warps: Optional[int], num_stages: Optional[int]) -> dict:
    """The launch's compiler options that were given (the interpreter takes none)."""
    if INTERPRETED:
        return {}
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    return {key: val for key, val in opts.items() if val is not None}
