"""Tensor parallelism: 2 and 4 ranks give the same prefill logits and greedy decode as one
(random checkpoints and the bundled model), on CPU over gloo and, gpu-marked, on GPUs over NCCL.

fp32 throughout; tolerance 1e-4 absolute (logits are O(1); the only difference between TP=1 and
TP=2 is the summation order of the all-reduces). Greedy tokens must match exactly.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from sglang.srt.configs.model_config import BUNDLED_MODEL_DIR, ModelConfig
from sglang.srt.distributed.parallel_state import destroy_distributed_environment, free_port
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.test.random_checkpoint import tiny_config, write_random_checkpoint
from sglang.test.runner_utils import greedy_logits

PROMPT = [3, 141, 59, 265, 358, 97, 93, 238, 46, 264, 338, 327]
DECODE_STEPS = 4
ATOL = 1e-4


def run_greedy(path: str, tp_rank: int = 0, tp_size: int = 1, port=None, kernels: str = "auto",
               device: str = "cpu"):
    """Prefill logits ``[T, V]`` of PROMPT and the logits of DECODE_STEPS greedy decode steps
    (``kernels``: the MoE runner and KDA decode backend; on CUDA rank r uses GPU r)."""
    runner = ModelRunner(ModelConfig.from_path(path), device=device, dtype=torch.float32,
                         tp_rank=tp_rank, tp_size=tp_size, nccl_port=port,
                         max_running_requests=1, max_total_tokens=64,
                         moe_runner_backend=kernels, linear_attn_decode_backend=kernels)
    return [t.cpu() for t in greedy_logits(runner, PROMPT, DECODE_STEPS)]


def _rank_main(rank: int, path: str, port: int, out_dir: str, tp_size: int = 2,
               kernels: str = "auto", device: str = "cpu") -> None:
    torch.set_num_threads(1)  # several ranks share two cores
    try:
        prefill, decode = run_greedy(path, rank, tp_size, port, kernels, device)
        torch.save({"prefill": prefill, "decode": decode}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_distributed_environment()


def _check_tp_matches_tp1(path: str, tp_size: int, out_dir: str, kernels: str = "auto",
                          device: str = "cpu") -> None:
    """TP ranks (with ``kernels``) == TP=1 with the default (torch-native) kernels."""
    vocab = ModelConfig.from_path(path).vocab_size
    mp.spawn(_rank_main, args=(path, free_port(), out_dir, tp_size, kernels, device),
             nprocs=tp_size, join=True)
    ref_prefill, ref_decode = run_greedy(path, device=device)
    for rank in range(tp_size):
        got = torch.load(os.path.join(out_dir, f"rank{rank}.pt"))
        assert got["prefill"].shape == ref_prefill.shape == (len(PROMPT), vocab)
        torch.testing.assert_close(got["prefill"], ref_prefill, atol=ATOL, rtol=0)
        torch.testing.assert_close(got["decode"], ref_decode, atol=ATOL, rtol=0)
        assert torch.equal(got["decode"].argmax(-1), ref_decode.argmax(-1))
    assert ref_prefill.std() > 1e-2  # the comparison is not between two constant outputs


def test_tp2_matches_tp1(tmp_path):
    cfg = tiny_config()
    for key in ("num_attention_heads", "num_experts", "intermediate_size",
                "moe_intermediate_size", "moe_shared_expert_intermediate_size", "vocab_size"):
        assert cfg[key] % 2 == 0, key
    path = write_random_checkpoint(str(tmp_path / "ckpt"))
    _check_tp_matches_tp1(path, 2, str(tmp_path))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU interpreter run")
def test_tp2_with_triton_kernels_matches_tp1(tmp_path):
    """The Triton MoE (on this rank's intermediate slice) and KDA recurrence (on this rank's
    heads) under TP=2 give TP=1's torch-native logits."""
    path = write_random_checkpoint(str(tmp_path / "ckpt"))
    _check_tp_matches_tp1(path, 2, str(tmp_path), kernels="triton")


@pytest.mark.slow  # four ranks on two cores; test_tp2_matches_tp1 is the fast check
def test_tp4_matches_tp1(tmp_path):
    cfg = tiny_config(num_attention_heads=4)
    path = write_random_checkpoint(str(tmp_path / "ckpt"), cfg)
    _check_tp_matches_tp1(path, 4, str(tmp_path))


@pytest.mark.slow
@pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "config.json").exists(), reason="no bundled model")
def test_tp4_matches_tp1_on_the_bundled_model(tmp_path):
    _check_tp_matches_tp1(str(BUNDLED_MODEL_DIR), 4, str(tmp_path))


GPUS = torch.cuda.device_count()


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("model", ["random", "bundled"])
def test_tp_matches_tp1_on_gpus(tmp_path, monkeypatch, model):
    """TP over NCCL (4 ranks where 4 GPUs exist, else 2), fp32, == TP=1 on GPU 0."""
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.setenv(var, "0" if var == "NCCL_NVLS_ENABLE" else "1")  # no NVLink multicast
    tp = 4 if GPUS >= 4 else 2
    if model == "bundled":
        if not (BUNDLED_MODEL_DIR / "config.json").exists():
            pytest.skip("no bundled model")
        path = str(BUNDLED_MODEL_DIR)
    else:
        path = write_random_checkpoint(str(tmp_path / "ckpt"), tiny_config(num_attention_heads=4))
    _check_tp_matches_tp1(path, tp, str(tmp_path), device="cuda")
