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
written by ``benchmark/kernels/tune_moe_grouped_gemm.py``) through
:func:`sgl_kernel.moe_grouped_gemm_configs.launch_config`; the pair list from
:mod:`sgl_kernel.moe_align`. Reference: :func:`moe_grouped_gemm_reference`.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from sgl_kernel._triton_mode import INTERPRETED, LaunchConfig, compiler_options, placeholder
from sgl_kernel.fp8_act_quant import quantize_groups
from sgl_kernel.fp8_blocks import FP8_MAX, QBLOCK, block_dequantize, check_block_scale
# The kernel's inputs, from their own modules: a caller of the kernel needs these three with it.
from sgl_kernel.moe_align import MoEAlignment, moe_align
from sgl_kernel.moe_grouped_gemm_configs import launch_config

__all__ = ["moe_grouped_gemm", "moe_grouped_gemm_reference", "weight_tma_applies",
           "quantizes_out", "MoEAlignment", "moe_align", "launch_config", "LaunchConfig"]

# The model dtypes the epilogue rounds to (gate and up, and the output before a quantisation).
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


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
