"""sgl_kernel.mla_rope: MLA's query and key assembled with RoPE in one launch, bit-equal to
RotaryEmbedding followed by the two concatenations (interpreter: fp32 / fp16; CUDA: bf16 too),
for both channel pairings, strided inputs as the model passes them, and bad shapes."""
from __future__ import annotations

import pytest
import torch

from kernel_test_utils import DEVICE, ON_CUDA, needs_triton

pytestmark = needs_triton

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])


def _inputs(dtype, t=3, h=11, r=40, d=16, seed=0, rk=None):
    """``rk``: the key's non-rope width when it differs from the query's ``r`` (normal form)."""
    gen = torch.Generator().manual_seed(seed)
    rk = r if rk is None else rk
    # q_latent as the absorbed bmm leaves it ([H, T, R] transposed), q_rope / k_rope as slices
    # of wider projection outputs: none of them contiguous beyond the last dim.
    q_latent = torch.randn(h, t, r, generator=gen).to(DEVICE, dtype).transpose(0, 1)
    q_full = torch.randn(t, h, 8 + d, generator=gen).to(DEVICE, dtype)
    kv = torch.randn(t, rk + d, generator=gen).to(DEVICE, dtype)
    latent = torch.randn(t, rk, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([5, 0, 1000][:t], device=DEVICE)
    return positions, q_latent, q_full[..., 8:], latent, kv[:, rk:]


@pytest.mark.parametrize("rk", [None, 72])  # 72: a key wider than the query (normal form)
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_rope_then_cat(dtype, neox, rk):
    from sgl_kernel.mla_rope import mla_rope_assemble, mla_rope_reference
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    positions, q_latent, q_rope, latent, k_rope = _inputs(dtype, rk=rk)
    rope = RotaryEmbedding(16, 16, 2048, 10000.0, is_neox_style=neox)
    table = rope.cos_sin_cache(positions.device)
    q, k = mla_rope_assemble(positions, table, q_latent, q_rope, latent, k_rope, neox)
    q_ref, k_ref = mla_rope_reference(positions, rope, q_latent, q_rope, latent, k_rope)
    assert q.dtype == q_ref.dtype and k.dtype == k_ref.dtype
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    # One token alone rounds as it does beside others (decode vs verify).
    q1, k1 = mla_rope_assemble(positions[1:2], table, q_latent[1:2], q_rope[1:2], latent[1:2],
                               k_rope[1:2], neox)
    assert torch.equal(q1, q[1:2]) and torch.equal(k1, k[1:2])


def test_rejects_bad_shapes():
    from sgl_kernel.mla_rope import mla_rope_assemble

    positions, q_latent, q_rope, latent, k_rope = _inputs(torch.float32)
    table = torch.zeros(2048, 16, device=DEVICE)
    with pytest.raises(ValueError, match="q_rope"):
        mla_rope_assemble(positions, table, q_latent, q_rope[..., :15], latent, k_rope, False)
    with pytest.raises(ValueError, match="fp32"):
        mla_rope_assemble(positions, table.half(), q_latent, q_rope, latent, k_rope, False)
    with pytest.raises(ValueError, match="contiguous"):
        mla_rope_assemble(positions, table, q_latent, q_rope, latent.t().contiguous().t(),
                          k_rope, False)


def test_model_with_the_kernel_equals_the_torch_form(monkeypatch):
    """The bundled model with ``set_rope_backend`` on: prefill and decode logits bit-equal to the
    torch rotation and concatenations (the MLA layers' only change)."""
    from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
    from sglang.srt.layers.kernel_choices import KernelChoices
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding, set_rope_backend
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.test.runner_utils import greedy_logits

    if not (BUNDLED_MODEL_DIR / "config.json").exists():
        pytest.skip("no bundled model")
    # The torch form first (the default on CUDA is the kernel).
    runner = ModelRunner(ModelConfig.from_path(str(BUNDLED_MODEL_DIR)), device=DEVICE,
                         dtype=torch.float32, max_running_requests=4, max_total_tokens=256,
                         kernel_choices=KernelChoices(mla_rope=False))
    ropes = [m for m in runner.model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes and not runner.triton_rope
    # 17 tokens: the absorbed form; 70 (>= MLA_NORMAL_FORM_MIN_TOKENS): the normal form.
    from sglang.srt.layers.attention.torch_native_mla import TorchNativeMLABackend

    normal = []
    real = TorchNativeMLABackend.forward_extend_normal
    monkeypatch.setattr(TorchNativeMLABackend, "forward_extend_normal",
                        lambda self, q, *a, **kw: normal.append(q.shape[0]) or real(self, q, *a,
                                                                                    **kw))
    prompts = [list(range(3, 20)), [3 + i % 50 for i in range(70)]]
    ref = [greedy_logits(runner, p, 3) for p in prompts]
    assert set_rope_backend(runner.model, True, runner.device)
    assert all(m.use_triton for m in ropes)
    got = [greedy_logits(runner, p, 3) for p in prompts]
    for a, b in zip(sum(map(list, ref), []), sum(map(list, got), [])):
        assert torch.equal(a, b)
    assert set(normal) == {70}  # the long prompt's MLA layers ran in normal form, both times
    set_rope_backend(runner.model, False, runner.device)


def test_choice_needs_cuda_or_the_interpreter(monkeypatch):
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding, set_rope_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rope = RotaryEmbedding(16, 16, 64, 10000.0, True)
    with pytest.raises(ValueError, match=r"KernelChoices\(mla_rope=True\) needs CUDA"):
        set_rope_backend(rope, True, torch.device("cpu"))
    assert not set_rope_backend(rope, False, torch.device("cpu")) and not rope.use_triton
