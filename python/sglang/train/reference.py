"""Plain-PyTorch, differentiable reference BailingMoeV3 (Ling-3.0), written from docs/model.md.

It is the oracle the serving model is tested against and the model the training code trains.
Parameter names are exactly the Hugging Face checkpoint names (docs/model.md §2.1-2.2), so
``state_dict()`` is a checkpoint and a checkpoint loads with ``load_state_dict(strict=True)``.
Inputs are batched ``[B, T]`` token ids of one length; positions are ``0..T-1``.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Tuple, Union

import torch
from torch import nn

from sglang.srt.configs.bailing_moe_v3 import BailingMoeV3Config
from sglang.train.reference_kda import KDA_MODES, KDAAttention
from sglang.train.reference_mla import MLAAttention, RMSNorm
from sglang.train.reference_moe import MLP, MoE


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(input_layernorm(h))``; ``h += mlp(post_attention_layernorm(h))``."""

    def __init__(self, cfg: BailingMoeV3Config, layer_id: int, kda: bool, moe: bool,
                 expert_limit: float, shared_limit: float):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.layer_id, self.is_kda = layer_id, kda
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        if kda:
            self.attention = KDAAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim,
                                          cfg.short_conv_kernel_size, cfg.kda_lower_bound,
                                          cfg.kda_safe_gate, eps)
        else:
            self.attention = MLAAttention(cfg.hidden_size, cfg.num_attention_heads,
                                          cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                                          cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.rope_theta,
                                          eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        if moe:
            self.mlp = MoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                           cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size,
                           cfg.num_shared_experts, cfg.n_group, cfg.topk_group,
                           cfg.norm_topk_prob, cfg.routed_scaling_factor,
                           cfg.moe_router_enable_expert_bias, expert_limit, shared_limit)
        else:
            # Dense layers carry no clamp: the limit lists describe (shared) experts only.
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, kda_mode: str, chunk_size: int) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.is_kda:
            h = h + self.attention(x, kda_mode, chunk_size)
        else:
            h = h + self.attention(x)
        return h + self.mlp(self.post_attention_layernorm(h))


class MTPLayer(DecoderLayer):
    """The NextN/MTP block ``model.layers.{N}`` (docs/model.md §6.1): MLA + MoE (never clamped) plus
    ``enorm``, ``hnorm``, ``eh_proj`` (input order ``[embedding, hidden]``) and ``final_layernorm``."""

    def __init__(self, cfg: BailingMoeV3Config, layer_id: int):
        super().__init__(cfg, layer_id, kda=False, moe=True, expert_limit=0.0, shared_limit=0.0)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward_mtp(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``emb`` = embedding of token t+1, ``hidden`` = final-normed main hidden at t."""
        u = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        u = u.to(emb.dtype)  # keep the residual stream in the parameter dtype under autocast
        return self.final_layernorm(super().forward(u, "chunk", 1))


class _Backbone(nn.Module):
    """The ``model.`` namespace of the checkpoint: embeddings, layers (+ MTP), final norm."""

    def __init__(self, cfg: BailingMoeV3Config):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers = []
        for i in range(cfg.num_hidden_layers):
            layers.append(DecoderLayer(cfg, i, cfg.is_kda_layer(i), cfg.is_moe_layer(i),
                                       cfg.expert_swiglu_limit(i),
                                       cfg.shared_expert_swiglu_limit(i)))
        for j in range(cfg.num_nextn_predict_layers):
            layers.append(MTPLayer(cfg, cfg.num_hidden_layers + j))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def parse_config(config: Union[BailingMoeV3Config, Dict[str, Any]]) -> Tuple[
        BailingMoeV3Config, Dict[str, Any]]:
    """Accept a parsed config or a config.json dict; return ``(parsed, raw dict)``."""
    if isinstance(config, BailingMoeV3Config):
        return config, config.to_dict()
    if not isinstance(config, dict):
        raise TypeError(f"config must be a BailingMoeV3Config or a dict, got {type(config)!r}")
    cfg = BailingMoeV3Config.from_dict(config)
    if cfg.rope_scaling:
        raise ValueError(f"rope_scaling={cfg.rope_scaling!r} is not supported by the reference "
                         "model (Ling-3.0 ships rope_scaling: null)")
    return cfg, dict(config)


class ReferenceBailingMoeV3(nn.Module):
    """The whole model: ``model.*`` backbone (with the MTP layer when configured) and ``lm_head``.

    ``kda_mode`` selects the KDA implementation (``recurrent``/``chunk``/``fla``/``auto``, see
    :mod:`sglang.train.reference_kda`); ``kda_chunk_size`` the chunk of the chunked form.
    ``init=False`` skips the random initialisation (used when weights are loaded right after).
    """

    def __init__(self, config: Union[BailingMoeV3Config, Dict[str, Any]], kda_mode: str = "chunk",
                 kda_chunk_size: int = 32, init: bool = True, seed: int = 0):
        super().__init__()
        self.config, self.config_dict = parse_config(config)
        if kda_mode not in KDA_MODES:
            raise ValueError(f"kda_mode must be one of {KDA_MODES}, got {kda_mode!r}")
        self.kda_mode, self.kda_chunk_size = kda_mode, kda_chunk_size
        self.model = _Backbone(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        if init:
            self.reset_parameters(seed)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``input_ids [B, T]`` -> ``(logits [B, T, V] fp32, hidden [B, T, H] final-normed)``."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        h = self.model.word_embeddings(input_ids)
        for layer in self.model.layers[:self.config.num_hidden_layers]:
            h = layer(h, self.kda_mode, self.kda_chunk_size)
        hidden = self.model.norm(h)
        return self.lm_head(hidden).float(), hidden

    @property
    def mtp_layer(self) -> MTPLayer:
        """The NextN block; a clear error when the config has ``num_nextn_predict_layers = 0``."""
        if self.config.num_nextn_predict_layers < 1:
            raise ValueError("this model has no MTP layer (num_nextn_predict_layers = 0)")
        return self.model.layers[self.config.num_hidden_layers]

    def mtp_forward(self, hidden: torch.Tensor, next_ids: torch.Tensor
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """MTP draft (docs/model.md §6.1): pairs ``(hidden[:, t], next_ids[:, t])`` at position t.

        ``hidden [B, T, H]`` is the main model's final-normed hidden state, ``next_ids [B, T]``
        the token at t+1 (in training: input ids rolled by -1). Returns
        ``(mtp_logits [B, T, V] fp32, mtp_hidden [B, T, H])``; ``mtp_hidden`` is the block's
        ``final_layernorm`` output, which a further draft step would take as its hidden input.
        """
        if hidden.shape[:2] != next_ids.shape:
            raise ValueError(f"hidden {tuple(hidden.shape)} and next_ids {tuple(next_ids.shape)} "
                             "must agree on [B, T]")
        out = self.mtp_layer.forward_mtp(self.model.word_embeddings(next_ids), hidden)
        return self.lm_head(out).float(), out

    # ------------------------------------------------------------------ MoE balancing
    def moe_layers(self) -> Dict[int, MoE]:
        """MoE blocks by layer index (the MTP layer included)."""
        return {layer.layer_id: layer.mlp for layer in self.model.layers
                if isinstance(layer.mlp, MoE)}

    def pop_expert_counts(self) -> Dict[int, torch.Tensor]:
        """Per-layer routed-token counts ``{layer_id: [E] int64}`` accumulated over the forwards
        since the last call (layers that did not run are absent); resets them."""
        stats = {}
        for i, moe in self.moe_layers().items():
            counts = moe.pop_expert_counts()
            if counts is not None:
                stats[i] = counts
        return stats

    @torch.no_grad()
    def update_expert_bias(self, counts: Dict[int, torch.Tensor], rate: float = 1e-3) -> None:
        """Aux-loss-free balancing: ``expert_bias += rate * sign(mean(count) - count)`` per layer,
        so overloaded experts become less likely to be selected."""
        moes = self.moe_layers()
        for i, c in counts.items():
            bias = moes[i].gate.expert_bias
            c = c.to(device=bias.device, dtype=torch.float32)
            bias.add_(rate * torch.sign(c.mean() - c))

    # ------------------------------------------------------------------ initialisation
    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Deterministic random init that keeps activations O(1) through the stack.

        Linear weights ~ N(0, 1/fan_in); output projections (``o_proj``, ``dense``, ``down_proj``)
        are further scaled by ``1/sqrt(2 * layers)`` so the residual stream grows slowly;
        embeddings ~ N(0, 1); norms 1; conv taps ~ N(0, 1/K); KDA gates Mamba-style
        (``A`` in [1, 16], ``dt`` in [1e-3, 1e-1]); ``expert_bias`` 0.
        """
        gen = torch.Generator().manual_seed(seed)
        depth = 2 * (self.config.num_hidden_layers + self.config.num_nextn_predict_layers)

        def normal_(t: torch.Tensor, std: float) -> None:
            t.copy_(torch.randn(t.shape, generator=gen) * std)

        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear):
                std = mod.in_features ** -0.5
                if name.endswith(("o_proj", "dense", "down_proj")):
                    std /= math.sqrt(depth)
                normal_(mod.weight, std)
            elif isinstance(mod, nn.Conv1d):
                normal_(mod.weight, mod.weight.shape[-1] ** -0.5)
            elif isinstance(mod, nn.Embedding):
                normal_(mod.weight, 1.0)
            elif isinstance(mod, KDAAttention):
                mod.init_gate_params(gen, (1.0, 16.0), (1e-3, 1e-1))
                mod.o_norm.weight.fill_(1.0)
            elif isinstance(mod, RMSNorm):
                mod.weight.fill_(1.0)
            elif isinstance(mod, MoE):
                normal_(mod.gate.weight, mod.gate.weight.shape[1] ** -0.5)
                mod.gate.expert_bias.zero_()

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32,
                        device: Union[str, torch.device] = "cpu",
                        **kwargs: Any) -> "ReferenceBailingMoeV3":
        """Load ``config.json`` + safetensors (single file or sharded with an index) from ``path``.

        Weights are cast to ``dtype`` except ``expert_bias`` (kept fp32); ``kwargs`` go to the
        constructor (``kda_mode``, ``kda_chunk_size``)."""
        from sglang.train.reference_io import load_checkpoint

        return load_checkpoint(cls, path, dtype=dtype, device=device, **kwargs)

    def save_pretrained(self, path: str, dtype: torch.dtype = torch.bfloat16,
                        max_shard_bytes: int = 5 * 10 ** 9) -> str:
        """Write ``config.json``, safetensors shards (+ ``model.safetensors.index.json`` when
        there is more than one) and ``generation_config.json`` to ``path``; returns ``path``."""
        from sglang.train.reference_io import save_checkpoint

        return save_checkpoint(self, path, dtype=dtype, max_shard_bytes=max_shard_bytes)
