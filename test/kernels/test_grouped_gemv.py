"""sgl_kernel.grouped_gemv and the Triton small-M MoE built on it, against their torch references.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, fp32 / fp16 inputs:
the interpreter has no bf16). The ``gpu`` test repeats the MoE check in bf16 on the device.
"""
from __future__ import annotations

import pytest
import torch

from kernel_test_utils import DEVICE, ON_CUDA, needs_triton
from sglang.srt.layers.moe.fused_moe_native import fused_moe_gather
from sglang.srt.layers.moe.fused_moe_triton import fused_moe_small_m

pytestmark = needs_triton


@pytest.fixture(scope="module")
def triton_mode():
    """The kernel module (compiled on CUDA, interpreted on CPU)."""
    import sgl_kernel.grouped_gemv as module

    return module


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


FP32, FP16 = (torch.float32, 1e-6), (torch.float16, 2e-3)
SLOW = pytest.mark.slow  # the interpreter: one case of each test stays in the fast set


@pytest.mark.parametrize("dtype,tol,rows_per_x", [
    (*FP32, 1), (*FP16, 3), pytest.param(*FP32, 3, marks=SLOW), pytest.param(*FP16, 1, marks=SLOW),
])
def test_grouped_gemv_matches_reference(triton_mode, dtype, tol, rows_per_x):
    gen = torch.Generator().manual_seed(rows_per_x)
    t, e, n, k = 4, 7, 70, 150  # n, k not multiples of the blocks
    x = torch.randn(t, k, generator=gen).to(DEVICE, dtype)
    w_full = torch.randn(e, n + 20, k, generator=gen).to(DEVICE, dtype)
    w = w_full[:, 10:10 + n]  # a strided view, as a TP slice would be
    ids = torch.randint(0, e, (t * rows_per_x, 2), generator=gen).to(DEVICE)[:, 0]  # strided
    ids[1] = ids[0]  # repeated experts are fine
    # Small blocks: several row blocks and column steps, ragged edges masked.
    got = triton_mode.grouped_gemv(x, w, ids, rows_per_x=rows_per_x, block_n=32, block_k=64)
    ref = triton_mode.grouped_gemv_reference(x, w, ids, rows_per_x=rows_per_x)
    assert _rel(triton_mode.grouped_gemv(x, w, ids, rows_per_x=rows_per_x), ref) < tol
    assert got.dtype == dtype and got.shape == (t * rows_per_x, n)
    assert _rel(got, ref) < tol


@pytest.mark.parametrize("dtype,tol,limit", [
    (*FP32, 0.7), (*FP16, 0.0), pytest.param(*FP32, 0.0, marks=SLOW),
    pytest.param(*FP16, 0.7, marks=SLOW),
])
def test_swiglu_epilogue_matches_reference(triton_mode, dtype, tol, limit):
    """``swiglu_limit``: [gate; up] rows -> silu(gate) * up (clamped), as silu_and_mul does."""
    gen = torch.Generator().manual_seed(11)
    t, e, i, k = 3, 5, 36, 80
    x = torch.randn(t, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(e, 2 * i, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    ids = torch.randint(0, e, (t * 2,), generator=gen).to(DEVICE)
    got = triton_mode.grouped_gemv(x, w, ids, rows_per_x=2, block_n=16, block_k=32,
                                   swiglu_limit=limit)
    ref = triton_mode.grouped_gemv_reference(x, w, ids, rows_per_x=2, swiglu_limit=limit)
    assert got.shape == (t * 2, i) and _rel(got, ref) < tol
    if limit:
        assert got.float().abs().max() <= limit * limit + 1e-3  # both factors were clamped


@pytest.mark.parametrize("dtype,tol", [FP32, FP16])
def test_extra_pairs_ride_the_routed_launch(triton_mode, dtype, tol):
    """``extra_w``: one more pair per row (the shared expert), with its own SwiGLU clamp (one
    group clamped, the other not) and its own activation rows (``extra_x``)."""
    gen = torch.Generator().manual_seed(5)
    t, e, i, k = 3, 6, 24, 40
    x = torch.randn(t, k, generator=gen).to(DEVICE, dtype)
    xs = torch.randn(t, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(e, 2 * i, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    sw = (torch.randn(2 * i, k, generator=gen) / k ** 0.5 * 3).to(DEVICE, dtype)
    ids = torch.randint(0, e, (t * 2,), generator=gen).to(DEVICE)
    for limit, extra_limit, extra_x in ((0.0, 0.3, None), (0.4, 0.0, xs)):
        got = triton_mode.grouped_gemv(x, w, ids, rows_per_x=2, swiglu_limit=limit, extra_w=sw,
                                       extra_limit=extra_limit, extra_x=extra_x)
        ref = triton_mode.grouped_gemv_reference(x, w, ids, rows_per_x=2, swiglu_limit=limit,
                                                 extra_w=sw, extra_limit=extra_limit,
                                                 extra_x=extra_x)
        assert got.shape == (t * 3, i) and _rel(got, ref) < tol
    # the shared rows were clamped at 0.3 in the first form: every factor within the limit
    first = triton_mode.grouped_gemv(x, w, ids, rows_per_x=2, swiglu_limit=0.0, extra_w=sw,
                                     extra_limit=0.3)
    assert first[t * 2:].float().abs().max() <= 0.09 + 1e-3


@pytest.mark.parametrize("dtype,tol", [FP32, FP16] + ([(torch.bfloat16, 1e-2)] if ON_CUDA else []))
def test_block_fp8_weights_match_the_fp32_dequantised_reference(triton_mode, dtype, tol):
    """float8_e4m3fn experts (and shared expert) with 128 x 128 block scales: the fp32 product
    with the weight q * scale (the scales applied to x); gate and up on their own grids (I = 96
    is not a block multiple); tiles narrower and wider than a scale block."""
    from sgl_kernel.fp8_blocks import block_quantize

    gen = torch.Generator().manual_seed(12)
    t, e, i, k = 2, 4, 96, 160
    x = torch.randn(t, k, generator=gen).to(DEVICE, dtype)
    w, ws = block_quantize(torch.randn(e, 2 * i, k, generator=gen) / k ** 0.5, split=i)
    sw, sws = block_quantize(torch.randn(2 * i, k, generator=gen) / k ** 0.5, split=i)
    ids = torch.randint(0, e, (t * 2,), generator=gen).to(DEVICE)
    w, ws, sw, sws = (z.to(DEVICE) for z in (w, ws, sw, sws))
    kw = dict(rows_per_x=2, swiglu_limit=0.0, extra_w=sw, w_scale=ws, extra_w_scale=sws)
    ref = triton_mode.grouped_gemv_reference(x, w, ids, **kw)
    for block_k in (64, 256):
        other = triton_mode.grouped_gemv(x, w, ids, block_n=64, block_k=block_k, **kw)
        assert other.shape == (t * 3, i) and _rel(other, ref) < tol
    got = triton_mode.grouped_gemv(x, w, ids, **kw)
    assert _rel(got, ref) < tol
    with pytest.raises(ValueError, match="share a scale row"):
        triton_mode.grouped_gemv(x, w, ids, block_n=256, **kw)
    down, ds = block_quantize(torch.randn(e, k, i, generator=gen) / i ** 0.5)
    down, ds = down.to(DEVICE), ds.to(DEVICE)
    got2 = triton_mode.grouped_gemv(got[:t * 2], down, ids, w_scale=ds)
    assert _rel(got2, triton_mode.grouped_gemv_reference(got[:t * 2], down, ids, w_scale=ds)) < tol
    with pytest.raises(ValueError, match="block scales"):
        triton_mode.grouped_gemv(x, w, ids, rows_per_x=2, swiglu_limit=0.0)
    with pytest.raises(ValueError, match="block scale must be"):
        triton_mode.grouped_gemv(x, w, ids, rows_per_x=2, swiglu_limit=0.0, w_scale=ws[:, :1])


def test_grouped_gemv_rejects_bad_shapes(triton_mode):
    x, w = torch.randn(2, 8), torch.randn(3, 4, 8)
    with pytest.raises(ValueError, match="expected x"):
        triton_mode.grouped_gemv(x, torch.randn(3, 4, 9), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="T \\* rows_per_x"):
        triton_mode.grouped_gemv(x, w, torch.zeros(3, dtype=torch.int64), rows_per_x=2)
    with pytest.raises(ValueError, match="extra_w must be"):
        triton_mode.grouped_gemv(x, w, torch.zeros(2, dtype=torch.int64),
                                 extra_w=torch.randn(4, 9))
    with pytest.raises(ValueError, match="gate; up"):
        triton_mode.grouped_gemv(x, torch.randn(3, 5, 8), torch.zeros(2, dtype=torch.int64),
                                 swiglu_limit=0.0)
    with pytest.raises(ValueError, match="contiguous"):
        triton_mode.grouped_gemv(x, w.transpose(1, 2).contiguous().transpose(1, 2),
                                 torch.zeros(2, dtype=torch.int64))


def _moe_inputs(dtype, t=3, e=9, h=48, i=40, k=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=gen) / i ** 0.5
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    to = dict(device=DEVICE, dtype=dtype)
    return hidden.to(**to), w13.to(**to), w2.to(**to), weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 5e-3)])
@pytest.mark.parametrize("limit", [0.0, 0.5])
def test_small_m_moe_matches_gather_reference(triton_mode, dtype, tol, limit):
    hidden, w13, w2, weights, ids = _moe_inputs(dtype)
    got = fused_moe_small_m(hidden, w13, w2, weights, ids, limit)
    ref = fused_moe_gather(hidden, w13, w2, weights, ids, limit)
    assert got.dtype == dtype and got.shape == hidden.shape
    assert _rel(got, ref) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 5e-3)])
def test_small_m_moe_with_shared_expert_matches_native(triton_mode, dtype, tol):
    """The shared expert as extra pairs of the two launches equals the native path given the
    shared expert's output (``SiluAndMul`` clamps differ between the two groups)."""
    from sglang.srt.layers.activation import silu_and_mul
    from sglang.srt.layers.moe.fused_moe_triton import SharedExpertWeights

    hidden, w13, w2, weights, ids = _moe_inputs(dtype)
    gen = torch.Generator().manual_seed(3)
    sw13 = (torch.randn(w13.shape[1:], generator=gen) / 7).to(DEVICE, dtype)
    sw2 = (torch.randn(w2.shape[1:], generator=gen) / 6).to(DEVICE, dtype)
    shared_out = ((silu_and_mul((hidden.float() @ sw13.float().t()).to(dtype), 0.3).float()
                   @ sw2.float().t()).to(dtype))
    got = fused_moe_small_m(hidden, w13, w2, weights, ids, 0.0,
                            SharedExpertWeights(sw13, sw2, 0.3))
    ref = fused_moe_gather(hidden, w13, w2, weights, ids, 0.0, shared=shared_out)
    assert got.shape == hidden.shape and _rel(got, ref) < tol
    via_output = fused_moe_small_m(hidden, w13, w2, weights, ids, 0.0, shared=shared_out)
    assert _rel(via_output, ref) < tol


def test_model_with_triton_moe_matches_native(triton_mode, tmp_path, monkeypatch):
    """A whole random tiny model (fp32): prefill logits and a decode step through
    ``moe_runner_backend='triton'`` equal the torch-native MoE's, also with the shared expert
    riding the routed launches plus the one-kernel combine (``KernelChoices.moe_combine``) and
    the dense projections / LM head through the small-M GEMM (``KernelChoices.small_m_gemm``),
    with KDA's output norm inside o_proj's loads or (``kda_norm_in_o_proj=False``) apart."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.kernel_choices import KernelChoices
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.layers.moe.moe_layer import BailingMoE, FusedMoE
    from sglang.test.random_checkpoint import tiny_config, write_random_checkpoint
    from sglang.test.runner_utils import greedy_logits

    path = write_random_checkpoint(str(tmp_path / "c"), tiny_config(), seed=4)
    ids = [5, 17, 99, 3, 250, 42]
    logits = {}
    for backend, fused, norm_in in (("torch_native", "0", "1"), ("triton", "0", "1"),
                                    ("triton", "1", "1"), ("triton", "1", "0")):
        choices = KernelChoices(moe_combine=fused == "1", small_m_gemm=fused == "1",
                                kda_norm_in_o_proj=norm_in == "1")
        runner = ModelRunner(ModelConfig.from_path(path), device=DEVICE, dtype=torch.float32,
                             moe_runner_backend=backend, max_running_requests=2,
                             max_total_tokens=64, kernel_choices=choices)
        moes = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
        assert moes and all(m.runner_backend == backend for m in moes)
        assert all(m.fused_combine == (fused == "1") for m in moes)
        assert runner.small_m_gemm == (fused == "1")
        if fused == "1":  # the tiny model's shared expert has the routed experts' shape
            assert all(m.shared_as_pairs() is not None for m in runner.model.modules()
                       if isinstance(m, BailingMoE))
        kda = [m for m in runner.model.modules() if hasattr(m, "norm_in_o_proj")]
        assert kda and all(m.norm_in_o_proj == (norm_in == "1") for m in kda)
        logits[backend + fused + norm_in] = greedy_logits(runner, ids, 1)
    for variant in ("triton01", "triton11", "triton10"):
        for got, ref in zip(logits[variant], logits["torch_native01"]):
            assert _rel(got, ref) < 1e-5, variant


def test_backend_choice_is_validated(monkeypatch):
    from torch import nn

    from sglang.srt.layers.moe.moe_layer import set_moe_runner_backend

    assert set_moe_runner_backend(nn.Linear(1, 1), "auto", torch.device("cpu")) == "torch_native"
    with pytest.raises(ValueError, match="one of"):
        set_moe_runner_backend(nn.Linear(1, 1), "cutlass", torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA"):
        set_moe_runner_backend(nn.Linear(1, 1), "triton", torch.device("cpu"))


@pytest.mark.gpu
def test_small_m_moe_bf16_on_cuda(triton_mode):
    hidden, w13, w2, weights, ids = _moe_inputs(torch.bfloat16, t=6, e=64, h=512, i=256, k=8)
    got = fused_moe_small_m(hidden, w13, w2, weights, ids, 7.0)
    ref = fused_moe_gather(hidden, w13, w2, weights, ids, 7.0)
    exact = fused_moe_gather(hidden.float(), w13.float(), w2.float(), weights, ids, 7.0)
    # Both bf16 paths round h13, the activation and y alike; only the accumulation order differs.
    assert _rel(got, exact) <= 1.5 * _rel(ref, exact) + 1e-3


def test_small_m_moe_is_batch_invariant(triton_mode):
    """A token's MoE output is bit-identical alone and beside other tokens (a 1-token decode
    and a 4-token verify): each (token, expert) pair is its own launch row with a tile chosen
    from the weight's shape, never from the number of pairs (what bit-exact speculation
    needs)."""
    hidden, w13, w2, weights, ids = _moe_inputs(torch.float32, t=4)
    together = fused_moe_small_m(hidden, w13, w2, weights, ids, 0.5)
    for t in range(4):
        alone = fused_moe_small_m(hidden[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1], 0.5)
        assert torch.equal(alone[0], together[t]), f"token {t}"
