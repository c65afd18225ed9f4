"""BailingMoeV3ForCausalLM (Ling-3.0): KDA linear attention + gated MLA + grouped-top-k MoE.

The math is docs/model.md §3 (KDA), §4 (MLA in absorbed form), §5 (MoE); checkpoint names
are §2.1. Every layer is tensor-parallel by heads (attention) or by the intermediate dim (MLPs,
experts), with the TP rank/size read when the model is built.

Weight loading goes through a table of :class:`~sglang.srt.models.weight_slots.WeightSlot`
(checkpoint name -> full shape and the parameter whose ``weight_loader`` takes it), built from the
modules themselves, so the name list of :meth:`BailingMoeV3ForCausalLM.checkpoint_spec` and the
loader cannot disagree.
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from sglang.srt.configs.bailing_moe_v3 import BailingMoeV3Config
from sglang.srt.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from sglang.srt.layers.activation import SigmoidHeadGate
from sglang.srt.layers.attention.kda_ops import KDAGate
from sglang.srt.layers.layernorm import GatedRMSNorm, RMSNorm
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    copy_checked,
    normal_dummy_init,
)
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.moe.moe_layer import BailingMLP, BailingMoE
from sglang.srt.layers.radix_attention import RadixAttention, RadixLinearAttention
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, get_rope
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_loader.weight_utils import LazyWeight
from sglang.srt.models.weight_slots import (
    Slots,
    WeightSlot,
    canonical_alias,
    linear_slot,
    load_into_slots,
    merged_slots,
    mlp_slots,
    moe_slots,
    norm_slot,
    tag_parameter_names,
)

__all__ = [
    "BailingKDA",
    "BailingMLA",
    "BailingMoeV3DecoderLayer",
    "BailingMoeV3Model",
    "BailingMoeV3ForCausalLM",
    "EntryClass",
    "set_kda_norm_in_o_proj",
]


def _fp32_vector(n: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)


def _uniform_dummy_init(low: float, high: float, log: bool = False):
    """``dummy_init`` hook: U(low, high), or log of it."""

    def init(tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill ``tensor`` in place."""
        u = torch.rand(tensor.shape, generator=generator, device=generator.device,
                       dtype=torch.float64) * (high - low) + low
        with torch.no_grad():
            tensor.copy_(u.log() if log else u)

    return init


# ============================================================================================
# KDA (docs/model.md §3)
# ============================================================================================

# Decode / verify row counts whose KDA output norm runs inside o_proj's small-M GEMM (the GEMM's
# own bound, sgl_kernel.small_m_gemm.SMALL_M_MAX_ROWS; kept here so CPU builds never import triton).
_SMALL_M_ROWS = 64

class BailingKDA(nn.Module):
    """Kimi Delta Attention with a full-rank forget gate and a sigmoid-gated output norm.

    The six input projections run as one column-parallel matmul (``fused_qkvbfg_proj``, per-head
    shards of q|k|v|b|f|g); the short convolution and the recurrence live in the backend
    (:class:`RadixLinearAttention`), which owns the per-request conv window and state.
    """

    def __init__(self, config: BailingMoeV3Config, layer_id: int,
                 params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.total_num_heads = config.num_attention_heads
        self.num_heads = divide(self.total_num_heads, tp, "num_attention_heads")
        self.head_dim = config.head_dim
        hd = self.total_num_heads * self.head_dim
        self.fused_qkvbfg_proj = MergedColumnParallelLinear(
            config.hidden_size, [hd, hd, hd, self.total_num_heads, hd, hd],
            params_dtype=params_dtype)
        local = self.num_heads * self.head_dim
        self.A_log = _fp32_vector(self.num_heads)
        self.A_log.weight_loader = self._load_head_vector
        self.A_log.dummy_init = _uniform_dummy_init(1.0, 16.0, log=True)
        self.dt_bias = _fp32_vector(local)
        self.dt_bias.weight_loader = self._load_head_vector
        self.dt_bias.dummy_init = _uniform_dummy_init(-0.1, 0.1)
        self.o_norm = GatedRMSNorm(self.head_dim, config.rms_norm_eps, "sigmoid", params_dtype)
        self.o_proj = RowParallelLinear(hd, config.hidden_size, params_dtype=params_dtype)
        # KDA's output norm inside o_proj's loads at decode / verify sizes (with the small-M
        # GEMM); set for the whole model by set_kda_norm_in_o_proj.
        self.norm_in_o_proj = False
        self.attn = RadixLinearAttention(layer_id, self.num_heads, self.head_dim,
                                         config.short_conv_kernel_size)
        conv = self.attn.conv_weight
        conv.data = conv.data.to(params_dtype or torch.get_default_dtype())
        conv.weight_loader = self._load_conv
        self.lower_bound = config.kda_lower_bound if config.kda_safe_gate else None

    def _load_head_vector(self, param: nn.Parameter, loaded: LazyWeight, shard_id=None) -> None:
        """A_log / dt_bias: this rank's contiguous block of a per-head (or per-channel) vector.

        Any stored layout with the right element count is accepted (Kimi keeps A_log as
        ``[1, 1, H, 1]``); such tiny tensors are read whole and flattened.
        """
        n = param.numel()
        full = n * get_tensor_model_parallel_world_size()
        numel = 1
        for s in loaded.shape:
            numel *= s
        if numel != full:
            raise ValueError(f"{loaded.name}: expected {full} elements, got shape {loaded.shape}")
        if len(loaded.shape) == 1:
            src = loaded.narrow(0, self.tp_rank * n, n)
        else:
            src = loaded.load().reshape(-1).narrow(0, self.tp_rank * n, n)
        copy_checked(param, param.data, src, loaded.name)

    def _load_conv(self, param: nn.Parameter, loaded: LazyWeight, shard_id: int) -> None:
        """``{q,k,v}_conv1d.weight [H*D, 1, K]`` -> rows of block ``shard_id`` (q|k|v), per-head shard."""
        local = self.num_heads * self.head_dim
        full = self.total_num_heads * self.head_dim
        kernel = param.shape[1]
        if loaded.shape not in ((full, 1, kernel), (full, kernel)):
            raise ValueError(f"{loaded.name}: expected ({full}, 1, {kernel}), got {loaded.shape}")
        src = loaded.narrow(0, self.tp_rank * local, local).reshape(local, kernel)
        copy_checked(param, param.data.narrow(0, shard_id * local, local), src, loaded.name)

    def weight_slots(self, prefix: str) -> Slots:
        """Checkpoint names under ``prefix`` (``...attention.``)."""
        full = self.total_num_heads * self.head_dim
        kernel = self.attn.conv_kernel
        slots = merged_slots(prefix, ("q_proj", "k_proj", "v_proj", "b_proj", "f_proj", "g_proj"),
                              self.fused_qkvbfg_proj)
        for i, n in enumerate(("q_conv1d", "k_conv1d", "v_conv1d")):
            slots[f"{prefix}{n}.weight"] = WeightSlot((full, 1, kernel), self.attn.conv_weight, i)
        slots[f"{prefix}A_log"] = WeightSlot((self.total_num_heads,), self.A_log)
        slots[f"{prefix}dt_bias"] = WeightSlot((full,), self.dt_bias)
        slots.update(norm_slot(f"{prefix}o_norm.weight", self.o_norm))
        slots.update(linear_slot(f"{prefix}o_proj.weight", self.o_proj))
        return slots

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        """``x [T, hidden]`` (input-normed) -> ``[T, hidden]`` after the all-reduce in o_proj."""
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        q, k, v, b, f, z = self.fused_qkvbfg_proj.split_output(self.fused_qkvbfg_proj(x))
        # The decay and beta are formed by the backend from their raw inputs (a kernel backend
        # as it loads them); q, k, v stay views of the projection output.
        gate = KDAGate(f, b, self.A_log, self.dt_bias, self.lower_bound)
        o = self.attn(q, k, v, None, None, forward_batch, gate=gate)  # [T, h, d]
        if self.norm_in_o_proj and self.o_proj.small_m_gemm and t <= _SMALL_M_ROWS:
            from sgl_kernel.small_m_gemm import GatedNormPrologue  # norm inside o_proj's loads

            norm = self.o_norm
            return self.o_proj(o.reshape(t, h * d), gated_norm=GatedNormPrologue(
                z, norm.weight, norm.variance_epsilon, d, norm.activation))
        o = self.o_norm(o, z.view(t, h, d))
        return self.o_proj(o.reshape(t, h * d))


def set_kda_norm_in_o_proj(model: nn.Module, on: bool) -> bool:
    """Run every :class:`BailingKDA` layer's output norm inside its o_proj's loads (``on``; the
    small-M GEMM's gated-norm prologue, at decode / verify sizes) or as its own launch before a
    plain o_proj (``KernelChoices.kda_norm_in_o_proj``: its own launch measured faster in CUDA
    graphs, docs/performance.md); returns ``on``."""
    for module in model.modules():
        if isinstance(module, BailingKDA):
            module.norm_in_o_proj = bool(on)
    return bool(on)


def set_mla_absorb_gemv(model: nn.Module, on: bool) -> bool:
    """Run every :class:`BailingMLA` layer's absorbed per-head products as grouped mat-vecs
    (``on``: batch-invariant, ``KernelChoices.mla_absorb_gemv``) or through ``torch.bmm``;
    returns ``on``."""
    for module in model.modules():
        if isinstance(module, BailingMLA):
            module.absorb_gemv = bool(on)
    return bool(on)


# ============================================================================================
# MLA (docs/model.md §4), absorbed form for prefill and decode alike
# ============================================================================================
class BailingMLA(nn.Module):
    """Multi-head latent attention with a head-wise sigmoid output gate.

    ``kv_b_proj`` is never kept whole: its loader splits each head's block into
    ``w_kc [h, qk_nope, kv_lora_rank]`` (W_UK, absorbed into the query) and
    ``w_vc [h, kv_lora_rank, v_head_dim]`` (W_UV^T, applied to the latent output).
    """

    def __init__(self, config: BailingMoeV3Config, layer_id: int, rope: RotaryEmbedding,
                 params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        dtype = params_dtype or torch.get_default_dtype()
        hidden = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        self.num_heads = divide(self.total_num_heads, tp, "num_attention_heads")
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        qk_total = self.total_num_heads * config.qk_head_dim
        # The three projections of the layer's input (the query's, or its low-rank first half;
        # the latent with the shared rope key; the head gate) as one matmul: q and the gate are
        # split per head, the latent is needed whole on every rank.
        q_in = self.q_lora_rank or qk_total
        self.fused_qkv_a_g_proj = MergedColumnParallelLinear(
            hidden, [q_in, self.kv_lora_rank + self.qk_rope_head_dim, self.total_num_heads],
            params_dtype=dtype, replicated=[bool(self.q_lora_rank), True, False])
        if self.q_lora_rank:
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps, dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, qk_total, params_dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps, dtype)
        h = self.num_heads
        self.w_kc = nn.Parameter(torch.empty(h, self.qk_nope_head_dim, self.kv_lora_rank,
                                             dtype=dtype), requires_grad=False)
        self.w_vc = nn.Parameter(torch.empty(h, self.kv_lora_rank, self.v_head_dim, dtype=dtype),
                                 requires_grad=False)
        self.w_kc.weight_loader = self._load_kv_b
        self.w_vc.dummy_init = normal_dummy_init(self.kv_lora_rank)
        self.head_gate = SigmoidHeadGate()
        self.dense = RowParallelLinear(self.total_num_heads * self.v_head_dim, hidden,
                                       params_dtype=dtype)
        self.rotary_emb = rope
        self.attn = RadixAttention(layer_id, h, self.kv_lora_rank, self.qk_rope_head_dim,
                                   scaling=config.qk_head_dim ** -0.5)
        # set_mla_absorb_gemv: the absorbed products as grouped mat-vecs over copies of w_kc /
        # w_vc with rows along the reduced dim (made at the first such forward, after loading).
        self.absorb_gemv = False
        self._absorb_rows: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def _load_kv_b(self, param: nn.Parameter, loaded: LazyWeight, shard_id=None) -> None:
        """``kv_b_proj.weight [H*(nope+v), r]``: this rank's heads, split into w_kc and w_vc."""
        per_head = self.qk_nope_head_dim + self.v_head_dim
        full = (self.total_num_heads * per_head, self.kv_lora_rank)
        if tuple(loaded.shape) != full:
            raise ValueError(f"{loaded.name}: expected {full}, got {loaded.shape}")
        h = self.num_heads
        blocks = loaded.narrow(0, self.tp_rank * h * per_head, h * per_head)
        blocks = blocks.reshape(h, per_head, self.kv_lora_rank)
        copy_checked(self.w_kc, self.w_kc.data, blocks[:, : self.qk_nope_head_dim], loaded.name)
        copy_checked(self.w_vc, self.w_vc.data,
                     blocks[:, self.qk_nope_head_dim:].transpose(1, 2), loaded.name)

    def weight_slots(self, prefix: str) -> Slots:
        """Checkpoint names under ``prefix`` (``...attention.``)."""
        q_name = "q_a_proj" if self.q_lora_rank else "q_proj"
        slots = merged_slots(prefix, (q_name, "kv_a_proj_with_mqa", "g_proj"),
                             self.fused_qkv_a_g_proj)
        if self.q_lora_rank:
            slots.update(norm_slot(f"{prefix}q_a_layernorm.weight", self.q_a_layernorm))
            slots.update(linear_slot(f"{prefix}q_b_proj.weight", self.q_b_proj))
        slots.update(norm_slot(f"{prefix}kv_a_layernorm.weight", self.kv_a_layernorm))
        per_head = self.qk_nope_head_dim + self.v_head_dim
        slots[f"{prefix}kv_b_proj.weight"] = WeightSlot(
            (self.total_num_heads * per_head, self.kv_lora_rank), self.w_kc)
        slots.update(linear_slot(f"{prefix}dense.weight", self.dense))
        return slots

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        """``x [T, hidden]`` (input-normed) -> ``[T, hidden]`` after the all-reduce in dense.

        Attention runs in absorbed form (docs/model.md §4.3), or in normal form (§4.1) when the
        backend picks it for this batch (long prefills: ``RadixAttention.use_normal_form``).
        Both write the same cache rows, so the decode that follows does not depend on the form.
        """
        t, h = x.shape[0], self.num_heads
        fused = self.fused_qkv_a_g_proj
        q, kv_a, g = fused.split_output(fused(x))
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_rope = q.reshape(t, h, -1).split([self.qk_nope_head_dim,
                                                    self.qk_rope_head_dim], -1)
        latent, k_rope = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        latent = self.kv_a_layernorm(latent)
        if self.attn.use_normal_form(forward_batch):
            o = self._attend_normal(positions, q_nope, q_rope, latent, k_rope, forward_batch)
        else:
            o = self._attend_absorbed(positions, q_nope, q_rope, latent, k_rope, forward_batch)
        o = self.head_gate(o, g)  # one sigmoid scalar per head
        return self.dense(o.reshape(t, h * self.v_head_dim))

    def _attend_absorbed(self, positions: torch.Tensor, q_nope: torch.Tensor,
                         q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                         forward_batch: ForwardBatch) -> torch.Tensor:
        """Absorbed form: W_UK folded into the query, W_UV applied to the latent output.
        Returns head outputs ``[T, h, v]``."""
        if not self.absorb_gemv:
            q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_kc).transpose(0, 1)  # [T, h, r]
            q, k = self.rotary_emb.assemble_mla(positions, q_latent, q_rope, latent, k_rope)
            o_latent = self.attn(q, k, forward_batch)
            return torch.bmm(o_latent.transpose(0, 1), self.w_vc).transpose(0, 1)  # [T, h, v]
        t, h = q_nope.shape[:2]
        heads = torch.arange(h, device=q_nope.device).repeat(t)  # (token, head) -> head's weight
        q_latent = self._per_head_gemv(q_nope, 0, heads)
        q, k = self.rotary_emb.assemble_mla(positions, q_latent, q_rope, latent, k_rope)
        o_latent = self.attn(q, k, forward_batch)
        return self._per_head_gemv(o_latent, 1, heads)

    def _per_head_gemv(self, x: torch.Tensor, which: int, heads: torch.Tensor) -> torch.Tensor:
        """``x[t, i] @ W[i]`` for every (token, head) of ``x [T, h, d]`` as one grouped mat-vec
        (``W`` = ``w_kc`` for ``which`` 0, ``w_vc`` for 1; ``heads [T * h]``: each row's head):
        each row's sum runs in an order set by the weight's shape alone, so a token rounds alike
        in a decode and in a verify."""
        from sgl_kernel.grouped_gemv import grouped_gemv

        if self._absorb_rows is None:
            self._absorb_rows = (self.w_kc.data.transpose(1, 2).contiguous(),
                                 self.w_vc.data.transpose(1, 2).contiguous())
        t, h, d = x.shape
        out = grouped_gemv(x.reshape(t * h, d).contiguous(), self._absorb_rows[which], heads)
        return out.view(t, h, -1)

    def _attend_normal(self, positions: torch.Tensor, q_nope: torch.Tensor,
                       q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                       forward_batch: ForwardBatch) -> torch.Tensor:
        """Normal form: per-head ``q = [q_nope ‖ rope(q_rope)]``; the backend expands the cache
        rows into keys and values with w_kc / w_vc. Returns head outputs ``[T, h, v]``."""
        # q [T, h, qk_nope + qk_rope] and the cache rows k [T, kv_lora_rank + qk_rope] as the
        # absorbed path assembles them (one launch with KernelChoices.mla_rope, else torch; the
        # two agree bit for bit), so the decode that follows reads the same cache rows.
        q, k = self.rotary_emb.assemble_mla(positions, q_nope, q_rope, latent, k_rope)
        return self.attn.forward_normal(q, k, self.w_kc, self.w_vc, forward_batch)


# ============================================================================================
# Decoder layer and model
# ============================================================================================
class BailingMoeV3DecoderLayer(nn.Module):
    """Pre-norm block: attention (KDA or MLA) then MLP (dense or MoE), residuals fused into norms.

    ``is_nextn`` builds the MTP layer's block: MLA + MoE, no SwiGLU clamp (docs/model.md §5.4,
    §6.1).
    """

    def __init__(self, config: BailingMoeV3Config, layer_id: int, rope: RotaryEmbedding,
                 params_dtype: Optional[torch.dtype] = None, is_nextn: bool = False):
        super().__init__()
        self.layer_id = layer_id
        self.is_kda = not is_nextn and config.is_kda_layer(layer_id)
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, params_dtype)
        self.attention = (BailingKDA(config, layer_id, params_dtype) if self.is_kda
                          else BailingMLA(config, layer_id, rope, params_dtype))
        self.post_attention_layernorm = RMSNorm(hidden, eps, params_dtype)
        self.is_moe = is_nextn or config.is_moe_layer(layer_id)
        if self.is_moe:
            expert_limit = 0.0 if is_nextn else config.expert_swiglu_limit(layer_id)
            shared_limit = 0.0 if is_nextn else config.shared_expert_swiglu_limit(layer_id)
            self.mlp = BailingMoE(
                hidden, config.num_experts, config.num_experts_per_tok,
                config.moe_intermediate_size, config.shared_expert_intermediate_size,
                config.n_group, config.topk_group, config.norm_topk_prob,
                config.routed_scaling_factor, config.moe_router_enable_expert_bias,
                config.router_dtype, expert_limit, shared_limit, params_dtype)
        else:
            self.mlp = BailingMLP(hidden, config.intermediate_size, params_dtype=params_dtype)

    def weight_slots(self, prefix: str) -> Slots:
        """Checkpoint names under ``prefix`` (``model.layers.{i}.``)."""
        slots = norm_slot(f"{prefix}input_layernorm.weight", self.input_layernorm)
        slots.update(norm_slot(f"{prefix}post_attention_layernorm.weight",
                                self.post_attention_layernorm))
        slots.update(self.attention.weight_slots(f"{prefix}attention."))
        if self.is_moe:
            slots.update(moe_slots(f"{prefix}mlp.", self.mlp))
        else:
            slots.update(mlp_slots(f"{prefix}mlp.", self.mlp))
        return slots

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: Optional[torch.Tensor],
                forward_batch: ForwardBatch) -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual stream)``; their sum is the layer's output."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.attention(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def make_rope(config: BailingMoeV3Config) -> RotaryEmbedding:
    """The one RoPE of all MLA layers: rope dims only, ``partial_rotary_factor`` ignored (§4.2)."""
    return get_rope(config.qk_rope_head_dim, config.qk_rope_head_dim,
                    config.max_position_embeddings, config.rope_theta,
                    is_neox_style=not config.rope_interleave, rope_scaling=config.rope_scaling)


class BailingMoeV3Model(nn.Module):
    """Embedding, decoder layers and the final norm (HF ``model.*``).

    ``layers_to_capture`` (empty by default, set through
    :meth:`BailingMoeV3ForCausalLM.set_dspark_layers_to_capture`) lists decoder layers whose
    outputs :meth:`forward_with_aux` also returns.
    """

    def __init__(self, config: BailingMoeV3Config, params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.config = config
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                      params_dtype)
        rope = make_rope(config)
        self.layers = nn.ModuleList(
            BailingMoeV3DecoderLayer(config, i, rope, params_dtype)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype)
        self.layers_to_capture: Tuple[int, ...] = ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]``."""
        return self.forward_with_aux(input_ids, positions, forward_batch)[0]

    def forward_with_aux(self, input_ids: torch.Tensor, positions: torch.Tensor,
                         forward_batch: ForwardBatch
                         ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(final-normed hidden [T, hidden], aux [T, m * hidden] or None)``.

        ``aux`` concatenates, in ``layers_to_capture`` order, the raw residual stream after
        each listed layer (the layer's output ``mlp out + residual``, not normed): what a DSpark
        draft was trained on. ``None`` when nothing is captured.
        """
        capture = self.layers_to_capture
        captured: Dict[int, torch.Tensor] = {}
        hidden_states, residual = self.word_embeddings(input_ids), None
        for i, layer in enumerate(self.layers):
            hidden_states, residual = layer(positions, hidden_states, residual, forward_batch)
            if capture and i in capture:
                captured[i] = hidden_states + residual
        final = self.norm(hidden_states, residual)[0]  # the config guarantees >= 1 layer
        if not capture:
            return final, None
        return final, torch.cat([captured[i] for i in capture], dim=-1)


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class BailingMoeV3ForCausalLM(nn.Module):
    """The Ling-3.0 target model: ``forward(input_ids, positions, forward_batch)`` -> logits."""

    def __init__(self, config: BailingMoeV3Config, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.config = config
        self.dtype = dtype or torch.get_default_dtype()
        self.model = BailingMoeV3Model(config, self.dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, self.dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.word_embeddings.weight
        self.logits_processor = LogitsProcessor(config.vocab_size)
        tag_parameter_names(self)
        self._slots: Optional[Slots] = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """fp32 logits per the forward mode; hidden states per ``capture_hidden_mode``; the
        captured layers' outputs (every token) in ``aux_hidden_states`` when set."""
        hidden_states, aux = self.model.forward_with_aux(input_ids, positions, forward_batch)
        return self.logits_processor(hidden_states, self.lm_head, forward_batch,
                                     aux_hidden_states=aux)

    # ---------------------------------------------------------------- DSpark context
    def set_dspark_layers_to_capture(self, layer_ids: Optional[Sequence[int]]) -> None:
        """Also return the outputs of decoder layers ``layer_ids`` (0-based, "after layer l",
        the draft config's ``target_layer_ids``) for every token, concatenated in this order
        as ``aux_hidden_states [T, len(layer_ids) * hidden]``. ``None`` or empty switches it
        off (the default; then nothing extra is computed). Set once, before any CUDA graph is
        captured: the choice is part of the traced forward."""
        ids = tuple(layer_ids or ())
        n = self.config.num_hidden_layers
        for i, layer in enumerate(ids):
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
                raise ValueError(f"set_dspark_layers_to_capture: layer_ids[{i}] = {layer!r} "
                                 f"is not a decoder layer of this {n}-layer target (0..{n - 1})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"set_dspark_layers_to_capture: layer_ids {list(ids)} repeat a "
                             "layer")
        self.model.layers_to_capture = ids

    @property
    def dspark_layers_to_capture(self) -> Tuple[int, ...]:
        """The captured layers (empty when off)."""
        return self.model.layers_to_capture

    # ---------------------------------------------------------------- draft sharing
    def get_embed_and_head(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's shards of the token embedding and the LM head (shared with drafts)."""
        return self.model.word_embeddings.weight, self.lm_head.weight

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        """Replace the embedding and LM head with tensors of the same (local) shapes."""
        for module, w in ((self.model.word_embeddings, embed), (self.lm_head, head)):
            if tuple(w.shape) != tuple(module.weight.shape):
                raise ValueError(f"set_embed_and_head: expected {tuple(module.weight.shape)}, "
                                 f"got {tuple(w.shape)}")
            del module.weight
            module.weight = w if isinstance(w, nn.Parameter) else nn.Parameter(
                w, requires_grad=False)
            if not hasattr(module.weight, "weight_loader"):
                module.weight.weight_loader = module.weight_loader
        self._slots = None  # the table points at the replaced parameters

    # ---------------------------------------------------------------- weights
    def weight_slots(self) -> Slots:
        """Checkpoint name -> slot for every tensor this model loads (built once)."""
        if self._slots is None:
            m = self.model
            slots: Slots = {"model.word_embeddings.weight": WeightSlot(
                (self.config.vocab_size, self.config.hidden_size), m.word_embeddings.weight)}
            for i, layer in enumerate(m.layers):
                slots.update(layer.weight_slots(f"model.layers.{i}."))
            slots.update(norm_slot("model.norm.weight", m.norm))
            if not self.config.tie_word_embeddings:
                slots["lm_head.weight"] = WeightSlot(
                    (self.config.vocab_size, self.config.hidden_size), self.lm_head.weight)
            self._slots = slots
        return self._slots

    def checkpoint_spec(self) -> Dict[str, Tuple[int, ...]]:
        """Every checkpoint tensor the target consumes, with its full unsharded shape."""
        return {name: slot.shape for name, slot in self.weight_slots().items()}

    def canonical_checkpoint_name(self, name: str) -> Optional[str]:
        """Canonical spec name of a checkpoint tensor, or ``None`` to skip it silently (rotary
        caches, the MTP layer ``model.layers.{N}.*`` and beyond, a tied ``lm_head``)."""
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) >= self.config.num_hidden_layers:
            return None
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return None
        return canonical_alias(name)

    def load_weights(self, weights: Iterable[Tuple[str, LazyWeight]]) -> Set[str]:
        """Load ``(name, LazyWeight)`` pairs (raw or canonical names); returns the names loaded.

        Nothing needs post-processing: ``kv_b_proj`` is split into ``w_kc``/``w_vc`` as it loads.
        """
        return load_into_slots(self.weight_slots(), weights, self.canonical_checkpoint_name)


EntryClass = [BailingMoeV3ForCausalLM]
