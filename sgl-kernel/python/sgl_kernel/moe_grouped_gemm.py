"""Grouped GEMM over (token, expert) pairs sorted by expert: the large-M (prefill) MoE GEMMs.

``out[p] = W[e_p] @ x[p // rows_per_x]`` for every pair ``p = t * k + slot`` of a batch's
routes ``topk_ids [T, k]``, with ``W [E, N, K]`` (rows contiguous along K: the layout of
``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]``). Above a few hundred pairs every expert
has several rows, so reading each expert once per column tile for all of its rows (a GEMM)
beats re-reading it per pair (the grouped GEMV of :mod:`sgl_kernel.grouped_gemv`).

Two steps, no host sync, every size fixed by the input shapes, so both run inside CUDA graphs:

* :func:`moe_align` (torch ops on the device): the pair ids sorted by expert (stable), each
  expert's group padded to a multiple of ``block_m`` with the sentinel id ``P = T * k``, the
  expert of every ``block_m``-row block and the number of blocks in use (a device scalar). The
  buffers are sized by the worst case ``P + min(E, P) * (block_m - 1)`` rows; the kernel's
  programs past the used blocks return at once.
* :func:`moe_grouped_gemm` (Triton): one program per (row block, column tile). It gathers its
  rows of ``x`` through the pair ids (the up-projection reads ``hidden [T, H]`` with
  ``rows_per_x = k``; the down-projection reads ``act [P, I]`` with ``rows_per_x = 1``), runs
  ``tl.dot`` with an fp32 accumulator over K and writes row ``p`` of ``out [P, N_out]`` (pair
  order, so the combine reads it like the small-M path's output; sentinel rows write nothing).

The SwiGLU epilogue (``swiglu=True``): ``w`` holds gate rows ``[0, I)`` then up rows
``[I, 2I)``; a program accumulates the gate tile and the up tile of the same ``I`` columns,
rounds each to x's dtype (the reference's ``h13`` in the model dtype), applies
``sglang.srt.layers.activation.silu_and_mul``'s math in fp32 (with ``limit > 0``:
``min(silu(gate), limit) * clamp(up, -limit, limit)``) and rounds once. ``N_out = I``, and the
``[P, 2I]`` intermediate never exists. With ``LaunchConfig.swiglu_interleave`` a program's
``BLOCK_N`` tile columns alternate the gate and the up row of ``BLOCK_N / 2`` output columns
(no weight re-layout: the column's row pointer picks the half), so one ``tl.dot`` and one fp32
accumulator serve both halves and the epilogue splits the even and odd columns. Per output
column the arithmetic is the same; what changes is the registers a program holds (one
``[BLOCK_M, BLOCK_N]`` accumulator and, with block-fp8 scales, one dot result instead of two of
each: fewer registers at every tile, which leaves room for larger tiles; docs/performance.md)
against twice the programs reading each gathered row of ``x``. The tile sweep decides.

Block fp8 (``w_scale`` given; :mod:`sgl_kernel.fp8_blocks` layout): weight-only fp8 ("w8a16"),
no per-call dequantised copy of any expert. One ``BLOCK_K`` slice never straddles a 128-column
scale block (``BLOCK_K`` divides 128), so a slice's weight rows each have one scale. Two inner
loops, chosen per launch by ``LaunchConfig.fp8_prescale``:

* per-block product scaling (``False``, the default): the tile is converted e4m3 -> x's dtype
  (exact: every e4m3 value is a bf16 / fp16 / fp32 value), the slice's ``tl.dot`` is multiplied
  in fp32 by its per-row scales and added to the accumulator: the weight is ``q * scale`` in
  fp32, never rounded. Each slice's dot result is waited on before it is scaled, so the tensor
  cores idle while it is: in the dense fp8 GEMM (:mod:`sgl_kernel.fp8_gemm`) that wait cost
  more of the tensor-core rate than the e4m3 conversion did (docs/performance.md, the prefill
  section's "Dense fp8 at prefill sizes");
* pre-scaled weight tiles (``True``): the tile is converted to fp32, multiplied by its rows'
  scales, rounded to x's dtype and fed to one running ``tl.dot(a, w, acc)`` over K. The
  weight's values are then exactly the reference path's dequantised weight
  (:func:`sgl_kernel.fp8_blocks.block_dequantize` to the model dtype: the fp32 product rounded
  once), up to the fp32 summation order; the extra cost is a multiply and a rounding per weight
  element on the CUDA cores, per row block. Compiled for sm_90 by Triton 3.6 both loops still
  end each K step with ``wgmma.wait_group 0`` (the converted weight tile goes from registers to
  shared memory either way), so what pre-scaling removes is the accumulator's multiply-add per
  step. The tile sweep decides which one is faster.

Fp8 activations (w8a8, ``x_scale`` given; ``KernelChoices.moe_fp8_activations``, on for fp8
models on CUDA):
``x`` quantised per row and 128-column group (:mod:`sgl_kernel.fp8_act_quant`), the dot on the
e4m3 operands (the fp8 tensor cores, twice the bf16 rate), each K slice's sum scaled by the
row's activation scale and the column's weight scale. The activations' rounding to e4m3 is
numerics the weight-only path and the torch-native reference do not have; the reference takes
the dequantised activations (``x_scale`` given) and so checks the kernel, not the rounding.

Weight tiles by TMA (``LaunchConfig.weight_tma``, a table entry's choice): the ``[BLOCK_N,
BLOCK_K]`` weight tile comes through a host-built TMA descriptor of ``w`` instead of per-thread
pointer loads (the gathered rows of ``x`` keep pointer loads); the arithmetic is the same. A
descriptor is chosen per launch, not per program, so with a shared expert the launch is split
in two: the routed experts' row blocks, then the shared expert's (the last id, whose ``T``
rows are the last ``ceil(T / block_m)`` blocks in use; ``MoEAlignment.num_tokens``).

Tiles (and the fp8 inner loop) come from a per-GPU table (``configs/moe_grouped_gemm.json``,
written by ``benchmark/kernels/tune_moe_grouped_gemm.py``) through :func:`launch_config`. Reference:
:func:`moe_grouped_gemm_reference`.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from sgl_kernel._triton_mode import INTERPRETED, LaunchConfig, compiler_options, placeholder
from sgl_kernel.fp8_act_quant import quantize_groups
from sgl_kernel.fp8_blocks import FP8_MAX, QBLOCK, block_dequantize, check_block_scale

__all__ = ["MoEAlignment", "moe_align", "max_padded_pairs", "moe_grouped_gemm",
           "moe_grouped_gemm_reference", "launch_config", "fallback_config", "config_key",
           "config_fields", "load_config_table", "table_device", "table_entry", "nearest_bucket",
           "select_config", "config_change_points", "launch_int_args", "CONFIG_PATH",
           "weight_tma_applies",
           "DEFAULT_CONFIG", "LaunchConfig", "quantizes_out"]

logger = logging.getLogger(__name__)
CONFIG_PATH = os.path.join(os.path.dirname(__file__), "configs", "moe_grouped_gemm.json")
# The model dtypes the epilogue rounds to (gate and up, and the output before a quantisation).
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class MoEAlignment(NamedTuple):
    """The expert-sorted pair list of one batch's routes (all on the routes' device).

    ``sorted_pairs [max_padded]`` int32: pair ids grouped by expert (stable within an expert),
    each group padded to a multiple of ``block_m`` with the sentinel ``num_pairs``;
    ``block_expert [max_padded // block_m]`` int32: the expert of every ``block_m``-row block
    (-1 past the used blocks); ``num_blocks [1]`` int32: how many blocks are used;
    ``num_tokens``: the routes' rows ``T`` (a shared expert routed once per token, the last
    expert id, holds the last ``ceil(T / block_m)`` blocks in use)."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_blocks: torch.Tensor
    block_m: int
    num_pairs: int
    num_experts: int
    num_tokens: int = 0


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the padded list in the worst case: at most ``min(E, P)`` groups are non-empty,
    each padded by at most ``block_m - 1``; the total is a multiple of ``block_m``."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return bound // block_m * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the pairs ``p = t * k + slot`` of ``topk_ids [T, k]`` by expert and pad each expert's
    group to a multiple of ``block_m`` (see :class:`MoEAlignment`).

    Torch ops only and no value read on the host (counts by ``scatter_add_``, not
    ``bincount``, whose CUDA form reads the maximum on the host): capturable in a CUDA graph.
    Output sizes depend on ``T * k``, ``num_experts`` and ``block_m`` only."""
    if topk_ids.dim() != 2 or block_m < 1 or num_experts < 1:
        raise ValueError(f"moe_align: expected topk_ids [T, k], num_experts >= 1, block_m >= 1; "
                         f"got {tuple(topk_ids.shape)}, {num_experts}, {block_m}")
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    p = flat.numel()
    padded_len = max_padded_pairs(p, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_end = padded.cumsum(0)
    start = counts.cumsum(0) - counts  # first sorted position of each expert
    order = torch.argsort(flat, stable=True)  # pair ids in expert order
    expert_of = flat[order]
    # Sorted position i of expert e moves to e's padded group at the same offset i - start[e].
    dest = (padded_end - padded)[expert_of] + torch.arange(p, device=dev) - start[expert_of]
    sorted_pairs = torch.full((padded_len,), p, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    # A block's expert: the first whose padded group ends after the block's first row.
    first_row = torch.arange(0, padded_len, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, first_row, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    num_blocks = (padded_end[-1:] // block_m).to(torch.int32)
    return MoEAlignment(sorted_pairs, block_expert, num_blocks, block_m, p, num_experts,
                        topk_ids.shape[0])


@triton.jit
def _act_scale(xs_ptrs, k0, valid, A_SCALE: tl.constexpr, QB: tl.constexpr):
    """w8a8: the K slice's activation scale per row (one 128-column group); else 1."""
    if A_SCALE:
        a_s = tl.load(xs_ptrs + k0 // QB, mask=valid, other=0.0)[:, None]
    else:
        a_s = 1.0
    return a_s


@triton.jit
def _add_slice(acc, a, b, a_s, scale_ptrs, mask_n, HAS_SCALE: tl.constexpr,
               DOT_PREC: tl.constexpr):
    """``acc`` plus one K slice's product: in block fp8 (the slice lies in one scale column)
    its sum times the rows' activation scales ``a_s`` and the columns' weight scales at
    ``scale_ptrs``; otherwise one running dot."""
    if HAS_SCALE:
        acc += tl.dot(a, b, input_precision=DOT_PREC) * a_s * tl.load(
            scale_ptrs, mask=mask_n, other=0.0)[None, :]
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _k_loop_tma(desc, e_idx, row, up_row0, a_ptrs, xs_ptrs, s_gate, s_up, mask_n, valid, K,
                stride_sk, acc, acc_up, SWIGLU: tl.constexpr, HAS_SCALE: tl.constexpr,
                A_SCALE: tl.constexpr, QB: tl.constexpr, DOT_PREC: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K loop of one program with its weight tiles read through the TMA descriptor
    ``desc`` of an ``[E, N, K]`` weight (``e_idx``: the expert; ``row``: the tile's first gate
    row, ``up_row0 + row`` its first up row; reads past K are zeros). The arithmetic is the
    pointer loop's (per-block product scaling in fp8)."""
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        b = tl.trans(tl.reshape(desc.load([e_idx, row, k0]), [BLOCK_N, BLOCK_K])).to(a.dtype)
        a_s = _act_scale(xs_ptrs, k0, valid, A_SCALE, QB)
        col = (k0 // QB) * stride_sk
        acc = _add_slice(acc, a, b, a_s, s_gate + col, mask_n, HAS_SCALE, DOT_PREC)
        if SWIGLU:
            b_up = tl.trans(tl.reshape(desc.load([e_idx, up_row0 + row, k0]),
                                       [BLOCK_N, BLOCK_K])).to(a.dtype)
            acc_up = _add_slice(acc_up, a, b_up, a_s, s_up + col, mask_n, HAS_SCALE, DOT_PREC)
        a_ptrs += BLOCK_K
    return acc, acc_up


@triton.jit
def _moe_grouped_gemm_kernel(x_ptr, w_ptr, s_ptr, xs_ptr, out_ptr, os_ptr, ws_ptr, ss_ptr,
                             w_desc, tail_blocks,
                             pairs_ptr, bexp_ptr, nblk_ptr, N, K, num_pairs, rows_per_x,
                             max_blocks, stride_x, stride_xs, stride_we, stride_wn, stride_o,
                             stride_os, stride_se, stride_sn, stride_sk, up_row, up_scale_row,
                             limit, shared_expert, shared_limit, HAS_SHARED: tl.constexpr,
                             ACT_DT: tl.constexpr, QUANT_OUT: tl.constexpr,
                             FMAX: tl.constexpr, ROUND_E4M3: tl.constexpr,
                             SWIGLU: tl.constexpr, INTERLEAVE: tl.constexpr,
                             HAS_LIMIT: tl.constexpr,
                             HAS_SCALE: tl.constexpr, PRESCALE: tl.constexpr,
                             W_TMA: tl.constexpr, PART: tl.constexpr,
                             A_SCALE: tl.constexpr, QB: tl.constexpr,
                             DOT_PREC: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Swizzle: GROUP_M row blocks sweep the column tiles together, so their A rows and the
    # weight tiles they share stay in L2 (GROUP_M = 1: a row block's column tiles in a row).
    pid = tl.program_id(0)
    # Output columns per program: with the interleaved SwiGLU tile, half the tile's columns.
    TILE_OUT: tl.constexpr = BLOCK_N // 2 if INTERLEAVE else BLOCK_N
    tiles_n = tl.cdiv(N, TILE_OUT)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(max_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    used = tl.load(nblk_ptr)
    # PART 1: the blocks before the last tail_blocks (the routed experts' when the shared
    # expert, the last id, holds those); PART 2: only the last tail_blocks, whose expert is
    # the one weight this launch was given.
    if PART == 1:
        used -= tail_blocks
    if PART == 2:
        pid_m += used - tail_blocks
    if pid_m >= used:  # past the blocks this batch uses (sizes are worst-case)
        return
    if PART == 2:
        expert = tl.zeros([], dtype=tl.int64)
    else:
        expert = tl.load(bexp_ptr + pid_m).to(tl.int64)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs  # padding rows: sentinel ids, neither read nor written
    rows = (pairs // rows_per_x).to(tl.int64)
    if INTERLEAVE:
        # Tile column j holds output column j // 2: its gate row (even j) or its up row (odd
        # j), so one dot and one accumulator cover both halves (module docstring).
        cols = tl.arange(0, BLOCK_N)
        offs_n = pid_n * TILE_OUT + cols // 2
        half = cols % 2
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + rows[:, None] * stride_x + offs_k[None, :]
    xs_ptrs = xs_ptr + rows * stride_xs  # w8a8: each row's group scales
    # The weight tile as [BLOCK_K, BLOCK_N] (K contiguous): w[e]^T without a copy.
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    if HAS_SHARED:  # the shared expert's rows: its own weight (same row layout), own clamp
        is_shared = expert == shared_expert
        w_base = tl.where(is_shared, ws_ptr, w_base)
        s_base = tl.where(is_shared, ss_ptr, s_base)
        limit = tl.where(is_shared, shared_limit, limit)
    b_ptrs = w_base + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    s_gate = s_base + (offs_n // QB) * stride_sn
    s_up = s_gate + up_scale_row * stride_sn  # the up half's block rows follow the gate half's
    if INTERLEAVE:  # the odd columns read the up rows and their scale rows
        b_ptrs += (half * up_row).to(tl.int64)[None, :]
        s_gate += half * up_scale_row * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if W_TMA:  # the weight through its descriptor (a shared expert: a launch of its own)
        row = pid_n * BLOCK_N
        e32 = expert.to(tl.int32)  # descriptor coordinates are 32-bit
        acc, acc_up = _k_loop_tma(w_desc, e32, row, N, a_ptrs, xs_ptrs, s_gate, s_up, mask_n,
                                  valid, K, stride_sk, acc, acc_up, SWIGLU, HAS_SCALE, A_SCALE,
                                  QB, DOT_PREC, BLOCK_N, BLOCK_K)
    else:  # pointer loads of the weight tiles
        for k0 in range(0, K, BLOCK_K):
            mask_k = offs_k < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
            mask_b = mask_k[:, None] & mask_n[None, :]
            if PRESCALE:
                # This K slice lies in one scale column: each weight row (a column of the tile)
                # times its scale in fp32, rounded once to x's dtype, as the reference dequantises;
                # then one running dot (no fp32 scaling of each slice's result).
                col = (k0 // QB) * stride_sk
                q_gate = tl.load(b_ptrs, mask=mask_b, other=0.0).to(tl.float32)
                sc_gate = tl.load(s_gate + col, mask=mask_n, other=0.0)
                w_gate = (q_gate * sc_gate[None, :]).to(a.dtype)
                acc = tl.dot(a, w_gate, acc, input_precision=DOT_PREC)
                if SWIGLU and not INTERLEAVE:  # the up rows of the same columns, own scale rows
                    q_up = tl.load(b_ptrs + up_row, mask=mask_b, other=0.0).to(tl.float32)
                    sc_up = tl.load(s_up + col, mask=mask_n, other=0.0)
                    w_up = (q_up * sc_up[None, :]).to(a.dtype)
                    acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PREC)
            else:
                # e4m3 -> x's dtype: exact; with fp8 activations (w8a8) no conversion at all.
                b = tl.load(b_ptrs, mask=mask_b, other=0.0).to(a.dtype)
                a_s = _act_scale(xs_ptrs, k0, valid, A_SCALE, QB)
                col = (k0 // QB) * stride_sk
                acc = _add_slice(acc, a, b, a_s, s_gate + col, mask_n, HAS_SCALE, DOT_PREC)
                if SWIGLU and not INTERLEAVE:  # the up rows of the same columns, up_row further on
                    b_up = tl.load(b_ptrs + up_row, mask=mask_b, other=0.0).to(a.dtype)
                    acc_up = _add_slice(acc_up, a, b_up, a_s, s_up + col, mask_n, HAS_SCALE,
                                        DOT_PREC)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    offs_o = pid_n * TILE_OUT + tl.arange(0, TILE_OUT)
    if SWIGLU:
        if INTERLEAVE:  # [BLOCK_M, BLOCK_N] -> the even (gate) and odd (up) columns
            gate_acc, up_acc = tl.split(tl.reshape(acc, [BLOCK_M, TILE_OUT, 2]))
        else:
            gate_acc, up_acc = acc, acc_up
        # As the unfused path: gate and up rounded to the model dtype, then SwiGLU in fp32.
        gate = gate_acc.to(ACT_DT).to(tl.float32)
        up = up_acc.to(ACT_DT).to(tl.float32)
        act = gate * tl.sigmoid(gate)
        if HAS_LIMIT:
            act = tl.minimum(act, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        result = act * up
    else:
        result = acc
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_o + offs_o[None, :]
    mask_o = valid[:, None] & (offs_o < N)[None, :]
    if QUANT_OUT:
        # The down-projection's input quantised here (TILE_OUT is GROUPS whole 128-column
        # groups): the result rounded to the model dtype, as the unfused path stores it, then
        # fp8_act_quant's rule on each group (a row-major reshape makes each group a row);
        # columns past N are zero and leave amax alone.
        GROUPS: tl.constexpr = TILE_OUT // QB
        r = tl.where(mask_o, result.to(ACT_DT).to(tl.float32), 0.0)
        q, q_scale = quantize_groups(tl.reshape(r, [BLOCK_M * GROUPS, QB]), FMAX, ROUND_E4M3)
        tl.store(out_ptrs, tl.reshape(q, [BLOCK_M, TILE_OUT]).to(out_ptr.dtype.element_ty),
                 mask=mask_o)
        groups = pid_n * GROUPS + tl.arange(0, GROUPS)
        tl.store(os_ptr + pairs.to(tl.int64)[:, None] * stride_os + groups[None, :],
                 tl.reshape(q_scale, [BLOCK_M, GROUPS]),
                 mask=valid[:, None] & (groups * QB < N)[None, :])
    else:
        tl.store(out_ptrs, result.to(ACT_DT), mask=mask_o)


# ------------------------------------------------------------------------------ launch configs
# Without a table entry for the device and shape: 64-row blocks (a prefill chunk's experts hold
# tens of rows each), 128 output columns, BLOCK_K 64 (128 in fp8: one scale block per step),
# per-block product scaling in fp8 until a sweep has timed the pre-scaled tiles; see
# fallback_config for the row block of smaller batches.
DEFAULT_CONFIG = LaunchConfig(block_n=128, block_k=64, num_warps=4, num_stages=3, block_m=64,
                              group_m=1)
_FIELDS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
# Stored for fp8 entries only (a bf16 launch ignores it); a missing key reads as False, so the
# tables written before the field existed keep their meaning.
_FP8_FIELDS = ("fp8_prescale",)
# Stored for SwiGLU (up-projection) entries only, on the same terms.
_SWIGLU_FIELDS = ("swiglu_interleave",)


def fallback_config(num_experts: int, pairs: int, fp8: bool) -> LaunchConfig:
    """:data:`DEFAULT_CONFIG` (BLOCK_K 128 in fp8) with a row block no taller than the mean
    group needs (16..64 rows): at a few pairs per expert a 64-row block would be mostly
    padding, multiplied all the same."""
    per_expert = triton.next_power_of_2(max(-(-pairs // max(num_experts, 1)), 1))
    return DEFAULT_CONFIG._replace(block_m=min(max(per_expert, 16), DEFAULT_CONFIG.block_m),
                                   block_k=QBLOCK if fp8 else DEFAULT_CONFIG.block_k)


def config_key(num_experts: int, n: int, k: int, fp8: bool, act_fp8: bool = False) -> str:
    """The table's key of a weight ``[E, N, K]`` in bf16 or block fp8, the latter on activations
    in the model dtype (``dtype=fp8``) or quantised to fp8 (``act_fp8``: ``dtype=w8a8``)."""
    if act_fp8 and not fp8:
        raise ValueError("moe_grouped_gemm: fp8 activations need block-fp8 weights")
    return f"E={num_experts},N={n},K={k},dtype={'w8a8' if act_fp8 else 'fp8' if fp8 else 'bf16'}"


@functools.lru_cache(maxsize=8)
def load_config_table(path: str = CONFIG_PATH) -> Dict[str, dict]:
    """``{device name: {config_key: {pairs bucket (str): config fields}}}`` from ``path``
    (keys starting with ``_`` are notes); an absent file is an empty table."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        table = json.load(f)
    return {dev: shapes for dev, shapes in table.items()
            if not dev.startswith("_") and isinstance(shapes, dict)}


@functools.lru_cache(maxsize=16)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _from_fields(fields: dict) -> LaunchConfig:
    return LaunchConfig(block_n=int(fields["block_n"]), block_k=int(fields["block_k"]),
                        num_warps=int(fields["num_warps"]), num_stages=int(fields["num_stages"]),
                        block_m=int(fields["block_m"]), group_m=int(fields.get("group_m", 1)),
                        fp8_prescale=bool(fields.get("fp8_prescale", False)),
                        swiglu_interleave=bool(fields.get("swiglu_interleave", False)),
                        weight_tma=bool(fields.get("weight_tma", False)))


def config_fields(cfg: LaunchConfig, fp8: bool = False, swiglu: bool = False) -> dict:
    """The table's record of ``cfg``; for an fp8 weight (``fp8``) also its inner-loop scheme
    ``fp8_prescale`` (bf16 records leave it out: the kernel ignores it there), for a SwiGLU
    up-projection (``swiglu``) also its tile layout ``swiglu_interleave``."""
    names = _FIELDS + (_FP8_FIELDS if fp8 else ()) + (_SWIGLU_FIELDS if swiglu else ())
    names += ("weight_tma",) if cfg.weight_tma else ()  # absent reads as pointer loads
    return {name: getattr(cfg, name) for name in names}


def launch_config(num_experts: int, n: int, k: int, pairs: int, fp8: bool = False,
                  device: Optional[torch.device] = None, swiglu: bool = False,
                  table_path: str = CONFIG_PATH, act_fp8: bool = False) -> LaunchConfig:
    """Tiles of :func:`moe_grouped_gemm` for a weight ``[E, N, K]`` (N counts the gate and up
    rows of a SwiGLU weight) and ``pairs`` (token, expert) pairs.

    From the table at ``table_path`` under the CUDA device's name and :func:`config_key` (with
    ``act_fp8``: the w8a8 entry, fp8 activations with their group scales): the
    entry of the pair bucket nearest ``pairs`` on a log scale (the sweep times powers of two;
    an entry without ``fp8_prescale`` takes per-block product scaling).
    Without an entry, :func:`fallback_config`; under Triton's CPU interpreter,
    whose cost is per program and per op, 16-row blocks and whole-width column / K tiles (at most
    128 wide)."""
    out_cols = n // 2 if swiglu else n
    if INTERPRETED or device is None or torch.device(device).type != "cuda":
        return LaunchConfig(block_n=min(triton.next_power_of_2(max(out_cols, 16)), 128),
                            block_k=min(triton.next_power_of_2(max(k, 16)), 128),
                            block_m=16, group_m=1)
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    buckets = table_entry(num_experts, n, k, fp8, _device_name(index), table_path, act_fp8)
    return select_config(buckets, num_experts, pairs, fp8)


def _gpu_model(device_name: str) -> Optional[Tuple[str, str]]:
    """(vendor, model) of a GPU name: its first word and its first word with a digit
    (``NVIDIA H100 PCIe`` -> ``("NVIDIA", "H100")``, ``NVIDIA GeForce RTX 4090`` ->
    ``("NVIDIA", "4090")``); None when no word has a digit."""
    words = device_name.split()
    model = next((w for w in words[1:] if any(c.isdigit() for c in w)), None)
    return (words[0], model) if model else None


def table_device(device_names: Iterable[str], device_name: str) -> Optional[str]:
    """Which of the table's ``device_names`` holds the tiles for the GPU called
    ``device_name``: that name itself, else one of the same model (:func:`_gpu_model`; e.g.
    ``NVIDIA H100 PCIe`` takes ``NVIDIA H100 80GB HBM3``: the same SM and shared memory, so
    the same tiles fit), else None. Of several such names, the first in order."""
    names = list(device_names)
    if device_name in names:
        return device_name
    model = _gpu_model(device_name)
    same = [name for name in names if model is not None and _gpu_model(name) == model]
    return same[0] if same else None


@functools.lru_cache(maxsize=16)
def _note_table_device(device_name: str, chosen: Optional[str], table_path: str) -> None:
    """Say once per GPU name when its tiles are not its own (the lru_cache makes it once)."""
    if chosen == device_name:
        return
    how = (f"using those of {chosen!r}" if chosen else
           "using the fallback tiles, which may be several times slower at prefill sizes")
    logger.warning("moe_grouped_gemm: no tiles for %r in %s; %s. "
                   "benchmark/kernels/tune_moe_grouped_gemm.py sweeps and writes them.",
                   device_name, table_path, how)


def table_entry(num_experts: int, n: int, k: int, fp8: bool, device_name: str,
                table_path: str = CONFIG_PATH, act_fp8: bool = False
                ) -> Optional[Dict[str, dict]]:
    """The table's ``{pairs bucket (str): config fields}`` for a weight ``[E, N, K]`` (on fp8
    activations: ``act_fp8``) on the GPU called ``device_name`` (``torch.cuda.get_device_name``;
    a GPU absent from the table takes the entries of its model's, :func:`table_device`, with
    one warning), None without an entry."""
    table = load_config_table(table_path)
    chosen = table_device(table, device_name)
    _note_table_device(device_name, chosen, table_path)
    return table.get(chosen or "", {}).get(config_key(num_experts, n, k, fp8, act_fp8)) or None


def nearest_bucket(buckets: Iterable[str], pairs: int) -> str:
    """The bucket (a table key: a pair count as a string) nearest ``pairs`` on a log scale; a
    tie goes to the first of ``buckets`` in their order (the table's)."""
    return min(buckets, key=lambda b: abs(math.log(max(int(b), 1)) - math.log(max(pairs, 1))))


def select_config(buckets: Optional[Mapping[str, dict]], num_experts: int, pairs: int,
                  fp8: bool) -> LaunchConfig:
    """What :func:`launch_config` returns on a CUDA device whose table entry is ``buckets``
    (:func:`table_entry`; None or empty: :func:`fallback_config`) for ``pairs`` pairs. Needs no
    GPU, so a plan of the compiles a batch size causes can be made anywhere."""
    if buckets:
        return _from_fields(buckets[nearest_bucket(buckets, pairs)])
    return fallback_config(num_experts, pairs, fp8)


def _config_rank(buckets: Optional[Mapping[str, dict]], num_experts: int, pairs: int,
                 fp8: bool) -> int:
    """A number that never decreases with ``pairs`` and changes wherever
    :func:`select_config`'s choice may: the chosen bucket (each bucket wins one contiguous
    range of pair counts on the log scale, the ranges in the buckets' order) or, without a
    table entry, the fallback's row block (a power of two growing with the pairs)."""
    if buckets:
        return int(nearest_bucket(buckets, pairs))
    return fallback_config(num_experts, pairs, fp8).block_m


def config_change_points(buckets: Optional[Mapping[str, dict]], num_experts: int, fp8: bool,
                         lo_pairs: int, hi_pairs: int) -> List[int]:
    """The pair counts ``p`` in ``(lo_pairs, hi_pairs]`` where :func:`select_config` picks a
    different config than for ``p - 1`` (sorted): between two of them every batch launches
    the same tiles. Buckets with equal fields are one config (no change point between them).
    Found by bisection of :func:`_config_rank`, a few dozen evaluations per change."""
    def rank(p: int) -> int:
        return _config_rank(buckets, num_experts, p, fp8)

    points: List[int] = []

    def split(lo: int, hi: int) -> None:  # every rank change in (lo, hi]; rank is monotone
        if hi <= lo or rank(lo) == rank(hi):
            return
        if hi == lo + 1:
            points.append(hi)
            return
        mid = (lo + hi) // 2
        split(lo, mid)
        split(mid, hi)

    split(max(lo_pairs, 1), hi_pairs)
    return [p for p in points if select_config(buckets, num_experts, p, fp8)
            != select_config(buckets, num_experts, p - 1, fp8)]


def launch_int_args(num_pairs: int, num_experts: int, block_m: int) -> Tuple[int, int]:
    """The integer arguments of a :func:`moe_grouped_gemm` launch that follow the batch:
    ``(num_pairs, max_blocks)`` (the others follow the weight). Triton compiles one variant of
    the kernel per class of each (equal to 1, divisible by 16, other), so these say which
    variant a batch of ``num_pairs`` pairs needs."""
    return num_pairs, max_padded_pairs(num_pairs, num_experts, block_m) // block_m


def _check_config(cfg: LaunchConfig, fp8: bool) -> None:
    for name in ("block_m", "block_n", "block_k"):
        val = getattr(cfg, name)
        if val is None or val < 16 or val & (val - 1):
            raise ValueError(f"moe_grouped_gemm: {name} must be a power of two >= 16 (tl.dot), "
                             f"got {val}")
    if fp8 and QBLOCK % cfg.block_k:
        raise ValueError(f"moe_grouped_gemm: a block-fp8 K slice must lie in one scale block "
                         f"(block_k dividing {QBLOCK}), got {cfg.block_k}")
    if cfg.group_m < 1:
        raise ValueError(f"moe_grouped_gemm: group_m must be >= 1, got {cfg.group_m}")


def moe_grouped_gemm(x: torch.Tensor, w: torch.Tensor, align: MoEAlignment, *, rows_per_x: int,
                     swiglu: bool, swiglu_limit: float = 0.0,
                     w_scale: Optional[torch.Tensor] = None,
                     config: Optional[LaunchConfig] = None,
                     out: Optional[torch.Tensor] = None,
                     x_scale: Optional[torch.Tensor] = None,
                     out_dtype: Optional[torch.dtype] = None,
                     quantize_out: bool = False,
                     shared_w: Optional[torch.Tensor] = None,
                     shared_scale: Optional[torch.Tensor] = None,
                     shared_limit: float = 0.0
                     ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """``out [P, N_out]`` (x's dtype) with ``out[p] = w[e_p] @ x[p // rows_per_x]`` for every
    pair of ``align`` (:func:`moe_align` of the routes), or with ``swiglu`` the clamped SwiGLU of
    ``[gate; up] = w[e_p] @ x[..]`` (``N_out = N / 2``; ``swiglu_limit`` 0 = no clamp).

    ``x [P / rows_per_x, K]`` and ``w [E, N, K]`` with contiguous last dims (any expert / row
    stride: a TP slice works). ``w`` in x's dtype, or ``float8_e4m3fn`` with its fp32 block scales
    ``w_scale`` (:mod:`sgl_kernel.fp8_blocks`; SwiGLU: gate and up on their own grids).
    ``config`` defaults to :func:`launch_config` with ``align.block_m``; a given one must have
    ``align``'s ``block_m``; its ``fp8_prescale`` picks the fp8 inner loop (module docstring)
    and is ignored for a weight in x's dtype. Sentinel rows are never written; every pair's row
    is.

    w8a8: ``x`` in ``float8_e4m3fn`` with its per-row, 128-column group scales ``x_scale [M,
    ceil(K/128)]`` (:func:`sgl_kernel.fp8_act_quant.per_token_group_quant_fp8`) and a block-fp8
    ``w``: the dot runs on the e4m3 operands and each K slice's sum is scaled by the row's
    activation scale times the column's weight scale (``fp8_prescale`` does not apply).
    ``out_dtype`` (the model dtype; needed when ``out`` is not given) is then the output's
    dtype; otherwise the output has x's dtype.

    ``quantize_out`` (the w8a8 up-projection, whose output is the down-projection's input):
    the result, rounded to that dtype as it would be stored, is quantised per row and
    128-column group by :mod:`sgl_kernel.fp8_act_quant`'s rule inside the epilogue, and
    ``(q float8_e4m3fn [P, N_out], scale fp32 [P, ceil(N_out / 128)])`` is returned: bit for
    bit ``per_token_group_quant_fp8`` of the plain output, without storing it. Needs tiles of
    whole 128-column groups (:func:`quantizes_out`); ``out`` is not taken.

    ``shared_w [N, K]`` (with ``shared_scale`` for block fp8, and its own SwiGLU clamp
    ``shared_limit``): one more expert, id ``E`` in ``align`` (aligned over ``E + 1``
    experts), whose rows use this weight instead of ``w[E]``: the shared expert as pairs of
    the routed experts' launches (every token routed to it once). Its layout must be one
    routed expert's (same shape, dtype and row strides; a TP slice of each is fine)."""
    e, n, k = w.shape if w.dim() == 3 else (None, None, None)
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != k:
        raise ValueError(f"moe_grouped_gemm: expected x [M, K], w [E, N, K]; got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}")
    p = align.num_pairs
    has_shared = shared_w is not None
    if rows_per_x < 1 or x.shape[0] * rows_per_x != p or align.num_experts != e + has_shared:
        raise ValueError(f"moe_grouped_gemm: x has {x.shape[0]} rows x rows_per_x {rows_per_x} "
                         f"for {p} aligned pairs of {align.num_experts} experts (w has {e}"
                         f"{' and a shared expert' if has_shared else ''})")
    if x.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError("moe_grouped_gemm: the last dims of x and w must be contiguous")
    fp8 = w.dtype == torch.float8_e4m3fn
    act_fp8 = x.dtype == torch.float8_e4m3fn
    if act_fp8 != (x_scale is not None) or (act_fp8 and not fp8):
        raise ValueError(f"moe_grouped_gemm: fp8 activations need their group scales (x_scale) "
                         f"and a block-fp8 weight; got x {x.dtype}, w {w.dtype}, x_scale given: "
                         f"{x_scale is not None}")
    if act_fp8:
        groups = -(-k // QBLOCK)
        if (x_scale.dtype != torch.float32 or tuple(x_scale.shape) != (x.shape[0], groups)
                or x_scale.stride(1) != 1):
            raise ValueError(f"moe_grouped_gemm: x_scale must be fp32 [{x.shape[0]}, {groups}] "
                             f"(one scale per row and {QBLOCK} columns) with a contiguous last "
                             f"dim, got {x_scale.dtype} {tuple(x_scale.shape)}")
        out_dtype = out.dtype if out is not None and out_dtype is None else out_dtype
        if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"moe_grouped_gemm: fp8 activations need out_dtype (bf16, fp16 or "
                             f"fp32), got {out_dtype}")
    else:
        out_dtype = x.dtype
    if fp8 != (w_scale is not None) or (not fp8 and w.dtype != x.dtype):
        raise ValueError(f"moe_grouped_gemm: w must be x's dtype ({x.dtype}) or float8_e4m3fn "
                         f"with its block scales, got {w.dtype} (w_scale given: "
                         f"{w_scale is not None})")
    if swiglu and n % 2:
        raise ValueError(f"moe_grouped_gemm: SwiGLU needs [gate; up] rows, got {n} rows")
    n_out = n // 2 if swiglu else n
    if fp8:
        check_block_scale(w, w_scale, n_out if swiglu else None, "moe_grouped_gemm w")
    if has_shared and (tuple(shared_w.shape) != (n, k) or shared_w.dtype != w.dtype
                       or shared_w.stride() != w.stride()[1:]
                       or (shared_scale is None) != (w_scale is None)
                       or (fp8 and (tuple(shared_scale.shape) != tuple(w_scale.shape[1:])
                                    or shared_scale.stride() != w_scale.stride()[1:]))):
        raise ValueError(f"moe_grouped_gemm: the shared expert must be laid out as one routed "
                         f"expert ({w.dtype} [{n}, {k}], its scales beside it), got "
                         f"{shared_w.dtype} {tuple(shared_w.shape)} stride {shared_w.stride()}")
    if quantize_out and out is not None:
        raise ValueError("moe_grouped_gemm: quantize_out allocates its own outputs; pass no out")
    if quantize_out:
        out = torch.empty(p, n_out, dtype=torch.float8_e4m3fn, device=x.device)
        out_scale = torch.empty(p, -(-n_out // QBLOCK), dtype=torch.float32, device=x.device)
    elif out is None:
        out = torch.empty(p, n_out, dtype=out_dtype, device=x.device)
    elif tuple(out.shape) != (p, n_out) or out.stride(1) != 1 or out.dtype != out_dtype:
        raise ValueError(f"moe_grouped_gemm: out must be [{p}, {n_out}] {out_dtype} with a "
                         f"contiguous last dim, got {tuple(out.shape)} {out.dtype}")
    if config is None:
        config = launch_config(e, n, k, p, fp8, x.device, swiglu,
                               act_fp8=act_fp8)._replace(block_m=align.block_m)
    elif config.block_m != align.block_m:
        raise ValueError(f"moe_grouped_gemm: config.block_m {config.block_m} != the alignment's "
                         f"{align.block_m}")
    _check_config(config, fp8)
    if quantize_out and not quantizes_out(config, swiglu):
        raise ValueError(f"moe_grouped_gemm: quantize_out needs tiles of whole {QBLOCK}-column "
                         f"activation groups, got block_n {config.block_n}"
                         f"{' interleaved' if swiglu and config.swiglu_interleave else ''}")
    max_blocks = align.block_expert.shape[0]
    if p == 0 or n_out == 0 or max_blocks == 0:
        return (out, out_scale) if quantize_out else out
    scale = w_scale if fp8 else placeholder(x.device)
    xs = x_scale if act_fp8 else placeholder(x.device)
    # With a shared expert the clamp is chosen per row block; "no clamp" is then +inf, whose
    # min / clamp leave every value as it is.
    lims = [float(swiglu_limit), float(shared_limit) if has_shared else 0.0]
    has_limit = swiglu and any(v > 0 for v in lims)
    limit, s_limit = (v if v > 0 or not has_limit else float("inf") for v in lims)
    # fp32 operands: full-precision products (Triton's default on CUDA would be TF32).
    prec = "ieee" if x.dtype == torch.float32 else None
    interleave = swiglu and bool(config.swiglu_interleave)
    tile_out = config.block_n // 2 if interleave else config.block_n
    os_ = out_scale if quantize_out else placeholder(x.device)
    ws = shared_w if has_shared else placeholder(x.device)
    ss = shared_scale if has_shared and fp8 else placeholder(x.device)
    w_tma = bool(config.weight_tma)
    if w_tma and not weight_tma_applies(config, swiglu, fp8 and not act_fp8, n_out, w,
                                        shared_w):
        raise ValueError(f"moe_grouped_gemm: weight_tma needs tiles inside one expert's rows "
                         f"({n_out} output rows, block_n {config.block_n}), the weight as stored "
                         f"(no interleaved SwiGLU tile, no pre-scaled fp8 tile) and 16-byte "
                         f"aligned rows")
    if w_tma and has_shared and align.num_tokens < 1:
        raise ValueError("moe_grouped_gemm: weight_tma with a shared expert needs the "
                         "alignment's num_tokens (moe_align records it)")
    tiles_n = triton.cdiv(n_out, tile_out)

    def launch(weight, w_scale_, limit_, part, blocks, tail):
        _moe_grouped_gemm_kernel[(blocks * tiles_n,)](
            x, weight, w_scale_, xs, out, os_, ws, ss,
            _weight_descriptor(weight, config) if w_tma else None, tail, align.sorted_pairs,
            align.block_expert, align.num_blocks, n_out, k, p, rows_per_x, blocks, x.stride(0),
            xs.stride(0) if act_fp8 else 0, weight.stride(0), weight.stride(1),
            out.stride(0), os_.stride(0) if quantize_out else 0,
            w_scale_.stride(0) if fp8 else 0, w_scale_.stride(1) if fp8 else 0,
            w_scale_.stride(2) if fp8 else 0, n_out * weight.stride(1), -(-n_out // QBLOCK),
            limit_, e, s_limit, HAS_SHARED=has_shared and part == 0,
            ACT_DT=_TL_DTYPES[out_dtype], QUANT_OUT=quantize_out, FMAX=FP8_MAX,
            ROUND_E4M3=INTERPRETED, SWIGLU=swiglu, INTERLEAVE=interleave, HAS_LIMIT=has_limit,
            HAS_SCALE=fp8,
            PRESCALE=fp8 and not act_fp8 and bool(config.fp8_prescale), W_TMA=w_tma,
            PART=part, A_SCALE=act_fp8, QB=QBLOCK, DOT_PREC=prec,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, **compiler_options(config.num_warps, config.num_stages))

    if w_tma and has_shared:
        # One descriptor per launch: the routed experts' blocks, then the shared expert's
        # (the last id: its T pairs are the last ceil(T / block_m) blocks in use) with its
        # own weight, scales and clamp. Choosing a descriptor per program inside one launch
        # would compile the pipelined K loop twice (twice the shared memory).
        tail = -(-align.num_tokens // align.block_m)
        launch(w, scale, limit, 1, max_blocks, tail)
        launch(shared_w.unsqueeze(0), shared_scale.unsqueeze(0) if fp8 else scale, s_limit, 2,
               tail, tail)
    else:  # one launch; a shared expert's rows pick their weight per program
        launch(w, scale, limit, 0, max_blocks, 0)
    return (out, out_scale) if quantize_out else out


def weight_tma_applies(config: LaunchConfig, swiglu: bool, prescale_possible: bool, n_out: int,
                       w: torch.Tensor, shared_w: Optional[torch.Tensor] = None) -> bool:
    """Whether ``config`` may read the weight ``w [E, N, K]`` through a TMA descriptor
    (``LaunchConfig.weight_tma``): every column tile inside one expert's rows (``block_n``
    divides the ``n_out`` output rows), the weight tile used as stored (no interleaved SwiGLU
    tile; no pre-scaled fp8 tile where the weight-only fp8 loop could take one:
    ``prescale_possible``), and the rows 16-byte aligned (a TMA descriptor's rule), the shared
    expert's too."""
    if n_out % config.block_n or (swiglu and config.swiglu_interleave):
        return False
    if prescale_possible and config.fp8_prescale:
        return False
    return all(t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0
                                               for st in t.stride()[:-1])
               for t in ([w] if shared_w is None else [w, shared_w]))


def _weight_descriptor(w: torch.Tensor, config: LaunchConfig):
    """The TMA descriptor of ``w [E, N, K]`` whose box is one ``[block_n, block_k]`` weight
    tile of one expert (reads past K are zeros)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(w, list(w.shape), list(w.stride()),
                            [1, config.block_n, config.block_k])


def quantizes_out(config: LaunchConfig, swiglu: bool) -> bool:
    """Whether :func:`moe_grouped_gemm` with ``config`` can quantise its output in the
    epilogue (``quantize_out``): each program's output tile is whole 128-column groups."""
    tile_out = config.block_n // 2 if swiglu and config.swiglu_interleave else config.block_n
    return tile_out % QBLOCK == 0


def moe_grouped_gemm_reference(x: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, *,
                               rows_per_x: int, swiglu: bool, swiglu_limit: float = 0.0,
                               w_scale: Optional[torch.Tensor] = None,
                               x_scale: Optional[torch.Tensor] = None,
                               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Plain-torch :func:`moe_grouped_gemm` over the routes ``topk_ids [T, k]`` (pair ``p`` =
    ``t * k + slot``): per pair the expert's weight (block fp8: ``q * scale`` in fp32) times its
    row of x in fp32, rounded to x's dtype; with ``swiglu`` the gate and up halves are rounded,
    then ``min(silu(gate), limit) * clamp(up, -limit, limit)`` (no clamp at 0) in fp32, rounded
    once (``sglang.srt.layers.activation.silu_and_mul``). w8a8 (``x`` e4m3 with ``x_scale``):
    the rows are ``q * scale`` in fp32 and the results are rounded to ``out_dtype``."""
    dtype = x.dtype
    if x_scale is not None:
        x = x.float() * x_scale.float().repeat_interleave(QBLOCK, -1)[:, :x.shape[1]]
        dtype = out_dtype
    ids = topk_ids.reshape(-1).long()
    weights = w[ids]
    if w_scale is not None:
        n = w.shape[1]
        weights = block_dequantize(weights, w_scale[ids], torch.float32,
                                   n // 2 if swiglu else None)
    rows = x.repeat_interleave(rows_per_x, dim=0) if rows_per_x > 1 else x
    h = torch.einsum("pnk,pk->pn", weights.float(), rows.float()).to(dtype)
    if not swiglu:
        return h
    i = h.shape[1] // 2
    gate, up = h[:, :i].float(), h[:, i:].float()
    act = torch.nn.functional.silu(gate)
    if swiglu_limit > 0:
        act = act.clamp(max=swiglu_limit)
        up = up.clamp(-swiglu_limit, swiglu_limit)
    return (act * up).to(dtype)
