"""Configuration of BailingMoeV3 (Ling-3.0): KDA linear attention + gated MLA + grouped-top-k MoE.

The fields mirror the Hugging Face ``config.json`` of ``BailingMoeV3ForCausalLM`` (``model_type``
``bailing_hybrid``). Only what inference needs is parsed; a missing required field or a value that
breaks an invariant raises :class:`ConfigError` naming the field.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from sglang.srt.configs.hf_fields import dtype_of, rope_theta_of

ARCHITECTURE = "BailingMoeV3ForCausalLM"


class ConfigError(ValueError):
    """A model config that cannot be served (missing field, bad value, unsupported architecture)."""


# Fields every BailingMoeV3 config.json must carry (no sensible default exists).
_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "num_attention_heads",
    "head_dim",
    "layer_group_size",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "intermediate_size",
)


@dataclass
class BailingMoeV3Config:
    """Parsed BailingMoeV3 config; see ``docs/model.md`` §1 for each field's meaning."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    head_dim: int  # KDA head dim (K = V)
    layer_group_size: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int
    q_lora_rank: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    short_conv_kernel_size: int = 4
    no_kda_lora: bool = True
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: int = 4096
    gated_attention_proj_granularity_type: str = "head_wise"
    num_shared_experts: int = 1
    moe_shared_expert_intermediate_size: Optional[int] = None
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    score_function: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    router_dtype: str = "fp32"
    expert_swiglu_limit_list: List[float] = field(default_factory=list)
    share_expert_swiglu_limit_list: List[float] = field(default_factory=list)
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    eos_token_id: Any = None
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None
    torch_dtype: str = "bfloat16"
    architectures: List[str] = field(default_factory=lambda: [ARCHITECTURE])
    model_type: str = "bailing_hybrid"

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "BailingMoeV3Config":
        """Parse a config.json dict; unknown keys are ignored, missing required keys are an error."""
        archs = raw.get("architectures") or []
        if not archs or archs[0] != ARCHITECTURE:
            raise ConfigError(
                f"unsupported architecture {archs[0] if archs else None!r}: this engine serves "
                f"{ARCHITECTURE} (dispatch is on architectures[0]; model_type 'bailing_hybrid' is "
                "shared with other Ling versions)"
            )
        missing = [k for k in _REQUIRED if raw.get(k) is None]
        if missing:
            raise ConfigError(f"config.json is missing required field(s): {', '.join(missing)}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in names}
        # Ling and DeepSeek spell the router activation differently.
        if "score_function" not in raw and "scoring_func" in raw:
            kwargs["score_function"] = raw["scoring_func"]
        # transformers 5 layouts: rope_parameters.rope_theta, dtype beside torch_dtype.
        try:
            # MLA rotates qk_rope_head_dim of each head (Ling writes it as partial_rotary_factor
            # 0.5 of head_dim 128).
            fraction = (raw["qk_rope_head_dim"] / raw["head_dim"]
                        if raw.get("head_dim") else 1.0)
            kwargs["rope_theta"] = rope_theta_of(raw, cls.rope_theta, rotary_fraction=fraction)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        kwargs["torch_dtype"] = dtype_of(raw, cls.torch_dtype)
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    def to_dict(self) -> Dict[str, Any]:
        """The config as a config.json-style dict (round-trips through :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Check the invariants the model code relies on; raise :class:`ConfigError` otherwise."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        for name in _REQUIRED:
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"{name} must be a positive integer, got {v!r}")
        need(self.layer_group_size >= 1, "layer_group_size must be >= 1")
        need(self.short_conv_kernel_size >= 1, "short_conv_kernel_size must be >= 1")
        need(self.num_experts_per_tok <= self.num_experts,
             "num_experts_per_tok must be <= num_experts")
        need(self.n_group >= 1 and self.num_experts % self.n_group == 0,
             f"num_experts ({self.num_experts}) must be divisible by n_group ({self.n_group})")
        need(1 <= self.topk_group <= self.n_group, "topk_group must be in [1, n_group]")
        experts_per_group = self.num_experts // self.n_group
        need(self.topk_group * experts_per_group >= self.num_experts_per_tok,
             "topk_group groups must hold at least num_experts_per_tok experts")
        need(self.score_function == "sigmoid",
             f"score_function {self.score_function!r} is not supported (only 'sigmoid')")
        need(self.hidden_act == "silu", f"hidden_act {self.hidden_act!r} is not supported")
        need(self.gated_attention_proj_granularity_type == "head_wise",
             "gated_attention_proj_granularity_type must be 'head_wise'")
        need(self.kda_lower_bound < 0, "kda_lower_bound must be negative")
        need(self.no_kda_lora, "no_kda_lora=false (low-rank KDA gates) is not supported")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even")
        need(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank must be null or > 0")
        need(self.num_nextn_predict_layers in (0, 1), "num_nextn_predict_layers must be 0 or 1")
        need(0 <= self.first_k_dense_replace <= self.num_hidden_layers,
             "first_k_dense_replace must be in [0, num_hidden_layers]")
        for name in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            lst = getattr(self, name) or []
            need(isinstance(lst, list) and all(isinstance(x, (int, float)) and x >= 0 for x in lst),
                 f"{name} must be a list of non-negative numbers")

    # ------------------------------------------------------------------ derived layout
    def is_kda_layer(self, layer_id: int) -> bool:
        """docs/model.md §1.3: every ``layer_group_size``-th layer and an incomplete tail group
        are MLA; the rest are KDA."""
        g = self.layer_group_size
        full_groups_end = (self.num_hidden_layers // g) * g
        return not ((layer_id + 1) % g == 0 or layer_id >= full_groups_end)

    @property
    def kda_layer_ids(self) -> List[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_kda_layer(i)]

    @property
    def full_attention_layer_ids(self) -> List[int]:
        """MLA layers of the target model (the MTP layer is not included)."""
        return [i for i in range(self.num_hidden_layers) if not self.is_kda_layer(i)]

    @property
    def layer_types(self) -> List[str]:
        return ["linear_attention" if self.is_kda_layer(i) else "full_attention"
                for i in range(self.num_hidden_layers)]

    def is_moe_layer(self, layer_id: int) -> bool:
        """Layers from ``first_k_dense_replace`` on (and the MTP layer) use the MoE block."""
        return layer_id >= self.first_k_dense_replace

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Per-token MLA latent cache width: normed latent + rope key (576 for Flash)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_expert_intermediate_size(self) -> int:
        width = self.moe_shared_expert_intermediate_size or self.moe_intermediate_size
        return width * self.num_shared_experts

    @property
    def mtp_layer_id(self) -> int:
        """Checkpoint index of the MTP layer: ``model.layers.{num_hidden_layers}``."""
        return self.num_hidden_layers

    def expert_swiglu_limit(self, layer_id: int) -> float:
        """Clamp limit of the routed experts of a layer; 0 means plain SwiGLU (MTP: always 0)."""
        lst = self.expert_swiglu_limit_list or []
        return float(lst[layer_id]) if 0 <= layer_id < len(lst) and lst[layer_id] else 0.0

    def shared_expert_swiglu_limit(self, layer_id: int) -> float:
        """Clamp limit of the shared expert of a layer; 0 means plain SwiGLU (MTP: always 0)."""
        lst = self.share_expert_swiglu_limit_list or []
        return float(lst[layer_id]) if 0 <= layer_id < len(lst) and lst[layer_id] else 0.0

    @property
    def eos_token_ids(self) -> List[int]:
        e = self.eos_token_id
        if e is None:
            return []
        return list(e) if isinstance(e, (list, tuple)) else [int(e)]
