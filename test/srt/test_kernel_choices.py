"""KernelChoices: the defaults per device, weights and flags (no environment variable picks a
kernel), the one override tests and benchmarks use, and how a runner applies it."""
from __future__ import annotations

import argparse
import os

import pytest
import torch

from sglang.srt.layers.kernel_choices import (
    KernelChoices,
    add_kernel_choices_arg,
    default_kernel_choices,
    kernel_choices_from_args,
)

FAST_ON_CUDA = ("rmsnorm", "mla_rope", "gated_act")  # measured faster, gated: on for CUDA
MOE_FOLLOWERS = ("router", "moe_combine")  # follow --moe-runner-backend


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("backend", ["auto", "triton", "torch_native"])
def test_defaults_on_cuda(quantized, backend):
    kc = default_kernel_choices("cuda", quantized=quantized, moe_runner_backend=backend)
    assert kc.is_resolved
    assert all(getattr(kc, name) for name in FAST_ON_CUDA)
    triton_moe = backend in ("auto", "triton")  # auto is triton on CUDA
    assert all(getattr(kc, name) == triton_moe for name in MOE_FOLLOWERS)
    assert kc.small_m_gemm == quantized  # fp8 weights: read in place by the small-M GEMM
    assert not kc.kda_norm_in_o_proj and not kc.moe_grouped_mm and kc.pdl_weight_prefetch
    assert kc.moe_align_kernel == triton_moe  # the grouped GEMM path's expert sort kernel
    # w8a8 on fp8 models: the MoE's grouped GEMMs and the dense projections on the library's
    # block-scaled GEMM (both timed faster), not the dense Triton GEMM (timed slower)
    assert kc.moe_fp8_activations == quantized and not kc.dense_fp8_activations
    assert kc.dense_scaled_mm == quantized


@pytest.mark.parametrize("quantized", [False, True])
def test_defaults_off_cuda_are_the_torch_paths(quantized):
    for deterministic in (False, True):
        kc = default_kernel_choices("cpu", quantized=quantized, moe_runner_backend="auto",
                                    enable_deterministic_inference=deterministic)
        assert kc == KernelChoices(rmsnorm=False, mla_rope=False, router=False,
                                   moe_combine=False, small_m_gemm=False,
                                   mla_absorb_gemv=False, kda_norm_in_o_proj=False,
                                   moe_grouped_mm=False, pdl_weight_prefetch=True,
                                   moe_align_kernel=False, moe_fp8_activations=False,
                                   dense_fp8_activations=False, dense_scaled_mm=False,
                                   gated_act=False)


def test_triton_moe_backend_brings_router_and_combine_anywhere():
    """An explicit ``--moe-runner-backend triton`` (CPU: the interpreter) runs the whole Triton
    MoE block: router kernel and one-kernel combine too; the norms still follow the device."""
    kc = default_kernel_choices("cpu", quantized=False, moe_runner_backend="triton")
    assert kc.router and kc.moe_combine and not kc.rmsnorm and not kc.small_m_gemm


def test_deterministic_inference_turns_on_the_small_m_gemm_for_16_bit_weights():
    assert not default_kernel_choices("cuda", quantized=False).small_m_gemm
    assert default_kernel_choices("cuda", quantized=False,
                                  enable_deterministic_inference=True).small_m_gemm
    assert default_kernel_choices("cuda", quantized=True,
                                  enable_deterministic_inference=True).small_m_gemm
    # ... and MLA's absorbed products as grouped mat-vecs (only then).
    assert not default_kernel_choices("cuda", quantized=True).mla_absorb_gemv
    assert default_kernel_choices("cuda", quantized=False,
                                  enable_deterministic_inference=True).mla_absorb_gemv


def test_forced_fields_win_and_the_rest_keep_their_defaults():
    kc = KernelChoices(rmsnorm=False, moe_grouped_mm=True).resolve(
        "cuda", quantized=True, moe_runner_backend="auto")
    assert kc.is_resolved and not kc.rmsnorm and kc.moe_grouped_mm
    assert kc.mla_rope and kc.router and kc.small_m_gemm
    assert KernelChoices().resolve("cuda", quantized=True) == default_kernel_choices(
        "cuda", quantized=True)
    assert not KernelChoices(router=True).is_resolved
    assert KernelChoices(router=True, rmsnorm=False).forced() == {"rmsnorm": False,
                                                                  "router": True}


def test_choices_are_typed():
    with pytest.raises(TypeError, match="KernelChoices.rmsnorm"):
        KernelChoices(rmsnorm=1)
    with pytest.raises(TypeError, match="KernelChoices.router"):
        KernelChoices(router="0")
    with pytest.raises(Exception):  # frozen
        KernelChoices().rmsnorm = True
    with pytest.raises(ValueError, match="kernel backend"):
        default_kernel_choices("cuda", quantized=False, moe_runner_backend="cutlass")


def test_parse_reads_the_benchmark_spelling():
    assert KernelChoices.parse("") == KernelChoices()
    kc = KernelChoices.parse("rmsnorm=0, router=on,small_m_gemm=TRUE")
    assert kc == KernelChoices(rmsnorm=False, router=True, small_m_gemm=True)
    assert kc.describe() == "rmsnorm=0,router=1,small_m_gemm=1"
    assert KernelChoices.parse(kc.describe()) == kc
    with pytest.raises(ValueError, match="kernel choice router='maybe' is not a boolean"):
        KernelChoices.parse("router=maybe")
    with pytest.raises(ValueError, match="rmsnrom"):
        KernelChoices.parse("rmsnrom=1")
    with pytest.raises(ValueError, match="field=value"):
        KernelChoices.parse("rmsnorm")


def test_benchmark_option():
    parser = argparse.ArgumentParser()
    add_kernel_choices_arg(parser)
    assert kernel_choices_from_args(parser.parse_args([])) is None
    args = parser.parse_args(["--kernel-choices", "kda_norm_in_o_proj=1"])
    assert kernel_choices_from_args(args) == KernelChoices(kda_norm_in_o_proj=True)


# ------------------------------------------------------------------------------ in a runner
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from sglang.test.random_checkpoint import tiny_config, write_random_checkpoint

    return write_random_checkpoint(str(tmp_path_factory.mktemp("kc") / "c"), tiny_config(),
                                   seed=3)


def _runner(path: str, **kw):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner

    return ModelRunner(ModelConfig.from_path(path), device="cpu", dtype=torch.float32,
                       max_running_requests=1, max_total_tokens=32, **kw)


def _layer_state(runner):
    from sglang.srt.layers.activation import SigmoidHeadGate, SiluAndMul
    from sglang.srt.layers.layernorm import GatedRMSNorm, RMSNorm
    from sglang.srt.layers.moe.moe_layer import FusedMoE
    from sglang.srt.layers.moe.topk import MoEGate
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding
    from sglang.srt.models.bailing_moe_v3 import BailingKDA, BailingMLA

    mods = list(runner.model.modules())

    def one(values):
        values = set(values)
        assert len(values) == 1, values  # every layer of a kind follows the one choice
        return values.pop()

    return dict(
        rmsnorm=one(m.use_triton for m in mods if isinstance(m, (RMSNorm, GatedRMSNorm))),
        mla_rope=one(m.use_triton for m in mods if isinstance(m, RotaryEmbedding)),
        router=one(m.use_triton for m in mods if isinstance(m, MoEGate)),
        moe_combine=one(m.fused_combine for m in mods if isinstance(m, FusedMoE)),
        moe_grouped_mm=one(m.grouped_mm for m in mods if isinstance(m, FusedMoE)),
        small_m_gemm=one(m.small_m_gemm for m in mods if hasattr(m, "small_m_gemm")),
        kda_norm_in_o_proj=one(m.norm_in_o_proj for m in mods if isinstance(m, BailingKDA)),
        mla_absorb_gemv=one(m.absorb_gemv for m in mods if isinstance(m, BailingMLA)),
        gated_act=one(m.use_triton for m in mods if isinstance(m, (SiluAndMul, SigmoidHeadGate))),
    )


def test_runner_on_cpu_takes_the_torch_paths_by_default(tiny_path):
    runner = _runner(tiny_path)
    assert runner.kernel_choices == default_kernel_choices("cpu", quantized=False)
    assert runner.requested_kernel_choices is None
    assert not any(_layer_state(runner).values())
    assert (runner.triton_norms, runner.triton_rope, runner.small_m_gemm) == (False,) * 3


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="forcing Triton kernels on CPU needs the interpreter (test/conftest.py)")
def test_runner_applies_forced_choices_to_every_layer(tiny_path):
    forced = KernelChoices(rmsnorm=True, mla_rope=True, router=True, small_m_gemm=True,
                           kda_norm_in_o_proj=True, moe_grouped_mm=True, mla_absorb_gemv=True,
                           gated_act=True)
    runner = _runner(tiny_path, kernel_choices=forced)
    assert runner.requested_kernel_choices is forced
    state = _layer_state(runner)
    assert state == dict(rmsnorm=True, mla_rope=True, router=True, moe_combine=False,
                         moe_grouped_mm=True, small_m_gemm=True, kda_norm_in_o_proj=True,
                         mla_absorb_gemv=True, gated_act=True)
    # the one-kernel combine only exists on the Triton MoE runner
    triton = _runner(tiny_path, moe_runner_backend="triton",
                     kernel_choices=KernelChoices(router=False))
    assert _layer_state(triton)["moe_combine"] and not _layer_state(triton)["router"]
    with pytest.raises(TypeError, match="KernelChoices"):
        _runner(tiny_path, kernel_choices={"rmsnorm": True})


def test_server_args_carry_determinism_and_choices_to_the_runner():
    """``runner_kwargs_from_server_args`` passes ``--enable-deterministic-inference`` and a
    ``kernel_choices`` attribute (set by tests and benchmarks) on, and works without either."""
    from sglang.srt.model_executor.model_runner import runner_kwargs_from_server_args
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(device="cpu")
    kw = runner_kwargs_from_server_args(args)
    assert kw["kernel_choices"] is None
    assert kw["enable_deterministic_inference"] is bool(
        getattr(args, "enable_deterministic_inference", False))
    args.enable_deterministic_inference = True
    args.kernel_choices = KernelChoices(rmsnorm=True)
    kw = runner_kwargs_from_server_args(args)
    assert kw["enable_deterministic_inference"] is True
    assert kw["kernel_choices"] == KernelChoices(rmsnorm=True)
