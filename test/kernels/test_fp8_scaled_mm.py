"""sgl_kernel.fp8_scaled_mm: block-fp8 linear layers on torch's block-scaled ``_scaled_mm``.

On CPU the library's product is :func:`scaled_mm_reference` (torch's layout checks and the block
scales' meaning in plain torch), passed as ``mm``; the quantiser and the dequantised fallback run
in Triton's interpreter. The ``gpu`` test runs ``torch._scaled_mm`` itself on Ling-3.0-flash's
fused KDA projection shape.
"""
from __future__ import annotations

import logging

import pytest
import torch

from kernel_test_utils import DEVICE, ON_CUDA, needs_triton
from sgl_kernel import fp8_scaled_mm as fsm
from sgl_kernel.fp8_act_quant import group_dequantize, per_token_group_quant_fp8
from sgl_kernel.fp8_blocks import block_dequantize

pytestmark = needs_triton


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch):
    """Each test decides its shapes' checks anew."""
    monkeypatch.setattr(fsm, "_CHECKED", {})
    monkeypatch.setattr(fsm, "_SLICE_OUT", {})


def _fused_weight(pieces, k: int, seed: int):
    """An e4m3 weight made of ``pieces``, each on its own 128-row scale grid (as
    ``quantization.fp8`` lays out a merged layer), with varied block scales."""
    from sglang.srt.layers.quantization.fp8_utils import block_index

    gen = torch.Generator().manual_seed(seed)
    n = sum(pieces)
    q = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    rows = sum(-(-p // 128) for p in pieces)
    scale = torch.rand(rows, -(-k // 128), generator=gen) * 1e-3 + 1e-4
    return q.to(DEVICE), scale.to(DEVICE), block_index(pieces, 128).to(DEVICE)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _cuda_projection(pieces, m: int, seed: int):
    """``(q, s, rows, x, groups)``: a fused weight of ``pieces`` (K = 2560, the model's hidden
    width) with ``m`` rows of bf16 activations on CUDA and the weight's row groups."""
    q, s, rows = _fused_weight(pieces, 2560, seed=seed)
    x = torch.randn(m, 2560, device="cuda", dtype=torch.bfloat16)
    return q, s, rows, x, fsm.row_groups(pieces)


def _w8a8(x: torch.Tensor, q, s, rows) -> torch.Tensor:
    """fp32 ``x @ dequant(w).T`` with x quantised per row and 128-column group (w8a8)."""
    xq, xs = per_token_group_quant_fp8(x)
    return group_dequantize(xq, xs) @ block_dequantize(q, s, torch.float32, rows=rows).t()


def test_row_groups_follow_the_scale_grids():
    # KDA's q | k | v | b | f | g: b (one row per head) breaks the grid, f starts a new one.
    assert fsm.row_groups([2560, 2560, 2560, 20, 2560, 2560]) == [
        (0, 7680, 0), (7680, 7700, 60), (7700, 12820, 61)]
    assert fsm.row_groups([768, 768]) == [(0, 1536, 0)]
    assert fsm.row_groups([96, 96]) == [(0, 96, 0), (96, 192, 1)]
    assert fsm.row_groups([256, 0, 128]) == [(0, 384, 0)]
    assert fsm.scaled_mm_eligible(7680, 2560) and not fsm.scaled_mm_eligible(20, 2560)
    assert not fsm.scaled_mm_eligible(96, 200)


def test_operands_pass_the_library_layout_checks():
    q, s, _ = _fused_weight([256], 384, seed=1)
    x = torch.randn(40, 384).to(DEVICE)
    xq, xs = per_token_group_quant_fp8(x)
    a, b, sa, sb = fsm.scaled_mm_operands(xq, xs, q, s)
    assert sa.stride() == (1, 40) and torch.equal(sa, xs)  # outer-dim-major, same values
    assert b.stride(0) == 1 and sb.t().is_contiguous()
    out = fsm.scaled_mm_reference(a, b, sa, sb, torch.float32)
    ref = group_dequantize(xq, xs) @ block_dequantize(q, s, torch.float32).t()
    assert _rel(out, ref) < 1e-6
    with pytest.raises(ValueError, match="scale_a must be"):
        fsm.scaled_mm_reference(a, b, xs, sb, torch.float32)  # row-major activation scales
    with pytest.raises(ValueError, match="scale_b.t"):
        fsm.scaled_mm_reference(a, b, sa, s, torch.float32)  # the scales not transposed
    with pytest.raises(ValueError, match="multiples of 16"):
        fsm.scaled_mm_reference(a, b[:, :20], sa, s[:1].t(), torch.float32)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_fused_weight_through_row_groups(dtype, tol):
    """A merged weight with a piece off the 128-row grid: the grid-aligned groups on the
    library's product equal w8a8 (x quantised per row and group) on the dequantised weight, the
    20-row group the dequantised weight-only path; the bias is added once."""
    pieces, k, m = [256, 20, 128], 192, 24  # K = 192: a partial last scale column
    q, s, rows = _fused_weight(pieces, k, seed=2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(sum(pieces), generator=gen).to(DEVICE, dtype)
    calls = []

    def mm(*args, out_dtype, out=None):
        calls.append(args[1].shape[1])
        return fsm.scaled_mm_reference(*args, out_dtype, out)

    groups = fsm.row_groups(pieces)
    y = fsm.blockwise_linear(x, q, s, groups, bias, mm=mm)
    # each group's first call: its product, then the in-place write into a slice checked
    assert calls == [256, 256, 128, 128] and y.shape == (m, sum(pieces)) and y.dtype == dtype
    w = block_dequantize(q, s, torch.float32, rows=rows)
    xq, xs = per_token_group_quant_fp8(x)
    w8a8 = (group_dequantize(xq, xs) @ w.t() + bias.float()).to(dtype)
    weight_only = torch.nn.functional.linear(x, block_dequantize(q, s, dtype, rows=rows), bias)
    lib = torch.cat([torch.arange(0, 256), torch.arange(276, 404)])
    assert _rel(y[:, lib], w8a8[:, lib]) < tol
    assert _rel(y[:, 256:276], weight_only[:, 256:276]) < tol


def test_a_library_that_misreads_the_scales_is_refused(caplog):
    """A product that treats the weight's scales as untransposed fails the once-per-shape check:
    that shape keeps the dequantised path (one warning), also on the next call."""
    q, s, _ = _fused_weight([256], 256, seed=4)
    x = torch.randn(16, 256).to(DEVICE)
    calls = []

    def wrong(a, b, sa, sb, out_dtype, out=None):
        calls.append(1)
        return fsm.scaled_mm_reference(a, b, sa, sb.t().flip(0).t(), out_dtype, out)

    weight_only = torch.nn.functional.linear(x, block_dequantize(q, s, torch.float32))
    with caplog.at_level(logging.WARNING, logger=fsm.__name__):
        y = fsm.blockwise_linear(x, q, s, [(0, 256, 0)], mm=wrong)
        y2 = fsm.blockwise_linear(x, q, s, [(0, 256, 0)], mm=wrong)
    assert calls == [1]  # checked once, not called again
    assert torch.equal(y, y2) and _rel(y, weight_only) < 1e-5
    assert sum("keeps the dequantised path" in r.message for r in caplog.records) == 1


def test_a_refusing_library_falls_back_once(caplog):
    q, s, _ = _fused_weight([128], 128, seed=5)
    x = torch.randn(8, 128).to(DEVICE)
    calls = []

    def refuses(*args, out_dtype, out=None):
        calls.append(1)
        raise RuntimeError("Invalid scaling configuration.\nmore")

    with caplog.at_level(logging.WARNING, logger=fsm.__name__):
        for _ in range(2):
            y = fsm.blockwise_linear(x, q, s, [(0, 128, 0)], mm=refuses)
    assert calls == [1]
    assert _rel(y, torch.nn.functional.linear(x, block_dequantize(q, s, torch.float32))) < 1e-5
    assert any("Invalid scaling configuration." in r.message for r in caplog.records)


def test_a_later_refusal_falls_back_without_an_error(caplog):
    """A shape the library took at its first call but refuses at another row count (cuBLASLt's
    heuristics can) runs weight-only from then on: the call returns the right product, no
    exception reaches the model, one warning names the row count."""
    q, s, _ = _fused_weight([128], 128, seed=19)
    calls = []

    def picky(*args, out_dtype, out=None):
        calls.append(args[0].shape[0])
        if args[0].shape[0] > 16:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        return fsm.scaled_mm_reference(*args, out_dtype, out)

    gen = torch.Generator().manual_seed(20)
    x8 = torch.randn(8, 128, generator=gen).to(DEVICE)
    x40 = torch.randn(40, 128, generator=gen).to(DEVICE)
    fsm.blockwise_linear(x8, q, s, [(0, 128, 0)], mm=picky)
    assert fsm.library_status(x8.device, 128, 128, x8.dtype) is True
    with caplog.at_level(logging.WARNING, logger=fsm.__name__):
        y = fsm.blockwise_linear(x40, q, s, [(0, 128, 0)], mm=picky)
        y2 = fsm.blockwise_linear(x40, q, s, [(0, 128, 0)], mm=picky)
    assert fsm.library_status(x40.device, 128, 128, x40.dtype) is False and calls[-1] == 48
    assert torch.equal(y, y2)
    assert _rel(y, torch.nn.functional.linear(x40, block_dequantize(q, s, torch.float32))) < 1e-5
    assert sum("refused at 48 rows" in r.message for r in caplog.records) == 1


def _contiguous_writer(calls):
    """A library whose ``out=`` writes ``[M, N]`` values from the slice's first element as if
    the slice were contiguous (what torch's CPU ``_scaled_mm`` was seen doing), over the
    neighbouring columns."""
    def mm(*args, out_dtype, out=None):
        calls.append(out is not None)
        product = fsm.scaled_mm_reference(*args, out_dtype)
        if out is None:
            return product
        out.as_strided(product.shape, (product.shape[1], 1)).copy_(product)
        return out
    return mm


@pytest.mark.parametrize("writes_slices", [True, False])
def test_groups_are_written_into_one_output(writes_slices):
    """Three groups (256 | 32 | 128 rows) written into one output, no concatenation: where the
    library writes a column slice in place (the reference honours the row stride) later calls
    pass it the slice; where it writes as if contiguous (neighbours overwritten) the
    once-per-shape check sees the sentinels touched and later calls copy a separate product;
    either way every call equals the first and the groups' columns are their own products."""
    pieces, k, m = [256, 32, 128], 128, 40
    q, s, _ = _fused_weight(pieces, k, seed=9)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    calls = []
    mm = (lambda *a, out_dtype, out=None: calls.append(out is not None)
          or fsm.scaled_mm_reference(*a, out_dtype, out)) if writes_slices \
        else _contiguous_writer(calls)
    groups = fsm.row_groups(pieces)
    first = fsm.blockwise_linear(x, q, s, groups, mm=mm)
    assert calls == [False, True] * 3  # each group: its product, then the slice check
    assert all(fsm._SLICE_OUT[fsm._key(x.device, r1 - r0, k, x.dtype)] is writes_slices
               for r0, r1, _ in groups)
    calls.clear()
    again = fsm.blockwise_linear(x, q, s, groups, mm=mm)
    assert calls == [writes_slices] * 3 and torch.equal(again, first)
    for r0, r1, s0 in groups:
        alone = fsm.blockwise_linear(x, q[r0:r1], s[s0:s0 + -(-(r1 - r0) // 128)],
                                     [(0, r1 - r0, 0)], mm=fsm.scaled_mm_reference)
        assert torch.equal(first[:, r0:r1], alone)


def test_misaligned_columns_are_copied_not_written_in_place():
    """A group whose columns do not start on 16 bytes (fp16 output, a 20-row group before it:
    column 276 is byte 552) is never passed to the library as ``out=`` (cuBLASLt refuses such a
    slice with ``CUBLAS_STATUS_NOT_SUPPORTED``): its product is copied there; the aligned group
    is written in place (the output's rows, 408 columns, are 816 bytes); the 20- and 4-row
    groups, off the library's rules, are weight-only on weights dequantised once
    (:func:`weight_only_groups`)."""
    pieces, k, m = [256, 20, 128, 4], 128, 32
    q, s, rows = _fused_weight(pieces, k, seed=13)
    groups = fsm.row_groups(pieces)
    off_grid = fsm.weight_only_groups(q, s, groups, torch.float16)
    assert sorted(off_grid) == [1, 3] and off_grid[1].shape == (20, k)
    calls = []

    def fussy(*args, out_dtype, out=None):
        if out is not None and (out.data_ptr() % 16 or out.stride(0) * out.element_size() % 16):
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        calls.append((args[1].shape[1], out is not None))
        return fsm.scaled_mm_reference(*args, out_dtype, out)

    x = torch.randn(m, k, generator=torch.Generator().manual_seed(14)).to(DEVICE, torch.float16)
    first = fsm.blockwise_linear(x, q, s, groups, mm=fussy, dequantized=off_grid)
    calls.clear()
    again = fsm.blockwise_linear(x, q, s, groups, mm=fussy, dequantized=off_grid)
    assert calls == [(256, True), (128, False)] and torch.equal(again, first)
    weight_only = x @ block_dequantize(q, s, torch.float16, rows=rows).t()
    for cols in (slice(256, 276), slice(404, 408)):
        assert torch.equal(first[:, cols], weight_only[:, cols])


def test_library_calls_run_on_rows_padded_to_16():
    """The library's calls get the quantised rows padded to a multiple of 16 (zero rows, scale
    1) and the product keeps the caller's rows: 5 rows of x give the first 5 rows of the
    product of a 16-row x that starts with them, with one group or two (the weight-only
    20-row group takes x as it is)."""
    pieces, k = [128, 20], 128
    q, s, _ = _fused_weight(pieces, k, seed=16)
    groups = fsm.row_groups(pieces)
    off_grid = fsm.weight_only_groups(q, s, groups, torch.float32)
    seen = []

    def mm(*args, out_dtype, out=None):
        seen.append(args[0].shape[0])
        return fsm.scaled_mm_reference(*args, out_dtype, out)

    x16 = torch.randn(16, k, generator=torch.Generator().manual_seed(17)).to(DEVICE)
    full = fsm.blockwise_linear(x16, q, s, groups, mm=mm, dequantized=off_grid)
    y = fsm.blockwise_linear(x16[:5], q, s, groups, mm=mm, dequantized=off_grid)
    q5, s5, rows5 = fsm._quantized_rows(x16[:5])  # scales written outer-dim-major in place
    assert rows5 == 16 and s5.stride() == (1, 16)
    assert fsm._outer_dim_major(s5).data_ptr() == s5.data_ptr()  # no transposing copy
    assert bool((s5[5:] == 1).all()) and not q5[5:].view(torch.uint8).any()
    # (the same sums; fp32 matmuls of 5 and 16 rows may round apart in the last place)
    assert set(seen) == {16} and y.shape == (5, sum(pieces)) and _rel(y, full[:5]) < 1e-6
    y3 = fsm.blockwise_linear(x16[:5], q[:128], s[:1], [(0, 128, 0)], mm=mm)
    assert y3.shape == (5, 128) and _rel(y3, full[:5, :128]) < 1e-6


def test_fp8_linear_layer_with_dense_scaled_mm(monkeypatch):
    """A merged block-fp8 layer (pieces 96 | 20 | 128, K = 160, a bias) with ``small_m_gemm``
    and ``dense_scaled_mm`` (what ``KernelChoices.dense_scaled_mm`` sets) above the small-M
    rows: ``blockwise_linear`` on the layer's row groups, the library called for the two
    grid-aligned groups, the 20-row group on its weight dequantised once by
    ``set_fp8_activations`` (no dequantisation at the call); within the activations' e4m3
    rounding of the weight-only path; a 3-D x keeps its leading dims; the flag off:
    ``block_fp8_linear`` as before."""
    from sgl_kernel.small_m_gemm import SMALL_M_MAX_ROWS
    from sglang.srt.layers.linear import MergedColumnParallelLinear
    from sglang.srt.layers.quantization import quantization_scope
    from sglang.srt.layers.quantization.fp8 import Fp8Config, set_fp8_activations
    from sglang.srt.model_loader.weight_utils import LazyWeight

    pieces, k = [96, 20, 128], 160
    gen = torch.Generator().manual_seed(8)
    with quantization_scope(Fp8Config()):
        layer = MergedColumnParallelLinear(k, pieces, bias=True, params_dtype=torch.float32)
    for i, n in enumerate(pieces):
        layer.weight_loader(layer.weight, LazyWeight.from_tensor(
            f"w{i}", torch.randn(n, k, generator=gen) / k ** 0.5), i)
    layer.weight_loader(layer.bias, LazyWeight.from_tensor("b", torch.randn(sum(pieces),
                                                                            generator=gen)))
    layer = layer.to(DEVICE)
    x = torch.randn(100, k, generator=gen).to(DEVICE)
    assert x.shape[0] > SMALL_M_MAX_ROWS
    ref = torch.nn.functional.linear(x, layer.quant_method.dequantized_weight(layer, x.dtype),
                                     layer.bias)
    calls = []
    monkeypatch.setattr(fsm, "_library_scaled_mm", lambda *a, out_dtype, out=None: calls.append(
        a[1].shape[1]) or fsm.scaled_mm_reference(*a, out_dtype, out))
    layer.small_m_gemm = True
    plain = layer(x)
    assert not calls and torch.equal(plain, ref)  # flag off: the weight-only path
    set_fp8_activations(layer, moe=False, dense=False, dense_scaled_mm=True)
    assert layer.dense_scaled_mm and list(layer.scaled_mm_groups[1]) == [1]

    def no_dequantize(*args, **kwargs):
        raise AssertionError("a weight was dequantised at the call")

    monkeypatch.setattr(fsm, "block_fp8_dequantize", no_dequantize)
    got = layer(x)
    assert calls == [96, 96, 128, 128] and 0 < _rel(got, ref) < 0.1  # products, slice checks
    assert _rel(got[:, 96:116], ref[:, 96:116]) < 1e-6  # the 20-row piece: weight-only
    assert torch.equal(layer(x.reshape(4, 25, k)), got.reshape(4, 25, sum(pieces)))


@pytest.mark.gpu
def test_library_product_on_the_kda_projection_shape_on_cuda():
    """``torch._scaled_mm`` itself on the 42-layer model's fused KDA projection (q | k | v | b |
    f | g, K = 2560) at 256 rows in bf16: the grid-aligned groups within bf16 rounding of w8a8
    on the dequantised weight, the 20-row ``b`` piece (off the grid: the weight-only path, on x
    as it is) within bf16 rounding of the weight-only product; every group that can use the
    library did (its once-per-shape check passed)."""
    if not ON_CUDA:
        pytest.skip("needs CUDA")
    pieces = [2560, 2560, 2560, 20, 2560, 2560]
    q, s, rows, x, groups = _cuda_projection(pieces, 256, seed=7)
    y = fsm.blockwise_linear(x, q, s, groups)
    w8a8 = _w8a8(x, q, s, rows)
    weight_only = x.float() @ block_dequantize(q, s, torch.float32, rows=rows).t()
    b = slice(7680, 7700)
    lib = torch.cat([torch.arange(0, 7680), torch.arange(7700, sum(pieces))]).cuda()
    assert [fsm.library_status(x.device, r1 - r0, 2560, x.dtype) for r0, r1, _ in groups] \
        == [True, None, True]  # the 20-row group is not eligible, so never checked
    assert _rel(y[:, lib], w8a8[:, lib]) < 1e-2
    assert _rel(y[:, b], weight_only[:, b]) < 1e-2
    used = {n: fsm.library_status(x.device, n, 2560, x.dtype) for n in (7680, 20, 5120)}
    if not used[7680]:
        pytest.skip(f"the library did not take the block-scaled product here: {used}")
    assert used == {7680: True, 20: None, 5120: True}  # the 20-row piece never asks it
    # Later calls write the library's groups into their columns in place where its out= was
    # seen to honour the row stride, else copy them there: the same values either way.
    again = fsm.blockwise_linear(x, q, s, groups)
    print("library writes column slices in place:", dict(fsm._SLICE_OUT))
    assert _rel(again, y) < 1e-2 and torch.equal(again[:, b], y[:, b])


@pytest.mark.gpu
def test_groups_written_in_place_on_cuda():
    """The 42-layer model's fused KDA projection as it is (32 heads: q | k | v | b | f | g =
    4096 x 3 | 32 | 4096 x 2 rows, K = 2560) at 512 rows in bf16: three groups, all on the
    library, every column start and the row stride 16-byte aligned, so after the first call
    the library writes each group into its columns in place; both calls within bf16 rounding
    of w8a8 on the dequantised weight."""
    if not ON_CUDA:
        pytest.skip("needs CUDA")
    q, s, rows, x, groups = _cuda_projection([4096, 4096, 4096, 32, 4096, 4096], 512, seed=15)
    assert [g[1] - g[0] for g in groups] == [12288, 32, 8192]
    first = fsm.blockwise_linear(x, q, s, groups)
    if not all(fsm.library_status(x.device, r1 - r0, 2560, x.dtype) for r0, r1, _ in groups):
        pytest.skip(f"the library did not take every group here: {dict(fsm._CHECKED)}")
    slices = {n: fsm._SLICE_OUT.get(fsm._key(x.device, n, 2560, x.dtype))
              for n in (12288, 32, 8192)}
    again = fsm.blockwise_linear(x, q, s, groups)
    w8a8 = _w8a8(x, q, s, rows)
    assert _rel(first, w8a8) < 1e-2 and _rel(again, w8a8) < 1e-2
    assert slices == {12288: True, 32: True, 8192: True}, slices


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 40, 100, 333, 1000])
def test_library_takes_any_row_count_on_cuda(m):
    """Row counts that are not a multiple of 16 (a server's warm-up and its prompts): the
    library takes every group of the fused KDA and MLA projections (their calls run on rows
    padded to 16) and the product is w8a8 on the dequantised weight within bf16 rounding."""
    if not ON_CUDA:
        pytest.skip("needs CUDA")
    for pieces in ([4096, 4096, 4096, 32, 4096, 4096], [6144, 576, 32]):
        q, s, rows, x, groups = _cuda_projection(pieces, m, seed=18)
        y = fsm.blockwise_linear(x, q, s, groups)
        status = [fsm.library_status(x.device, r1 - r0, 2560, x.dtype) for r0, r1, _ in groups]
        assert status == [True] * len(groups), (pieces, status)
        assert y.shape == (m, sum(pieces)) and _rel(y, _w8a8(x, q, s, rows)) < 1e-2
