"""sgl_kernel.fp8_gemm (block-fp8 weights at prefill row counts) against its fp32 torch reference
(interpreter: fp32 / fp16; CUDA: bf16 at the model's shapes), and the dense fp8 layers taking it
above the small-M range."""
from __future__ import annotations

from typing import Optional, Tuple

import pytest
import torch

from kernel_test_utils import DEVICE, ON_CUDA, needs_triton

pytestmark = needs_triton

# fp32: the interpreter's full-precision dots (summation order only); fp16: a 2^-11 rounding of
# x's values is exact, the one rounding of the output dominates.
CASES = [(torch.float32, 1e-5), (torch.float16, 2e-3)] + ([(torch.bfloat16, 1e-2)] if ON_CUDA
                                                          else [])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _pieces(sizes, k: int, gen: torch.Generator):
    """A weight of ``sizes`` pieces, each quantised on its own 128 x 128 grid, with its
    row -> scale-row map (``fp8_utils.block_index``)."""
    from sgl_kernel.fp8_blocks import block_quantize
    from sglang.srt.layers.quantization.fp8_utils import block_index

    parts = [block_quantize(torch.randn(n, k, generator=gen) / k ** 0.5) for n in sizes]
    w = torch.cat([q for q, _ in parts])
    scale = torch.cat([s for _, s in parts])
    return w.to(DEVICE), scale.to(DEVICE), block_index(sizes, 128).to(DEVICE)


@pytest.mark.parametrize("dtype,tol", CASES)
def test_ragged_shapes_with_bias_match_the_reference(dtype, tol):
    """M not a multiple of the row tile, N of the column tile, K of the scale block (a ragged
    last step), a bias, one block grid for the whole weight."""
    from sgl_kernel.fp8_blocks import block_quantize
    from sgl_kernel.fp8_gemm import block_fp8_gemm, block_fp8_gemm_reference

    gen = torch.Generator().manual_seed(3)
    m, n, k = 70, 150, 300
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w, scale = (t.to(DEVICE) for t in block_quantize(torch.randn(n, k, generator=gen) / 17))
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    got = block_fp8_gemm(x, w, scale, bias=bias)
    assert got.dtype == dtype and got.shape == (m, n)
    assert _rel(got, block_fp8_gemm_reference(x, w, scale, bias=bias)) < tol
    assert _rel(block_fp8_gemm(x, w, scale), block_fp8_gemm_reference(x, w, scale)) < tol


@pytest.mark.parametrize("dtype,tol", CASES)
def test_pieces_on_their_own_grids_and_other_tiles(dtype, tol):
    """The bundled model's gate|up (two pieces of 96 rows, scale rows 0 and 1) through the row
    map, in int32 and int64, under several tilings: K steps of 64 (two per scale block), the
    swapped product, a one-row-tile group order."""
    from sgl_kernel.fp8_gemm import block_fp8_gemm, block_fp8_gemm_reference, gemm_config

    gen = torch.Generator().manual_seed(5)
    m, k = 40, 160
    w, scale, rows = _pieces([96, 96], k, gen)
    assert scale.shape == (2, 2) and int(rows[95]) == 0 and int(rows[96]) == 1
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    ref = block_fp8_gemm_reference(x, w, scale, rows)
    assert _rel(block_fp8_gemm(x, w, scale, rows), ref) < tol
    assert _rel(block_fp8_gemm(x, w, scale, rows.int()), ref) < tol
    for cfg in (gemm_config(16, 64, 64, 2), gemm_config(32, 32, 128, 1, swap_ab=True),
                gemm_config(16, 128, 32, 4, swap_ab=True)):
        assert _rel(block_fp8_gemm(x, w, scale, rows, config=cfg), ref) < tol, cfg


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-3)])
def test_prescaled_tiles_match_dequantise_then_matmul(dtype, tol):
    """``LaunchConfig.fp8_prescale``: the product with the weight dequantised to x's dtype
    (``fp8_blocks.block_dequantize``: fp32 ``q * scale`` rounded once) plus the bias, within
    summation order (fp32) and one output rounding (fp16: an ulp of the largest output is
    2^-10). Two pieces on their own grids (96 + 40 rows: ragged N, the row map), K = 300 (a
    partial last scale column and a ragged last step), plain and swapped tiles, BLOCK_K 64 and
    128. In fp16 the rounded weight shows: per-block product scaling gives other values."""
    from sgl_kernel.fp8_blocks import block_dequantize
    from sgl_kernel.fp8_gemm import block_fp8_gemm, gemm_config

    gen = torch.Generator().manual_seed(15)
    m, k = 40, 300
    w, scale, rows = _pieces([96, 40], k, gen)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(w.shape[0], generator=gen).to(DEVICE, dtype)
    w_x = block_dequantize(w, scale, dtype, rows=rows)
    ref = (x.float() @ w_x.float().t() + bias.float()).to(dtype)
    for cfg in (gemm_config(16, 64, 128, 2, fp8_prescale=True),
                gemm_config(32, 32, 64, 1, swap_ab=True, fp8_prescale=True)):
        got = block_fp8_gemm(x, w, scale, rows, bias, config=cfg)
        assert _rel(got, ref) < tol, cfg
    if dtype == torch.float16:
        per_block = block_fp8_gemm(x, w, scale, rows, bias, config=cfg._replace(
            fp8_prescale=False))
        assert not torch.equal(per_block, got) and _rel(got, ref) < _rel(per_block, ref)


def test_strided_x_and_rejects_bad_inputs():
    """A row slice of a wider x (strided rows) is read in place; wrong shapes, dtypes, scales
    and tiles are refused with a message."""
    from sgl_kernel.fp8_blocks import block_quantize
    from sgl_kernel.fp8_gemm import block_fp8_gemm, block_fp8_gemm_reference, gemm_config

    gen = torch.Generator().manual_seed(8)
    w, scale = (t.to(DEVICE) for t in block_quantize(torch.randn(48, 128, generator=gen) / 11))
    wide = torch.randn(20, 160, generator=gen).to(DEVICE)
    x = wide[:, 16:144]
    got = block_fp8_gemm(x, w, scale)
    assert _rel(got, block_fp8_gemm_reference(x, w, scale)) < 1e-5
    assert block_fp8_gemm(x[:0], w, scale).shape == (0, 48)
    with pytest.raises(ValueError, match="expected x"):
        block_fp8_gemm(torch.randn(2, 64, device=DEVICE), w, scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        block_fp8_gemm(x, w.float(), scale)
    with pytest.raises(ValueError, match="block scale"):
        block_fp8_gemm(x, w, scale[:, :0])
    with pytest.raises(ValueError, match="w_scale_rows"):
        block_fp8_gemm(x, w, scale, torch.zeros(47, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="bias"):
        block_fp8_gemm(x, w, scale, bias=torch.zeros(47, device=DEVICE))
    with pytest.raises(ValueError, match="block_k"):
        block_fp8_gemm(x, w, scale, config=gemm_config(16, 32, 96))


def _quantised(m: int, k: int, gen: torch.Generator):
    """Activations ``[m, k]`` drawn in fp32 and quantised per row and 128-column group: the
    e4m3 values, their scales and the fp32 input."""
    from sgl_kernel.fp8_act_quant import per_token_group_quant_fp8

    x = torch.randn(m, k, generator=gen).to(DEVICE)
    q, q_scale = per_token_group_quant_fp8(x)
    return q, q_scale, x


# w8a8 output dtypes: fp32 differs from the reference by summation order only, fp16 by its one
# output rounding (the interpreter has no bf16).
W8A8_CASES = [(torch.float32, 1e-5), (torch.float16, 2e-3)] + (
    [(torch.bfloat16, 1e-2)] if ON_CUDA else [])


@pytest.mark.parametrize("out_dtype,tol", W8A8_CASES)
def test_w8a8_ragged_shapes_with_bias_match_the_reference(out_dtype, tol):
    """e4m3 activations with their group scales (``x_scale``): M, N and K ragged (a partial
    last scale group and K step), a bias, under the default tiles, K steps of 64 (two per
    scale group) and the swapped product; against the reference that dequantises both operands
    in fp32. The plain and swapped tiles of one K step multiply the same fp32 values in the
    same order: bit-equal."""
    from sgl_kernel.fp8_blocks import block_quantize
    from sgl_kernel.fp8_gemm import block_fp8_gemm, block_fp8_gemm_reference, gemm_config

    gen = torch.Generator().manual_seed(21)
    m, n, k = 70, 150, 300
    q, q_scale, _ = _quantised(m, k, gen)
    w, scale = (t.to(DEVICE) for t in block_quantize(torch.randn(n, k, generator=gen) / 17))
    bias = torch.randn(n, generator=gen).to(DEVICE)
    ref = block_fp8_gemm_reference(q, w, scale, bias=bias, x_scale=q_scale, out_dtype=out_dtype)
    assert ref.dtype == out_dtype
    got = block_fp8_gemm(q, w, scale, bias=bias, x_scale=q_scale, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == (m, n) and _rel(got, ref) < tol
    no_bias = block_fp8_gemm_reference(q, w, scale, x_scale=q_scale, out_dtype=out_dtype)
    assert _rel(block_fp8_gemm(q, w, scale, x_scale=q_scale, out_dtype=out_dtype),
                no_bias) < tol
    for cfg in (gemm_config(16, 64, 64, 2), gemm_config(32, 32, 128, 1, swap_ab=True),
                gemm_config(16, 128, 32, 4, swap_ab=True)):
        other = block_fp8_gemm(q, w, scale, bias=bias, config=cfg, x_scale=q_scale,
                               out_dtype=out_dtype)
        assert _rel(other, ref) < tol, cfg
    swapped = block_fp8_gemm(q, w, scale, bias=bias, config=gemm_config(32, 64, 128, 2,
                                                                        swap_ab=True),
                             x_scale=q_scale, out_dtype=out_dtype)
    assert torch.equal(swapped, block_fp8_gemm(q, w, scale, bias=bias,
                                               config=gemm_config(32, 64, 128, 2),
                                               x_scale=q_scale, out_dtype=out_dtype))


def test_w8a8_pieces_on_their_own_grids():
    """A fused weight of two pieces (96 + 40 rows, each on its own block grid) through
    ``w_scale_rows`` (int64 and int32), plain and swapped tiles, K = 200 (ragged)."""
    from sgl_kernel.fp8_gemm import block_fp8_gemm, block_fp8_gemm_reference, gemm_config

    gen = torch.Generator().manual_seed(22)
    w, scale, rows = _pieces([96, 40], 200, gen)
    q, q_scale, _ = _quantised(40, 200, gen)
    bias = torch.randn(136, generator=gen).to(DEVICE)
    ref = block_fp8_gemm_reference(q, w, scale, rows, bias, x_scale=q_scale,
                                   out_dtype=torch.float32)
    for r in (rows, rows.int()):
        for cfg in (None, gemm_config(16, 64, 64, 2, swap_ab=True)):
            got = block_fp8_gemm(q, w, scale, r, bias, config=cfg, x_scale=q_scale,
                                 out_dtype=torch.float32)
            assert _rel(got, ref) < 1e-5, cfg
    # the map matters: the pieces' scales differ from the row // 128 grid's
    wrong = block_fp8_gemm_reference(q, w, scale[:2], None, bias, x_scale=q_scale,
                                     out_dtype=torch.float32)
    assert _rel(wrong, ref) > 1e-3


def test_w8a8_rejects_bad_inputs():
    """fp8 activations without their scales, scales of the wrong shape or dtype, no output
    dtype, scales beside a 16/32-bit x, an e4m3 output and pre-scaled tiles are refused."""
    from sgl_kernel.fp8_blocks import block_quantize
    from sgl_kernel.fp8_gemm import block_fp8_gemm, block_fp8_gemm_reference, gemm_config

    gen = torch.Generator().manual_seed(23)
    w, scale = (t.to(DEVICE) for t in block_quantize(torch.randn(48, 200, generator=gen)))
    q, q_scale, x = _quantised(20, 200, gen)
    f32 = torch.float32
    for fn in (block_fp8_gemm, block_fp8_gemm_reference):
        with pytest.raises(ValueError, match="needs its x_scale"):
            fn(q, w, scale, out_dtype=f32)
        with pytest.raises(ValueError, match="x_scale must be fp32"):
            fn(q, w, scale, x_scale=q_scale[:, :1], out_dtype=f32)
        with pytest.raises(ValueError, match="x_scale must be fp32"):
            fn(q, w, scale, x_scale=q_scale[:19], out_dtype=f32)
        with pytest.raises(ValueError, match="x_scale must be fp32"):
            fn(q, w, scale, x_scale=q_scale.half(), out_dtype=f32)
        with pytest.raises(ValueError, match="needs out_dtype"):
            fn(q, w, scale, x_scale=q_scale)
        with pytest.raises(ValueError, match="x_scale is for a float8_e4m3fn x"):
            fn(x, w, scale, x_scale=q_scale)
        with pytest.raises(ValueError, match="out_dtype must be"):
            fn(q, w, scale, x_scale=q_scale, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_prescale does not apply"):
        block_fp8_gemm(q, w, scale, x_scale=q_scale, out_dtype=f32,
                       config=gemm_config(16, 64, 128, 2, fp8_prescale=True))
    with pytest.raises(ValueError, match="expected x"):
        from sgl_kernel.fp8_gemm import block_fp8_linear

        block_fp8_linear(x.reshape(4, 5, 200), w, scale, fp8_activations=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_block_fp8_linear_fp8_activations(dtype):
    """``block_fp8_linear(..., fp8_activations=True)``: the activations quantised per token and
    group (bit-equal to the torch rule), then the fused w8a8 GEMM: equal to the kernel on the
    reference quantisation, within one output rounding of the fp32 reference on it, in x's
    dtype. A fused weight's row map and a bias; a strided x. ``fp8_activations=False`` stays
    the dequantise + F.linear path, bit for bit."""
    from sgl_kernel.fp8_act_quant import per_token_group_quant_fp8_reference
    from sgl_kernel.fp8_gemm import (block_fp8_dequantize, block_fp8_gemm,
                                     block_fp8_gemm_reference, block_fp8_linear)

    gen = torch.Generator().manual_seed(24)
    w, scale, rows = _pieces([96, 40], 300, gen)
    wide = torch.randn(50, 320, generator=gen).to(DEVICE, dtype)
    x = wide[:, 10:310]
    bias = torch.randn(136, generator=gen).to(DEVICE, dtype)
    got = block_fp8_linear(x, w, scale, rows, bias, fp8_activations=True)
    assert got.dtype == dtype and got.shape == (50, 136)
    q, q_scale = per_token_group_quant_fp8_reference(x)
    assert torch.equal(got, block_fp8_gemm(q, w, scale, rows, bias, x_scale=q_scale,
                                           out_dtype=dtype))
    ref = block_fp8_gemm_reference(q, w, scale, rows, bias, x_scale=q_scale, out_dtype=dtype)
    assert _rel(got, ref) < (1e-5 if dtype == torch.float32 else 2e-3)
    lib = torch.nn.functional.linear(x, block_fp8_dequantize(w, scale, rows, dtype), bias)
    assert torch.equal(block_fp8_linear(x, w, scale, rows, bias), lib)
    assert torch.equal(block_fp8_linear(x, w, scale, rows, bias, fp8_activations=False), lib)
    assert block_fp8_linear(x[:0], w, scale, rows, bias, fp8_activations=True).shape == (0, 136)


def _w8a8_error(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                rows: Optional[torch.Tensor]) -> Tuple[float, float]:
    """The w8a8 result of ``x`` against the weight-only fp32 product (same fp8 weight), after
    checking the error bound that the activations' e4m3 rounding implies element by element:
    a value of a group with scale ``s`` (its amax / 448) is off by at most 2^-4 of itself
    (3 mantissa bits, round to nearest) or, below e4m3's normal range, by 2^-10 ``s`` (half its
    subnormal step), so ``|w8a8 - ref| <= 2^-4 |x| @ |w|.T + 2^-10 s @ |w|.T`` (fp32 slack
    beside). Returns the error's mean relative to the reference's RMS and the norm-wise
    relative error."""
    from sgl_kernel.fp8_act_quant import per_token_group_quant_fp8_reference
    from sgl_kernel.fp8_blocks import block_dequantize
    from sgl_kernel.fp8_gemm import block_fp8_gemm_reference, block_fp8_linear

    got = block_fp8_linear(x, w, scale, rows, fp8_activations=True).float()
    ref = block_fp8_gemm_reference(x.float(), w, scale, rows)
    wf = block_dequantize(w, scale, torch.float32, rows=rows).abs()
    _, q_scale = per_token_group_quant_fp8_reference(x)
    s = q_scale.repeat_interleave(128, -1)[:, :x.shape[1]]
    bound = 2.0 ** -4 * x.float().abs() @ wf.t() + 2.0 ** -10 * s @ wf.t()
    err = (got - ref).abs()
    assert bool((err <= bound * (1 + 1e-4) + 1e-6 * ref.abs().max()).all()), \
        float((err / bound).max())
    return (float(err.mean() / ref.pow(2).mean().sqrt()),
            float((got - ref).norm() / ref.norm()))


def test_w8a8_error_against_the_weight_only_product():
    """The w8a8 product against the weight-only one (fp32, the same fp8 weight): every element
    within the bound of the activations' e4m3 rounding (``_w8a8_error``), and far inside it on
    average: a rounding error spread evenly up to 2^-4 of each value has an RMS of about
    2^-4 / sqrt(3) = 0.036 of it; measured here 0.025 norm-wise and 0.020 mean (relative to
    the output's RMS) for Gaussian activations, and less with a few outlier columns 30x larger
    (their groups' other values stay in e4m3's normal range: the same relative precision)."""
    gen = torch.Generator().manual_seed(25)
    w, scale, rows = _pieces([96, 40], 640, gen)
    x = torch.randn(72, 640, generator=gen).to(DEVICE)
    mean, norm = _w8a8_error(x, w, scale, rows)
    assert mean < 0.03 and norm < 0.035, (mean, norm)
    x[:, ::37] *= 30  # outlier channels, as real activations have
    mean, norm = _w8a8_error(x, w, scale, rows)
    assert mean < 0.03 and norm < 0.035, (mean, norm)


def test_launch_config_table():
    """Every bucket's tile divides the scale block and keeps tl.dot's minimum width; a weight of
    few rows gets a narrow column tile."""
    from sgl_kernel.fp8_gemm import launch_config

    for m in (65, 100, 1000, 8192, 1 << 20):
        for n in (32, 576, 2560, 20512):
            cfg = launch_config(m, n, 2560)
            assert 128 % cfg.block_k == 0 and cfg.block_m >= 16 and 16 <= cfg.block_n <= 128
            assert cfg.block_n <= max(16, n)
    assert launch_config(1024, 32, 2560).block_n == 32


def _fp8_layer(pieces, k: int, bias: bool):
    """A MergedColumnParallelLinear (or Replicated for one piece) with fp8 weights quantised at
    load from random fp32 pieces, on DEVICE."""
    from sglang.srt.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
    from sglang.srt.layers.quantization import quantization_scope
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.model_loader.weight_utils import LazyWeight

    gen = torch.Generator().manual_seed(11)
    with quantization_scope(Fp8Config()):
        if len(pieces) == 1:
            layer = ReplicatedLinear(k, pieces[0], bias=bias, params_dtype=torch.float32)
        else:
            layer = MergedColumnParallelLinear(k, list(pieces), bias=bias,
                                               params_dtype=torch.float32)
    for i, n in enumerate(pieces):
        loaded = LazyWeight.from_tensor(f"w{i}", torch.randn(n, k, generator=gen) / k ** 0.5)
        layer.weight_loader(layer.weight, loaded, i if len(pieces) > 1 else None)
    if bias:
        layer.weight_loader(layer.bias, LazyWeight.from_tensor(
            "b", torch.randn(sum(pieces), generator=gen)))
    return layer.to(DEVICE)


def _layer_above_small_m(dtype: torch.dtype, seed: int):
    """A fused block-fp8 layer (two 96-row pieces, K = 160, a bias in ``dtype``), 100 rows of x
    (above the small-M range) and the dequantise + ``F.linear`` reference of its product."""
    from sgl_kernel.small_m_gemm import SMALL_M_MAX_ROWS

    layer = _fp8_layer([96, 96], 160, bias=True)
    layer.bias.data = layer.bias.data.to(dtype)
    x = torch.randn(100, 160, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
    assert x.shape[0] > SMALL_M_MAX_ROWS
    ref = torch.nn.functional.linear(x, layer.quant_method.dequantized_weight(layer, dtype),
                                     layer.bias)
    return layer, x, ref


@pytest.mark.parametrize("dtype,tol", CASES)
def test_fp8_linear_method_above_the_small_m_range(dtype, tol, monkeypatch):
    """``Fp8LinearMethod.apply`` with the layer's Triton flag (``small_m_gemm``) on, 100 rows
    (above SMALL_M_MAX_ROWS): block_fp8_linear, which dequantises in one Triton pass and runs
    F.linear, bit for bit the dequantise + F.linear reference path; with the fused GEMM chosen
    for these rows (FUSED_MAX_ROWS raised) within ``tol`` of it (the reference rounds the weight
    to x's dtype first: fp32 differs by summation order only). A 3-D x keeps its leading dims;
    flag off: the reference path, no kernel."""
    import sgl_kernel.fp8_gemm as fg

    layer, x, ref = _layer_above_small_m(dtype, seed=12)
    calls = []
    real = fg.block_fp8_gemm
    monkeypatch.setattr(fg, "block_fp8_gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    layer.small_m_gemm = False
    assert torch.equal(layer(x), ref) and not calls
    layer.small_m_gemm = True
    if x.shape[0] > fg.FUSED_MAX_ROWS:
        assert torch.equal(layer(x), ref) and not calls
    monkeypatch.setattr(fg, "FUSED_MAX_ROWS", 128)
    got = layer(x)
    assert calls and got.dtype == dtype and _rel(got, ref) < tol
    assert torch.equal(got, real(x, layer.weight, layer.weight_scale_inv,
                                 layer.weight_row_block, layer.bias))
    assert torch.equal(layer(x.reshape(4, 25, 160)), got.reshape(4, 25, 192))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_linear_method_with_fp8_activations(dtype, monkeypatch):
    """A block-fp8 layer with ``small_m_gemm`` and ``fp8_activations`` (what
    ``KernelChoices.dense_fp8_activations`` sets) above the small-M rows: the w8a8 path, bit for bit
    ``block_fp8_linear(..., fp8_activations=True)`` (the fused GEMM called with e4m3 x and its
    scales), within the activations' e4m3 rounding of the weight-only reference path; a 3-D x
    keeps its leading dims. ``small_m_gemm`` off: the reference path, fp8_activations or not.
    A decode-sized batch: the small-M kernel on x in its own dtype, as without the flag."""
    import sgl_kernel.fp8_gemm as fg

    layer, x, ref = _layer_above_small_m(dtype, seed=26)
    calls = []
    real = fg.block_fp8_gemm
    monkeypatch.setattr(fg, "block_fp8_gemm", lambda *a, **kw: calls.append(
        kw.get("x_scale") is not None and a[0].dtype == torch.float8_e4m3fn) or real(*a, **kw))
    layer.fp8_activations = True
    layer.small_m_gemm = False
    assert torch.equal(layer(x), ref) and not calls
    layer.small_m_gemm = True
    got = layer(x)
    assert calls == [True] and got.dtype == dtype
    assert torch.equal(got, fg.block_fp8_linear(x, layer.weight, layer.weight_scale_inv,
                                                layer.weight_row_block, layer.bias,
                                                fp8_activations=True))
    assert 0 < _rel(got, ref) < 0.1
    assert torch.equal(layer(x.reshape(4, 25, 160)), got.reshape(4, 25, 192))
    few = x[:4]
    calls.clear()
    on = layer(few)
    layer.fp8_activations = False
    assert torch.equal(on, layer(few)) and not calls


def test_row_parallel_gated_norm_above_the_small_m_range():
    """A gated-norm o_proj at prefill rows: the torch GatedRMSNorm first, then block_fp8_gemm
    (fp32, interpreter), equal to the norm followed by the dequantised product."""
    from sgl_kernel.small_m_gemm import GatedNormPrologue, gated_norm_reference
    from sglang.srt.layers.linear import RowParallelLinear
    from sglang.srt.layers.quantization import quantization_scope
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.model_loader.weight_utils import LazyWeight

    gen = torch.Generator().manual_seed(13)
    with quantization_scope(Fp8Config()):
        layer = RowParallelLinear(128, 48, params_dtype=torch.float32)
    layer.weight_loader(layer.weight, LazyWeight.from_tensor("o", torch.randn(48, 128,
                                                                            generator=gen)))
    layer = layer.to(DEVICE)
    layer.small_m_gemm = True
    x, gate = (torch.randn(80, 128, generator=gen).to(DEVICE) for _ in "xg")
    pro = GatedNormPrologue(gate, (1 + torch.rand(64, generator=gen)).to(DEVICE), 1e-6, 64)
    got = layer(x, gated_norm=pro)
    ref = torch.nn.functional.linear(gated_norm_reference(x, pro),
                                     layer.quant_method.dequantized_weight(layer, x.dtype))
    assert _rel(got, ref) < 1e-5


# The model's dense fp8 shapes (docs/model.md): KDA's fused q|k|v|b|f|g and o_proj, MLA's
# q_proj, kv_a and dense, the shared expert and the dense MLP.
LING_SHAPES = [([4096, 4096, 4096, 32, 4096, 4096], 2560), ([2560], 4096), ([6144], 2560),
               ([576], 2560), ([768, 768], 2560), ([2560], 768), ([6144, 6144], 2560)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1024, 8192, 333])
def test_cuda_bf16_at_the_model_shapes(m):
    """bf16 on the GPU at the model's shapes: within bf16 rounding of the fp32 reference and of
    the dequantise + F.linear path; the same for pre-scaled weight tiles (``fp8_prescale``)."""
    if not ON_CUDA:
        pytest.skip("needs CUDA")
    from sgl_kernel.fp8_gemm import (block_fp8_dequantize, block_fp8_gemm,
                                     block_fp8_gemm_reference, launch_config)

    gen = torch.Generator().manual_seed(m)
    for pieces, k in LING_SHAPES:
        w, scale, rows = _pieces(pieces, k, gen)
        x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
        got = block_fp8_gemm(x, w, scale, rows)
        ref = block_fp8_gemm_reference(x, w, scale, rows)
        assert _rel(got, ref) < 1e-2, (pieces, k)
        if len(pieces) == 1:  # one grid: the map and row // 128 agree
            assert torch.equal(block_fp8_gemm(x, w, scale), got)
        # Pre-scaled tiles: the dequantise-to-bf16 + F.linear path's values up to summation
        # order, so within bf16 output rounding of it (and of the fp32 reference).
        cfg = launch_config(m, w.shape[0], k)._replace(fp8_prescale=True)
        pre = block_fp8_gemm(x, w, scale, rows, config=cfg)
        lib = torch.nn.functional.linear(x, block_fp8_dequantize(w, scale, rows, x.dtype))
        assert _rel(pre, lib) < 1e-2 and _rel(pre, ref) < 1e-2, (pieces, k)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1024, 8192, 333])
def test_cuda_w8a8_bf16_at_the_model_shapes(m):
    """w8a8 in bf16 on the GPU at the model's shapes (the default tiles: the swapped product
    from 513 rows): the fused fp8 GEMM within bf16 output rounding of the fp32 reference on the
    same quantised activations, ``block_fp8_linear(..., fp8_activations=True)`` bit-equal to
    quantisation + that GEMM, and within the activations' e4m3 rounding of the weight-only
    product (norm-wise, as in ``test_w8a8_error_against_the_weight_only_product``)."""
    if not ON_CUDA:
        pytest.skip("needs CUDA")
    from sgl_kernel.fp8_act_quant import per_token_group_quant_fp8
    from sgl_kernel.fp8_gemm import block_fp8_gemm, block_fp8_gemm_reference, block_fp8_linear

    gen = torch.Generator().manual_seed(m + 1)
    for pieces, k in LING_SHAPES:
        w, scale, rows = _pieces(pieces, k, gen)
        x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
        q, q_scale = per_token_group_quant_fp8(x)
        got = block_fp8_gemm(q, w, scale, rows, x_scale=q_scale, out_dtype=torch.bfloat16)
        ref = block_fp8_gemm_reference(q, w, scale, rows, x_scale=q_scale,
                                       out_dtype=torch.float32)
        assert got.dtype == torch.bfloat16 and _rel(got, ref) < 1e-2, (pieces, k)
        assert torch.equal(block_fp8_linear(x, w, scale, rows, fp8_activations=True), got)
        weight_only = block_fp8_gemm_reference(x, w, scale, rows, out_dtype=torch.float32)
        norm = float((got.float() - weight_only).norm() / weight_only.norm())
        assert norm < 0.035, (pieces, k, norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_kernel_is_bit_equal_to_the_torch_dequantisation(dtype):
    """block_fp8_dequantize: the weight q * scale rounded once, bit-equal to fp8_blocks'
    block_dequantize, with and without the row map (ragged N and K)."""
    from sgl_kernel.fp8_blocks import block_dequantize
    from sgl_kernel.fp8_gemm import block_fp8_dequantize

    gen = torch.Generator().manual_seed(14)
    w, scale, rows = _pieces([96, 40], 200, gen)
    assert torch.equal(block_fp8_dequantize(w, scale, rows, dtype),
                       block_dequantize(w, scale, dtype, rows=rows))
    one, one_scale = w[:, :130], scale[:1, :2].contiguous()
    assert torch.equal(block_fp8_dequantize(one[:100], one_scale, None, dtype),
                       block_dequantize(one[:100], one_scale, dtype))
