"""GPU parity: the serving model in bf16 on CUDA vs the fp32 reference, torch_native vs fla KDA.

Tolerances (bf16 weights and activations through every layer of a random model):
relative Frobenius error of the logits ||serve - ref|| / ||ref|| <= 3e-2, and the greedy token
agrees with the reference's at >= 90% of positions (near-ties may legitimately flip in bf16).
fla ``chunk_kda`` prefill vs the torch_native chunked KDA, both in bf16: relative error <= 2e-2.
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


def test_bf16_serving_matches_reference(checkpoint):
    torch.manual_seed(0)
    ids = torch.randint(0, GPU_OVERRIDES["vocab_size"], (300,))
    ref = ReferenceBailingMoeV3.from_pretrained(checkpoint, dtype=torch.float32, device="cuda")
    with torch.no_grad():
        ref_logits = ref(ids.cuda()[None])[0][0]
    got = _prefill_logits(checkpoint, ids, "torch_native", "torch")
    assert _rel(got, ref_logits) <= 3e-2
    agree = (got.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"greedy agreement {agree:.3f}"


def test_fla_prefill_matches_torch_native(checkpoint):
    from sglang.srt.layers.attention import fla_kda

    if not fla_kda.is_available():
        pytest.skip("fla-core not installed")
    torch.manual_seed(1)
    ids = torch.randint(0, GPU_OVERRIDES["vocab_size"], (480,))  # < 512 positions of the tiny config
    a = _prefill_logits(checkpoint, ids, "torch_native", "torch")
    b = _prefill_logits(checkpoint, ids, "triton", "fla")
    assert _rel(b, a) <= 2e-2
