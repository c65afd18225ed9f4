"""Plain-PyTorch, differentiable reference of the DSpark draft pass (no caches, no padding).

It is the oracle the serving model (:mod:`sglang.srt.models.dspark`) is tested against, and the
model draft training starts from. Parameter names are exactly the published checkpoint names, so
``state_dict()`` is a checkpoint. Everything works on one request at a time, written the way the
maths reads:

* context ``H = hidden_norm(fc(target_hidden))`` for the ``C`` committed tokens before the anchor;
* per layer, keys/values = ``[k_proj(H) ; k_proj(x)]`` (an explicit concatenation of context
  rows and block rows), queries from the block ``x`` only, dense softmax with no mask (the block
  is non-causal and sees the whole context);
* base logits from the shared LM head; the Markov bias ``W2 W1[prev]``; the confidence logit
  ``proj([h ; W1[prev]])``.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.configs.dspark import DSparkDraftConfig
from sglang.train.reference_mla import RMSNorm

__all__ = ["rope_neox", "ReferenceDSparkDraft"]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox RoPE on ``x [..., T, d]`` at ``positions [T]``: channel ``i`` pairs with ``i + d/2``
    and rotates by ``pos * theta^(-2i/d)``. Computed in fp32."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2.0 / d)
    angles = (positions.to(torch.float64).unsqueeze(-1) * inv_freq).float()  # [T, d/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class _Attention(nn.Module):
    def __init__(self, cfg: DSparkDraftConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                    cfg.num_key_value_heads, hd)
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(d, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def _keys(self, x: torch.Tensor, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x [N, d]`` -> rotated normed keys and values ``[kv_heads, N, hd]``."""
        n = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.head_dim)).transpose(0, 1)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        return rope_neox(k, positions, self.theta).to(x.dtype), v

    def forward(self, x: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor,
                ctx_pos: torch.Tensor) -> torch.Tensor:
        """Block ``x [g, d]`` (input-normed) attends to ``[ctx ; x]`` -> ``[g, d]``."""
        g = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(g, self.heads, self.head_dim)).transpose(0, 1)
        q = rope_neox(q, block_pos, self.theta).to(x.dtype)  # [H, g, hd]
        k_ctx, v_ctx = self._keys(ctx, ctx_pos)
        k_blk, v_blk = self._keys(x, block_pos)
        k = torch.cat([k_ctx, k_blk], dim=1)  # [kv, C + g, hd]
        v = torch.cat([v_ctx, v_blk], dim=1)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(self.head_dim)  # [H, g, C + g]
        o = torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v  # [H, g, hd]
        return self.o_proj(o.transpose(0, 1).reshape(g, self.heads * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, d: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: DSparkDraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor,
                ctx_pos: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), block_pos, ctx, ctx_pos)
        return h + self.mlp(self.post_attention_layernorm(h))


class _MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class _ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1, bias=True)


class ReferenceDSparkDraft(nn.Module):
    """The DSpark draft's parameters (checkpoint names) and its maths, per request.

    ``config`` is a :class:`DSparkDraftConfig` or a draft config.json dict. The embedding and
    LM head are the target's and are passed to the calls that need them.
    """

    def __init__(self, config: Union[DSparkDraftConfig, Dict[str, Any]], init: bool = True,
                 seed: int = 0):
        super().__init__()
        if isinstance(config, dict):
            self.config_dict = dict(config)
            config = DSparkDraftConfig.from_dict(config)
        else:
            self.config_dict = config.to_dict()
        self.config = config
        d = config.hidden_size
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.fc = nn.Linear(config.context_input_size, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.markov_head = _MarkovHead(config.vocab_size, config.markov_rank)
        if config.enable_confidence_head:
            self.confidence_head = _ConfidenceHead(config.confidence_input_size)
        if init:
            self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1/r), biases 0, norms 1."""
        gen = torch.Generator().manual_seed(seed)
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen)
                                 * mod.in_features ** -0.5)
                if mod.bias is not None:
                    mod.bias.zero_()
            elif isinstance(mod, nn.Embedding):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen)
                                 * mod.weight.shape[1] ** -0.5)
            elif isinstance(mod, RMSNorm):
                mod.weight.fill_(1.0)

    # ------------------------------------------------------------------ the draft pass
    def draft_block(self, target_hidden: torch.Tensor, anchor_id: int, anchor_pos: int,
                    embed: torch.Tensor, head: torch.Tensor,
                    context_positions: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """One request's backbone pass.

        ``target_hidden [C, m*d]``: the target features of the ``C`` context tokens (default at
        positions ``0 .. C-1``); the block ``[anchor, MASK x (g-1)]`` sits at
        ``anchor_pos .. anchor_pos + g - 1``. Returns ``(h [g, d], base_logits [g, V] fp32)``.
        """
        g = self.config.gamma
        dev = target_hidden.device
        ids = torch.full((g,), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[0] = anchor_id
        block_pos = anchor_pos + torch.arange(g, device=dev)
        if context_positions is None:
            context_positions = torch.arange(target_hidden.shape[0], device=dev)
        ctx = self.hidden_norm(self.fc(target_hidden))
        h = F.embedding(ids, embed)
        for layer in self.layers:
            h = layer(h, block_pos, ctx, context_positions)
        h = self.norm(h)
        return h, (h @ head.t()).float()

    def markov_bias(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """``W2 W1[prev]`` ``[..., V]`` fp32 (teacher forcing: any previous tokens at once)."""
        return self.markov_head.markov_w2(self.markov_head.markov_w1(prev_tokens)).float()

    def markov_greedy(self, base_logits: torch.Tensor, anchor_id: int
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The greedy Markov loop for one block ``base_logits [g, V]``: returns the drafted
        tokens ``[g]`` and the corrected logits ``[g, V]``."""
        prev = torch.tensor(anchor_id, device=base_logits.device)
        tokens, rows = [], []
        for k in range(base_logits.shape[0]):
            row = base_logits[k] + self.markov_bias(prev)
            prev = row.argmax()
            tokens.append(prev)
            rows.append(row)
        return torch.stack(tokens), torch.stack(rows)

    def confidence_logits(self, h: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """``proj([h ; W1[prev]])`` ``[...]`` fp32 for ``h [..., d]``, ``prev_tokens [...]``."""
        feat = h
        if self.config.confidence_head_with_markov:
            feat = torch.cat([h, self.markov_head.markov_w1(prev_tokens)], dim=-1)
        return self.confidence_head.proj(feat).squeeze(-1).float()

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path: str, dtype: torch.dtype = torch.bfloat16,
                        extra_tensors: Optional[Dict[str, torch.Tensor]] = None) -> str:
        """Write ``config.json`` and ``model.safetensors`` (the state dict plus ``extra_tensors``,
        e.g. DeepSpec's ``embed_tokens.weight`` / ``lm_head.weight`` copies) to ``path``."""
        from safetensors.torch import save_file

        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported checkpoint dtype {dtype}; use one of "
                             f"{list(_DTYPE_NAMES)}")
        os.makedirs(path, exist_ok=True)
        tensors = dict(self.state_dict())
        tensors.update(extra_tensors or {})
        tensors = {k: v.detach().to("cpu", dtype).contiguous().clone()
                   for k, v in tensors.items()}
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        config = dict(self.config_dict)
        config["torch_dtype"] = _DTYPE_NAMES[dtype]
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        return path
