"""Final-norm hidden states -> fp32 next-token logits (and the hidden states drafts consume).

Row selection, without any host sync (lengths stay on the device):

* DECODE: every row is the last (and only) token of its request -> ``[B, V]``;
* TARGET_VERIFY, or ``forward_batch.return_full_logits``: every token -> ``[T, V]``;
* otherwise (EXTEND, DRAFT_EXTEND): the last token of each request, at
  ``extend_start_loc + extend_seq_lens - 1`` -> ``[B, V]``.

``hidden_states`` of the output follows ``forward_batch.capture_hidden_mode`` (FULL: ``[T, H]``,
LAST: ``[B, H]``, NULL: ``None``) and is the model's final-normed hidden state, which is what the
MTP draft layer consumes.

``aux_hidden_states`` is passed through untouched: the raw outputs of selected decoder layers for
every token ``[T, m * H]`` (a DSpark draft's context), ``None`` unless the model captures them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from sglang.srt.distributed import (
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
)
from sglang.srt.layers.linear import linear
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch

__all__ = ["LogitsProcessorOutput", "LogitsProcessor", "last_token_indices"]


@dataclass
class LogitsProcessorOutput:
    """``next_token_logits`` fp32 ``[B or T, vocab_size]``; ``hidden_states`` per capture mode;
    ``aux_hidden_states [T, m * H]`` when the model captures decoder-layer outputs."""

    next_token_logits: torch.Tensor
    hidden_states: Optional[torch.Tensor] = None
    aux_hidden_states: Optional[torch.Tensor] = None


def last_token_indices(forward_batch: ForwardBatch) -> torch.Tensor:
    """Row of each request's last new token in the flattened ``[T]`` batch (device tensor)."""
    return forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1


def _wants_all_rows(forward_batch: ForwardBatch) -> bool:
    return forward_batch.return_full_logits or forward_batch.forward_mode.is_target_verify()


class LogitsProcessor(nn.Module):
    """Selects rows, applies the (vocab-sharded) LM head, gathers and trims the padding."""

    small_m_gemm = False  # see sglang.srt.layers.linear.set_linear_backend

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = get_tensor_model_parallel_world_size()

    def forward(self, hidden_states: torch.Tensor, lm_head: Union[nn.Module, torch.Tensor],
                forward_batch: ForwardBatch,
                capture_hidden_mode: Optional[CaptureHiddenMode] = None,
                aux_hidden_states: Optional[torch.Tensor] = None) -> LogitsProcessorOutput:
        """``hidden_states [T, H]`` (final-normed); ``lm_head`` a ParallelLMHead or its weight.

        ``capture_hidden_mode`` overrides ``forward_batch.capture_hidden_mode`` when given;
        ``aux_hidden_states`` goes to the output as it is.
        """
        weight = lm_head.weight if isinstance(lm_head, nn.Module) else lm_head
        mode = forward_batch.forward_mode
        if mode.is_decode() or _wants_all_rows(forward_batch):
            rows = hidden_states
        else:
            rows = hidden_states[last_token_indices(forward_batch)]
        logits = linear(rows.to(weight.dtype), weight, None, self.small_m_gemm).float()
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        if logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size]  # padded vocab rows of the last rank

        capture = forward_batch.capture_hidden_mode if capture_hidden_mode is None \
            else capture_hidden_mode
        if capture == CaptureHiddenMode.FULL:
            hidden_out = hidden_states
        elif capture == CaptureHiddenMode.LAST:
            hidden_out = hidden_states if mode.is_decode() \
                else hidden_states[last_token_indices(forward_batch)]
        else:
            hidden_out = None
        return LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden_out,
                                     aux_hidden_states=aux_hidden_states)
