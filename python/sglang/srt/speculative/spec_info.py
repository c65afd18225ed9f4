"""Speculative-decoding vocabulary shared by the scheduler and the workers.

* :class:`SpeculativeAlgorithm` — ``--speculative-algorithm`` as an enum (SGLang's name).
* :class:`NextNDraftInput` — what one NEXTN round hands the next (per request): the chain seed
  (the last committed token, whose KV is not written yet), the first draft token and the draft
  hidden state that continues the chain, the distribution that first draft was sampled from, and
  the committed sequence length.
* :class:`NextNRelay` — that payload for every request slot, in persistent device buffers indexed
  by ``req_pool_idx`` (slot 0 = padding row). A round gathers its inputs by slot and scatters its
  outputs by slot, so nothing that depends on acceptance ever crosses to the host: the scheduler
  only passes slot indices, which it already knows (the FutureMap idea of upstream's overlap
  scheduler, specialised to the NEXTN chain).
* :class:`SpecMetricsOutput` — per-request speculative counters of finishing requests,
  scheduler -> TokenizerManager (routed through the detokenizer, which forwards unknown messages
  unchanged and in order, so it arrives before the finishing token message it belongs to).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, auto
from typing import List, Optional

import torch

__all__ = ["SpeculativeAlgorithm", "NextNDraftInput", "NextNRelay", "SpecMetricsOutput",
           "nextn_token_headroom"]


class SpeculativeAlgorithm(IntEnum):
    """The speculative algorithm of a server (``NONE`` when speculation is off)."""

    NONE = auto()
    NEXTN = auto()  # MTP layer as a chain drafter (upstream maps NEXTN to its EAGLE worker)
    DSPARK = auto()  # block drafter with confidence-scheduled verify length

    @classmethod
    def from_string(cls, name: Optional[str]) -> "SpeculativeAlgorithm":
        """Case-insensitive; ``None`` / ``""`` / ``"NONE"`` is ``NONE``; ``EAGLE`` means NEXTN."""
        if name is None:
            return cls.NONE
        key = name.strip().upper()
        key = {"": "NONE", "EAGLE": "NEXTN"}.get(key, key)
        if key not in cls.__members__:
            raise ValueError(f"--speculative-algorithm {name!r} is unknown; choose one of "
                             f"{', '.join(m for m in cls.__members__ if m != 'NONE')}")
        return cls[key]

    def is_none(self) -> bool:
        """Speculation is off."""
        return self == SpeculativeAlgorithm.NONE

    def is_nextn(self) -> bool:
        """The MTP chain drafter."""
        return self == SpeculativeAlgorithm.NEXTN

    def is_dspark(self) -> bool:
        """The DSpark block drafter."""
        return self == SpeculativeAlgorithm.DSPARK


@dataclass
class NextNDraftInput:
    """One round's per-request inputs (all device tensors, ``B`` rows)."""

    seq_lens: torch.Tensor  # [B] int64: committed tokens (the seed's position)
    seed: torch.Tensor  # [B] int64: chain position 0 (last bonus / first sampled token)
    draft_token: torch.Tensor  # [B] int64: chain position 1 (the previous draft extend's pick)
    hidden: torch.Tensor  # [B, H]: draft hidden state at position seq_lens - 1
    # [B, V] fp32: the distribution draft_token was drawn from (sampled requests only).
    draft_probs: Optional[torch.Tensor] = None


class NextNRelay:
    """Per-slot persistent buffers holding each request's :class:`NextNDraftInput`.

    ``draft_probs`` (``[slots, V]`` fp32) is allocated on the first round that samples: an
    all-greedy server never pays for it.
    """

    def __init__(self, num_slots: int, hidden_size: int, vocab_size: int,
                 hidden_dtype: torch.dtype, device: torch.device | str):
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        n = num_slots + 1  # + the padding slot 0
        self.seq_lens = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.seed = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.draft_token = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.hidden = torch.zeros(n, hidden_size, dtype=hidden_dtype, device=self.device)
        self.draft_probs: Optional[torch.Tensor] = None

    def _probs_buffer(self) -> torch.Tensor:
        if self.draft_probs is None:
            # Uniform rows, so even a never-written slot is a valid distribution.
            self.draft_probs = torch.full((self.num_slots + 1, self.vocab_size),
                                          1.0 / self.vocab_size, dtype=torch.float32,
                                          device=self.device)
        return self.draft_probs

    def gather(self, slots: torch.Tensor, with_probs: bool) -> NextNDraftInput:
        """The payload of the requests in ``slots [B]`` (copies: later scatters do not alias)."""
        return NextNDraftInput(
            seq_lens=self.seq_lens[slots], seed=self.seed[slots],
            draft_token=self.draft_token[slots], hidden=self.hidden[slots],
            draft_probs=self._probs_buffer()[slots] if with_probs else None)

    def scatter(self, slots: torch.Tensor, *, seq_lens: Optional[torch.Tensor] = None,
                seed: Optional[torch.Tensor] = None, draft_token: Optional[torch.Tensor] = None,
                hidden: Optional[torch.Tensor] = None,
                draft_probs: Optional[torch.Tensor] = None) -> None:
        """Write the given fields of the requests in ``slots [B]`` (device index_copy only)."""
        for buf, value in ((self.seq_lens, seq_lens), (self.seed, seed),
                           (self.draft_token, draft_token), (self.hidden, hidden)):
            if value is not None:
                buf.index_copy_(0, slots, value.to(buf.dtype))
        if draft_probs is not None:
            self._probs_buffer().index_copy_(0, slots, draft_probs.float())


@dataclass
class SpecMetricsOutput:
    """Speculative counters of requests that finish in the token message that follows."""

    rids: List[str]
    spec_verify_ct: List[int]  # verify rounds that counted toward the request
    spec_num_correct_drafts: List[int]  # accepted draft tokens (bonus tokens excluded)
    spec_num_proposed_drafts: List[int]  # spec_verify_ct * (num_draft_tokens - 1)


def nextn_token_headroom(num_draft_tokens: int) -> int:
    """Tokens a NEXTN request may hold beyond ``prompt + max_new_tokens``: two chains.

    The host learns a round's outcome one round late, so when it sees a request finish, the
    device has already committed up to ``N - 1`` tokens past the finish point and launched one
    more round of ``N`` chain slots. KV-slot reservations and the request->token map's width
    (and so the largest position RoPE sees) carry this much slack.
    """
    return 2 * int(num_draft_tokens)
