"""DetokenizerManager: token ids from the scheduler -> text for the TokenizerManager.

One process. For every request it keeps a :class:`DecodeStatus` and decodes incrementally:
text is only released once the bytes of the newest tokens form complete characters (a multi-byte
character split over several byte-level tokens is held back until its last byte arrives), and
decoding re-uses a few preceding tokens as context so tokenizers whose pieces depend on their
left neighbour (leading-space handling) decode the same as a full decode would.

Stop strings: the scheduler decides *when* to stop (it decodes the tail of each request and
finishes it with ``FINISH_MATCHED_STR``); this process decides *what text* the user sees. Text that
could be the beginning of a stop string is held back while the request runs, so the cumulative
text a client sees never has to shrink when the stop string completes and is cut off.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import zmq

from sglang.srt.managers.io_struct import BatchStrOutput, BatchTokenIDOutput
from sglang.srt.managers.utils import (
    configure_child_logging,
    exit_if_parent_died,
    load_tokenizer,
    set_parent_death_signal,
)

logger = logging.getLogger(__name__)

# Replacement character: what a decoder emits for an incomplete UTF-8 sequence.
_INCOMPLETE = "\ufffd"


@dataclass
class DecodeStatus:
    """Incremental-decoding state of one request."""

    ids: List[int] = field(default_factory=list)
    # ids[surr_offset:read_offset] is decoding context whose text is already in `text`;
    # ids[read_offset:] have not produced text yet.
    surr_offset: int = 0
    read_offset: int = 0
    text: str = ""
    sent_len: int = 0  # characters of `text` already sent to the TokenizerManager


def longest_stop_prefix_suffix(text: str, stop_strs: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a prefix of some stop string."""
    best = 0
    for stop in stop_strs:
        for n in range(min(len(stop), len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def trim_at_stop(text: str, finished_reason: Optional[Dict[str, Any]], no_stop_trim: bool) -> str:
    """Cut ``text`` before the matched stop string of a finished request (unless no_stop_trim)."""
    if no_stop_trim or not finished_reason:
        return text
    matched = finished_reason.get("matched")
    if isinstance(matched, str) and matched:
        pos = text.find(matched)
        if pos != -1:
            return text[:pos]
    return text


class IncrementalDetokenizer:
    """The decoding logic without sockets (used by the process and directly by tests)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.status: Dict[str, DecodeStatus] = {}

    def _decode(self, ids: Sequence[int], skip: bool, spaces: bool) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=skip, spaces_between_special_tokens=spaces
        )

    def _advance(self, s: DecodeStatus, skip: bool, spaces: bool, final: bool) -> None:
        """Append the text of the not-yet-decoded ids once it is made of whole characters."""
        if s.read_offset >= len(s.ids):
            return
        context = self._decode(s.ids[s.surr_offset:s.read_offset], skip, spaces)
        full = self._decode(s.ids[s.surr_offset:], skip, spaces)
        new_text = full[len(context):]
        if new_text.endswith(_INCOMPLETE) and not final:
            return  # wait for the remaining bytes of a multi-byte character
        s.text += new_text
        s.surr_offset, s.read_offset = s.read_offset, len(s.ids)

    def process(self, recv: BatchTokenIDOutput) -> BatchStrOutput:
        """Decode one scheduler message; returns the new text of each request in it."""
        out_strs: List[str] = []
        for i, rid in enumerate(recv.rids):
            new_ids = recv.decode_ids[i]
            finished = recv.finished_reasons[i]
            if self.tokenizer is None:
                out_strs.append("")
                continue
            s = self.status.setdefault(rid, DecodeStatus())
            no_trim = recv.no_stop_trim[i]
            ids = list(new_ids)
            # A request stopped by a stop token: the token's text is not part of the output.
            if finished and isinstance(finished.get("matched"), int) and ids and not no_trim:
                ids = ids[:-1]
            s.ids.extend(ids)
            skip, spaces = recv.skip_special_tokens[i], recv.spaces_between_special_tokens[i]
            self._advance(s, skip, spaces, final=finished is not None)
            if finished is not None:
                text = trim_at_stop(s.text, finished, no_trim)
                self.status.pop(rid, None)
            else:
                hold = 0 if no_trim else longest_stop_prefix_suffix(s.text, recv.stop_strs[i])
                text = s.text[: len(s.text) - hold]
            # With the hold-back above the visible text only grows; guard anyway.
            delta = text[s.sent_len:] if len(text) > s.sent_len else ""
            s.sent_len = max(s.sent_len, len(text))
            out_strs.append(delta)
        return BatchStrOutput(
            rids=recv.rids,
            finished_reasons=recv.finished_reasons,
            output_strs=out_strs,
            output_ids=recv.decode_ids,
            prompt_tokens=recv.prompt_tokens,
            completion_tokens=recv.completion_tokens,
            cached_tokens=recv.cached_tokens,
            output_token_logprobs_val=recv.output_token_logprobs_val,
            output_token_logprobs_idx=recv.output_token_logprobs_idx,
            output_top_logprobs_val=recv.output_top_logprobs_val,
            output_top_logprobs_idx=recv.output_top_logprobs_idx,
            input_token_logprobs_val=recv.input_token_logprobs_val,
            input_token_logprobs_idx=recv.input_token_logprobs_idx,
            input_top_logprobs_val=recv.input_top_logprobs_val,
            input_top_logprobs_idx=recv.input_top_logprobs_idx,
            output_hidden_states=recv.output_hidden_states,
        )


class DetokenizerManager:
    """The detokenizer process: PULL from the scheduler, PUSH to the TokenizerManager."""

    def __init__(self, server_args: Any, port_args: Any):
        self.context = zmq.Context(2)
        self.recv_from_scheduler = self.context.socket(zmq.PULL)
        self.recv_from_scheduler.bind(port_args.detokenizer_ipc_name)
        self.send_to_tokenizer = self.context.socket(zmq.PUSH)
        self.send_to_tokenizer.connect(port_args.tokenizer_ipc_name)
        self.detok = IncrementalDetokenizer(load_tokenizer(server_args))
        self.parent_pid = os.getppid()

    def event_loop(self) -> None:
        """Forward forever; exits when the parent process is gone."""
        poller = zmq.Poller()
        poller.register(self.recv_from_scheduler, zmq.POLLIN)
        while True:
            if not poller.poll(timeout=1000):
                exit_if_parent_died(self.parent_pid)
                continue
            recv = self.recv_from_scheduler.recv_pyobj()
            if isinstance(recv, BatchTokenIDOutput):
                self.send_to_tokenizer.send_pyobj(self.detok.process(recv))
            else:  # control replies the scheduler routed through us: pass them on unchanged
                self.send_to_tokenizer.send_pyobj(recv)


def run_detokenizer_process(server_args: Any, port_args: Any) -> None:
    """Process entry point (started by the Engine with multiprocessing spawn)."""
    set_parent_death_signal()
    configure_child_logging(server_args, "Detokenizer")
    try:
        DetokenizerManager(server_args, port_args).event_loop()
    except Exception:
        logger.exception("detokenizer process failed")
        raise
