"""sgl_kernel.moe_router (sigmoid + bias + group-limited top-k + weights in one kernel) against
sglang.srt.layers.moe.topk.select_experts, and through a model. Without CUDA the kernel runs in
Triton's CPU interpreter."""
from __future__ import annotations

import pytest
import torch

from kernel_test_utils import DEVICE, needs_triton

from sglang.srt.layers.moe.topk import select_experts

pytestmark = needs_triton


def _logits(t, e, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(t, e, generator=g)).to(DEVICE), (0.3 * torch.randn(e, generator=g)).to(DEVICE)


@pytest.mark.parametrize("t,e,groups,topk_group,k,bias,renorm,scale", [
    (3, 512, 8, 4, 8, True, True, 2.5),   # Ling-3.0-flash
    (6, 16, 4, 2, 4, True, True, 2.5),    # the bundled model
    (4, 64, 1, 1, 6, False, False, 1.0),  # no groups, no bias, no renormalisation
    (2, 32, 4, 4, 3, True, True, 1.0),    # every group kept
    (5, 8, 8, 3, 2, True, True, 1.5),     # one expert per group (best only, no second)
])
def test_matches_select_experts(t, e, groups, topk_group, k, bias, renorm, scale):
    from sgl_kernel.moe_router import moe_router_topk

    logits, b = _logits(t, e)
    b = b if bias else None
    weights, ids = moe_router_topk(logits, k, b, groups, topk_group, renorm, scale)
    ref = select_experts(logits, k, b, groups, topk_group, renorm, scale)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref.topk_ids)
    torch.testing.assert_close(weights, ref.topk_weights, rtol=1e-6, atol=1e-7)


def test_rows_are_independent_of_the_batch_and_empty_batches_work():
    from sgl_kernel.moe_router import moe_router_topk

    logits, b = _logits(6, 512, seed=1)
    w_all, i_all = moe_router_topk(logits, 8, b, 8, 4, True, 2.5)
    w_one, i_one = moe_router_topk(logits[4:5], 8, b, 8, 4, True, 2.5)
    assert torch.equal(w_all[4:5], w_one) and torch.equal(i_all[4:5], i_one)
    w0, i0 = moe_router_topk(logits[:0], 8, b, 8, 4, True, 2.5)
    assert w0.shape == i0.shape == (0, 8)


def test_bad_inputs_are_rejected():
    from sgl_kernel.moe_router import moe_router_topk

    logits, b = _logits(2, 24)
    with pytest.raises(ValueError, match="powers of two"):
        moe_router_topk(logits, 4, None, 4, 2)
    logits, b = _logits(2, 32)
    with pytest.raises(ValueError, match="expert_bias"):
        moe_router_topk(logits, 4, b[:5], 4, 2)
    with pytest.raises(ValueError, match="topk_group"):
        moe_router_topk(logits, 4, b, 4, 5)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        moe_router_topk(logits[0], 4, b, 4, 2)


@pytest.mark.slow  # every router of a model in the interpreter; the kernel tests above are fast
def test_model_with_the_triton_router_matches_the_torch_router():
    """``KernelChoices(router=True)``: every router of the bundled model runs the kernel, with
    the torch router's logits and greedy tokens."""
    from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
    from sglang.srt.layers.kernel_choices import KernelChoices
    from sglang.srt.layers.moe.topk import MoEGate
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.test.runner_utils import greedy_logits

    if not (BUNDLED_MODEL_DIR / "config.json").exists():
        pytest.skip("no bundled model")
    results = {}
    for router in (False, True):
        runner = ModelRunner(ModelConfig.from_path(str(BUNDLED_MODEL_DIR)), device=DEVICE,
                             dtype=torch.float32, max_running_requests=1, max_total_tokens=64,
                             kernel_choices=KernelChoices(router=router))
        gates = [m for m in runner.model.modules() if isinstance(m, MoEGate)]
        assert gates and all(g.use_triton == router for g in gates)
        results[router] = greedy_logits(runner, list(range(3, 20)), 3)
    for a, b in zip(results[False], results[True]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_choice_needs_cuda_or_the_interpreter(monkeypatch):
    from sglang.srt.layers.moe.moe_layer import set_moe_runner_backend
    from sglang.srt.layers.moe.topk import MoEGate

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"KernelChoices\(router=True\) needs CUDA"):
        set_moe_runner_backend(MoEGate(8, 16, 2, 4, 2, True, 1.0), "auto", torch.device("cpu"),
                               router=True)


def test_pdl_switch_leaves_results_unchanged():
    """With set_pdl(True) the router still matches select_experts (under the interpreter the
    switch stays off: the PDL code path is inert there); a bf16 bias is widened in the kernel."""
    from sgl_kernel import pdl
    from sgl_kernel.moe_router import moe_router_topk

    logits, b = _logits(3, 64, seed=2)
    b = b.half()  # exact in fp32: the kernel's widening equals .float()
    try:
        pdl.set_pdl(True)
        weights, ids = moe_router_topk(logits, 6, b, 8, 4, True, 2.5)
    finally:
        pdl.set_pdl(False)
    ref = select_experts(logits, 6, b.float(), 8, 4, True, 2.5)
    assert torch.equal(ids, ref.topk_ids)
    torch.testing.assert_close(weights, ref.topk_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_equal_with_and_without_pdl_in_a_graph():
    """On an sm90+ GPU: two Flash-sized routers back to back, launched with PDL inside a CUDA
    graph, give the same bits as without."""
    from pdl_graph_utils import assert_bitwise_equal, outputs_without_and_with_pdl, skip_without_pdl
    from sgl_kernel.moe_router import moe_router_topk

    skip_without_pdl()
    logits0, bias = _logits(4, 512, seed=3)
    logits = torch.empty_like(logits0)

    def step():
        logits.copy_(logits0)
        w1, i1 = moe_router_topk(logits, 8, bias, 8, 4, True, 2.5)
        w2, i2 = moe_router_topk(logits * w1[:, :1], 8, bias, 8, 4, True, 2.5)
        return w1, i1, w2, i2

    assert_bitwise_equal(outputs_without_and_with_pdl(step))
