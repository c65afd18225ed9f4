"""sgl_kernel.moe_grouped_gemm (expert-sorted pair list + grouped GEMM) and the large-M Triton MoE
built on it, against their torch references.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, fp32 / fp16 inputs:
the interpreter has no bf16). The ``gpu`` tests repeat the MoE on Ling-3.0-flash's expert shapes
in bf16 and block fp8, eager and inside a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

from kernel_test_utils import DEVICE, ON_CUDA, needs_triton
from sglang.srt.layers.moe.fused_moe_native import fused_moe_gather, fused_moe_loop
from sglang.srt.layers.moe.fused_moe_triton import fused_moe_grouped

pytestmark = needs_triton

FP32, FP16 = (torch.float32, 1e-5), (torch.float16, 3e-3)


@pytest.fixture(scope="module")
def mgg():
    """The kernel module (compiled on CUDA, interpreted on CPU)."""
    import sgl_kernel.moe_grouped_gemm as module

    return module


@pytest.fixture(scope="module")
def tiles():
    """The kernel's launch configurations (the per-GPU table and its lookup)."""
    import sgl_kernel.moe_grouped_gemm_configs as module

    return module


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _mean_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean absolute difference over mean magnitude: the scale of an elementwise rounding (e4m3's
    3 mantissa bits: a few per cent), where ``_rel``'s max over one output can sit on a clamp."""
    return float((a.float() - b.float()).abs().mean() / b.float().abs().mean().clamp_min(1e-12))


def _routes(t: int, k: int, e: int, seed: int, skew: bool = True) -> torch.Tensor:
    """``[T, k]`` distinct experts per token; with ``skew`` experts 1 and 4 get no pair and
    expert 0 more than a 16-row block."""
    gen = torch.Generator().manual_seed(seed)
    allowed = [x for x in range(e) if not skew or x not in (1, 4)]
    rows = []
    for _ in range(t):
        pick = torch.randperm(len(allowed), generator=gen)[:k]
        row = [allowed[j] for j in pick]
        if skew and 0 not in row:
            row[0] = 0
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64).reshape(t, k).to(DEVICE)


@pytest.mark.parametrize("t,k,e,block_m", [(40, 3, 6, 16), (1, 1, 6, 16), (7, 4, 6, 32),
                                           (0, 2, 5, 16), (30, 2, 200, 16)])
def test_align_invariants(mgg, t, k, e, block_m):
    """Every pair exactly once, grouped by expert (stable), groups padded to ``block_m`` with the
    sentinel, each block's expert and the used block count right, sizes from shapes only."""
    from sgl_kernel.moe_align import max_padded_pairs

    ids = _routes(t, k, e, seed=t + e, skew=e > 4)
    al = mgg.moe_align(ids, e, block_m)
    p = t * k
    assert al.sorted_pairs.shape == (max_padded_pairs(p, e, block_m),)
    assert al.block_expert.shape == (al.sorted_pairs.shape[0] // block_m,)
    assert al.sorted_pairs.dtype == al.block_expert.dtype == al.num_blocks.dtype == torch.int32
    pairs = al.sorted_pairs.cpu().long()
    flat = ids.reshape(-1).cpu()
    counts = torch.bincount(flat, minlength=e)
    blocks = int(sum((int(c) + block_m - 1) // block_m for c in counts))
    assert al.num_blocks.tolist() == [blocks] and al.num_blocks.device == ids.device
    used = pairs[:blocks * block_m]
    assert (pairs[blocks * block_m:] == p).all()  # the unused tail is all sentinels
    real = used[used < p]
    assert sorted(real.tolist()) == list(range(p))  # every pair exactly once
    block_expert = al.block_expert.cpu().long()
    assert (block_expert[blocks:] == -1).all()
    row = 0
    for expert in range(e):  # groups in expert order, stable, padded
        n = int(counts[expert])
        nb = (n + block_m - 1) // block_m
        group = used[row:row + nb * block_m]
        assert group[:n].tolist() == torch.nonzero(flat == expert).flatten().tolist()
        assert (group[n:] == p).all()
        assert (block_expert[row // block_m:row // block_m + nb] == expert).all()
        row += nb * block_m
    assert row == blocks * block_m


def _weights(e: int, n: int, k: int, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(e, n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype,tol,limit,cfg", [
    (*FP32, 0.0, (16, 32, 32)), (*FP16, 0.7, None),
    (*FP32, 0.7, None), (*FP16, 0.0, (32, 16, 16)),
])
def test_up_projection_with_swiglu_matches_reference(mgg, dtype, tol, limit, cfg):
    """``[gate; up]`` rows -> the clamped SwiGLU in the epilogue, ``[P, I]`` in pair order; also
    with tiles smaller than the shapes (several column tiles and K steps, ragged edges)."""
    t, k, e, h, i = 40, 3, 6, 64, 48
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    w13 = _weights(e, 2 * i, h, dtype, 4)
    ids = _routes(t, k, e, seed=5)
    config = None
    if cfg is not None:
        bm, bn, bk = cfg
        config = mgg.LaunchConfig(block_n=bn, block_k=bk, block_m=bm)
    al = mgg.moe_align(ids, e, 16 if cfg is None else cfg[0])
    got = mgg.moe_grouped_gemm(x, w13, al, rows_per_x=k, swiglu=True, swiglu_limit=limit,
                               config=config)
    ref = mgg.moe_grouped_gemm_reference(x, w13, ids, rows_per_x=k, swiglu=True,
                                         swiglu_limit=limit)
    assert got.shape == (t * k, i) and got.dtype == dtype
    assert _rel(got, ref) < tol
    if limit:  # the clamp bites
        from sglang.srt.layers.activation import silu_and_mul

        h13 = mgg.moe_grouped_gemm_reference(x, w13, ids, rows_per_x=k, swiglu=False)
        assert _rel(silu_and_mul(h13, limit), ref) < tol
        assert _rel(silu_and_mul(h13, 0.0), ref) > 10 * tol


@pytest.mark.parametrize("dtype,tol,cfg", [(*FP16, None), (*FP32, (16, 16, 16)),
                                           (*FP32, None)])
def test_down_projection_matches_reference(mgg, dtype, tol, cfg):
    """``rows_per_x = 1``: the activations are read by pair id; the output rows are the pairs'."""
    t, k, e, h, i = 24, 2, 6, 64, 48
    gen = torch.Generator().manual_seed(6)
    act = torch.randn(t * k, i, generator=gen).to(DEVICE, dtype)
    w2 = _weights(e, h, i, dtype, 7)
    ids = _routes(t, k, e, seed=8)
    block_m = 16 if cfg is None else cfg[0]
    config = None if cfg is None else mgg.LaunchConfig(block_n=cfg[1], block_k=cfg[2],
                                                       block_m=cfg[0])
    out = torch.full((t * k, h), float("nan"), dtype=dtype, device=DEVICE)
    got = mgg.moe_grouped_gemm(act, w2, mgg.moe_align(ids, e, block_m), rows_per_x=1,
                               swiglu=False, config=config, out=out)
    assert got is out and not got.isnan().any()  # every pair's row written
    assert _rel(got, mgg.moe_grouped_gemm_reference(act, w2, ids, rows_per_x=1,
                                                    swiglu=False)) < tol


@pytest.mark.parametrize("dtype,tol,i,block_k", [(*FP32, 96, 32), (*FP16, 48, None),
                                                 (*FP32, 160, 64)])
def test_block_fp8_weights_match_the_dequantised_reference(mgg, dtype, tol, i, block_k):
    """Block-fp8 experts (``I`` not a multiple of 128: gate and up on their own scale grids;
    ``I = 160``: a column tile across two scale rows), up + SwiGLU and down, against the fp32
    dequantised weights."""
    from sgl_kernel.fp8_blocks import block_quantize

    t, k, e, h = 20, 3, 6, 192  # h: two scale columns, the second one partial
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    w13, s13 = block_quantize(_weights(e, 2 * i, h, torch.float32, 10), split=i)
    w2, s2 = block_quantize(_weights(e, h, i, torch.float32, 11))
    ids = _routes(t, k, e, seed=12)
    cfg = None if block_k is None else mgg.LaunchConfig(block_n=64, block_k=block_k, block_m=16)
    al = mgg.moe_align(ids, e, 16)
    act = mgg.moe_grouped_gemm(x, w13, al, rows_per_x=k, swiglu=True, swiglu_limit=2.0,
                               w_scale=s13, config=cfg)
    ref = mgg.moe_grouped_gemm_reference(x, w13, ids, rows_per_x=k, swiglu=True,
                                         swiglu_limit=2.0, w_scale=s13)
    assert _rel(act, ref) < tol
    if dtype == torch.float32:  # the reference's dequantisation is the engine's (fp32 q * s)
        from sgl_kernel.fp8_blocks import block_dequantize

        plain = mgg.moe_grouped_gemm_reference(x, block_dequantize(w13, s13, dtype, i), ids,
                                               rows_per_x=k, swiglu=True, swiglu_limit=2.0)
        assert torch.equal(plain, ref)
    y = mgg.moe_grouped_gemm(act, w2, al, rows_per_x=1, swiglu=False, w_scale=s2, config=cfg)
    assert _rel(y, mgg.moe_grouped_gemm_reference(act, w2, ids, rows_per_x=1, swiglu=False,
                                                  w_scale=s2)) < tol


# Pre-scaled tiles against "dequantise to x's dtype, then matmul": fp32 differs by summation order
# only; fp16 by that and the output's rounding (at most an ulp of the largest output, 2^-10,
# which also covers gate / up rounded before the SwiGLU).
@pytest.mark.parametrize("dtype,tol,i,cfg", [
    (torch.float32, 1e-5, 48, (16, 64, 64)), (torch.float16, 1e-3, 48, (16, 32, 32)),
    (torch.float16, 1e-3, 160, None),
])
def test_prescaled_fp8_tiles_match_dequantise_then_matmul(mgg, dtype, tol, i, cfg):
    """``fp8_prescale``: up + SwiGLU and down on block-fp8 experts equal the reference on the
    weight dequantised to x's dtype (``fp8_blocks.block_dequantize``: fp32 ``q * scale`` rounded
    once). ``I = 48``: gate and up rows on separate scale rows; K = H = 192 and K = I: partial
    last scale columns; ``I = 160``: two scale rows per half, interpreter tiles. In fp16 the
    rounded weight shows: the result differs from per-block product scaling's."""
    from sgl_kernel.fp8_blocks import block_dequantize, block_quantize

    t, k, e, h = 20, 3, 6, 192
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    w13, s13 = block_quantize(_weights(e, 2 * i, h, torch.float32, 22), split=i)
    w2, s2 = block_quantize(_weights(e, h, i, torch.float32, 23))
    ids = _routes(t, k, e, seed=24)
    if cfg is None:  # the launch's own tiles (under the interpreter: whole-width, BLOCK_K 128)
        base = mgg.launch_config(e, 2 * i, h, t * k, True, x.device, swiglu=True)
    else:
        base = mgg.LaunchConfig(block_n=cfg[1], block_k=cfg[2], block_m=cfg[0])
    base = base._replace(block_m=16 if cfg is None else cfg[0])
    pre = base._replace(fp8_prescale=True)
    al = mgg.moe_align(ids, e, base.block_m)
    act = mgg.moe_grouped_gemm(x, w13, al, rows_per_x=k, swiglu=True, swiglu_limit=2.0,
                               w_scale=s13, config=pre)
    ref = mgg.moe_grouped_gemm_reference(x, block_dequantize(w13, s13, dtype, i), ids,
                                         rows_per_x=k, swiglu=True, swiglu_limit=2.0)
    assert _rel(act, ref) < tol
    y = mgg.moe_grouped_gemm(act, w2, al, rows_per_x=1, swiglu=False, w_scale=s2, config=pre)
    y_ref = mgg.moe_grouped_gemm_reference(act, block_dequantize(w2, s2, dtype), ids,
                                           rows_per_x=1, swiglu=False)
    assert _rel(y, y_ref) < tol
    if dtype == torch.float16:  # the flag reaches the kernel: the weight's rounding shows
        per_block = mgg.moe_grouped_gemm(act, w2, al, rows_per_x=1, swiglu=False, w_scale=s2,
                                         config=base)
        assert not torch.equal(per_block, y) and _rel(y, y_ref) < _rel(per_block, y_ref)


@pytest.mark.parametrize("out_dtype,tol,i,cfg", [
    (torch.float32, 1e-5, 48, (16, 64, 64)), (torch.float16, 3e-3, 160, None),
])
def test_fp8_activations_match_the_dequantised_reference(mgg, out_dtype, tol, i, cfg):
    """w8a8: activations quantised per row and 128 columns (``fp8_act_quant``), the dot on e4m3
    operands, each K slice scaled by the row's and the column's scales: up + SwiGLU and down
    equal the reference on the dequantised activations and weights (fp32: summation order
    only). K = H = 192: a partial last group; ``I = 160``: two scale rows per half."""
    from sgl_kernel.fp8_act_quant import per_token_group_quant_fp8
    from sgl_kernel.fp8_blocks import block_quantize

    t, k, e, h = 20, 3, 6, 192
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(t, h, generator=gen).to(DEVICE) * 4
    w13, s13 = block_quantize(_weights(e, 2 * i, h, torch.float32, 32), split=i)
    w2, s2 = block_quantize(_weights(e, h, i, torch.float32, 33))
    ids = _routes(t, k, e, seed=34)
    config = None if cfg is None else mgg.LaunchConfig(block_n=cfg[1], block_k=cfg[2],
                                                       block_m=cfg[0])
    al = mgg.moe_align(ids, e, 16)
    xq, xs = per_token_group_quant_fp8(x)
    act = mgg.moe_grouped_gemm(xq, w13, al, rows_per_x=k, swiglu=True, swiglu_limit=2.0,
                               w_scale=s13, config=config, x_scale=xs, out_dtype=out_dtype)
    assert act.dtype == out_dtype
    ref = mgg.moe_grouped_gemm_reference(xq, w13, ids, rows_per_x=k, swiglu=True,
                                         swiglu_limit=2.0, w_scale=s13, x_scale=xs,
                                         out_dtype=out_dtype)
    assert _rel(act, ref) < tol
    aq, as_ = per_token_group_quant_fp8(ref)
    y = mgg.moe_grouped_gemm(aq, w2, al, rows_per_x=1, swiglu=False, w_scale=s2,
                             config=config, x_scale=as_, out_dtype=out_dtype)
    y_ref = mgg.moe_grouped_gemm_reference(aq, w2, ids, rows_per_x=1, swiglu=False,
                                           w_scale=s2, x_scale=as_, out_dtype=out_dtype)
    assert _rel(y, y_ref) < tol
    # The activations' e4m3 rounding is the only new error against the weight-only result.
    weight_only = mgg.moe_grouped_gemm_reference(x, w13, ids, rows_per_x=k, swiglu=True,
                                                 swiglu_limit=2.0, w_scale=s13)
    assert 1e-3 < _mean_rel(act, weight_only) < 0.08


@pytest.mark.parametrize("fmt,dtype,tol,i,cfg", [
    ("plain", torch.float32, 1e-5, 48, (16, 32, 32)), ("plain", torch.float16, 3e-3, 48, None),
    ("fp8", torch.float32, 1e-5, 160, (16, 64, 64)), ("fp8 pre", torch.float16, 1e-3, 48, None),
    ("w8a8", torch.float32, 1e-5, 160, (16, 64, 128)),
])
def test_interleaved_swiglu_tile_matches_two_accumulators(mgg, fmt, dtype, tol, i, cfg):
    """``swiglu_interleave``: gate and up rows alternating in one tile give the SwiGLU of the
    two-accumulator tile and of the reference, for plain, block-fp8 (both inner loops; ``I =
    160``: a tile across two scale rows) and w8a8 experts, with ragged column tiles."""
    from sgl_kernel.fp8_act_quant import per_token_group_quant_fp8
    from sgl_kernel.fp8_blocks import block_dequantize, block_quantize

    t, k, e, h = 20, 3, 6, 192
    gen = torch.Generator().manual_seed(41)
    x = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    w13, s13, xs, ref_w = _weights(e, 2 * i, h, dtype, 42), None, None, None
    kw = {}
    if fmt != "plain":
        w13, s13 = block_quantize(_weights(e, 2 * i, h, torch.float32, 42), split=i)
        ref_w = block_dequantize(w13, s13, dtype if fmt == "fp8 pre" else torch.float32, i)
    if fmt == "w8a8":
        x, xs = per_token_group_quant_fp8(x.float())
        kw = dict(x_scale=xs, out_dtype=dtype)
    ids = _routes(t, k, e, seed=43)
    if cfg is None:  # the launch's own tiles (under the interpreter: whole-width, BLOCK_K 128)
        base = mgg.launch_config(e, 2 * i, h, t * k, fmt != "plain", x.device, swiglu=True)
    else:
        base = mgg.LaunchConfig(block_n=cfg[1], block_k=cfg[2], block_m=cfg[0])
    base = base._replace(block_m=16, fp8_prescale=fmt == "fp8 pre")
    al = mgg.moe_align(ids, e, 16)
    two, one = (mgg.moe_grouped_gemm(x, w13, al, rows_per_x=k, swiglu=True, swiglu_limit=2.0,
                                     w_scale=s13, config=base._replace(swiglu_interleave=il),
                                     **kw) for il in (False, True))
    if fmt == "w8a8":
        ref = mgg.moe_grouped_gemm_reference(x, w13, ids, rows_per_x=k, swiglu=True,
                                             swiglu_limit=2.0, w_scale=s13, **kw)
    else:
        ref = mgg.moe_grouped_gemm_reference(x, w13 if ref_w is None else ref_w.to(
            torch.float32 if fmt == "fp8" else dtype), ids, rows_per_x=k, swiglu=True,
            swiglu_limit=2.0).to(dtype)
    assert one.shape == (t * k, i) and one.dtype == dtype
    assert _rel(one, ref) < tol and _rel(two, ref) < tol
    assert _rel(one, two) < tol  # per output column the same arithmetic


@pytest.mark.parametrize("fmt,dtype,il,block_n", [("w8a8", torch.float32, False, 128),
                                                  ("w8a8", torch.float16, True, 256),
                                                  ("w8a8", torch.float32, False, 256),
                                                  ("fp8", torch.float16, False, 128),
                                                  ("plain", torch.float32, False, 128)])
def test_quantized_output_equals_quantizing_the_output(mgg, fmt, dtype, il, block_n):
    """``quantize_out``: the epilogue's e4m3 rows and group scales are bit for bit
    ``per_token_group_quant_fp8`` of the plain output (``I = 160``: a full and a partial
    group; interleaved tiles of 256 columns, and tiles of two groups); tiles of a part of a
    group are refused."""
    from sgl_kernel.fp8_act_quant import per_token_group_quant_fp8
    from sgl_kernel.fp8_blocks import block_quantize

    t, k, e, h, i = 20, 3, 6, 192, 160
    gen = torch.Generator().manual_seed(51)
    x = (torch.randn(t, h, generator=gen) * 3).to(DEVICE, dtype)
    w13, s13, kw = _weights(e, 2 * i, h, dtype, 52), None, {}
    if fmt != "plain":
        w13, s13 = block_quantize(_weights(e, 2 * i, h, torch.float32, 52), split=i)
    if fmt == "w8a8":
        xq, xs = per_token_group_quant_fp8(x)
        x, kw = xq, dict(x_scale=xs, out_dtype=dtype)
    ids = _routes(t, k, e, seed=53)
    cfg = mgg.LaunchConfig(block_n=block_n, block_k=64, block_m=16, swiglu_interleave=il)
    al = mgg.moe_align(ids, e, 16)
    plain = mgg.moe_grouped_gemm(x, w13, al, rows_per_x=k, swiglu=True, swiglu_limit=2.0,
                                 w_scale=s13, config=cfg, **kw)
    q, scale = mgg.moe_grouped_gemm(x, w13, al, rows_per_x=k, swiglu=True, swiglu_limit=2.0,
                                    w_scale=s13, config=cfg, quantize_out=True, **kw)
    q_ref, scale_ref = per_token_group_quant_fp8(plain)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (t * k, 2)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale, scale_ref)
    assert not mgg.quantizes_out(cfg._replace(block_n=64), swiglu=True)
    with pytest.raises(ValueError, match="quantize_out needs tiles of whole 128"):
        mgg.moe_grouped_gemm(x, w13, al, rows_per_x=k, swiglu=True, w_scale=s13,
                             config=cfg._replace(block_n=64), quantize_out=True, **kw)


@pytest.mark.parametrize("fmt,dtype,swiglu", [("plain", torch.float32, True),
                                              ("plain", torch.float16, False),
                                              ("fp8", torch.float32, True),
                                              ("w8a8", torch.float32, True),
                                              ("w8a8", torch.float16, False)])
def test_weight_tma_tiles_equal_pointer_tiles(mgg, fmt, dtype, swiglu):
    """``weight_tma``: weight tiles read through a TMA descriptor give the pointer loop's output
    (same slices, same arithmetic), with the shared expert's own descriptor and a K that no
    ``block_k`` divides (the descriptor's zero fill past K); configs it cannot serve are
    refused."""
    from sgl_kernel.fp8_act_quant import per_token_group_quant_fp8
    from sgl_kernel.fp8_blocks import block_quantize

    t, k, e, i = 12, 3, 5, 128
    n, kk = (2 * i if swiglu else 256), 208  # K: no block_k divides it; 16-byte rows
    w, sw = _weights(e, n, kk, torch.float32, 61), _weights(1, n, kk, torch.float32, 62)
    scale = s_scale = xs = None
    if fmt != "plain":
        w, scale = block_quantize(w, split=i if swiglu else None)
        sw, s_scale = block_quantize(sw, split=i if swiglu else None)
        s_scale = s_scale[0]
    else:
        w, sw = w.to(dtype), sw.to(dtype)
    sw = sw[0]
    ids = torch.cat([_routes(t, k, e, seed=63), torch.full((t, 1), e, device=DEVICE)], dim=1)
    gen = torch.Generator().manual_seed(64)
    x = torch.randn(t if swiglu else t * (k + 1), kk, generator=gen).to(DEVICE, dtype)
    kw = dict(shared_w=sw, shared_scale=s_scale, swiglu_limit=2.0 if swiglu else 0.0,
              shared_limit=3.0 if swiglu else 0.0)
    if fmt == "w8a8":
        x, xs = per_token_group_quant_fp8(x)
        kw.update(x_scale=xs, out_dtype=dtype)
    cfg = mgg.LaunchConfig(block_n=64, block_k=64 if fmt == "plain" else 128, block_m=16)
    al = mgg.moe_align(ids, e + 1, 16)
    outs = [mgg.moe_grouped_gemm(x, w, al, rows_per_x=k + 1 if swiglu else 1, swiglu=swiglu,
                                 w_scale=scale, config=cfg._replace(weight_tma=tma), **kw)
            for tma in (False, True)]
    assert outs[0].abs().max() > 0
    assert _rel(outs[1], outs[0]) < (1e-6 if dtype == torch.float32 else 1e-3)
    assert mgg.weight_tma_applies(cfg, swiglu, fmt == "fp8", n // 2 if swiglu else n, w, sw)
    refused = [cfg._replace(block_n=2 * n)]  # a tile across two experts' rows
    if swiglu:
        refused.append(cfg._replace(swiglu_interleave=True))
    for bad in refused:
        with pytest.raises(ValueError, match="weight_tma needs"):
            mgg.moe_grouped_gemm(x, w, al, rows_per_x=k + 1 if swiglu else 1, swiglu=swiglu,
                                 w_scale=scale, config=bad._replace(weight_tma=True), **kw)


def test_rejects_bad_inputs(tiles, mgg):
    x = torch.zeros(4, 32, device=DEVICE)
    w = torch.zeros(3, 16, 32, device=DEVICE)
    ids = torch.zeros(4, 2, dtype=torch.int64, device=DEVICE)
    al = mgg.moe_align(ids, 3, 16)
    with pytest.raises(ValueError, match="rows_per_x"):
        mgg.moe_grouped_gemm(x, w, al, rows_per_x=1, swiglu=False)
    with pytest.raises(ValueError, match="block_m"):
        mgg.moe_grouped_gemm(x, w, al, rows_per_x=2, swiglu=False,
                             config=mgg.LaunchConfig(16, 16, block_m=32))
    with pytest.raises(ValueError, match="power of two"):
        mgg.moe_grouped_gemm(x, w, al, rows_per_x=2, swiglu=False,
                             config=mgg.LaunchConfig(24, 16, block_m=16))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mgg.moe_grouped_gemm(x, w.half(), al, rows_per_x=2, swiglu=False)
    # w8a8: the activations' scales, a block-fp8 weight and an output dtype are all needed.
    from sgl_kernel.fp8_blocks import block_quantize

    q, ws = block_quantize(w.float())
    x8 = x.to(torch.float8_e4m3fn)
    xs = torch.ones(4, 1, device=DEVICE)
    with pytest.raises(ValueError, match="x_scale"):
        mgg.moe_grouped_gemm(x8, q, al, rows_per_x=2, swiglu=False, w_scale=ws,
                             out_dtype=torch.float32)
    with pytest.raises(ValueError, match="block-fp8 weight"):
        mgg.moe_grouped_gemm(x8, w, al, rows_per_x=2, swiglu=False, x_scale=xs,
                             out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"x_scale must be fp32 \[4, 1\]"):
        mgg.moe_grouped_gemm(x8, q, al, rows_per_x=2, swiglu=False, w_scale=ws,
                             x_scale=torch.ones(4, 2, device=DEVICE), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        mgg.moe_grouped_gemm(x8, q, al, rows_per_x=2, swiglu=False, w_scale=ws, x_scale=xs)
    with pytest.raises(ValueError, match="block-fp8 weights"):
        tiles.config_key(3, 16, 32, False, act_fp8=True)


# ------------------------------------------------------------------------------ the MoE block
def _moe_inputs(dtype, t, e, h, i, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(DEVICE, dtype)
    weights = torch.rand(t, k, generator=gen).softmax(-1).to(DEVICE)
    ids = _routes(t, k, e, seed + 1)
    return hidden, w13, w2, weights, ids


@pytest.mark.parametrize("dtype,tol,limit,combine_kernel", [
    (*FP32, 0.5, True), (*FP16, 0.0, False), (*FP32, 0.0, False), (*FP16, 0.5, True),
])
def test_grouped_moe_matches_gather_reference(mgg, dtype, tol, limit, combine_kernel):
    """align -> up + SwiGLU -> down -> combine equals the native gather path (same roundings),
    with the shared expert's output joining the fp32 combine."""
    hidden, w13, w2, weights, ids = _moe_inputs(dtype, t=40, e=6, h=64, i=48, k=3)
    shared = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2)).to(
        DEVICE, dtype)
    got = fused_moe_grouped(hidden, w13, w2, weights, ids, limit, shared=shared,
                            combine_kernel=combine_kernel)
    ref = fused_moe_gather(hidden, w13, w2, weights, ids, limit, shared=shared)
    assert got.shape == hidden.shape and got.dtype == dtype
    assert _rel(got, ref) < tol


def test_grouped_moe_fp8_matches_dequantised_gather(mgg):
    """Block-fp8 experts through the grouped path equal the gather path on the fp32 weights
    ``q * scale`` (fp32: no rounding of the dequantised weight on either side)."""
    from sgl_kernel.fp8_blocks import block_dequantize, block_quantize

    hidden, w13, w2, weights, ids = _moe_inputs(torch.float32, t=24, e=6, h=64, i=96, k=4)
    q13, s13 = block_quantize(w13, split=96)
    q2, s2 = block_quantize(w2)
    got = fused_moe_grouped(hidden, q13, q2, weights, ids, 0.4, w13_scale=s13, w2_scale=s2)
    ref = fused_moe_gather(hidden, block_dequantize(q13, s13, torch.float32, 96),
                           block_dequantize(q2, s2, torch.float32), weights, ids, 0.4)
    assert _rel(got, ref) < 1e-5


def test_grouped_moe_fp8_activations(mgg):
    """``fp8_activations=True``: the hidden states and the SwiGLU output quantised per row and
    128 columns before their GEMMs: equal to that composition of the references (fp32), and
    within the activations' e4m3 rounding of the weight-only path."""
    from sgl_kernel.fp8_act_quant import per_token_group_quant_fp8
    from sgl_kernel.fp8_blocks import block_quantize
    from sglang.srt.layers.moe.fused_moe_native import combine_expert_outputs

    hidden, w13, w2, weights, ids = _moe_inputs(torch.float32, t=24, e=6, h=160, i=96, k=4)
    q13, s13 = block_quantize(w13, split=96)
    q2, s2 = block_quantize(w2)
    got = fused_moe_grouped(hidden, q13, q2, weights, ids, 0.4, w13_scale=s13, w2_scale=s2,
                            fp8_activations=True)
    xq, xs = per_token_group_quant_fp8(hidden)
    act = mgg.moe_grouped_gemm_reference(xq, q13, ids, rows_per_x=4, swiglu=True,
                                         swiglu_limit=0.4, w_scale=s13, x_scale=xs,
                                         out_dtype=torch.float32)
    aq, as_ = per_token_group_quant_fp8(act)
    y = mgg.moe_grouped_gemm_reference(aq, q2, ids, rows_per_x=1, swiglu=False, w_scale=s2,
                                       x_scale=as_, out_dtype=torch.float32)
    assert _rel(got, combine_expert_outputs(y, weights, None)) < 1e-5
    weight_only = fused_moe_grouped(hidden, q13, q2, weights, ids, 0.4, w13_scale=s13,
                                    w2_scale=s2)
    assert 1e-3 < _mean_rel(got, weight_only) < 0.08
    # bf16 / fp32 experts ignore the flag.
    assert torch.equal(fused_moe_grouped(hidden, w13, w2, weights, ids, 0.4,
                                         fp8_activations=True),
                       fused_moe_grouped(hidden, w13, w2, weights, ids, 0.4))


@pytest.mark.parametrize("fmt,limits,align_kernel", [
    ("plain", (0.4, 0.0), False), ("plain", (0.0, 0.3), True), ("fp8", (0.4, 0.4), False),
    ("w8a8", (0.0, 0.3), False),
])
def test_grouped_moe_shared_expert_as_pairs(mgg, fmt, limits, align_kernel):
    """``shared_weights``: the shared expert as one more expert every token takes with weight
    1, in the routed experts' two launches, equals the same kernels run on the shared expert
    alone with its output added in the combine, bit for bit (each row's arithmetic is its
    own); a clamp on one side only (routed or shared) stays on that side."""
    from sgl_kernel.fp8_blocks import block_quantize
    from sglang.srt.layers.moe.fused_moe_triton import SharedExpertWeights

    routed_limit, shared_limit = limits
    hidden, w13, w2, weights, ids = _moe_inputs(torch.float32, t=24, e=6, h=160, i=128, k=3,
                                                seed=61)
    gen = torch.Generator().manual_seed(62)
    sw13 = (torch.randn(2 * 128, 160, generator=gen) / 160 ** 0.5).to(DEVICE)
    sw2 = (torch.randn(160, 128, generator=gen) / 128 ** 0.5).to(DEVICE)
    kw, skw, s13, s2 = {}, {}, None, None
    if fmt != "plain":
        (w13, s13), (w2, s2) = block_quantize(w13, split=128), block_quantize(w2)
        (sw13, ss13), (sw2, ss2) = block_quantize(sw13, split=128), block_quantize(sw2)
        kw = dict(w13_scale=s13, w2_scale=s2, fp8_activations=fmt == "w8a8")
        skw = dict(w13_scale=ss13[None], w2_scale=ss2[None], fp8_activations=fmt == "w8a8")
    alone = fused_moe_grouped(hidden, sw13[None], sw2[None], torch.ones(24, 1, device=DEVICE),
                              torch.zeros(24, 1, dtype=torch.int64, device=DEVICE),
                              shared_limit, **skw)
    ref = fused_moe_grouped(hidden, w13, w2, weights, ids, routed_limit, shared=alone,
                            align_kernel=align_kernel, **kw)
    shared = SharedExpertWeights(sw13, sw2, shared_limit, *(
        (skw["w13_scale"][0], skw["w2_scale"][0]) if skw else ()))
    got = fused_moe_grouped(hidden, w13, w2, weights, ids, routed_limit,
                            shared_weights=shared, align_kernel=align_kernel, **kw)
    assert torch.equal(got, ref)
    # The clamp reaches only its own side: without it the result changes.
    unclamped = fused_moe_grouped(hidden, w13, w2, weights, ids, routed_limit,
                                  shared_weights=shared._replace(limit=0.0),
                                  align_kernel=align_kernel, **kw)
    assert torch.equal(unclamped, got) == (shared_limit == 0.0)
    with pytest.raises(ValueError, match="output or its weights"):
        fused_moe_grouped(hidden, w13, w2, weights, ids, routed_limit, shared=alone,
                          shared_weights=shared, **kw)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_model_prefill_through_grouped_gemm_matches_native(mgg, tmp_path, monkeypatch,
                                                           quantization):
    """A whole random tiny model (fp32) with the small-batch limit lowered so that a 6-token
    prefill takes the grouped GEMM (and the decode step the grouped GEMV): its logits equal the
    torch-native MoE's, and neither the expert loop nor per-call dequantisation runs."""
    import sglang.srt.layers.moe.fused_moe_native as native
    import sglang.srt.layers.moe.fused_moe_triton as fmt
    import sglang.srt.layers.moe.moe_layer as moe_layer
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.test.random_checkpoint import tiny_config, write_random_checkpoint
    from sglang.test.runner_utils import greedy_logits

    path = write_random_checkpoint(str(tmp_path / "c"), tiny_config(), seed=4)
    ids = [5, 17, 99, 3, 250, 42]
    logits = {}
    for backend in ("torch_native", "triton"):
        runner = ModelRunner(ModelConfig.from_path(path), device=DEVICE, dtype=torch.float32,
                             moe_runner_backend=backend, max_running_requests=2,
                             max_total_tokens=64, quantization=quantization)
        calls = []
        if backend == "triton":
            monkeypatch.setattr(moe_layer, "SMALL_M_MAX_PAIRS", 2)  # top-2: decode stays small
            real = fmt.fused_moe_grouped
            monkeypatch.setattr(fmt, "fused_moe_grouped", lambda *a, **kw: calls.append(
                kw.get("shared_weights") is not None) or real(*a, **kw))
            monkeypatch.setattr(native, "fused_moe_loop", None)  # must not be reached
            assert runner.max_cuda_graph_tokens() is None
        logits[backend] = greedy_logits(runner, ids, 1)
        # The Triton prefill carries the shared expert as pairs of the grouped GEMMs.
        assert calls == ([True] * len(calls) if backend == "triton" else []) and bool(calls) == (
            backend == "triton")
    for got, ref in zip(logits["triton"], logits["torch_native"]):
        assert _rel(got, ref) < 1e-5


def test_model_prefill_with_fp8_activations(mgg, tmp_path, monkeypatch):
    """``KernelChoices(moe_fp8_activations=True)`` on a block-fp8 tiny model: the choice reaches the
    MoE layers, the prefill's grouped GEMMs run w8a8, and the logits stay within the
    activations' e4m3 rounding of the weight-only model's."""
    import sglang.srt.layers.moe.fused_moe_triton as fmt
    import sglang.srt.layers.moe.moe_layer as moe_layer
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.kernel_choices import KernelChoices
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.test.random_checkpoint import tiny_config, write_random_checkpoint
    from sglang.test.runner_utils import greedy_logits

    path = write_random_checkpoint(str(tmp_path / "c"), tiny_config(), seed=4)
    monkeypatch.setattr(moe_layer, "SMALL_M_MAX_PAIRS", 2)
    real = fmt.fused_moe_grouped
    seen = []
    monkeypatch.setattr(fmt, "fused_moe_grouped", lambda *a, **kw: seen.append(
        kw.get("fp8_activations")) or real(*a, **kw))
    logits = {}
    for on in (False, True):
        runner = ModelRunner(ModelConfig.from_path(path), device=DEVICE, dtype=torch.float32,
                             moe_runner_backend="triton", max_running_requests=2,
                             max_total_tokens=64, quantization="fp8",
                             kernel_choices=KernelChoices(moe_fp8_activations=on))
        assert runner.kernel_choices.moe_fp8_activations is on
        experts = [m for m in runner.model.modules() if isinstance(m, moe_layer.FusedMoE)]
        assert experts and all(m.fp8_activations is on for m in experts)
        seen.clear()
        logits[on] = greedy_logits(runner, [5, 17, 99, 3, 250, 42], 1)
        assert seen and set(seen) == {on}
    got, ref = logits[True][0], logits[False][0]
    assert 0 < _mean_rel(got, ref) < 0.05

# ------------------------------------------------------------------------------ on the GPU
def _ling_inputs(fp8: bool, pairs: int = 2048, k: int = 8):
    """Ling-3.0-flash's expert shapes (E=512, H=2560, I=768), uniform random routing."""
    e, h, i = 512, 2560, 768
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = pairs // k
    hidden = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, i, device="cuda", generator=gen) / i ** 0.5
    weights = torch.rand(t, k, device="cuda", generator=gen).softmax(-1)
    ids = torch.rand(t, e, device="cuda", generator=gen).argsort(-1)[:, :k]
    scales = (None, None)
    if fp8:
        from sgl_kernel.fp8_blocks import block_dequantize, block_quantize

        (w13, s13), (w2, s2) = block_quantize(w13, split=i), block_quantize(w2)
        scales = (s13, s2)
        exact_w = (block_dequantize(w13, s13, torch.float32, i),
                   block_dequantize(w2, s2, torch.float32))
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
        exact_w = (w13.float(), w2.float())
    return hidden, w13, w2, weights, ids, scales, exact_w


@pytest.mark.gpu
@pytest.mark.parametrize("fp8,act_fp8", [(False, False), (True, False), (True, True)])
def test_grouped_moe_on_ling_shapes_on_cuda(mgg, fp8, act_fp8):
    """bf16 activations, bf16 or block-fp8 experts at 2048 pairs: as close to the fp32 result as
    the bf16 native loop (same roundings, only the accumulation order differs); w8a8 (fp8
    activations): within the e4m3 rounding of the activations; and the same values replayed
    from a CUDA graph with other routes copied in (no host sync)."""
    hidden, w13, w2, weights, ids, (s13, s2), (w13f, w2f) = _ling_inputs(fp8)
    limit = 7.0

    def run(routes):
        return fused_moe_grouped(hidden, w13, w2, weights, routes, limit, w13_scale=s13,
                                 w2_scale=s2, fp8_activations=act_fp8)

    got = run(ids)
    exact = fused_moe_loop(hidden.float(), w13f, w2f, weights, ids, limit)
    ref = fused_moe_loop(hidden, w13f.bfloat16(), w2f.bfloat16(), weights, ids, limit)
    if act_fp8:
        assert _mean_rel(got, exact) < 0.06
    else:
        assert _rel(got, exact) <= 1.5 * _rel(ref, exact) + 1e-3
    static_ids = ids.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (Triton compiles) outside the capture
        run(static_ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(static_ids)
    other = torch.rand(ids.shape[0], 512, device="cuda").argsort(-1)[:, :ids.shape[1]]
    other[:, 0] = 3  # one expert with a long group
    static_ids.copy_(other)
    graph.replay()
    torch.testing.assert_close(out, run(other), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("prescaled_fp8", [False, True])
def test_grouped_gemm_kernel_on_cuda_matches_reference(tiles, mgg, prescaled_fp8):
    """The kernel alone in bf16 on a Ling-width expert slice (fewer experts so the per-pair
    reference fits), with the table's / fallback tiles; and block-fp8 experts with pre-scaled
    tiles against the reference on the weights dequantised to bf16 (``I = 768``: 6 scale rows
    per half; compiled on sm_90 this is the path the interpreter cannot check in bf16)."""
    if not ON_CUDA:
        pytest.skip("needs CUDA")
    t, k, e, h, i = 96, 8, 32, 2560, 768
    hidden, w13, w2, _, ids = _moe_inputs(torch.bfloat16, t=t, e=e, h=h, i=i, k=k)
    al = mgg.moe_align(ids, e, 64)
    cfg, s13, s2 = tiles.DEFAULT_CONFIG, None, None
    if prescaled_fp8:
        from sgl_kernel.fp8_blocks import block_dequantize, block_quantize

        (w13, s13), (w2, s2) = block_quantize(w13.float(), split=i), block_quantize(w2.float())
        cfg = cfg._replace(block_k=128, fp8_prescale=True)
    act = mgg.moe_grouped_gemm(hidden, w13, al, rows_per_x=k, swiglu=True, swiglu_limit=7.0,
                               w_scale=s13, config=cfg)
    # The interleaved SwiGLU tile on the same experts: per output column the same arithmetic.
    act_il = mgg.moe_grouped_gemm(hidden, w13, al, rows_per_x=k, swiglu=True, swiglu_limit=7.0,
                                  w_scale=s13, config=cfg._replace(swiglu_interleave=True))
    if prescaled_fp8:  # the reference path's weights: q * scale rounded once to bf16
        w13 = block_dequantize(w13, s13, torch.bfloat16, i)
        w2_ref = block_dequantize(w2, s2, torch.bfloat16)
    else:
        w2_ref = w2
    ref = mgg.moe_grouped_gemm_reference(hidden, w13, ids, rows_per_x=k, swiglu=True,
                                         swiglu_limit=7.0)
    assert _rel(act, ref) < 2e-2
    y = mgg.moe_grouped_gemm(ref, w2, al, rows_per_x=1, swiglu=False, w_scale=s2,
                             config=cfg if prescaled_fp8 else None)
    assert _rel(y, mgg.moe_grouped_gemm_reference(ref, w2_ref, ids, rows_per_x=1,
                                                  swiglu=False)) < 2e-2
    assert _rel(act_il, ref) < 2e-2 and _rel(act_il, act) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "w8a8"])
def test_weight_tma_on_cuda_matches_pointer_tiles(mgg, fmt):
    """Compiled for the GPU (the TMA path the interpreter only emulates): both GEMMs of the
    MoE on Ling-width experts with the shared expert as pairs, weight tiles through TMA
    descriptors against pointer loads, eager and replayed from a CUDA graph."""
    if not ON_CUDA:
        pytest.skip("needs CUDA")
    from sgl_kernel.fp8_act_quant import per_token_group_quant_fp8
    from sgl_kernel.fp8_blocks import block_quantize

    t, k, e, h, i = 256, 8, 32, 2560, 768
    hidden, w13, w2, _, ids = _moe_inputs(torch.bfloat16, t=t, e=e, h=h, i=i, k=k)
    sw13, sw2 = w13[0].clone(), w2[0].clone()
    s13 = s2 = ss13 = ss2 = xs = None
    x, kw = hidden, {}
    if fmt == "w8a8":
        (w13, s13), (w2, s2) = block_quantize(w13.float(), split=i), block_quantize(w2.float())
        sw13, sw2 = w13[0].clone(), w2[0].clone()
        ss13, ss2 = s13[0].clone(), s2[0].clone()
        x, xs = per_token_group_quant_fp8(hidden)
        kw = dict(x_scale=xs, out_dtype=torch.bfloat16)
    routes = torch.cat([ids, torch.full((t, 1), e, device="cuda")], dim=1)
    al = mgg.moe_align(routes, e + 1, 64)
    cfg = mgg.LaunchConfig(block_n=64, block_k=128 if fmt == "w8a8" else 64, num_warps=4,
                           num_stages=2, block_m=64, group_m=8)

    def both(tma: bool):
        c = cfg._replace(weight_tma=tma)
        act = mgg.moe_grouped_gemm(x, w13, al, rows_per_x=k + 1, swiglu=True, swiglu_limit=7.0,
                                   w_scale=s13, config=c, shared_w=sw13, shared_scale=ss13,
                                   shared_limit=7.0, **kw)
        a_in, a_kw = act, {}
        if fmt == "w8a8":
            a_in, a_s = per_token_group_quant_fp8(act)
            a_kw = dict(x_scale=a_s, out_dtype=torch.bfloat16)
        return act, mgg.moe_grouped_gemm(a_in, w2, al, rows_per_x=1, swiglu=False, w_scale=s2,
                                         config=c, shared_w=sw2, shared_scale=ss2, **a_kw)

    ptr, tma = both(False), both(True)
    for got, ref in zip(tma, ptr):
        assert ref.abs().max() > 0 and _rel(got, ref) < 1e-2
    if fmt == "w8a8":  # the model's tile: 256 columns, two activation groups quantised inside
        wide = cfg._replace(block_n=256, num_warps=8, num_stages=3, weight_tma=True)
        up = dict(rows_per_x=k + 1, swiglu=True, swiglu_limit=7.0, w_scale=s13, config=wide,
                  shared_w=sw13, shared_scale=ss13, shared_limit=7.0, **kw)
        q, q_scale = mgg.moe_grouped_gemm(x, w13, al, quantize_out=True, **up)
        q_ref, scale_ref = per_token_group_quant_fp8(mgg.moe_grouped_gemm(x, w13, al, **up))
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(q_scale, scale_ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = both(True)
    graph.replay()
    for got, ref in zip(replayed, tma):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
