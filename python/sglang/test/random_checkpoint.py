"""Tiny random BailingMoeV3 checkpoints for tests (Hugging Face layout, written by the reference
model). The default config exercises every feature of the architecture at toy sizes."""
from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import torch

from sglang.train.reference import ReferenceBailingMoeV3
from sglang.train.reference_kda import KDAAttention
from sglang.train.reference_mla import RMSNorm
from sglang.train.reference_moe import MoE

_TINY: Dict[str, Any] = {
    "architectures": ["BailingMoeV3ForCausalLM"],
    "model_type": "bailing_hybrid",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "layer_group_size": 3,  # MLA at layers 2 and 5, KDA elsewhere
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,  # KDA head dim
    "short_conv_kernel_size": 4,
    "no_kda_lora": True,
    "kda_safe_gate": True,
    "kda_lower_bound": -5.0,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "rotary_dim": 8,
    "partial_rotary_factor": 0.5,  # in the real config and must be ignored (docs/model.md §4.2)
    "rope_theta": 10000.0,
    "rope_interleave": True,
    "rope_scaling": None,
    "max_position_embeddings": 512,
    "gated_attention_proj_granularity_type": "head_wise",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_shared_experts": 1,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_group": 4,
    "topk_group": 2,
    "score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "router_dtype": "fp32",
    # Small non-zero limits so the clamp of §5.4 changes the output; layer 0 (dense) stays 0.
    "expert_swiglu_limit_list": [0.0, 0.0, 0.0, 0.6, 0.0, 0.4],
    "share_expert_swiglu_limit_list": [0.0, 0.0, 0.5, 0.0, 0.7, 0.8],
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "use_qkv_bias": False,
    "use_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}


def tiny_config(**overrides: Any) -> Dict[str, Any]:
    """A small ``BailingMoeV3ForCausalLM`` config.json dict; keyword arguments override fields.

    Defaults: 6 layers (KDA 0,1,3,4; MLA 2,5), layer 0 dense, 8 experts top-2 in 4 groups
    (2 kept), one shared expert, KDA 2 heads x 16, MLA latent 32 / nope 16 / rope 8 / v 16,
    vocab 512, an MTP layer, clamp limits that bite on layers 2-5."""
    cfg = copy.deepcopy(_TINY)
    cfg.update(overrides)
    n = cfg["num_hidden_layers"]
    for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        lst = list(cfg.get(key) or [])
        cfg[key] = (lst + [0.0] * n)[:n]  # one entry per layer when the layer count changes
    return cfg


@torch.no_grad()
def randomize_for_tests(model: ReferenceBailingMoeV3, seed: int = 0) -> None:
    """Make every weight matter in a parity test: norm weights ``1 + 0.2 N(0,1)``, a non-zero
    router bias that changes selections, and KDA gates spread over ``(-4.5, -0.1)`` so that both
    fast and slow decay occur within a short prompt."""
    gen = torch.Generator().manual_seed(seed + 1)
    for mod in model.modules():
        if isinstance(mod, RMSNorm):
            mod.weight.copy_(1.0 + 0.2 * torch.randn(mod.weight.shape, generator=gen))
        elif isinstance(mod, KDAAttention):
            mod.o_norm.weight.copy_(1.0 + 0.2 * torch.randn(mod.o_norm.weight.shape,
                                                            generator=gen))
            a = torch.empty(mod.A_log.shape).uniform_(0.5, 2.0, generator=gen)
            mod.A_log.copy_(a.log())
            mod.dt_bias.copy_(torch.empty(mod.dt_bias.shape).uniform_(-1.5, 0.5, generator=gen))
        elif isinstance(mod, MoE):
            bias = mod.gate.expert_bias
            bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))


def write_random_checkpoint(path: str, config: Optional[Dict[str, Any]] = None, seed: int = 0,
                            dtype: torch.dtype = torch.float32,
                            max_shard_bytes: Optional[int] = None) -> str:
    """Write a random checkpoint of ``config`` (default :func:`tiny_config`) to ``path``.

    Weights come from the reference model's deterministic init (``seed``) plus
    :func:`randomize_for_tests`; ``max_shard_bytes`` small enough gives several shards."""
    cfg = tiny_config() if config is None else copy.deepcopy(config)
    model = ReferenceBailingMoeV3(cfg, seed=seed)
    randomize_for_tests(model, seed)
    if max_shard_bytes is None:
        model.save_pretrained(path, dtype=dtype)
    else:
        model.save_pretrained(path, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return path
