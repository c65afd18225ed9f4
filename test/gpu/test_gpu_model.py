"""GPU parity: the serving model in bf16 on CUDA vs the fp32 reference, torch_native vs fla KDA.

Tolerances. The yardstick is the plain-PyTorch reference model itself run in bf16: its relative
Frobenius error against the fp32 reference (``e16``, about 5% on this random 6-layer model) is
what bf16 rounding alone costs. The serving model in bf16 must stay within ``1.5 * e16`` of the
fp32 reference and agree with its greedy token at >= 90% of positions (near-ties may flip in
bf16); so must the model with fla ``chunk_kda`` prefill. (fla vs torch-native directly is not a
fair gate: two bf16 paths each about ``e16`` from the truth differ by up to about sqrt(2) ``e16``;
a first version gated on ``e16`` and failed on the H200.) (A fixed 3e-2 was tried first and is too tight: on CPU the serving model's bf16
error is 3.0% while the reference's own is 5.0%.)
"""
from __future__ import annotations

import pytest
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.test.random_checkpoint import tiny_config, write_random_checkpoint
from sglang.train.reference import ReferenceBailingMoeV3

pytestmark = pytest.mark.gpu

# Wider than the CPU tiny config so the fla kernel sees realistic head sizes.
GPU_OVERRIDES = dict(hidden_size=256, num_attention_heads=4, head_dim=64, vocab_size=1024,
                     moe_intermediate_size=128, intermediate_size=512)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu_ckpt")
    write_random_checkpoint(str(path), tiny_config(**GPU_OVERRIDES), seed=3)
    return str(path)


def _prefill_logits(path: str, ids: torch.Tensor, backend: str, kda_impl: str) -> torch.Tensor:
    runner = ModelRunner(ModelConfig.from_path(path), device="cuda", dtype=torch.bfloat16,
                         attention_backend=backend, kda_prefill_impl=kda_impl,
                         max_running_requests=2, max_total_tokens=4096)
    req = runner.req_to_token_pool.alloc(1)[0]
    runner.kda_state_pool.clear_slots([req])
    loc = runner.token_to_kv_pool_allocator.alloc(ids.numel())
    runner.req_to_token_pool.write(req, 0, loc)
    fb = ForwardBatch.for_extend(ids.cuda(), [req], [0], [ids.numel()], loc,
                                 return_full_logits=True)
    with torch.no_grad():
        return runner.forward(fb).next_token_logits.float()


def _reference_bf16_error(checkpoint: str, ids: torch.Tensor):
    """fp32 reference logits and the reference's own bf16 relative error."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        ref = ReferenceBailingMoeV3.from_pretrained(checkpoint, dtype=dtype, device="cuda")
        with torch.no_grad():
            out[dtype] = ref(ids.cuda()[None])[0][0].float()
    return out[torch.float32], _rel(out[torch.bfloat16], out[torch.float32])


def _assert_close_to_reference(got: torch.Tensor, ref_logits: torch.Tensor, e16: float) -> None:
    err = _rel(got, ref_logits)
    print(f"bf16 serving rel. error {err:.4f}, reference's own bf16 error {e16:.4f}")
    assert err <= 1.5 * e16, (err, e16)
    agree = (got.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"greedy agreement {agree:.3f}"


def test_bf16_serving_matches_reference(checkpoint):
    torch.manual_seed(0)
    ids = torch.randint(0, GPU_OVERRIDES["vocab_size"], (300,))
    ref_logits, e16 = _reference_bf16_error(checkpoint, ids)
    _assert_close_to_reference(_prefill_logits(checkpoint, ids, "torch_native", "torch"),
                               ref_logits, e16)


def test_fla_prefill_matches_torch_native(checkpoint):
    from sglang.srt.layers.attention import fla_kda

    if not fla_kda.is_available():
        pytest.skip("fla-core not installed")
    torch.manual_seed(1)
    ids = torch.randint(0, GPU_OVERRIDES["vocab_size"], (480,))  # < 512 positions of the tiny config
    ref_logits, e16 = _reference_bf16_error(checkpoint, ids)
    got = _prefill_logits(checkpoint, ids, "triton", "fla")
    print(f"fla vs torch-native (both bf16): "
          f"{_rel(got, _prefill_logits(checkpoint, ids, 'torch_native', 'torch')):.4f}")
    _assert_close_to_reference(got, ref_logits, e16)
