"""Vocab-parallel token embedding and LM head.

The vocabulary is padded up to a multiple of the TP size and split into equal contiguous row
blocks; rank ``r`` holds rows ``[r*n, (r+1)*n)`` of the padded table (padding rows are zero and
are never looked up, since real ids are below ``vocab_size``). An embedding lookup masks the ids
outside the local block, looks up the rest and all-reduces (exactly one rank contributes each
row). The LM head's logits are all-gathered by :class:`LogitsProcessor`.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from sglang.srt.layers.linear import copy_checked
from sglang.srt.model_loader.weight_utils import LazyWeight

__all__ = ["pad_vocab_size", "vocab_parallel_lookup", "VocabParallelEmbedding", "ParallelLMHead",
           "SharedEmbedAndHead"]


def pad_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Smallest multiple of ``tp_size`` that is ``>= vocab_size``."""
    return -(-vocab_size // tp_size) * tp_size


def vocab_parallel_lookup(input_ids: torch.Tensor, weight: torch.Tensor, vocab_start: int,
                          tp_size: int) -> torch.Tensor:
    """Embed ``input_ids`` with this rank's row block ``weight`` (starting at ``vocab_start``).

    With TP > 1 the rows of ids owned by other ranks are zero before the all-reduce.
    """
    if tp_size == 1:
        return F.embedding(input_ids, weight)
    n = weight.shape[0]
    local = input_ids - vocab_start
    owned = (local >= 0) & (local < n)
    out = F.embedding(local.clamp(0, n - 1), weight)
    out = out * owned.unsqueeze(-1).to(out.dtype)
    return tensor_model_parallel_all_reduce(out)


class VocabParallelEmbedding(nn.Module):
    """Token embedding ``[vocab_size, embedding_dim]`` sharded by vocabulary rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: LazyWeight, shard_id=None) -> None:
        """Copy this rank's vocabulary rows; the padding rows past ``vocab_size`` become zero."""
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"{loaded.name}: expected shape "
                             f"{(self.num_embeddings, self.embedding_dim)}, got {loaded.shape}")
        start = self.vocab_start_index
        rows = max(0, min(self.num_embeddings - start, self.num_embeddings_per_partition))
        if rows:
            copy_checked(param, param.data.narrow(0, 0, rows), loaded.narrow(0, start, rows),
                         loaded.name)
        with torch.no_grad():
            param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [T] -> [T, embedding_dim]`` (complete on every rank)."""
        return vocab_parallel_lookup(input_ids, self.weight, self.vocab_start_index, self.tp_size)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings} (padded {self.num_embeddings_padded}), "
                f"dim={self.embedding_dim}, tp={self.tp_rank}/{self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection ``[vocab_size, hidden]``, sharded by vocabulary rows.

    It is applied by :class:`~sglang.srt.layers.logits_processor.LogitsProcessor` (row selection,
    fp32 logits, all-gather), never called directly.
    """

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Not callable: the head is applied by LogitsProcessor."""
        raise RuntimeError("ParallelLMHead is applied through LogitsProcessor, not called")


class SharedEmbedAndHead:
    """For draft models that use the target's word embedding and LM head instead of their own:
    the host class sets ``config`` (``vocab_size``, ``hidden_size``), ``tp_size`` and
    ``_shared = {}`` in its constructor."""

    config: Any
    tp_size: int
    _shared: Dict[str, torch.Tensor]

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        """Use the target's (local shards of) word embedding and LM head."""
        rows = pad_vocab_size(self.config.vocab_size, self.tp_size) // self.tp_size
        for name, w in (("embed", embed), ("head", head)):
            if tuple(w.shape) != (rows, self.config.hidden_size):
                raise ValueError(f"set_embed_and_head: {name} must be "
                                 f"{(rows, self.config.hidden_size)}, got {tuple(w.shape)}")
        self._shared = {"embed": embed, "head": head}

    def get_embed_and_head(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The shared (target's) embedding and LM head shards."""
        if not self._shared:
            raise RuntimeError(f"{type(self).__name__}: set_embed_and_head was not called")
        return self._shared["embed"], self._shared["head"]
