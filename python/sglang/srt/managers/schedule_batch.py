"""Requests and batches as the scheduler sees them (host side).

Flow: ``Req`` (one request, its tokens and bookkeeping) -> ``ScheduleBatch`` (the requests of one
forward plus pool handles) -> ``ForwardBatch`` (device tensors for the model runner), built by
:meth:`ScheduleBatch.prepare_for_extend` (a prefill) or :meth:`ScheduleBatch.prepare_for_round`
(the KV slots of a decode round, which the round worker runs).

KV bookkeeping of a request: ``req_pool_idx`` is its row in the req->token map (and its KDA
state slot); ``kv_len`` tokens of ``fill_ids`` (prompt + output) have their KV written, at the
slots ``req_to_token[req_pool_idx, :kv_len]``. Between steps the newest output token has no KV
yet: it is the input of the next decode. With speculative decoding the host also mirrors those
slots (``Req.kv_committed_slots``), because the device map runs one round ahead of the host.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from sglang.srt.mem_cache.memory_pool import PoolExhausted, ReqToTokenPool, TokenToKVPoolAllocator
from sglang.srt.rounds.relay import host_to_device
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo


# ---------------------------------------------------------------------------- finish reasons
class BaseFinishReason(ABC):
    """Why a request stopped; ``to_json`` gives SGLang's ``meta_info.finish_reason`` dict."""

    def __init__(self, is_error: bool = False):
        self.is_error = is_error

    @abstractmethod
    def to_json(self) -> Dict[str, Any]:
        """The ``finish_reason`` dict of the response."""


class FINISH_MATCHED_TOKEN(BaseFinishReason):
    """Stopped on an EOS id or one of ``stop_token_ids``."""

    def __init__(self, matched: int):
        super().__init__()
        self.matched = matched

    def to_json(self) -> Dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


class FINISH_MATCHED_STR(BaseFinishReason):
    """Stopped because the output text contains one of the ``stop`` strings."""

    def __init__(self, matched: str):
        super().__init__()
        self.matched = matched

    def to_json(self) -> Dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


class FINISH_LENGTH(BaseFinishReason):
    """Reached ``max_new_tokens``."""

    def __init__(self, length: int):
        super().__init__()
        self.length = length

    def to_json(self) -> Dict[str, Any]:
        return {"type": "length", "length": self.length}


class FINISH_ABORT(BaseFinishReason):
    """Aborted (by the client, or because the request can never be served)."""

    def __init__(self, message: str = "Unknown error", status_code: Optional[int] = None,
                 err_type: Optional[str] = None):
        super().__init__(is_error=True)
        self.message = message
        self.status_code = status_code
        self.err_type = err_type

    def to_json(self) -> Dict[str, Any]:
        return {"type": "abort", "message": self.message, "status_code": self.status_code,
                "err_type": self.err_type}


# ---------------------------------------------------------------------------- request
class Req:
    """One generation request inside the scheduler."""

    def __init__(
        self,
        rid: str,
        origin_input_text: Optional[str],
        origin_input_ids: List[int],
        sampling_params: Any,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        eos_token_ids: Optional[Set[int]] = None,
        return_hidden_states: bool = False,
    ):
        self.rid = rid
        self.origin_input_text = origin_input_text
        self.origin_input_ids = list(origin_input_ids)
        self.output_ids: List[int] = []
        self.sampling_params = sampling_params
        self.stream = stream
        self.eos_token_ids: Set[int] = set(eos_token_ids or ())
        self.finished_reason: Optional[BaseFinishReason] = None
        self.created_time = time.perf_counter()

        # Memory bookkeeping (see the module docstring).
        self.req_pool_idx: Optional[int] = None
        self.kv_len = 0
        self.extend_input_len = 0  # tokens of the next extend (set by the scheduler)
        self.cached_tokens = 0  # prefix-cache hits (no radix cache yet: always 0)
        # KV slots promised to this request at admission (prompt + max_new_tokens).
        self.reserved_tokens = 0
        # Speculative decoding: CPU tensors of the committed KV slots (None: read the device
        # map on release), and the request's verify rounds / accepted draft tokens.
        self.kv_committed_slots: Optional[List[torch.Tensor]] = None
        self.spec_verify_ct = 0
        self.spec_num_correct_drafts = 0
        # Per verify round (scheduler_round.py): [k] = rounds that accepted k drafts; output
        # tokens the rounds committed; and, when the worker plans a verify length (cap) per
        # round, [l] = rounds planned with l drafts and the sum of the planned lengths.
        self.spec_correct_drafts_histogram: List[int] = []
        self.spec_num_block_accept_tokens = 0
        self.spec_cap_lens_histogram: List[int] = []
        self.spec_num_cap_tokens = 0

        # Logprobs. Input logprobs cover prompt tokens logprob_start_len .. end (-1: none).
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.output_token_logprobs_val: List[float] = []
        self.output_token_logprobs_idx: List[int] = []
        self.output_top_logprobs_val: List[List[float]] = []
        self.output_top_logprobs_idx: List[List[int]] = []
        self.input_token_logprobs_val: List[Optional[float]] = []
        self.input_token_logprobs_idx: List[int] = []
        self.input_top_logprobs_val: List[List[float]] = []
        self.input_top_logprobs_idx: List[List[int]] = []

        # Hidden states not yet sent to the detokenizer (CPU tensors): each prefill chunk's
        # rows [n, H], then one row [H] per decode step (the input token's, as upstream).
        self.return_hidden_states = return_hidden_states
        self.hidden_states: List[torch.Tensor] = []

        # What has been streamed to the detokenizer already.
        self.sent_output_len = 0
        self.sent_input_logprobs = False

    # ------------------------------------------------------------------ views
    @property
    def fill_ids(self) -> List[int]:
        """Every token of the sequence: prompt then output."""
        return self.origin_input_ids + self.output_ids

    @property
    def seqlen(self) -> int:
        """Prompt plus output length."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def prefill_done(self) -> bool:
        """The whole prompt has its KV (the last chunk ran)."""
        return self.kv_len >= len(self.origin_input_ids)

    def finished(self) -> bool:
        """A finish reason is set."""
        return self.finished_reason is not None

    def wants_input_logprobs(self) -> bool:
        """Prompt-token logprobs were asked for (``logprob_start_len >= 0``)."""
        return self.return_logprob and self.logprob_start_len >= 0

    # ------------------------------------------------------------------ finish checks
    def check_finished(self, tokenizer: Any = None) -> None:
        """Set ``finished_reason`` after a new output token (length, stop token, stop string)."""
        if self.finished_reason is not None or not self.output_ids:
            return
        sp = self.sampling_params
        if len(self.output_ids) >= sp.max_new_tokens:
            self.finished_reason = FINISH_LENGTH(length=sp.max_new_tokens)
            return
        # As upstream: ignore_eos disables every token-based stop (EOS and stop_token_ids), and
        # min_new_tokens holds back only token-based stops (the sampler also masks those tokens).
        last = self.output_ids[-1]
        if not sp.ignore_eos and len(self.output_ids) >= (getattr(sp, "min_new_tokens", 0) or 0):
            stop_ids = getattr(sp, "stop_token_ids", None) or ()
            if last in stop_ids or last in self.eos_token_ids:
                self.finished_reason = FINISH_MATCHED_TOKEN(matched=last)
                return
        stop_strs = getattr(sp, "stop_strs", None) or []
        if stop_strs and tokenizer is not None:
            matched = self._match_stop_str(tokenizer, stop_strs)
            if matched is not None:
                self.finished_reason = FINISH_MATCHED_STR(matched=matched)

    def _match_stop_str(self, tokenizer: Any, stop_strs: List[str]) -> Optional[str]:
        """A stop string inside the decoded tail of the output, or None.

        Checked after every token, so only text the newest token can complete matters: a stop
        string of ``b`` UTF-8 bytes spans at most ``b`` byte-level tokens, plus one for the token
        it starts in. The detokenizer cuts the text at the match.
        """
        window = max(len(s.encode("utf-8")) for s in stop_strs) + 1
        tail = tokenizer.decode(
            self.output_ids[-window:],
            skip_special_tokens=getattr(self.sampling_params, "skip_special_tokens", True),
        )
        for s in stop_strs:
            if s and s in tail:
                return s
        return None


def release_kv_cache(req: Req, req_to_token_pool: ReqToTokenPool,
                     allocator: TokenToKVPoolAllocator) -> None:
    """Return a request's KV slots and its req->token row (its KDA state slot) to the pools."""
    if req.req_pool_idx is None:
        return
    if req.kv_committed_slots is not None:
        # Host mirror (speculative decoding): no device read, and rows past kv_len that an
        # in-flight round writes are not this request's committed slots.
        if req.kv_committed_slots:
            allocator.free(torch.cat(req.kv_committed_slots))
        req.kv_committed_slots = []
    elif req.kv_len > 0:
        slots = req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len]
        allocator.free(slots.to(torch.int64))
    req_to_token_pool.free(req.req_pool_idx)
    req.req_pool_idx = None
    req.kv_len = 0


# ---------------------------------------------------------------------------- batch
@dataclass
class ScheduleBatch:
    """The requests of one forward and the pools their slots come from."""

    reqs: List[Req]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: TokenToKVPoolAllocator
    device: torch.device
    forward_mode: Optional[ForwardMode] = None
    # Per request, filled by prepare_for_extend (host values).
    prefix_lens: List[int] = field(default_factory=list)
    extend_lens: List[int] = field(default_factory=list)
    # Sampling state of the rows that get a token this forward: all rows of a decode batch;
    # in an extend batch only the requests whose prompt completes (``sample_rows``).
    sampling_info: Optional[SamplingBatchInfo] = None
    sample_rows: Optional[List[int]] = None
    # KV slots of the last extend (device), for the host mirror of speculative requests.
    out_cache_loc: Optional[torch.Tensor] = None
    # (host slot ids, their device tensor) of the last round, reused while the requests stay.
    _device_slots: Optional[Tuple[List[int], torch.Tensor]] = field(default=None, repr=False)

    @classmethod
    def init_new(cls, reqs: List[Req], req_to_token_pool: ReqToTokenPool,
                 token_to_kv_pool_allocator: TokenToKVPoolAllocator,
                 device: torch.device | str) -> "ScheduleBatch":
        """A batch over admitted requests (each must already own a ``req_pool_idx``)."""
        return cls(list(reqs), req_to_token_pool, token_to_kv_pool_allocator, torch.device(device))

    def batch_size(self) -> int:
        """Number of requests."""
        return len(self.reqs)

    def is_empty(self) -> bool:
        """No requests left."""
        return not self.reqs

    @property
    def return_logprob(self) -> bool:
        """Some request of the batch wants logprobs."""
        return any(r.return_logprob for r in self.reqs)

    def _alloc(self, n: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = self.token_to_kv_pool_allocator.alloc(n, out)
        if out is None:
            # Admission reserves every request's worst case, so this is a scheduler bug.
            raise PoolExhausted(
                f"KV pool exhausted: need {n} slots, "
                f"{self.token_to_kv_pool_allocator.available_size()} free"
            )
        return out

    def prepare_for_extend(self) -> ForwardBatch:
        """Prefill (or the next chunk): tokens ``fill_ids[kv_len : kv_len + extend_input_len]``.

        Allocates their KV slots and records them in ``req_to_token``. Full logits (every row)
        are requested only when some request wants input logprobs.
        """
        self.forward_mode = ForwardMode.EXTEND
        self.prefix_lens = [r.kv_len for r in self.reqs]
        self.extend_lens = [r.extend_input_len for r in self.reqs]
        if any(n <= 0 for n in self.extend_lens):
            raise ValueError("every request of an extend batch needs extend_input_len > 0")
        ids: List[int] = []
        for r, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens):
            ids.extend(r.fill_ids[p : p + n])
        out_cache_loc = self._alloc(len(ids))
        self.out_cache_loc = out_cache_loc
        start = 0
        for r, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens):
            self.req_to_token_pool.write(r.req_pool_idx, p, out_cache_loc[start : start + n])
            start += n
        return ForwardBatch.for_extend(
            torch.tensor(ids, dtype=torch.int64).to(self.device),
            [r.req_pool_idx for r in self.reqs],
            self.prefix_lens,
            self.extend_lens,
            out_cache_loc,
            return_full_logits=any(r.wants_input_logprobs() for r in self.reqs),
        )

    def commit_forward(self) -> None:
        """After a prefill (or chunk): the tokens it consumed now have KV. (A round's tokens
        are committed when the round is consumed, ``scheduler_round.process_round``.)"""
        mirrored = any(r.kv_committed_slots is not None for r in self.reqs)
        # One copy when results are processed (the caller reads the sampled tokens anyway).
        loc = self.out_cache_loc.cpu() if mirrored else None
        start = 0
        for r, n in zip(self.reqs, self.extend_lens):
            r.kv_len += n
            if r.kv_committed_slots is not None:
                r.kv_committed_slots.append(loc[start:start + n])
            start += n

    def prepare_for_round(self, round_tokens: int, loc_buffer: Optional[torch.Tensor] = None):
        """A decode round: ``(req_pool_indices [B], round_cache_loc [B, N], seq_lens_bound)``.

        ``N = round_tokens`` KV slots per request are allocated ahead (1 for plain decode; a
        speculative chain's width, an upper bound on what the round keeps), into ``loc_buffer
        [B, N]`` when given (the round worker's static graph input: no copy before a replay;
        ``round_cache_loc`` is then that buffer, valid until the next round); where they land in
        the request->token map depends on the device-side sequence lengths, so the worker
        records them there. Host values here are only slot indices and ``seq_lens_bound``, a
        host integer no sequence of the round can exceed: the host knows each request's tokens
        up to the round before the one in flight, which adds at most ``N``; this round adds at
        most ``N`` more. The slot indices reach the device without waiting for the stream and
        are reused while the batch keeps its requests.
        """
        self.forward_mode = ForwardMode.DECODE if round_tokens == 1 else ForwardMode.TARGET_VERIFY
        b = len(self.reqs)
        loc = self._alloc(b * round_tokens, loc_buffer).view(b, round_tokens)
        slot_ids = [r.req_pool_idx for r in self.reqs]
        if self._device_slots is None or self._device_slots[0] != slot_ids:
            self._device_slots = (slot_ids, host_to_device(slot_ids, self.device))
        bound = min(max(r.seqlen for r in self.reqs) + 2 * round_tokens,
                    self.req_to_token_pool.max_context_len)
        return self._device_slots[1], loc, bound

    def filter_batch(self, keep_indices: Optional[List[int]] = None) -> None:
        """Keep the given requests (default: the unfinished ones)."""
        if keep_indices is None:
            keep_indices = [i for i, r in enumerate(self.reqs) if not r.finished()]
        if len(keep_indices) == len(self.reqs):
            return
        self.reqs = [self.reqs[i] for i in keep_indices]
        if self.sampling_info is not None:
            # Exact flags again (filter keeps the parent's): once the last penalised or sampled
            # request has left, the batch takes the lighter paths and CUDA graphs again.
            self.sampling_info = self.sampling_info.filter(keep_indices).refresh_flags(
                [r.sampling_params for r in self.reqs]) if keep_indices else None
        self.prefix_lens, self.extend_lens = [], []

    def merge_batch(self, other: "ScheduleBatch") -> None:
        """Append another batch's requests and sampling rows (a prefill joining the running
        batch); both batches must carry the sampling state of all their requests."""
        assert (self.sampling_info is None) == (not self.reqs), "running batch lacks sampling state"
        assert other.sampling_info is not None and other.sampling_info.batch_size == len(other.reqs)
        self.reqs.extend(other.reqs)
        self.sampling_info = other.sampling_info if self.sampling_info is None \
            else self.sampling_info.merge(other.sampling_info)
        self.prefix_lens, self.extend_lens = [], []
