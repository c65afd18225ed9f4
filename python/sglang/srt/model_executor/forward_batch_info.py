"""What one model forward sees: the mode, the flattened token batch and handles to the pools.

Layout conventions (shared by the model, the attention backends and the scheduler):

* Tokens of all requests are flattened request-major into ``T`` rows: ``input_ids[T]``,
  ``positions[T]``, ``out_cache_loc[T]`` (the MLA KV slot each new token is written to).
* Per request (``B`` rows): ``req_pool_indices`` (row of the req->token map, also the KDA state
  slot), ``seq_lens`` (tokens in the sequence **after** this forward), ``extend_prefix_lens``
  (tokens already in the cache), ``extend_seq_lens`` (new tokens in this forward) and
  ``extend_start_loc`` (offset of the request's first new token in the ``T`` rows).
  DECODE is the special case ``extend_seq_lens == 1``; TARGET_VERIFY has ``num_draft_tokens`` per
  request.
* Host mirrors (``*_cpu``) are filled by the scheduler for EXTEND only. Decode and verify paths
  must work from device tensors alone (``needs_cpu_seq_lens = False`` everywhere), so that the
  host can run ahead of the GPU.
* A prefill replayed from a captured graph (``model_executor/prefill_graph_runner.py``) is one
  request padded at its end to the graph's token count: the host mirrors describe the padded
  batch (what the captured launches were shaped for) and :class:`PrefillPadding` carries, on the
  device, what the host must not know: the request's length and pool slot.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any, List, Optional

import torch

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.mem_cache.memory_pool import KDAStatePool, MLATokenToKVPool, ReqToTokenPool


class ForwardMode(IntEnum):
    """Kind of forward (names as in SGLang)."""

    EXTEND = auto()  # prefill, possibly after a cached prefix / earlier chunk
    DECODE = auto()  # one new token per request
    IDLE = auto()  # nothing to run
    TARGET_VERIFY = auto()  # target scores a chain of draft tokens (stage, don't commit, KDA state)
    DRAFT_EXTEND = auto()  # draft model consumes the accepted tokens after a verify

    def is_extend(self) -> bool:
        """Multi-token forwards: attention backends treat verify and draft-extend as extends."""
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND

    def is_cuda_graph(self) -> bool:
        """Modes a captured decode round may contain (a speculative round: the draft's decodes,
        the target's verify and the draft extend)."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND,
                        ForwardMode.IDLE)


@dataclass
class PrefillPadding:
    """A one-request prefill padded at its end to ``P`` rows (the batch's ``T``).

    Rows ``real_len .. P - 1`` are padding: their tokens are arbitrary, their KV rows go to the
    pool's padding slot, and a layer whose state runs along the sequence (the KDA conv window
    and recurrent state) must end that state at row ``real_len - 1`` and write it to ``slot``.
    Causal attention and row-wise layers need nothing: a real row never sees a later one.
    """

    real_len: torch.Tensor  # int64 [1] on the device: the request's tokens (>= 1)
    slot: torch.Tensor  # int64 [1] on the device: its request-pool slot (= KDA state slot)
    valid: torch.Tensor  # bool [P] on the device: row < real_len


class CaptureHiddenMode(IntEnum):
    """Which final-normed hidden states the model returns (speculative drafts need them)."""

    NULL = auto()
    LAST = auto()  # the last token of each request: [B, hidden]
    FULL = auto()  # every token: [T, hidden]


@dataclass
class ForwardBatch:
    """Device-side description of one forward; see the module docstring for the layout."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, length after this forward
    out_cache_loc: torch.Tensor  # [T] int64
    extend_seq_lens: torch.Tensor  # [B] int64
    extend_prefix_lens: torch.Tensor  # [B] int64
    extend_start_loc: torch.Tensor  # [B] int64
    req_to_token_pool: Optional["ReqToTokenPool"] = None
    token_to_kv_pool: Optional["MLATokenToKVPool"] = None
    kda_state_pool: Optional["KDAStatePool"] = None
    attn_backend: Optional["AttentionBackend"] = None
    # Host mirrors, EXTEND only (None for decode / verify).
    req_pool_indices_cpu: Optional[List[int]] = None
    seq_lens_cpu: Optional[torch.Tensor] = None
    extend_seq_lens_cpu: Optional[List[int]] = None
    extend_prefix_lens_cpu: Optional[List[int]] = None
    # A host-known integer >= every request's seq_len (set for every batch the engine builds,
    # including decode / verify / draft extend, where it is an upper bound computed on the host
    # without reading accept-dependent device values). Sizes padded gathers of the cache.
    seq_lens_upper_bound: Optional[int] = None
    # Output control.
    return_full_logits: bool = False  # logits for every token [T, V] instead of last per request
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    # Speculative decoding payload (draft tokens, target hidden states, ...).
    spec_info: Any = None
    # Set for a prefill padded to a captured graph's token count (see PrefillPadding).
    padding: Optional[PrefillPadding] = None
    # Backend-private metadata filled by attn_backend.init_forward_metadata.
    attn_metadata: Any = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @classmethod
    def for_extend(
        cls,
        input_ids: torch.Tensor,
        req_pool_indices: List[int],
        prefix_lens: List[int],
        extend_lens: List[int],
        out_cache_loc: torch.Tensor,
        forward_mode: ForwardMode = ForwardMode.EXTEND,
        **kwargs: Any,
    ) -> "ForwardBatch":
        """Build an extend-like batch from host-known lengths (prefill, chunk, verify, draft extend).

        Positions are ``prefix_len .. prefix_len + extend_len - 1`` per request.
        """
        device = input_ids.device
        b = len(req_pool_indices)
        assert len(prefix_lens) == b and len(extend_lens) == b
        assert sum(extend_lens) == input_ids.shape[0] == out_cache_loc.shape[0]
        positions = torch.cat(
            [torch.arange(p, p + n, dtype=torch.int64) for p, n in zip(prefix_lens, extend_lens)]
        ) if b else torch.zeros(0, dtype=torch.int64)
        starts, acc = [], 0
        for n in extend_lens:
            starts.append(acc)
            acc += n
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=device)

        return cls(
            forward_mode=forward_mode,
            batch_size=b,
            input_ids=input_ids,
            positions=positions.to(device),
            req_pool_indices=t(req_pool_indices),
            seq_lens=t(seq_lens),
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            extend_seq_lens=t(extend_lens),
            extend_prefix_lens=t(prefix_lens),
            extend_start_loc=t(starts),
            req_pool_indices_cpu=[int(r) for r in req_pool_indices],
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
            extend_seq_lens_cpu=list(extend_lens),
            extend_prefix_lens_cpu=list(prefix_lens),
            seq_lens_upper_bound=max(seq_lens, default=0),
            **kwargs,
        )

    @classmethod
    def for_decode(
        cls,
        input_ids: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        **kwargs: Any,
    ) -> "ForwardBatch":
        """Build a decode batch from device tensors only (``seq_lens`` = length after this token)."""
        device = input_ids.device
        b = int(input_ids.shape[0])
        seq_lens = seq_lens.to(device=device, dtype=torch.int64)
        ones = torch.ones(b, dtype=torch.int64, device=device)
        return cls(
            forward_mode=ForwardMode.DECODE,
            batch_size=b,
            input_ids=input_ids,
            positions=seq_lens - 1,
            req_pool_indices=req_pool_indices.to(device=device, dtype=torch.int64),
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            extend_seq_lens=ones,
            extend_prefix_lens=seq_lens - 1,
            extend_start_loc=torch.arange(b, dtype=torch.int64, device=device),
            **kwargs,
        )
