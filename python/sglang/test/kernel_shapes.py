"""The model sizes the kernels see, for kernel tests and kernel benchmarks alike.

:func:`flash_kernel_dims` reads Ling-3.0-flash's sizes from the preset the engine ships (no
number copied by hand); :data:`TINY_KERNEL_DIMS` has the same structure at sizes Triton's CPU
interpreter runs in seconds (its cost is per program and per op), the config's scalars (eps,
clamps, gate bound, RoPE base) unchanged. Used by ``test/kernels/test_kernels_cuda.py`` and
``benchmark/kernels/bench_cold_l2_kernels.py``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["KernelDims", "flash_kernel_dims", "TINY_KERNEL_DIMS"]


@dataclass(frozen=True)
class KernelDims:
    """Sizes of one model as its kernels see them."""

    hidden: int
    heads: int
    head_dim: int  # KDA's head (q, k, v, gate)
    conv_kernel: int
    qk_nope: int
    qk_rope: int
    kv_lora_rank: int
    experts: int
    topk: int
    moe_inter: int
    groups: int
    topk_group: int
    routed_scale: float
    expert_limit: float  # the config's largest routed SwiGLU clamp
    shared_limit: float  # ... and the shared expert's
    eps: float
    vocab: int
    lower_bound: float  # KDA's safe gate
    rope_theta: float
    rope_interleave: bool
    context: int  # positions and request->token map width
    verify_chain: int  # tokens of a NEXTN verify (the engine's default chain)
    dense_inter: int  # the dense MLP's intermediate width (the first layers)
    v_head_dim: int  # MLA's value head


@functools.lru_cache(maxsize=None)
def flash_kernel_dims() -> KernelDims:
    """Ling-3.0-flash's sizes from the shipped preset."""
    from sglang.srt.configs.model_config import load_raw_config
    from sglang.srt.rounds.nextn.args import NEXTN_DEFAULT_SPEC

    c = load_raw_config("ling-3.0-flash")
    return KernelDims(
        hidden=c["hidden_size"], heads=c["num_attention_heads"], head_dim=c["head_dim"],
        conv_kernel=c["short_conv_kernel_size"], qk_nope=c["qk_nope_head_dim"],
        qk_rope=c["qk_rope_head_dim"], kv_lora_rank=c["kv_lora_rank"],
        experts=c["num_experts"], topk=c["num_experts_per_tok"],
        moe_inter=c["moe_intermediate_size"], groups=c["n_group"], topk_group=c["topk_group"],
        routed_scale=c["routed_scaling_factor"],
        expert_limit=max(c["expert_swiglu_limit_list"]),
        shared_limit=max(c["share_expert_swiglu_limit_list"]), eps=c["rms_norm_eps"],
        vocab=c["vocab_size"], lower_bound=c["kda_lower_bound"], rope_theta=c["rope_theta"],
        rope_interleave=c["rope_interleave"],
        # 8 K: a long decode's positions and request->token map width, inside
        # max_position_embeddings (the RoPE table and the map cost memory, not coverage).
        context=min(8192, c["max_position_embeddings"]), verify_chain=NEXTN_DEFAULT_SPEC[2],
        dense_inter=c["intermediate_size"], v_head_dim=c["v_head_dim"])


# hidden 192 spans two 128-column fp8 scale blocks, the second ragged, and is no power of two
# (masked tails).
TINY_KERNEL_DIMS = KernelDims(
    hidden=192, heads=2, head_dim=16, conv_kernel=4, qk_nope=16, qk_rope=8, kv_lora_rank=24,
    experts=16, topk=4, moe_inter=32, groups=4, topk_group=2, routed_scale=2.5, expert_limit=4.0,
    shared_limit=7.0, eps=1e-6, vocab=100, lower_bound=-5.0, rope_theta=6e6,
    rope_interleave=True, context=64, verify_chain=3, dense_inter=40, v_head_dim=12)
