"""The MTP (NEXTN) draft layer of BailingMoeV3, ``model.layers.{num_hidden_layers}``
(docs/model.md §6.1).

Given the target's final-normed hidden state ``h_t`` and the next token ``x_{t+1}``:
``u = eh_proj([enorm(embed(x_{t+1})) ‖ hnorm(h_t)])``, one MLA + MoE block (own MLA cache rows,
layer id ``num_hidden_layers``; no SwiGLU clamp), ``out = final_layernorm(u)``, logits from the
target's LM head. ``out`` is returned as the hidden state for chaining further draft steps.

The embedding and the LM head are the target's (``set_embed_and_head``); they are held as plain
tensors, not registered parameters, so the draft's parameters, dummy init and checkpoint spec
cover only its own layer.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Set, Tuple

import torch
from torch import nn

from sglang.srt.configs.bailing_moe_v3 import BailingMoeV3Config
from sglang.srt.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.vocab_parallel_embedding import (
    SharedEmbedAndHead,
    vocab_parallel_lookup,
)
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
from sglang.srt.model_loader.weight_utils import LazyWeight
from sglang.srt.models.bailing_moe_v3 import BailingMoeV3DecoderLayer, make_rope
from sglang.srt.models.weight_slots import (
    Slots,
    canonical_alias,
    linear_slot,
    load_into_slots,
    norm_slot,
    tag_parameter_names,
)

__all__ = ["BailingMoeNextNModel", "BailingMoeForCausalLMNextN", "EntryClass"]


class BailingMoeNextNModel(nn.Module):
    """The MTP layer's own modules (SGLang layout: ``enorm``, ``hnorm``, ``eh_proj``, ``decoder``,
    ``final_layernorm``)."""

    def __init__(self, config: BailingMoeV3Config, params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps, params_dtype)
        self.hnorm = RMSNorm(hidden, eps, params_dtype)
        # Small (H x 2H) and needed whole by every rank: replicated.
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, params_dtype=params_dtype)
        self.decoder = BailingMoeV3DecoderLayer(config, config.mtp_layer_id, make_rope(config),
                                                params_dtype, is_nextn=True)
        self.final_layernorm = RMSNorm(hidden, eps, params_dtype)


class BailingMoeForCausalLMNextN(SharedEmbedAndHead, nn.Module):
    """Draft model over the MTP layer; ``forward(..., hidden_states)`` -> logits + hidden states."""

    def __init__(self, config: BailingMoeV3Config, dtype: Optional[torch.dtype] = None):
        super().__init__()
        if config.num_nextn_predict_layers != 1:
            raise ValueError("BailingMoeForCausalLMNextN needs num_nextn_predict_layers == 1, got "
                             f"{config.num_nextn_predict_layers}")
        self.config = config
        self.dtype = dtype or torch.get_default_dtype()
        self.layer_id = config.mtp_layer_id
        self.model = BailingMoeNextNModel(config, self.dtype)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        # Plain dict: the target's tensors must not become parameters of the draft.
        self._shared: Dict[str, torch.Tensor] = {}
        tag_parameter_names(self)
        self._slots: Optional[Slots] = None

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch, hidden_states: torch.Tensor) -> LogitsProcessorOutput:
        """``hidden_states [T, hidden]``: the target's final-normed hidden states, row-aligned with
        ``input_ids`` (token ``t+1`` paired with ``h_t``).

        The output's ``hidden_states`` is the ``final_layernorm`` output per
        ``forward_batch.capture_hidden_mode`` (NULL is treated as FULL: a draft always returns it).
        """
        embed, head = self.get_embed_and_head()
        if hidden_states.dim() != 2 or hidden_states.shape != (input_ids.shape[0],
                                                               self.config.hidden_size):
            raise ValueError(f"NextN: hidden_states must be [{input_ids.shape[0]}, "
                             f"{self.config.hidden_size}], got {tuple(hidden_states.shape)}")
        m = self.model
        e = vocab_parallel_lookup(input_ids, embed, self.tp_rank * embed.shape[0], self.tp_size)
        x = torch.cat([m.enorm(e.to(self.dtype)), m.hnorm(hidden_states.to(self.dtype))], dim=-1)
        h, residual = m.decoder(positions, m.eh_proj(x), None, forward_batch)
        out, _ = m.final_layernorm(h, residual)
        capture = forward_batch.capture_hidden_mode
        if capture == CaptureHiddenMode.NULL:
            capture = CaptureHiddenMode.FULL
        return self.logits_processor(out, head, forward_batch, capture_hidden_mode=capture)

    # ---------------------------------------------------------------- weights
    def weight_slots(self) -> Slots:
        """Checkpoint name -> slot for the MTP layer's own tensors (built once)."""
        if self._slots is None:
            p, m = f"model.layers.{self.layer_id}.", self.model
            slots: Slots = {}
            slots.update(norm_slot(f"{p}enorm.weight", m.enorm))
            slots.update(norm_slot(f"{p}hnorm.weight", m.hnorm))
            slots.update(linear_slot(f"{p}eh_proj.weight", m.eh_proj))
            slots.update(m.decoder.weight_slots(p))
            slots.update(norm_slot(f"{p}final_layernorm.weight", m.final_layernorm))
            self._slots = slots
        return self._slots

    def checkpoint_spec(self) -> Dict[str, Tuple[int, ...]]:
        """Only ``model.layers.{N}.*`` (embedding and LM head come from the target)."""
        return {name: slot.shape for name, slot in self.weight_slots().items()}

    def canonical_checkpoint_name(self, name: str) -> Optional[str]:
        """Canonical name for tensors of the MTP layer; ``None`` for everything else."""
        if not name.startswith(f"model.layers.{self.layer_id}."):
            return None
        return canonical_alias(name)

    def load_weights(self, weights: Iterable[Tuple[str, LazyWeight]]) -> Set[str]:
        """Load the MTP layer's tensors (other names are skipped); returns the names loaded."""
        return load_into_slots(self.weight_slots(), weights, self.canonical_checkpoint_name)


EntryClass = [BailingMoeForCausalLMNextN]
