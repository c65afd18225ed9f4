"""sgl_kernel.rmsnorm (one-launch RMSNorm, residual add and KDA output gate fused) against the
torch norms of sglang.srt.layers.layernorm, and through a model. Without CUDA the kernel runs in
Triton's CPU interpreter."""
from __future__ import annotations

import pytest
import torch

from kernel_test_utils import DEVICE, ON_CUDA, needs_triton

from sglang.srt.layers.layernorm import GatedRMSNorm, RMSNorm, rms_norm, set_norm_backend

pytestmark = needs_triton
# CPU interpreter: fp32 only (see ENV.md); on CUDA bf16 as served.
DTYPES = [torch.float32] + ([torch.bfloat16] if ON_CUDA else [])


def _x(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(*shape, generator=g)).to(device=DEVICE, dtype=dtype)


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [24, 64])  # 24: a masked tail inside the power-of-2 block
def test_norm_and_fused_residual_match_the_torch_norm(dtype, d):
    from sgl_kernel.rmsnorm import rmsnorm

    x, res = _x((2, 3, d), dtype, 0), _x((2, 3, d), dtype, 1)
    w = _x((d,), torch.float32, 2)
    torch.testing.assert_close(rmsnorm(x, w, 1e-6), rms_norm(x, w, 1e-6), **_tol(dtype))
    out, new_res = rmsnorm(x, w, 1e-6, residual=res)
    assert torch.equal(new_res, x + res)  # the add rounds like the unfused one
    torch.testing.assert_close(out, rms_norm(x + res, w, 1e-6), **_tol(dtype))
    assert out.shape == x.shape and out.dtype == dtype
    # A strided input (a column slice) is read correctly.
    wide = _x((5, 2 * d), dtype, 3)
    torch.testing.assert_close(rmsnorm(wide[:, :d], w, 1e-6), rms_norm(wide[:, :d], w, 1e-6),
                               **_tol(dtype))


@pytest.mark.parametrize("activation", ["sigmoid", "swish"])
def test_gated_norm_matches_the_kda_output_norm(activation):
    ref = GatedRMSNorm(32, 1e-6, activation).to(DEVICE)
    ref.weight.data = _x((32,), torch.float32, 4)
    x, gate = _x((7, 4, 32), torch.float32, 5), _x((7, 4, 32), torch.float32, 6)
    expect = ref(x, gate)
    ref.use_triton = True
    torch.testing.assert_close(ref(x, gate), expect, rtol=1e-5, atol=1e-5)


def test_gate_inside_a_wider_projection_is_read_in_place():
    """KDA's output gate is ``z.view(T, H, d)`` of a column slice of the fused projection
    output: the kernel reads its rows where they lie (no flattening copy) and gives the result
    of the contiguous gate, bit for bit."""
    from sgl_kernel import rmsnorm as module

    t, h, d = 5, 3, 32
    fused = _x((t, 2 * h * d + 7), torch.float32, 11)  # [.. | z | ..]: z strided by 2hd+7
    z = fused[:, h * d + 7:].view(t, h, d)
    x, w = _x((t, h, d), torch.float32, 12), _x((d,), torch.float32, 13)
    blocks, inner, s_outer, s_inner = module._gate_rows(z, d)
    assert blocks.data_ptr() == z.data_ptr() and (inner, s_outer, s_inner) == (h, 2 * h * d + 7, d)
    got = module.rmsnorm(x, w, 1e-6, gate=z, activation="sigmoid")
    assert torch.equal(got, module.rmsnorm(x, w, 1e-6, gate=z.contiguous(), activation="sigmoid"))
    ref = GatedRMSNorm(d, 1e-6, "sigmoid").to(DEVICE)
    ref.weight.data = w
    torch.testing.assert_close(got, ref(x, z), rtol=1e-5, atol=1e-5)


def test_rows_are_independent_of_the_batch():
    """A row's output is bit-identical alone and inside a larger batch (verify == decode)."""
    from sgl_kernel.rmsnorm import rmsnorm

    x, res = _x((6, 40), torch.float32, 7), _x((6, 40), torch.float32, 8)
    w = _x((40,), torch.float32, 9)
    batch, _ = rmsnorm(x, w, 1e-6, residual=res)
    alone, _ = rmsnorm(x[3:4], w, 1e-6, residual=res[3:4])
    assert torch.equal(batch[3:4], alone)


def test_many_narrow_rows_share_programs(monkeypatch):
    """Above ``TILE_MIN_ROWS`` rows (lowered here to 8) narrow rows take several rows per
    program (``tile_rows``: 64 rows of 24 elements, so 37 rows are one program with masked
    rows): the norm with its residual add, and the gated norm reading its gate inside a wider
    projection, match the torch norms; a launch of at most ``TILE_MIN_ROWS`` rows and wide rows
    keep one row per program."""
    from sgl_kernel import rmsnorm as module

    monkeypatch.setattr(module, "TILE_MIN_ROWS", 8)
    assert module.tile_rows(37, 24) == 64 and module.tile_rows(8, 24) == 1
    assert module.tile_rows(10_000, 2560) == 1
    grids = []
    tile = module._rmsnorm_tile_kernel

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return tile[grid]

    monkeypatch.setattr(module, "_rmsnorm_tile_kernel", Recorder())
    x, res = _x((37, 24), torch.float32, 14), _x((37, 24), torch.float32, 15)
    w = _x((24,), torch.float32, 16)
    out, new_res = module.rmsnorm(x, w, 1e-6, residual=res)
    assert grids == [(1,)] and torch.equal(new_res, x + res)
    torch.testing.assert_close(out, rms_norm(x + res, w, 1e-6), rtol=1e-5, atol=1e-5)
    t, h, d = 7, 3, 32  # 21 rows of KDA's output norm, the gate a slice of the projection
    fused = _x((t, 2 * h * d + 5), torch.float32, 17)
    z = fused[:, h * d + 5:].view(t, h, d)
    xg, wg = _x((t, h, d), torch.float32, 18), _x((d,), torch.float32, 19)
    ref = GatedRMSNorm(d, 1e-6, "swish").to(DEVICE)
    ref.weight.data = wg
    got = module.rmsnorm(xg, wg, 1e-6, gate=z, activation="swish")
    assert grids == [(1,), (1,)]
    torch.testing.assert_close(got, ref(xg, z), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_rejected():
    from sgl_kernel.rmsnorm import rmsnorm

    x = _x((2, 8), torch.float32, 0)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(x, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="gate and activation"):
        rmsnorm(x, w, 1e-6, gate=x)
    with pytest.raises(ValueError, match="gate and activation"):
        rmsnorm(x, w, 1e-6, gate=x, activation="relu")
    with pytest.raises(ValueError, match="residual"):
        rmsnorm(x, w, 1e-6, residual=x[:1])
    with pytest.raises(ValueError, match="dtype"):
        rmsnorm(x, w, 1e-6, residual=x.double())


@pytest.mark.slow  # every norm of a model in the interpreter; the kernel tests above are fast
def test_model_with_triton_norms_matches_torch_norms():
    """The bundled model with every norm on the kernel gives the reference norms' logits and
    greedy tokens (prefill and decode)."""
    from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
    from sglang.srt.layers.kernel_choices import KernelChoices
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.test.runner_utils import greedy_logits

    if not (BUNDLED_MODEL_DIR / "config.json").exists():
        pytest.skip("no bundled model")
    # The torch norms first (the default on CUDA is the kernel).
    runner = ModelRunner(ModelConfig.from_path(str(BUNDLED_MODEL_DIR)), device=DEVICE,
                         dtype=torch.float32, max_running_requests=2, max_total_tokens=64,
                         kernel_choices=KernelChoices(rmsnorm=False))
    norms = [m for m in runner.model.modules() if isinstance(m, (RMSNorm, GatedRMSNorm))]
    assert norms and not runner.triton_norms
    ref = greedy_logits(runner, list(range(3, 20)), 3)
    assert set_norm_backend(runner.model, True, runner.device)
    assert all(m.use_triton for m in norms)
    got = greedy_logits(runner, list(range(3, 20)), 3)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_choice_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"KernelChoices\(rmsnorm=True\) needs CUDA"):
        set_norm_backend(RMSNorm(8), True, torch.device("cpu"))
    assert not set_norm_backend(RMSNorm(8), False, torch.device("cpu"))


def test_pdl_switch_leaves_results_unchanged():
    """With set_pdl(True) the norm still matches the torch norm (under the interpreter the switch
    stays off: the PDL code path is inert there)."""
    from sgl_kernel import pdl
    from sgl_kernel.rmsnorm import rmsnorm

    x, res, gate = (_x((3, 24), torch.float32, s) for s in (20, 21, 22))
    w = _x((24,), torch.float32, 23)
    try:
        pdl.set_pdl(True)
        out, new_res = rmsnorm(x, w, 1e-6, residual=res)
        gated = rmsnorm(x, w, 1e-6, gate=gate, activation="sigmoid")
    finally:
        pdl.set_pdl(False)
    assert torch.equal(new_res, x + res)
    torch.testing.assert_close(out, rms_norm(x + res, w, 1e-6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gated, rms_norm(x, w, 1e-6) * torch.sigmoid(gate),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_equal_with_and_without_pdl_in_a_graph():
    """On an sm90+ GPU: a fused residual norm feeding a gated norm, launched with PDL inside a
    CUDA graph, gives the same bits as without."""
    from pdl_graph_utils import assert_bitwise_equal, outputs_without_and_with_pdl, skip_without_pdl
    from sgl_kernel.rmsnorm import rmsnorm

    skip_without_pdl()
    x0, res0, gate = (_x((3, 2048), torch.bfloat16, s) for s in (30, 31, 32))
    w = _x((2048,), torch.bfloat16, 33)
    x, res = torch.empty_like(x0), torch.empty_like(res0)

    def step():
        x.copy_(x0)
        res.copy_(res0)
        h, r = rmsnorm(x, w, 1e-6, residual=res)
        return h, r, rmsnorm(h, w, 1e-6, gate=gate, activation="swish")

    assert_bitwise_equal(outputs_without_and_with_pdl(step))
