"""sgl_kernel.gated_act against its references and the model's torch forms: the SwiGLU (with
and without Ling's clamp) and MLA's sigmoid head gate, in the interpreter (fp32 / fp16) and
compiled on CUDA (bf16, through test_kernels_cuda.py::test_gated_act)."""
from __future__ import annotations

import pytest
import torch

from kernel_test_utils import DEVICE, ON_CUDA, needs_triton

pytestmark = needs_triton

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
# One output ulp: both sides round one fp32 value, whose last bits may differ (the kernel's
# sigmoid and torch's are separate implementations).
ULP = {torch.float32: 1e-6, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=ULP[want.dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("limit", [0.0, 1.5])
def test_silu_and_mul_matches_reference_and_the_torch_form(dtype, limit):
    from sgl_kernel.gated_act import silu_and_mul, silu_and_mul_reference
    from sglang.srt.layers.activation import silu_and_mul as torch_form

    gen = torch.Generator().manual_seed(3)
    t, inter = 5, 70  # no power of two: masked tail
    base = (torch.randn(t, 2 * inter + 6, generator=gen) * 3).to(DEVICE, dtype)
    x = base[:, 3:3 + 2 * inter]  # rows strided, as a view of a wider buffer
    got = silu_and_mul(x, limit)
    _close(got, silu_and_mul_reference(x, limit))
    _close(got, torch_form(x, limit))
    if limit:  # the clamp took effect on both factors somewhere
        assert (x[:, inter:].float().abs() > limit).any()
        assert got.float().abs().max() <= limit * limit + 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_gate_matches_reference_on_the_layers_layouts(dtype):
    from sgl_kernel.gated_act import sigmoid_head_gate, sigmoid_head_gate_reference

    gen = torch.Generator().manual_seed(4)
    t, h, v = 6, 3, 12
    g = (torch.randn(t, h, generator=gen) * 4).to(DEVICE, dtype)
    contiguous = torch.randn(t, h, v, generator=gen).to(DEVICE, dtype)
    head_major = torch.randn(h, t, v, generator=gen).to(DEVICE, dtype).transpose(0, 1)  # bmm's
    for o in (contiguous, head_major):
        got = sigmoid_head_gate(o, g)
        assert got.is_contiguous()
        _close(got, sigmoid_head_gate_reference(o, g))


def test_model_modules_take_the_kernel_when_switched(monkeypatch):
    """SiluAndMul and SigmoidHeadGate run the kernels once set_gated_act_backend turns them on
    (and their torch forms otherwise), with the same values; the switch needs CUDA or the
    interpreter."""
    import sgl_kernel.gated_act as kernels
    from sglang.srt.layers.activation import SigmoidHeadGate, SiluAndMul, set_gated_act_backend

    model = torch.nn.ModuleDict({"act": SiluAndMul(2.0), "gate": SigmoidHeadGate()})
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 20, generator=gen).to(DEVICE)
    o, g = torch.randn(4, 2, 8, generator=gen).to(DEVICE), torch.randn(4, 2, generator=gen).to(DEVICE)
    want = model["act"](x), model["gate"](o, g)
    calls = []
    for name in ("silu_and_mul", "sigmoid_head_gate"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, **kw: calls.append(_real) or
                            _real(*a, **kw))
    assert set_gated_act_backend(model, True, torch.device(DEVICE))
    got = model["act"](x), model["gate"](o, g)
    assert len(calls) == 2
    for a, b in zip(got, want):
        _close(a, b)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not ON_CUDA:
        with pytest.raises(ValueError, match=r"KernelChoices\(gated_act=True\) needs CUDA"):
            set_gated_act_backend(model, True, torch.device("cpu"))
    assert not set_gated_act_backend(model, False, torch.device("cpu"))
    assert not model["act"].use_triton and not model["gate"].use_triton


def test_bad_shapes_are_named():
    from sgl_kernel.gated_act import sigmoid_head_gate, silu_and_mul

    with pytest.raises(ValueError, match="x must be"):
        silu_and_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="limit must be"):
        silu_and_mul(torch.randn(3, 8), -1.0)
    with pytest.raises(ValueError, match="o must be"):
        sigmoid_head_gate(torch.randn(3, 8), torch.randn(3, 2))
    with pytest.raises(ValueError, match="g must be"):
        sigmoid_head_gate(torch.randn(3, 2, 4), torch.randn(3, 3))


def test_bundled_model_with_the_kernels_equals_the_torch_forms():
    """The bundled model (a dense first layer, MLA layers) with ``set_gated_act_backend`` on:
    prefill and decode logits within fp32 rounding of the torch forms, same greedy tokens."""
    from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
    from sglang.srt.layers.activation import (SigmoidHeadGate, SiluAndMul,
                                              set_gated_act_backend)
    from sglang.srt.layers.kernel_choices import KernelChoices
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.test.runner_utils import greedy_logits

    if not (BUNDLED_MODEL_DIR / "config.json").exists():
        pytest.skip("no bundled model")
    runner = ModelRunner(ModelConfig.from_path(str(BUNDLED_MODEL_DIR)), device=DEVICE,
                         dtype=torch.float32, max_running_requests=2, max_total_tokens=128,
                         kernel_choices=KernelChoices(gated_act=False))
    mods = [m for m in runner.model.modules() if isinstance(m, (SiluAndMul, SigmoidHeadGate))]
    assert {type(m) for m in mods} == {SiluAndMul, SigmoidHeadGate}
    prompt = list(range(3, 20))
    ref = greedy_logits(runner, prompt, 3)
    assert set_gated_act_backend(runner.model, True, runner.device)
    got = greedy_logits(runner, prompt, 3)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
