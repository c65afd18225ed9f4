"""Host layout of an extend batch and the per-forward metadata cache, shared by the plain-PyTorch
attention backends (``torch_native_mla``, ``torch_native_kda``) and the Triton ones built on
them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

__all__ = ["ExtendLayout", "extend_layout", "MetadataCache"]


@dataclass
class ExtendLayout:
    """Host-side per-request layout of an extend-like batch (one entry per request)."""

    slots: List[int]  # req_pool_indices
    prefix_lens: List[int]
    extend_lens: List[int]
    starts: List[int]  # first row of the request in the flattened T rows


def extend_layout(forward_batch: "ForwardBatch") -> ExtendLayout:
    """Per-request slots and lengths from the host mirrors when the scheduler filled them, else
    from the device tensors (verify / draft extend carry no host mirrors; reading them back is
    a stream sync)."""
    if forward_batch.req_pool_indices_cpu is not None:
        slots = list(forward_batch.req_pool_indices_cpu)
    else:
        slots = forward_batch.req_pool_indices.tolist()
    if forward_batch.extend_seq_lens_cpu is not None and forward_batch.extend_prefix_lens_cpu is not None:
        extend_lens = list(forward_batch.extend_seq_lens_cpu)
        prefix_lens = list(forward_batch.extend_prefix_lens_cpu)
    else:
        extend_lens = forward_batch.extend_seq_lens.tolist()
        prefix_lens = forward_batch.extend_prefix_lens.tolist()
    if not len(slots) == len(extend_lens) == len(prefix_lens):
        raise ValueError(f"extend batch: {len(slots)} requests but {len(extend_lens)} extend lengths "
                         f"and {len(prefix_lens)} prefix lengths")
    starts, acc = [], 0
    for n in extend_lens:
        starts.append(acc)
        acc += n
    if acc != forward_batch.num_tokens:
        raise ValueError(f"extend batch: extend lengths sum to {acc} but the batch has "
                         f"{forward_batch.num_tokens} tokens")
    return ExtendLayout(slots, prefix_lens, extend_lens, starts)


class MetadataCache:
    """Per-forward metadata kept on the backend (``ForwardBatch.attn_metadata`` is a single slot
    and a hybrid wrapper holds two backends). Built eagerly by ``init_forward_metadata`` and
    rebuilt lazily if a layer is called with a batch the backend has not seen."""

    def __init__(self):
        self._batch: Optional["ForwardBatch"] = None
        self._meta: Any = None

    def get(self, forward_batch: "ForwardBatch", build, refresh: bool = False) -> Any:
        """The metadata of ``forward_batch``; ``refresh`` rebuilds it even for a batch object seen
        before (a runner may refill one batch object between forwards)."""
        if refresh or self._batch is not forward_batch:
            self._meta = build(forward_batch)
            self._batch = forward_batch
        return self._meta
