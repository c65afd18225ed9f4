"""``x @ w.T`` for a block-fp8 weight at prefill row counts: a tiled Triton GEMM that reads the
e4m3 weight and its block scales directly, instead of dequantising the whole weight first.

The weight is ``float8_e4m3fn [N, K]`` with one fp32 scale per ``128 x 128`` block
(:mod:`sgl_kernel.fp8_blocks`; a fused weight of several pieces passes ``w_scale_rows``, the
scale row of every weight row). Each program computes a ``BLOCK_M x BLOCK_N`` output tile; the
tiles are visited in groups of ``GROUP_M`` row tiles (the programs running together share their
weight tiles in L2), and the K loop is software-pipelined over ``num_stages`` buffers. A step
loads an e4m3 weight tile, converts it to x's dtype (exact: every e4m3 value is a bf16 and an
fp16 value), runs ``tl.dot`` with an fp32 result over ``BLOCK_K`` columns inside one 128-column
scale block, and adds that sum times the block's scales (one per output column) to the fp32
accumulator ("per-block product scaling"). The bias is added in fp32 and the result rounded
once to x's dtype.

``LaunchConfig.fp8_prescale`` selects a second inner loop, "pre-scaled weight tiles": the e4m3
tile is converted to fp32, each weight row multiplied by its block scale (``BLOCK_K`` still
divides 128: one scale per row and step), rounded to x's dtype and fed to one running
``tl.dot(x, w, acc)`` over K, with no fp32 multiply-add of each step's result into the
accumulator. Its weight values are exactly the dequantised weight of the reference path
(:func:`block_fp8_dequantize`: the fp32 product rounded once to x's dtype), up to the fp32
summation order. Compiled for sm_90 by Triton 3.6 (``test_sm90_compile_prefill.py``) both
loops still end each K step with ``wgmma.wait_group 0``: the weight tile goes from registers to
shared memory either way. Off by default until ``bench_fp8_gemm.py``'s "prescaled" columns
have timed it against the per-block scaling on the GPU (docs/performance.md, "Not measured
yet").

Weight-only ("w8a16", the default): the result is the product with the exact weight
``q * scale``, up to the fp32 summation order: the same values as
:func:`block_fp8_gemm_reference` (dequantise in fp32, matmul), and the same weight the small-M
kernel (:mod:`sgl_kernel.small_m_gemm`) uses for decode, so prefill and decode compute with one
weight. From a few hundred rows on, a dense projection of this model (K = 2560 .. 6144) is
compute-bound on the bf16 tensor cores; the fp8 weight halves the weight bytes, which only
matter below that.

fp8 activations ("w8a8", ``x_scale``; the ``A_SCALE`` constexpr of the same kernel): x comes
quantised per token and 128-column group
(:func:`sgl_kernel.fp8_act_quant.per_token_group_quant_fp8`: ``scale = amax / 448``, e4m3
values; the layout the published fp8 checkpoints' ``activation_scheme: "dynamic"`` asks for). A
``BLOCK_K`` step (``BLOCK_K`` divides 128) then lies in one activation group and one weight
block: both e4m3 tiles go to ``tl.dot`` unconverted (the fp8 tensor cores, twice the bf16 rate
on H100 / H200: sm_90's ``wgmma ... .f32.e4m3.e4m3``, checked by
``test_sm90_compile_prefill.py``), and the step's fp32 sum is added to the fp32 accumulator as
``dot * a_scale[:, None] * w_scale[None, :]`` (one activation scale per row, one weight scale
per output column); the bias in fp32, one rounding to ``out_dtype``. Scaling every step's sum
also bounds the fp8 tensor cores' reduced-precision accumulation (Triton's sm_90 default lets
wgmma accumulate fp8 products imprecisely over a whole dot) to ``BLOCK_K`` products before fp32
takes over. No dequantised weight is formed and x is read at one byte a value. Pre-scaled tiles
do not apply (they round ``q * scale`` to x's dtype) and are refused; ``swap_ab`` runs the same
fp32 products transposed.

Its numerics: the product of the dequantised activations
(:func:`sgl_kernel.fp8_act_quant.group_dequantize`) with the exact weight, up to summation
order (:func:`block_fp8_gemm_reference` with ``x_scale``). Against the weight-only product it
carries the activations' e4m3 rounding: each value is off by at most 2^-4 of itself (3
mantissa bits, round to nearest) or, below e4m3's normal range, by 2^-10 of its group's scale;
on Gaussian activations that came to about 2.5 % norm-wise (``test_fp8_gemm.py``, "error
against the weight-only product"). The small-M kernel keeps decode weight-only, so with w8a8
prefill and decode no longer multiply the same activation values. :func:`block_fp8_linear`
takes it only when asked (``fp8_activations=True``: a dense block-fp8 layer passes its
``fp8_activations``, set by ``KernelChoices.dense_fp8_activations``), which is off by default until
``bench_fp8_gemm.py``'s w8a8 columns have timed it against the dequantise + cuBLAS path on the
GPU and the model's accuracy has been checked with it.

Why the engine dequantises instead (timings: docs/performance.md, the prefill section's "Dense
fp8 at prefill sizes"): at prefill sizes this kernel runs far below cuBLAS's rate on a bf16
weight, and a sweep of its tiles does not close the gap. Its variants (``fp8_gemm_variants.py``)
place the loss: the e4m3 -> bf16 conversion costs part of it, and the per-block promotion (each
block's dot result waited on, then scaled) the rest, since the tensor cores idle while a step's
sum is scaled. A one-pass Triton dequantisation (:func:`block_fp8_dequantize`: one read of the
fp8 weight, one write in x's dtype, where the torch path makes several full-size fp32 passes)
followed by cuBLAS adds only that pass to the bf16 GEMM, and was faster than both this kernel
and the torch dequantisation at every row count measured (128 to 8192). So the engine's entry
point :func:`block_fp8_linear` takes, weight-only, the dequantisation + library GEMM (the
reference path's values, bit for bit) and this kernel only up to ``FUSED_MAX_ROWS`` rows, now
none. With ``fp8_activations`` it takes this kernel's w8a8 variant at every row count it is
called for: no conversion is left and the tensor cores run at the fp8 rate, but the per-block
promotion stays (it is what keeps the fp8 accumulation short); whether that beats the
dequantisation + cuBLAS is for the GPU run of ``bench_fp8_gemm.py`` to show.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel._triton_mode import INTERPRETED, LaunchConfig, compiler_options
from sgl_kernel.fp8_blocks import QBLOCK, block_dequantize, check_block_scale

__all__ = ["gemm_config", "block_fp8_gemm", "block_fp8_gemm_reference", "block_fp8_dequantize",
           "block_fp8_linear", "launch_config", "FUSED_MAX_ROWS"]

# Rows up to which block_fp8_linear takes the fused GEMM: none, since the dequantisation pass +
# cuBLAS was faster at every measured row count from 128 (module docstring, "Why the engine
# dequantises instead"); the engine's range above the small-M kernel starts at 65 rows.
FUSED_MAX_ROWS = 0


def gemm_config(block_m: int, block_n: int, block_k: int = QBLOCK, group_m: int = 8,
                num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                swap_ab: bool = False, fp8_prescale: bool = False) -> LaunchConfig:
    """The :class:`LaunchConfig` of one :func:`block_fp8_gemm` launch, in this kernel's field
    order and defaults (a 128-column K step, 8 row tiles per swizzle group). ``block_k`` divides
    the 128-column scale block; ``swap_ab`` computes the transposed tile (the converted weight
    tile as the dot's first operand, which Hopper's wgmma may take from registers);
    ``fp8_prescale`` scales the weight tile before one running dot instead of scaling each
    step's dot result (module docstring)."""
    return LaunchConfig(block_n=block_n, block_k=block_k, num_warps=num_warps,
                        num_stages=num_stages, swap_ab=swap_ab, block_m=block_m,
                        group_m=group_m, fp8_prescale=fp8_prescale)


@triton.jit
def _block_fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, srow_ptr, xs_ptr, b_ptr, out_ptr, M, N, K,
                           stride_xm, stride_wn, stride_sn, stride_xsm, stride_om,
                           HAS_BIAS: tl.constexpr, ROW_MAP: tl.constexpr, EVEN_K: tl.constexpr,
                           QB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr,
                           PRESCALE: tl.constexpr, A_SCALE: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
    # Grouped order: GROUP_M row tiles walk the column tiles together, so a weight tile is read
    # from HBM once per group and from L2 by the others running beside it.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past M / N wrap onto valid ones (their results are never stored), so the loads need
    # no row masks: only a ragged last K step is masked.
    rows_m = (offs_m % M).to(tl.int64)
    rows_n = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    if ROW_MAP:  # a weight of several pieces, each on its own block grid
        s_ptrs = s_ptr + tl.load(srow_ptr + rows_n).to(tl.int64) * stride_sn
    else:
        s_ptrs = s_ptr + (rows_n // QB).to(tl.int64) * stride_sn
    if A_SCALE:  # e4m3 x: one scale per row and 128-column group, the weight's K blocks
        xs_ptrs = xs_ptr + rows_m * stride_xsm

    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            in_k = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=in_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=in_k[None, :], other=0.0)
        # The step lies in one scale block (BLOCK_K divides QB): one scale per weight row.
        scale = tl.load(s_ptrs + k0 // QB)
        if A_SCALE:
            # Both operands e4m3 (the fp8 tensor cores): the step's fp32 sum times the outer
            # product of its activation scales (one per row) and weight scales (one per output
            # column) is the product of the two dequantised slices. Scaling each step's sum
            # also bounds the tensor cores' reduced-precision fp8 accumulation to BLOCK_K
            # products before the fp32 accumulator takes over.
            x_scale = tl.load(xs_ptrs + k0 // QB)
            if SWAP_AB:
                # the same fp32 products in the same order as the plain tile's, transposed
                acc += (tl.dot(w, tl.trans(x), input_precision=DOT_PRECISION)
                        * x_scale[None, :] * scale[:, None])
            else:
                acc += (tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
                        * x_scale[:, None] * scale[None, :])
        elif PRESCALE:
            # q * scale in fp32 rounded once to x's dtype (the dequantised weight's values),
            # then one running dot: no fp32 scaling of each step's sum.
            w_s = (w.to(tl.float32) * scale[:, None]).to(x.dtype)
            if SWAP_AB:
                acc = tl.dot(w_s, tl.trans(x), acc, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(x, tl.trans(w_s), acc, input_precision=DOT_PRECISION)
        else:
            # e4m3 -> x's dtype is exact; the step's fp32 sum times the block's per-row scales
            # is the product with q * scale (never rounded).
            w_x = w.to(x.dtype)
            if SWAP_AB:
                acc += tl.dot(w_x, tl.trans(x), input_precision=DOT_PRECISION) * scale[:, None]
            else:
                acc += tl.dot(x, tl.trans(w_x), input_precision=DOT_PRECISION) * scale[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    mask_n = offs_n < N
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if SWAP_AB:
            acc += bias[:, None]
        else:
            acc += bias[None, :]
    mask_m = offs_m < M
    if SWAP_AB:
        o_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=mask_n[:, None] & mask_m[None, :])
    else:
        o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])


# (largest M of the bucket, config) on the GPU, first match wins. Hopper's wgmma takes 64-row
# warp-group tiles. Large M: 128 x 128 tiles with 8 warps and 3 stages (48 KB a stage: a bf16
# x tile and an fp8 w tile), which give every SM of a Hopper GPU a tile from a few hundred rows
# on for N >= 2560; up to 512 rows: 64-row tiles with 4 warps and 4 stages, so that the grid
# still covers the SMs. Starting points: time a change with benchmark/kernels/bench_fp8_gemm.py
# on the GPU. w8a8 (e4m3 x) takes the same tiles untimed (32 KB a stage); the benchmark's w8a8
# column sweeps them.
_GPU_TABLE = (
    (128, gemm_config(64, 128, 128, 8, 4, 4)),
    (512, gemm_config(64, 128, 128, 8, 4, 4)),
    # swap_ab with 8 warps: the converted weight tile as wgmma's first operand, faster than the
    # plain tile at large M (docs/performance.md, the prefill section's "Dense fp8 at
    # prefill sizes")
    (1 << 62, gemm_config(128, 128, 128, 8, 8, 3, swap_ab=True)),
)
# The interpreter's cost is per program and per op: small tiles keep a test's arrays small and
# still exercise several programs, the grouped order and the wrapped edge rows.
_INTERPRETED_CONFIG = gemm_config(32, 64, 128, 2)


def launch_config(m: int, n: int, k: int) -> LaunchConfig:
    """The tiles for an ``[m, k] x [n, k]`` product: from a table keyed by the row count's
    bucket (``_GPU_TABLE``; the last bucket is the fallback), the column tile narrowed for a
    weight of few rows (a 32-row gate projection); small tiles under the interpreter."""
    if INTERPRETED:
        cfg = _INTERPRETED_CONFIG
    else:
        cfg = next(c for top, c in _GPU_TABLE if m <= top)
    # A tile at least 16 wide (tl.dot's minimum), no wider than the weight needs.
    block_n = max(16, min(cfg.block_n, triton.next_power_of_2(max(n, 1))))
    del k  # every K is taken 128 columns (one scale block) at a time
    return cfg._replace(block_n=block_n)


_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
           w_scale_rows: Optional[torch.Tensor], bias: Optional[torch.Tensor],
           x_scale: Optional[torch.Tensor] = None,
           out_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """Raise ``ValueError`` unless the operands have the shapes and dtypes the kernel reads;
    return the output dtype (``out_dtype``, else x's)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"block_fp8_gemm: expected x [M, K] and w [N, K], got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype == torch.float8_e4m3fn:
        # w8a8: the activations' group scales come with them, and an e4m3 output is no use
        groups = -(-x.shape[1] // QBLOCK)
        if x_scale is None:
            raise ValueError("block_fp8_gemm: a float8_e4m3fn x needs its x_scale (fp32 "
                             f"[M, {groups}], per_token_group_quant_fp8)")
        if (x_scale.dtype != torch.float32
                or tuple(x_scale.shape) != (x.shape[0], groups)
                or (x_scale.numel() and x_scale.stride(1) != 1)):
            raise ValueError(f"block_fp8_gemm: x_scale must be fp32 [{x.shape[0]}, {groups}] "
                             f"(one scale per row and {QBLOCK}-column group) with a "
                             f"contiguous last dim, got {x_scale.dtype} "
                             f"{tuple(x_scale.shape)}")
        if out_dtype is None:
            raise ValueError("block_fp8_gemm: a float8_e4m3fn x needs out_dtype (fp32 / fp16 "
                             "/ bf16)")
    elif x.dtype not in _OUT_DTYPES:
        raise ValueError(f"block_fp8_gemm: x must be fp32 / fp16 / bf16, or float8_e4m3fn "
                         f"with x_scale, got {x.dtype}")
    elif x_scale is not None:
        raise ValueError(f"block_fp8_gemm: x_scale is for a float8_e4m3fn x, got x {x.dtype}")
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise ValueError(f"block_fp8_gemm: out_dtype must be fp32 / fp16 / bf16, got "
                         f"{out_dtype}")
    if w.dtype != torch.float8_e4m3fn or w.stride(1) != 1:
        raise ValueError(f"block_fp8_gemm: w must be float8_e4m3fn with a contiguous last dim, "
                         f"got {w.dtype} strides {w.stride()}")
    n, k = w.shape
    if w_scale_rows is None:
        check_block_scale(w, w_scale, name="block_fp8_gemm w")
    else:
        if tuple(w_scale_rows.shape) != (n,) or w_scale_rows.is_floating_point():
            raise ValueError(f"block_fp8_gemm: w_scale_rows must be an integer [{n}] tensor, "
                             f"got {w_scale_rows.dtype} {tuple(w_scale_rows.shape)}")
        if (w_scale.dtype != torch.float32 or w_scale.dim() != 2
                or w_scale.shape[1] != -(-k // QBLOCK) or w_scale.stride(1) != 1):
            raise ValueError(f"block_fp8_gemm: w_scale must be fp32 [rows, {-(-k // QBLOCK)}] "
                             f"with a contiguous last dim, got {w_scale.dtype} "
                             f"{tuple(w_scale.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"block_fp8_gemm: bias must be [{n}], got {tuple(bias.shape)}")
    return out_dtype or x.dtype


def block_fp8_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   w_scale_rows: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None,
                   config: Optional[LaunchConfig] = None,
                   x_scale: Optional[torch.Tensor] = None,
                   out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x [M, K] @ dequant(w) [N, K].T (+ bias [N])`` -> ``[M, N]`` in ``out_dtype`` (default:
    x's dtype).

    ``w`` is ``float8_e4m3fn`` with fp32 block scales ``w_scale [scale_rows, ceil(K/128)]``;
    weight row ``i`` uses scale row ``w_scale_rows[i]`` (int32 / int64, for a weight of several
    pieces each on its own grid) or ``i // 128`` when it is ``None``. ``x`` may be bf16, fp16
    or fp32 (fp32 inputs take full-precision dots: the interpreter tests). Accumulation, block
    scaling and the bias are fp32, with one rounding to the output dtype (module docstring);
    with ``config.fp8_prescale`` the weight is ``q * scale`` rounded to x's dtype (the
    reference path's dequantised weight) and only the accumulation and bias are fp32.

    With ``x_scale``, ``x`` is ``float8_e4m3fn`` quantised per row and 128-column group
    (:func:`sgl_kernel.fp8_act_quant.per_token_group_quant_fp8`; ``x_scale`` fp32
    ``[M, ceil(K/128)]``) and ``out_dtype`` is required: both operands go to ``tl.dot`` as e4m3
    ("w8a8", module docstring); ``fp8_prescale`` does not apply and is refused.
    ``config`` (:func:`gemm_config`) overrides :func:`launch_config` (the benchmark's sweep)."""
    out_dtype = _check(x, w, w_scale, w_scale_rows, bias, x_scale, out_dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or launch_config(m, n, k)
    if cfg.block_m is None or cfg.split_k != 1:  # a row tile; no K split in this kernel
        raise ValueError(f"block_fp8_gemm: the config needs block_m and split_k 1, got "
                         f"{cfg.block_m} and {cfg.split_k}")
    if QBLOCK % cfg.block_k or cfg.block_k < 16:
        raise ValueError(f"block_fp8_gemm: block_k must divide {QBLOCK} and be >= 16, got "
                         f"{cfg.block_k}")
    if x_scale is not None and cfg.fp8_prescale:
        # Pre-scaling rounds q * scale to x's dtype: an e4m3 x has no such weight tile.
        raise ValueError("block_fp8_gemm: fp8_prescale does not apply to float8_e4m3fn "
                         "activations (x_scale given)")
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _block_fp8_gemm_kernel[grid](
        x, w, w_scale, w_scale_rows if w_scale_rows is not None else w_scale,
        x_scale if x_scale is not None else w_scale, bias if bias is not None else out, out,
        m, n, k, x.stride(0), w.stride(0), w_scale.stride(0),
        x_scale.stride(0) if x_scale is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, ROW_MAP=w_scale_rows is not None,
        EVEN_K=k % cfg.block_k == 0, QB=QBLOCK, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SWAP_AB=cfg.swap_ab,
        PRESCALE=bool(cfg.fp8_prescale), A_SCALE=x_scale is not None,
        # fp32 inputs (interpreter tests) multiply exactly; 16-bit and fp8 inputs ignore it
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **compiler_options(cfg.num_warps, cfg.num_stages))
    return out


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, srow_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                       ROW_MAP: tl.constexpr, QB: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    # One pass over the weight: each fp8 byte read once, each output element written once.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask = mask_n[:, None] & (offs_k < K)[None, :]
    if ROW_MAP:
        s_rows = tl.load(srow_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    else:
        s_rows = (offs_n // QB).to(tl.int64)
    scale = tl.load(s_ptr + s_rows[:, None] * stride_sn + (offs_k // QB)[None, :], mask=mask,
                    other=0.0)
    q = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :], mask=mask,
                other=0.0)
    w = (q.to(tl.float32) * scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * stride_on + offs_k[None, :], w, mask=mask)


def block_fp8_dequantize(w: torch.Tensor, w_scale: torch.Tensor,
                         w_scale_rows: Optional[torch.Tensor] = None,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight ``q * scale`` (fp32 product) rounded once to ``dtype``, in one Triton pass:
    bit for bit :func:`sgl_kernel.fp8_blocks.block_dequantize` (the engine's dequantised
    reference weight), which takes several full-size fp32 passes in torch."""
    _check(w.new_empty(0, w.shape[1], dtype=dtype), w, w_scale, w_scale_rows, None)
    n, k = w.shape
    out = torch.empty(n, k, dtype=dtype, device=w.device)
    if n == 0 or k == 0:
        return out
    block_n, block_k = (32, 128) if INTERPRETED else (32, 256)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](w, w_scale, w_scale_rows if w_scale_rows is not None else w_scale,
                             out, n, k, w.stride(0), w_scale.stride(0), out.stride(0),
                             ROW_MAP=w_scale_rows is not None, QB=QBLOCK, BLOCK_N=block_n,
                             BLOCK_K=block_k)
    return out


def block_fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     w_scale_rows: Optional[torch.Tensor] = None,
                     bias: Optional[torch.Tensor] = None,
                     fp8_activations: bool = False) -> torch.Tensor:
    """``x [M, K] @ dequant(w).T (+ bias)`` in x's dtype.

    ``fp8_activations`` False (the default): the faster weight-only route for M (module
    docstring, "Why the engine dequantises instead"): :func:`block_fp8_gemm` up to
    ``FUSED_MAX_ROWS`` rows (none now), else the one-pass :func:`block_fp8_dequantize` to x's
    dtype and ``torch.nn.functional.linear`` (the library GEMM; bit for bit the engine's
    dequantise + F.linear reference path).

    ``fp8_activations`` True (``KernelChoices.dense_fp8_activations``): "w8a8", x quantised per row
    and 128-column group (:func:`sgl_kernel.fp8_act_quant.per_token_group_quant_fp8`) and
    multiplied by the e4m3 weight on the fp8 tensor cores by :func:`block_fp8_gemm`, with no
    dequantised weight (module docstring, "fp8 activations")."""
    if fp8_activations:
        from sgl_kernel.fp8_act_quant import per_token_group_quant_fp8

        if x.dim() != 2:
            raise ValueError(f"block_fp8_linear: expected x [M, K], got {tuple(x.shape)}")
        if x.stride(1) != 1:  # the quantisation reads rows with a contiguous last dim
            x = x.contiguous()
        q, q_scale = per_token_group_quant_fp8(x, QBLOCK)
        return block_fp8_gemm(q, w, w_scale, w_scale_rows, bias, x_scale=q_scale,
                              out_dtype=x.dtype)
    if x.dim() == 2 and x.shape[0] <= FUSED_MAX_ROWS:
        return block_fp8_gemm(x, w, w_scale, w_scale_rows, bias)
    return torch.nn.functional.linear(x, block_fp8_dequantize(w, w_scale, w_scale_rows, x.dtype),
                                      bias)


def block_fp8_gemm_reference(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                             w_scale_rows: Optional[torch.Tensor] = None,
                             bias: Optional[torch.Tensor] = None,
                             x_scale: Optional[torch.Tensor] = None,
                             out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Plain-torch :func:`block_fp8_gemm`: the weight dequantised in fp32 (never rounded), an
    fp32 matmul and bias, one rounding to ``out_dtype`` (default: x's dtype). With ``x_scale``
    (x ``float8_e4m3fn``, ``out_dtype`` required) x is first dequantised in fp32 by
    :func:`sgl_kernel.fp8_act_quant.group_dequantize`."""
    out_dtype = _check(x, w, w_scale, w_scale_rows, bias, x_scale, out_dtype)
    if x_scale is not None:
        from sgl_kernel.fp8_act_quant import group_dequantize

        xf = group_dequantize(x, x_scale, QBLOCK)
    else:
        xf = x.float()
    wf = block_dequantize(w, w_scale, torch.float32, rows=w_scale_rows)
    out = xf @ wf.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
