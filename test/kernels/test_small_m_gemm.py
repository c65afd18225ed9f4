"""sgl_kernel.small_m_gemm against its torch reference, and its batch invariance: a row's result is
the same bit for bit whatever the number of rows beside it (interpreter: fp32 / fp16; CUDA: bf16
too)."""
from __future__ import annotations

import pytest
import torch

from kernel_test_utils import DEVICE, ON_CUDA, needs_triton
from sgl_kernel._triton_mode import LaunchConfig

pytestmark = needs_triton

CASES = [(torch.float32, 1e-5), (torch.float16, 2e-3)] + ([(torch.bfloat16, 1e-2)] if ON_CUDA
                                                          else [])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("dtype,tol", CASES)
def test_matches_reference_and_is_batch_invariant(dtype, tol):
    from sgl_kernel.small_m_gemm import small_m_gemm, small_m_gemm_reference

    gen = torch.Generator().manual_seed(2)
    m, n, k = 20, 150, 300  # two row tiles; n, k ragged against the tiles
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w_full = torch.randn(n + 10, k, generator=gen).to(DEVICE, dtype) / k ** 0.5
    w = w_full[5:5 + n]  # a row slice, as a TP shard is
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    got = small_m_gemm(x, w, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    assert _rel(got, small_m_gemm_reference(x, w, bias)) < tol
    for rows in (slice(0, 1), slice(3, 7), slice(17, 18)):
        assert torch.equal(small_m_gemm(x[rows], w, bias), got[rows])


def test_mixed_dtypes_convert_x_and_round_once_to_out_dtype():
    """The router gate's form: fp16 activations, an fp32 weight, fp32 logits out; batch-invariant."""
    from sgl_kernel.small_m_gemm import small_m_gemm, small_m_gemm_reference

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 96, generator=gen).to(DEVICE, torch.float16)
    w = torch.randn(32, 96, generator=gen).to(DEVICE)
    got = small_m_gemm(x, w, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    ref = small_m_gemm_reference(x, w, out_dtype=torch.float32)
    assert _rel(got, ref) < 1e-5
    assert torch.equal(small_m_gemm(x[2:3], w, out_dtype=torch.float32), got[2:3])


@pytest.mark.parametrize("dtype,tol", CASES)
def test_split_k_matches_reference_and_is_batch_invariant(dtype, tol):
    """``split_k``: K ranges summed in range order by the tile's last range (a ragged last
    range, an empty one, a bias and a strided out), and ``swap_ab``, equal the reference,
    bit-equal across M."""
    from sgl_kernel.small_m_gemm import small_m_gemm, small_m_gemm_reference

    gen = torch.Generator().manual_seed(9)
    m, n, k = 18, 40, 330
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    ref = small_m_gemm_reference(x, w, bias)
    for split, swap in ((2, False), (4, True), (8, False), (1, True)):
        # 64-wide tiles: 6 in 2 ranges; 4: 2+2+2+empty; 8 -> 6 ranges; swap_ab: the weight as
        # the first operand
        cfg = LaunchConfig(16, 64, 4, 1, split, swap)
        got = small_m_gemm(x, w, bias, config=cfg)
        assert _rel(got, ref) < tol
        assert torch.equal(small_m_gemm(x[5:6], w, bias, config=cfg), got[5:6])
        wide = torch.zeros(m, n + 8, dtype=dtype, device=DEVICE)
        small_m_gemm(x, w, bias, out=wide[:, 4:4 + n], config=cfg)
        assert torch.equal(wide[:, 4:4 + n], got) and not wide[:, :4].any()
    from sgl_kernel._triton_mode import arrival_counts  # every tile's count reset for the next

    assert not arrival_counts("small_m_gemm", x.device, 1).any()


@pytest.mark.parametrize("dtype,tol", CASES)
def test_block_fp8_weight_matches_the_fp32_dequantised_reference(dtype, tol):
    """A float8_e4m3fn weight with 128 x 128 block scales (ragged edges): each block's fp32 sum
    scaled, equal to the reference with and without a K split, and still batch-invariant."""
    from sgl_kernel.fp8_blocks import block_quantize
    from sgl_kernel.small_m_gemm import small_m_gemm, small_m_gemm_reference

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(6, 300, generator=gen).to(DEVICE, dtype)
    w, scale = (z.to(DEVICE) for z in block_quantize(torch.randn(140, 300, generator=gen) / 17))
    got = small_m_gemm(x, w, w_scale=scale)
    assert got.dtype == dtype
    assert _rel(got, small_m_gemm_reference(x, w, w_scale=scale)) < tol
    assert torch.equal(small_m_gemm(x[4:5], w, w_scale=scale), got[4:5])
    # A tile steps whole scale blocks (64 columns asked: one block); split over K ranges.
    for cfg in (LaunchConfig(16, 64, 4, 1), LaunchConfig(32, 256, 4, 1, 2),
                LaunchConfig(16, 128, 4, 1, 3), LaunchConfig(32, 128, 4, 1, 2, True),
                LaunchConfig(16, 512, 4, 1, 1, True)):
        other = small_m_gemm(x, w, w_scale=scale, config=cfg)
        assert _rel(other, small_m_gemm_reference(x, w, w_scale=scale)) < tol
        assert torch.equal(small_m_gemm(x[1:2], w, w_scale=scale, config=cfg), other[1:2])
    # Several blocks a step (the last one past K here) add the blocks' sums in the order one
    # block a step does: the same bits, so the step width is free to tune.
    for split, widths in ((1, (256, 384, 512)), (2, (256,))):
        one = small_m_gemm(x, w, w_scale=scale, config=LaunchConfig(32, 128, 4, 1, split))
        for bk in widths:
            cfg = LaunchConfig(32, bk, 4, 1, split)
            assert torch.equal(small_m_gemm(x, w, w_scale=scale, config=cfg), one), (split, bk)
    with pytest.raises(ValueError, match="block scales"):
        small_m_gemm(x, w)
    # Two pieces of 70 rows, each on its own grid: the row -> scale-row map.
    wp = torch.cat([block_quantize(torch.randn(70, 300, generator=gen) / 17)[0] for _ in "ab"])
    sp = torch.randn(2, 3, generator=gen).abs()
    rows = torch.cat([torch.zeros(70), torch.ones(70)]).int()
    wp, sp, rows = wp.to(DEVICE), sp.to(DEVICE), rows.to(DEVICE)
    got = small_m_gemm(x, wp, w_scale=sp, w_scale_rows=rows)
    assert _rel(got, small_m_gemm_reference(x, wp, w_scale=sp, w_scale_rows=rows)) < tol


def test_rejects_bad_inputs():
    from sgl_kernel.small_m_gemm import small_m_gemm

    with pytest.raises(ValueError, match="expected x"):
        small_m_gemm(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="fp32 / fp16 / bf16"):
        small_m_gemm(torch.randn(2, 8), torch.randn(4, 8).to(torch.int8))
    with pytest.raises(ValueError, match="bias must be"):
        small_m_gemm(torch.randn(2, 8), torch.randn(4, 8), torch.randn(3))


def test_linear_layers_route_small_batches_through_it():
    """``set_linear_backend``: linear layers and the logits processor take the kernel for up to
    SMALL_M_MAX_ROWS rows and the library GEMM beyond; off, always the library GEMM."""
    from torch import nn

    from sgl_kernel.small_m_gemm import SMALL_M_MAX_ROWS, small_m_gemm
    from sglang.srt.layers.linear import ReplicatedLinear, linear, set_linear_backend
    from sglang.srt.layers.logits_processor import LogitsProcessor

    layer = ReplicatedLinear(40, 24, bias=True, params_dtype=torch.float32).to(DEVICE)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    model = nn.ModuleDict({"proj": layer, "logits": LogitsProcessor(24)})
    assert set_linear_backend(model, True, torch.device(DEVICE))
    assert layer.small_m_gemm and model["logits"].small_m_gemm
    x = torch.randn(3, 40, device=DEVICE)
    assert torch.equal(layer(x), small_m_gemm(x, layer.weight, layer.bias))
    big = torch.randn(SMALL_M_MAX_ROWS + 1, 40, device=DEVICE)
    assert torch.equal(linear(big, layer.weight, None, True),
                       torch.nn.functional.linear(big, layer.weight))
    assert not set_linear_backend(model, False, torch.device(DEVICE)) and not layer.small_m_gemm
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_fp32_router_gate_of_bf16_values_takes_a_bf16_copy():
    """``MoEGate.set_small_m_gemm``: an fp32 gate whose values are all bf16 (a bf16
    checkpoint's, or dummy ones) keeps a bf16 copy for bf16 activations, which gives the fp32
    logits (bf16 x bf16 is exact in fp32); a gate with other values, or fp32 activations, keeps
    the fp32 weight."""
    from sgl_kernel.small_m_gemm import small_m_gemm
    from sglang.srt.layers.moe.topk import MoEGate
    from sglang.srt.model_loader import init_dummy_weights

    gate = MoEGate(64, 48, 2, 1, 1, True, 1.0, router_dtype="fp32").to(DEVICE)
    init_dummy_weights(gate, seed=3)
    w = gate.weight.detach()
    assert w.dtype == torch.float32 and torch.equal(w.bfloat16().float(), w)
    gate.set_small_m_gemm(True)
    assert gate.small_m_gemm and torch.equal(gate._bf16_weight.float(), w)
    x = torch.randn(3, 64, device=DEVICE)
    assert torch.equal(gate.router_logits(x), small_m_gemm(x, w, out_dtype=torch.float32))
    if ON_CUDA:  # bf16 activations: the bf16 copy, the fp32 gate's logits
        xb = x.bfloat16()
        got = gate.router_logits(xb)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, xb.float() @ w.t(), rtol=1e-5, atol=1e-5)
        assert torch.equal(gate.router_logits(xb[1:2]), got[1:2])
    with torch.no_grad():
        gate.weight.add_(1e-4 * torch.rand_like(gate.weight))  # no longer bf16 values
    gate.set_small_m_gemm(True)
    assert gate._bf16_weight is None
    gate.set_small_m_gemm(False)
    assert not gate.small_m_gemm and gate._bf16_weight is None


def test_bf16_split_sums_to_the_fp32_gate_exactly():
    """``topk.bf16_split``: bf16 parts whose fp32 sum is the fp32 weight bit for bit (three for
    general values, one for bf16 values, zeros kept), None when too few parts are allowed."""
    from sglang.srt.layers.moe.topk import bf16_split

    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(5)) * 0.02
    w[0, :8] = 0
    w[1, 0] = 3.0e-30  # a tiny normal value keeps all its bits too
    parts = bf16_split(w)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, 48, 64)
    assert torch.equal(parts[0].float() + parts[1].float() + parts[2].float(), w)
    assert bf16_split(w.bfloat16().float()).shape == (1, 48, 64)
    assert bf16_split(w, max_parts=2) is None
    # The parts' product is the fp32 product up to the summation order.
    x = torch.randn(16, 64).bfloat16()
    exact = x.double() @ w.double().t()
    split = sum(x.float() @ p.float().t() for p in parts)
    assert float((split - exact).abs().max()) <= 2 * float((x.float() @ w.t() - exact).abs().max())


@pytest.mark.gpu
def test_fp32_router_gate_prefill_logits_from_bf16_parts_on_cuda():
    """A gate of general fp32 values on CUDA with ``small_m_gemm``: prefill-sized bf16 batches
    take the bf16 parts (one GEMM, fp32 output) and match the fp32 product to fp32 rounding;
    decode sizes keep the fp32 small-M GEMM."""
    if not ON_CUDA:
        pytest.skip("needs CUDA")
    from sglang.srt.layers.moe.topk import MoEGate

    gate = MoEGate(2560, 512, 8, 1, 1, True, 1.0, router_dtype="fp32").to("cuda")
    with torch.no_grad():
        gate.weight.normal_(0, 0.02)
    gate.set_small_m_gemm(True)
    assert gate._bf16_weight is None and gate._bf16_parts_t.shape == (2560, 3 * 512)
    x = torch.randn(4096, 2560, device="cuda").bfloat16()
    got = gate.router_logits(x)
    exact = (x.double() @ gate.weight.double().t())
    fp32 = torch.nn.functional.linear(x.float(), gate.weight)
    bf16_weight = torch.nn.functional.linear(x, gate.weight.bfloat16()).float()
    assert got.dtype == torch.float32 and got.shape == (4096, 512)
    err = float((got - exact).abs().max())
    # fp32-class, not bf16-class: the tensor cores' fp32 accumulation rounds a little coarser
    # than the SIMT fp32 GEMM (2.6x its error measured on the H200), far below a bf16 gate's.
    assert err <= 4 * float((fp32 - exact).abs().max()) + 1e-7
    assert 100 * err < float((bf16_weight - exact).abs().max())


@pytest.mark.parametrize("dtype,tol", CASES)
def test_gated_norm_prologue_matches_norm_then_product(dtype, tol):
    """``gated_norm``: KDA's output norm (per 64-wide head, sigmoid gate) folded into the
    product's loads equals GatedRMSNorm followed by the product; rows stay batch-invariant."""
    from sgl_kernel.small_m_gemm import GatedNormPrologue, small_m_gemm, small_m_gemm_reference

    gen = torch.Generator().manual_seed(7)
    m, heads, d, n = 5, 6, 64, 48
    x = torch.randn(m, heads * d, generator=gen).to(DEVICE, dtype)
    fused = torch.randn(m, heads * d + 8, generator=gen).to(DEVICE, dtype)
    pro = GatedNormPrologue(fused[:, 8:], (1 + torch.rand(d, generator=gen)).to(DEVICE, dtype),
                            1e-6, d)
    w = (torch.randn(n, heads * d, generator=gen) / 20).to(DEVICE, dtype)
    got = small_m_gemm(x, w, gated_norm=pro)
    assert _rel(got, small_m_gemm_reference(x, w, gated_norm=pro)) < tol
    swapped = small_m_gemm(x, w, gated_norm=pro, config=LaunchConfig(16, 128, 4, 1, 2, True))
    assert _rel(swapped, small_m_gemm_reference(x, w, gated_norm=pro)) < tol
    assert torch.equal(small_m_gemm(x[3:4], w, gated_norm=pro._replace(gate=pro.gate[3:4])),
                       got[3:4])
    with pytest.raises(ValueError, match="gated_norm"):
        small_m_gemm(x, w, gated_norm=pro._replace(head_dim=48))
    # A block-fp8 weight normalises one scale block of x at a time, also when a step spans
    # several blocks: the same bits as one block a step.
    from sgl_kernel.fp8_blocks import block_quantize
    w8, s8 = (z.to(DEVICE) for z in block_quantize(w.float().cpu()))
    one = small_m_gemm(x, w8, w_scale=s8, gated_norm=pro, config=LaunchConfig(16, 128, 4, 1))
    assert _rel(one, small_m_gemm_reference(x, w8, w_scale=s8, gated_norm=pro)) < tol
    assert torch.equal(small_m_gemm(x, w8, w_scale=s8, gated_norm=pro,
                                    config=LaunchConfig(16, 256, 4, 1)), one)


def test_model_row_bound_matches_the_kernels():
    """The KDA layer passes its output norm to o_proj's small-M GEMM up to the GEMM's own bound."""
    from sgl_kernel.small_m_gemm import SMALL_M_MAX_ROWS
    from sglang.srt.models import bailing_moe_v3

    assert bailing_moe_v3._SMALL_M_ROWS == SMALL_M_MAX_ROWS


def test_split_rule_fills_the_gpu_and_keeps_two_tiles_per_range():
    """The GPU configs' K split: doubled while the grid is under the target (512 programs on
    the H200's 132 SMs: four per SM rounded down to a power of two), at most 8, and never below
    two tiles per range; a weight of many row blocks is not split."""
    from sgl_kernel.small_m_gemm import _split_for, split_target_programs

    h200 = split_target_programs(132)
    assert h200 == 512 and split_target_programs(8) == 32 and split_target_programs(1) == 4
    assert _split_for(20512, 2560, 32, 128, h200) == 1  # KDA's fused projection: 641 row blocks
    assert _split_for(2560, 4096, 32, 128, h200) == 8  # the attention output: 80 row blocks
    assert _split_for(512, 2560, 16, 128, h200) == 8  # the router gate (fp32 tiles)
    assert _split_for(512, 512, 16, 256, h200) == 1  # two tiles: one range
    for n, k in ((576, 2560), (2560, 768), (6144, 2560)):
        split = _split_for(n, k, 16, 256, h200)
        assert split in (1, 2, 4, 8) and -(-k // 256) >= 2 * split
