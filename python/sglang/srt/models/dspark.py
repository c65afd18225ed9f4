"""The DSpark draft model: a parallel block drafter with a Markov head and a confidence head.

One draft round for a request whose last committed token (the *anchor*) sits at position ``P``:

1. **Context.** Hidden states of the target after decoder layers ``target_layer_ids`` are
   concatenated (``[T, m*d]``), projected by ``fc`` (no bias) and ``hidden_norm``. Every draft
   layer applies its own ``k_proj`` / ``v_proj`` + ``k_norm`` + RoPE (at the tokens' absolute
   positions) to that projection; the results live in a :class:`DSparkContextCache`, written once
   per committed token (:meth:`DSparkDraftModel.write_context`).
2. **Backbone.** The block ``[anchor, MASK x (gamma-1)]`` at positions ``P .. P+gamma-1`` is
   embedded with the target's embedding and run through the draft layers (Qwen3-style: RMSNorm,
   attention with per-head ``q_norm`` / ``k_norm``, SwiGLU). Queries come from the block only;
   keys/values are the request's context rows ``< ctx_len`` followed by the block rows, and the
   block is **non-causal**. After the final ``norm`` the target's LM head gives base logits
   ``U_k``; slot ``k`` (the anchor's slot included) predicts the token at ``P + k + 1``.
3. **Markov head** (vanilla, rank ``r``): ``logits_k = U_k + W2 W1[x_{k-1}]`` with
   ``x_{-1}`` = the anchor and ``x_{k-1}`` the token drafted at the previous slot, so the block
   is drafted by ``gamma`` tiny sequential steps (:meth:`DSparkDraftModel.markov_draft`).
   The corrected logits are the draft distribution that verification must use.
4. **Confidence head**: ``c_k = sigmoid(w [h_k ; W1[x_{k-1}]] + b)``, the probability that draft
   ``k`` survives verification given that the earlier ones did.

All forward paths are fixed-shape device arithmetic (no host reads of device values), so they can
be captured in CUDA graphs. The draft's own parameters are replicated on every TP rank (they are
small); the shared embedding and LM head are the target's vocabulary shards.

Checkpoint names (published layout, optional ``model.`` prefix): ``layers.{i}.self_attn.{q,k,v,o}
_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj
.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``, ``norm.weight``, ``fc.weight``,
``hidden_norm.weight``, ``markov_head.markov_w{1,2}.weight``,
``confidence_head.proj.{weight,bias}``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, NamedTuple, Optional, Set, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.configs.dspark import (
    DSparkDraftConfig,
    dspark_preset_needs_dummy,
    is_dspark_preset,
)
from sglang.srt.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
)
from sglang.srt.layers.activation import silu_and_mul
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ReplicatedLinear, copy_checked
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.sampler import sample_from_probs
from sglang.srt.layers.vocab_parallel_embedding import (
    SharedEmbedAndHead,
    vocab_parallel_lookup,
)
from sglang.srt.mem_cache.dspark_context_cache import DSparkContextCache
from sglang.srt.model_loader.dummy import init_dummy_weights
from sglang.srt.model_loader.loader import load_safetensors_weights
from sglang.srt.model_loader.weight_utils import LazyWeight
from sglang.srt.models.weight_slots import Slots, WeightSlot, load_into_slots, tag_parameter_names

__all__ = [
    "DSparkContextCache",
    "MarkovDraft",
    "DSparkProposal",
    "DSparkDraftModel",
    "LingDSparkModel",
    "Qwen3DSparkModel",
    "EntryClass",
    "load_dspark_draft",
]

# (slot k, Markov-corrected fp32 logits [B, V]) -> (tokens [B], the distribution drawn from
# [B, V] or None). Lets a worker apply the request's full sampling transform at every slot.
StepPicker = Callable[[int, torch.Tensor], Tuple[torch.Tensor, Optional[torch.Tensor]]]


# ============================================================================================
# Layers
# ============================================================================================
class DSparkAttention(nn.Module):
    """Block queries over ``[context rows ; block rows]``; per-head q/k RMSNorm, neox RoPE."""

    def __init__(self, config: DSparkDraftConfig, params_dtype: Optional[torch.dtype]):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, hd)
        self.q_proj = ReplicatedLinear(d, self.num_heads * hd, params_dtype=params_dtype)
        self.k_proj = ReplicatedLinear(d, self.num_kv_heads * hd, params_dtype=params_dtype)
        self.v_proj = ReplicatedLinear(d, self.num_kv_heads * hd, params_dtype=params_dtype)
        self.o_proj = ReplicatedLinear(self.num_heads * hd, d, params_dtype=params_dtype)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps, params_dtype)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps, params_dtype)
        # Qwen3 rotates all head channels in the neox pairing (i, i + hd/2).
        self.rotary_emb = get_rope(hd, hd, config.max_position_embeddings, config.rope_theta,
                                   is_neox_style=True)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``ctx [T, d]`` (projected target states) -> ``k, v [T, kv_heads, head_dim]``."""
        t = ctx.shape[0]
        k = self.k_norm(self.k_proj(ctx).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(ctx).view(t, self.num_kv_heads, self.head_dim)
        # The rotary module rotates a (query, key) pair; the key is passed as both.
        _, k = self.rotary_emb(positions, k, k)
        return k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        """``x [B, g, d]`` (input-normed block), ``positions [B, g]``, ``ctx_k/v [B, W, kv, hd]``,
        ``ctx_valid [B, W]`` bool -> ``[B, g, d]``."""
        b, g, _ = x.shape
        h, kv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(self.q_proj(x).view(b * g, h, hd))
        k = self.k_norm(self.k_proj(x).view(b * g, kv, hd))
        v = self.v_proj(x).view(b, g, kv, hd)
        q, k = self.rotary_emb(positions.reshape(-1), q, k)
        keys = torch.cat([ctx_k.to(k.dtype), k.view(b, g, kv, hd)], dim=1)  # [B, W + g, kv, hd]
        values = torch.cat([ctx_v.to(v.dtype), v], dim=1)
        if h != kv:
            keys = keys.repeat_interleave(h // kv, dim=2)
            values = values.repeat_interleave(h // kv, dim=2)
        # Every block row is visible to every block query (non-causal block).
        block_valid = torch.ones(b, g, dtype=torch.bool, device=x.device)
        mask = torch.cat([ctx_valid, block_valid], dim=1)[:, None, None, :]
        o = F.scaled_dot_product_attention(q.view(b, g, h, hd).transpose(1, 2),
                                           keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=mask, scale=hd ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(b, g, h * hd))


class DSparkMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj x) * up_proj x)``."""

    def __init__(self, hidden: int, intermediate: int, params_dtype: Optional[torch.dtype]):
        super().__init__()
        self.gate_proj = ReplicatedLinear(hidden, intermediate, params_dtype=params_dtype)
        self.up_proj = ReplicatedLinear(hidden, intermediate, params_dtype=params_dtype)
        self.down_proj = ReplicatedLinear(intermediate, hidden, params_dtype=params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[.., d] -> [.., d]``."""
        return self.down_proj(silu_and_mul(torch.cat([self.gate_proj(x), self.up_proj(x)], -1)))


class DSparkDecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(input_layernorm(h))``, then
    ``h += mlp(post_attention_layernorm(h))``."""

    def __init__(self, config: DSparkDraftConfig, params_dtype: Optional[torch.dtype]):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, params_dtype)
        self.self_attn = DSparkAttention(config, params_dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, params_dtype)
        self.mlp = DSparkMLP(d, config.intermediate_size, params_dtype)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        """``h [B, g, d]`` -> the layer's output ``[B, g, d]``."""
        h = h + self.self_attn(self.input_layernorm(h), positions, ctx_k, ctx_v, ctx_valid)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Table(nn.Module):
    """An embedding table ``weight [rows, dim]`` looked up by index (the Markov ``W1``)."""

    def __init__(self, rows: int, dim: int, params_dtype: Optional[torch.dtype]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=params_dtype or
                                               torch.get_default_dtype()), requires_grad=False)
        self.weight.weight_loader = self._load

    @staticmethod
    def _load(param: nn.Parameter, loaded: LazyWeight, shard_id=None) -> None:
        copy_checked(param, param.data, loaded.load(), loaded.name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [...] -> [..., dim]``."""
        return F.embedding(ids, self.weight)


class DSparkMarkovHead(nn.Module):
    """Vanilla first-order head: ``bias(prev) = markov_w2(markov_w1[prev])`` (a rank-``r``
    factorisation of a ``V x V`` transition matrix)."""

    def __init__(self, vocab: int, rank: int, params_dtype: Optional[torch.dtype]):
        super().__init__()
        self.markov_w1 = _Table(vocab, rank, params_dtype)
        self.markov_w2 = ReplicatedLinear(rank, vocab, params_dtype=params_dtype)

    def forward(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """``prev_tokens [...]`` -> fp32 logit bias ``[..., V]``."""
        return self.markov_w2(self.markov_w1(prev_tokens)).float()


class DSparkConfidenceHead(nn.Module):
    """``proj``: Linear(d + r -> 1) with bias (or d -> 1 without the Markov feature)."""

    def __init__(self, in_features: int, params_dtype: Optional[torch.dtype]):
        super().__init__()
        self.proj = ReplicatedLinear(in_features, 1, bias=True, params_dtype=params_dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``features [..., in]`` -> fp32 logits ``[...]``."""
        return self.proj(features).squeeze(-1).float()


# ============================================================================================
# Outputs
# ============================================================================================
class MarkovDraft(NamedTuple):
    """Result of the sequential Markov loop over one block."""

    tokens: torch.Tensor  # [B, g] int64 draft tokens
    logits: torch.Tensor  # [B, g, V] fp32 Markov-corrected logits
    probs: Optional[torch.Tensor]  # [B, g, V] the distribution each token was drawn from
    prev_tokens: torch.Tensor  # [B, g] the Markov input of each slot: [anchor, tokens[:, :-1]]


class DSparkProposal(NamedTuple):
    """A whole draft pass: hidden states, Markov draft and confidence logits."""

    hidden: torch.Tensor  # [B, g, d] after the final norm
    base_logits: torch.Tensor  # [B, g, V] fp32, before the Markov correction
    draft: MarkovDraft
    confidence_logits: Optional[torch.Tensor]  # [B, g] fp32 (sigmoid -> c_k); None without head


# ============================================================================================
# The model
# ============================================================================================
class DSparkDraftModel(SharedEmbedAndHead, nn.Module):
    """DSpark draft (see the module docstring). Built from a :class:`DSparkDraftConfig`."""

    def __init__(self, config: DSparkDraftConfig, dtype: Optional[torch.dtype] = None):
        super().__init__()
        if not isinstance(config, DSparkDraftConfig):
            raise TypeError(f"DSparkDraftModel needs a DSparkDraftConfig, got {type(config)!r}")
        self.config = config
        self.dtype = dtype or torch.get_default_dtype()
        d = config.hidden_size
        self.layers = nn.ModuleList(DSparkDecoderLayer(config, self.dtype)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps, self.dtype)
        self.fc = ReplicatedLinear(config.context_input_size, d, params_dtype=self.dtype)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps, self.dtype)
        self.markov_head = DSparkMarkovHead(config.vocab_size, config.markov_rank, self.dtype)
        self.confidence_head = (DSparkConfidenceHead(config.confidence_input_size, self.dtype)
                                if config.enable_confidence_head else None)
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        # Plain dict: the target's tensors must not become parameters of the draft (dummy init,
        # the checkpoint spec and the memory count cover the draft's own weights only).
        self._shared: Dict[str, torch.Tensor] = {}
        tag_parameter_names(self)
        self._slots: Optional[Slots] = None

    @property
    def gamma(self) -> int:
        """Query slots per block = draft tokens per round."""
        return self.config.gamma

    # ---------------------------------------------------------------- sharing with the target
    # set_embed_and_head / get_embed_and_head (SharedEmbedAndHead): checkpoints may carry their
    # own embed_tokens / lm_head copies (DeepSpec saves the frozen target tensors with the
    # draft); they are skipped at load time and the target's are used instead, which saves
    # 2 x V x d of memory and cannot disagree with it.
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings from the target's table, ``ids [...] -> [..., d]`` in the draft dtype."""
        embed, _ = self.get_embed_and_head()
        return vocab_parallel_lookup(ids, embed, self.tp_rank * embed.shape[0],
                                     self.tp_size).to(self.dtype)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[..., V]`` of final-normed ``h`` through the target's LM head."""
        _, head = self.get_embed_and_head()
        logits = F.linear(h.to(head.dtype), head).float()
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., : self.config.vocab_size]  # padded rows of the last shard

    # ---------------------------------------------------------------- context
    def new_context_cache(self, num_slots: int, max_context: int,
                          device: Union[str, torch.device, None] = None) -> DSparkContextCache:
        """A zeroed :class:`DSparkContextCache` sized for this draft."""
        device = device if device is not None else self.fc.weight.device
        return DSparkContextCache(self.config.num_hidden_layers, num_slots, max_context,
                                  self.config.num_key_value_heads, self.config.head_dim,
                                  self.dtype, device)

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``target_hidden [T, m*d]`` (target layers' outputs, concatenated in
        ``target_layer_ids`` order) -> ``hidden_norm(fc(.)) [T, d]``."""
        width = self.config.context_input_size
        if target_hidden.dim() != 2 or target_hidden.shape[1] != width:
            raise ValueError(f"target_hidden must be [T, {width}] "
                             f"({self.config.num_context_features} target layers x hidden "
                             f"{self.config.hidden_size}), got {tuple(target_hidden.shape)}")
        return self.hidden_norm(self.fc(target_hidden.to(self.dtype)))

    def write_context(self, target_hidden: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, cache: DSparkContextCache) -> None:
        """Project ``target_hidden [T, m*d]`` and store every layer's context K/V for the tokens
        at ``positions [T]`` of the requests in ``slots [T]`` (``-1``: padding row)."""
        t = target_hidden.shape[0]
        if tuple(positions.shape) != (t,) or tuple(slots.shape) != (t,):
            raise ValueError(f"write_context: positions and slots must be [{t}], got "
                             f"{tuple(positions.shape)} and {tuple(slots.shape)}")
        ctx = self.project_context(target_hidden)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.context_kv(ctx, positions)
            cache.write(i, slots, positions, k, v)

    # ---------------------------------------------------------------- backbone
    def forward_block(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor,
                      cache: DSparkContextCache, slots: torch.Tensor, ctx_lens: torch.Tensor,
                      ctx_width: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The parallel backbone over ``[anchor, MASK x (gamma-1)]``.

        ``anchor_ids, anchor_pos, slots, ctx_lens [B]``: each request's anchor token and its
        position, its cache slot and how many context rows (positions ``0 .. ctx_len-1``) it
        sees. ``ctx_width`` (host int, default the cache's ``max_context``) bounds the rows read;
        it must be ``>= max(ctx_lens)``. Padding requests: ``ctx_len = 0`` (any slot).
        Returns ``(h [B, g, d], base_logits [B, g, V] fp32)``.
        """
        b, g = anchor_ids.shape[0], self.gamma
        for name, x in (("anchor_pos", anchor_pos), ("slots", slots), ("ctx_lens", ctx_lens)):
            if tuple(x.shape) != (b,):
                raise ValueError(f"forward_block: {name} must be [{b}], got {tuple(x.shape)}")
        width = cache.max_context if ctx_width is None else int(ctx_width)
        if not 0 <= width <= cache.max_context:
            raise ValueError(f"forward_block: ctx_width {width} must be in [0, "
                             f"{cache.max_context}]")
        dev = anchor_ids.device
        ids = torch.full((b, g), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchor_ids
        offsets = torch.arange(g, device=dev)
        positions = anchor_pos.long().unsqueeze(1) + offsets  # [B, g]
        ctx_valid = torch.arange(width, device=dev).unsqueeze(0) < ctx_lens.unsqueeze(1)
        h = self.embed(ids)
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v = cache.read(i, slots, width)
            h = layer(h, positions, ctx_k, ctx_v, ctx_valid)
        h = self.norm(h)
        return h, self.lm_logits(h)

    # ---------------------------------------------------------------- heads
    def markov_bias(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Markov logit bias ``W2 W1[prev] [..., V]`` (fp32) for previous tokens ``[...]``."""
        return self.markov_head(prev_tokens)

    def markov_draft(self, base_logits: torch.Tensor, anchor_ids: torch.Tensor,
                     temperatures: Optional[torch.Tensor] = None,
                     uniforms: Optional[torch.Tensor] = None,
                     generator: Optional[torch.Generator] = None,
                     pick: Optional[StepPicker] = None) -> MarkovDraft:
        """The sequential loop over the ``g`` slots: ``logits_k = U_k + W2 W1[prev]``, pick
        ``x_k``, ``prev = x_k`` (``prev`` starts at the anchor).

        The pick is ``pick(k, logits_k)`` when given; otherwise greedy (argmax) without
        ``temperatures``, and with ``temperatures [B]`` a draw from ``softmax(logits_k / T)`` by
        inverse CDF with ``uniforms[:, k]`` (``[B, g]`` in [0, 1); default ``torch.rand`` with
        ``generator``), rows with ``T <= 0`` greedy. ``probs`` is the distribution each token was
        drawn from (one-hot for greedy rows; ``None`` for an all-greedy call).
        """
        b, g, vocab = base_logits.shape
        if tuple(anchor_ids.shape) != (b,):
            raise ValueError(f"markov_draft: anchor_ids must be [{b}], got "
                             f"{tuple(anchor_ids.shape)}")
        if pick is None and temperatures is not None:
            if tuple(temperatures.shape) != (b,):
                raise ValueError(f"markov_draft: temperatures must be [{b}], got "
                                 f"{tuple(temperatures.shape)}")
            if uniforms is None:
                uniforms = torch.rand(b, g, generator=generator, device=base_logits.device)
            elif tuple(uniforms.shape) != (b, g):
                raise ValueError(f"markov_draft: uniforms must be [{b}, {g}], got "
                                 f"{tuple(uniforms.shape)}")
        prev = anchor_ids.long()
        tokens, logits, probs = [], [], []
        for k in range(g):
            corrected = base_logits[:, k].float() + self.markov_bias(prev)
            if pick is not None:
                tok, p = pick(k, corrected)
            elif temperatures is None:
                tok, p = corrected.argmax(dim=-1), None
            else:
                tok, p = _sample_at_temperature(corrected, temperatures, uniforms[:, k])
            tokens.append(tok.long())
            logits.append(corrected)
            probs.append(p)
            prev = tok.long()
        tokens_t = torch.stack(tokens, dim=1)
        probs_t = None if any(p is None for p in probs) else torch.stack(probs, dim=1)
        prev_tokens = torch.cat([anchor_ids.long().unsqueeze(1), tokens_t[:, :-1]], dim=1)
        return MarkovDraft(tokens_t, torch.stack(logits, dim=1), probs_t, prev_tokens)

    @property
    def has_confidence_head(self) -> bool:
        """Whether the checkpoint has a confidence head (``enable_confidence_head``)."""
        return self.confidence_head is not None

    def confidence(self, h: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Confidence logits ``[B, g]`` from ``h [B, g, d]`` and each slot's previous token
        ``prev_tokens [B, g]`` (the anchor, then the drafts); ``sigmoid`` gives ``c_k``."""
        if self.confidence_head is None:
            raise RuntimeError("this DSpark draft has no confidence head "
                               "(enable_confidence_head is false)")
        if h.shape[:-1] != prev_tokens.shape:
            raise ValueError(f"confidence: h {tuple(h.shape)} and prev_tokens "
                             f"{tuple(prev_tokens.shape)} must agree on [B, g]")
        feat = h.to(self.dtype)
        if self.config.confidence_head_with_markov:
            feat = torch.cat([feat, self.markov_head.markov_w1(prev_tokens.long())], dim=-1)
        return self.confidence_head(feat)

    def propose(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor,
                cache: DSparkContextCache, slots: torch.Tensor, ctx_lens: torch.Tensor,
                ctx_width: Optional[int] = None, **markov_kwargs: Any) -> DSparkProposal:
        """Backbone, Markov loop and confidence head in order (``markov_kwargs`` go to
        :meth:`markov_draft`)."""
        h, base = self.forward_block(anchor_ids, anchor_pos, cache, slots, ctx_lens, ctx_width)
        draft = self.markov_draft(base, anchor_ids, **markov_kwargs)
        conf = self.confidence(h, draft.prev_tokens) if self.has_confidence_head else None
        return DSparkProposal(h, base, draft, conf)

    # ---------------------------------------------------------------- weights
    def weight_slots(self) -> Slots:
        """Checkpoint name -> slot; module paths are the published names (all replicated)."""
        if self._slots is None:
            self._slots = {name: WeightSlot(tuple(p.shape), p)
                           for name, p in self.named_parameters()}
        return self._slots

    def checkpoint_spec(self) -> Dict[str, Tuple[int, ...]]:
        """Every tensor the draft loads, with its shape."""
        return {name: slot.shape for name, slot in self.weight_slots().items()}

    def canonical_checkpoint_name(self, name: str) -> Optional[str]:
        """Drop an optional ``model.`` prefix; ``None`` (skipped) for the embedding / LM head
        copies and rotary caches."""
        if name.startswith("model."):
            name = name[len("model."):]
        if name in ("embed_tokens.weight", "lm_head.weight") or name.endswith(
                "rotary_emb.inv_freq"):
            return None
        return name

    def load_weights(self, weights: Iterable[Tuple[str, Union[torch.Tensor, LazyWeight]]],
                     strict: bool = True) -> Set[str]:
        """Load ``(name, tensor or LazyWeight)`` pairs; returns the canonical names loaded.

        An unexpected or wrongly shaped tensor is an error naming it; with ``strict`` so is a
        parameter the pairs did not cover.
        """
        lazy = ((n, w if isinstance(w, LazyWeight) else LazyWeight.from_tensor(n, w))
                for n, w in weights)
        loaded = load_into_slots(self.weight_slots(), lazy, self.canonical_checkpoint_name)
        missing = sorted(set(self.weight_slots()) - loaded)
        if strict and missing:
            raise ValueError(f"DSpark draft checkpoint is missing {len(missing)} tensor(s): "
                             f"{', '.join(missing)}")
        return loaded


def _sample_at_temperature(logits: torch.Tensor, temperatures: torch.Tensor,
                           u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[B]`` from ``softmax(logits / T)`` with uniforms ``u [B]`` (argmax where
    ``T <= 0``) and the distribution each was drawn from (one-hot for greedy rows)."""
    greedy = temperatures <= 0
    t = torch.where(greedy, torch.ones_like(temperatures), temperatures).float()
    probs = torch.softmax(logits / t.unsqueeze(1), dim=-1)
    argmax = logits.argmax(dim=-1)
    tokens = torch.where(greedy, argmax, sample_from_probs(probs, u))
    one_hot = F.one_hot(argmax, logits.shape[-1]).to(probs.dtype)
    return tokens, torch.where(greedy.unsqueeze(1), one_hot, probs)


class LingDSparkModel(DSparkDraftModel):
    """Upstream's name for a DSpark draft of a Ling target (same model)."""


class Qwen3DSparkModel(DSparkDraftModel):
    """DeepSpec's name for a DSpark draft with Qwen3-style layers (same model)."""


EntryClass = [Qwen3DSparkModel, LingDSparkModel, DSparkDraftModel]


def load_dspark_draft(draft_path: str, target_config: Any, *, dtype: torch.dtype,
                      device: Union[str, torch.device], load_format: str = "auto",
                      block_size: Optional[int] = None, seed: int = 0) -> DSparkDraftModel:
    """Parse ``draft_path/config.json`` against the target, build the draft on ``device`` and
    fill it from the folder's safetensors (``load_format="auto"``; every missing, unexpected or
    mis-shaped tensor is reported by name) or with dummy weights (``"dummy"``, the target's
    initialiser). ``draft_path`` may name a draft preset (``configs/dspark.py``), which has no
    weights: only ``"dummy"`` loads it.

    The embedding and LM head still have to be shared with :meth:`set_embed_and_head`.
    """
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"DSpark draft: unknown load_format {load_format!r}")
    if is_dspark_preset(draft_path) and load_format != "dummy":
        raise ValueError(dspark_preset_needs_dummy(draft_path, load_format))
    config = DSparkDraftConfig.from_path(draft_path, target_config, block_size)
    from sglang.srt.models.registry import get_model_class  # the registry imports this module

    model_cls = get_model_class(config.architectures[0], is_draft=True)
    with torch.device(device):
        model = model_cls(config, dtype=dtype)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_safetensors_weights(model, draft_path)
    return model.eval()
