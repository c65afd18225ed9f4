"""TokenizerManager helpers: request validation/tokenization and per-request output state."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Dict, List, Optional

from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import BatchStrOutput, GenerateReqInput, TokenizedGenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpecMetricsOutput

logger = logging.getLogger(__name__)

# Default prompt cap: characters per context token. A token of a real tokenizer rarely spans
# more than a few dozen characters, so a prompt this long cannot fit the context; refusing it
# before tokenizing keeps one request from spending seconds of CPU on a doomed prompt.
DEFAULT_PROMPT_CHARS_PER_TOKEN = 64


def max_prompt_chars(context_len: int) -> int:
    """The prompt cap in characters: ``SGLANG_MAX_PROMPT_CHARS``, or 64 x ``context_len``."""
    limit = int(envs.SGLANG_MAX_PROMPT_CHARS.get())
    if limit < 0:
        raise ValueError(f"SGLANG_MAX_PROMPT_CHARS must be >= 0 (0: the default), got {limit}")
    return limit or DEFAULT_PROMPT_CHARS_PER_TOKEN * context_len


def check_prompt_chars(num_chars: int, context_len: int, what: str = "the prompt") -> None:
    """``ValueError`` naming the limit when a text of ``num_chars`` characters is over it.

    Called before the tokenizer (or the chat template) runs, so the cost of refusing a huge
    prompt does not grow with its size beyond ``len``.
    """
    limit = max_prompt_chars(context_len)
    if num_chars > limit:
        raise ValueError(
            f"{what} has {num_chars} characters, more than the server's limit of {limit} "
            f"characters (SGLANG_MAX_PROMPT_CHARS; by default "
            f"{DEFAULT_PROMPT_CHARS_PER_TOKEN} x the context length of {context_len} tokens)")


def build_tokenized_request(obj: GenerateReqInput, tokenizer: Any, vocab_size: int,
                            context_len: int) -> TokenizedGenerateReqInput:
    """Validate and tokenize one normalized single request; ``ValueError`` names the problem."""
    if obj.text is not None:
        if tokenizer is None:
            # /v1 handlers refuse text in their own fields' terms before reaching here, so
            # this names /generate's fields, and sglang.Engine's keyword arguments.
            raise ValueError("this model has no tokenizer, so 'text' cannot be tokenized: "
                             "send the prompt as token ids in 'input_ids' instead of 'text' "
                             "(sglang.Engine: input_ids=[...] instead of prompt=...)")
        check_prompt_chars(len(obj.text), context_len, "the text prompt")
        input_ids = list(tokenizer.encode(obj.text))
    else:
        input_ids = list(obj.input_ids)
    if not input_ids:
        raise ValueError("the prompt is empty (no input tokens)")
    if len(input_ids) >= context_len:  # before the per-id scan below: cheap for a huge list
        raise ValueError(f"the input ({len(input_ids)} tokens) is longer than the model's "
                         f"context length ({context_len} tokens)")
    bad = [t for t in input_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"input id {bad[0]} is outside the vocabulary [0, {vocab_size})")

    sp = SamplingParams.from_dict(obj.sampling_params)
    sp.verify(vocab_size)
    sp.normalize(tokenizer)
    if sp.stop_strs and tokenizer is None:
        raise ValueError("stop strings need a tokenizer, and this model has none; "
                         "use stop_token_ids")
    n = len(input_ids)
    if sp.max_new_tokens is not None and n + sp.max_new_tokens > context_len:
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {context_len} "
            f"tokens. You requested a total of {n + sp.max_new_tokens} tokens: {n} tokens from "
            f"the input and {sp.max_new_tokens} tokens for the completion."
        )
    if not -1 <= obj.logprob_start_len <= n:
        raise ValueError(f"logprob_start_len must be in [-1, {n}] for a prompt of {n} tokens, "
                         f"got {obj.logprob_start_len}")
    if not 0 <= obj.top_logprobs_num <= vocab_size:
        raise ValueError(f"top_logprobs_num must be in [0, {vocab_size}], "
                         f"got {obj.top_logprobs_num}")
    return TokenizedGenerateReqInput(
        rid=obj.rid, input_text=obj.text, input_ids=input_ids, sampling_params=sp,
        return_logprob=obj.return_logprob, logprob_start_len=obj.logprob_start_len,
        top_logprobs_num=obj.top_logprobs_num, stream=obj.stream,
        return_hidden_states=obj.return_hidden_states,
    )


class ReqState:
    """Cumulative output of one request, owned by the event loop that awaits it.

    ``post``/``fail`` may be called from any thread; they forward to the owning loop.
    """

    def __init__(self, obj: GenerateReqInput, tokenized: TokenizedGenerateReqInput,
                 loop: asyncio.AbstractEventLoop, tokenizer: Any):
        self.obj = obj
        self.rid = obj.rid
        self.loop = loop
        self.tokenizer = tokenizer
        self.event = asyncio.Event()
        self.created_time = time.perf_counter()
        self.finished_time: Optional[float] = None
        self.prompt_tokens = len(tokenized.input_ids)
        self.text = ""
        self.output_ids: List[int] = []
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: Optional[Dict[str, Any]] = None
        self.finished = False
        self.error: Optional[str] = None
        self.bad_request_message: Optional[str] = None
        self.updates = 0
        self.seen_updates = 0
        self.out_lp: List[list] = []  # [logprob, id] pairs, text added on output
        self.out_top: List[list] = []
        self.in_lp: List[list] = []
        self.in_top: List[Optional[list]] = []
        self.spec: Optional[Dict[str, Any]] = None  # speculative counters (finishing chunk)
        # meta_info["hidden_states"] as upstream: [prompt rows [P][H]], then one [H] per step.
        self.hidden_states: List[list] = []

    # ---------------------------------------------------------------- producer side
    def post(self, out: BatchStrOutput, i: int) -> None:
        """Queue the ``i``-th entry of a detokenizer message for this request's loop."""
        item = (
            out.finished_reasons[i], out.output_strs[i], out.output_ids[i],
            out.completion_tokens[i], out.cached_tokens[i],
            list(zip(out.output_token_logprobs_val[i], out.output_token_logprobs_idx[i])),
            list(zip(out.output_top_logprobs_val[i], out.output_top_logprobs_idx[i])),
            list(zip(out.input_token_logprobs_val[i], out.input_token_logprobs_idx[i])),
            list(zip(out.input_top_logprobs_val[i], out.input_top_logprobs_idx[i])),
        )
        if out.output_hidden_states and out.output_hidden_states[i]:
            # Tensors to float lists here, on the receiving thread, not on the event loop;
            # queued first, so they are in place when the update below wakes the waiter.
            rows = [t.tolist() for t in out.output_hidden_states[i]]
            self._call(self._apply_hidden_states, rows)
        self._call(self._apply, item)

    def _apply_hidden_states(self, entries: List[list]) -> None:
        # A prompt's chunks join into its one entry (chunked prefill sends each chunk's rows).
        for entry in entries:
            if entry and isinstance(entry[0], list):  # a prompt chunk's rows
                if not self.hidden_states:
                    self.hidden_states.append([])
                self.hidden_states[0].extend(entry)
            else:  # one decode step's row
                self.hidden_states.append(entry)

    def post_spec_metrics(self, out: SpecMetricsOutput, i: int) -> None:
        """Queue the speculative counters of the ``i``-th entry (before the finishing update,
        in the order the messages arrived)."""
        spec: Dict[str, Any] = {
            "spec_verify_ct": out.spec_verify_ct[i],
            "spec_num_correct_drafts": out.spec_num_correct_drafts[i],
            "spec_num_proposed_drafts": out.spec_num_proposed_drafts[i],
            "spec_correct_drafts_histogram": (list(out.spec_correct_drafts_histogram[i])
                                              if out.spec_correct_drafts_histogram else []),
        }
        if out.spec_cap_lens_histogram is not None and out.spec_cap_lens_histogram[i]:
            spec.update(spec_cap_lens_histogram=list(out.spec_cap_lens_histogram[i]),
                        spec_num_cap_tokens=out.spec_num_cap_tokens[i],
                        spec_num_block_accept_tokens=out.spec_num_block_accept_tokens[i])
        self._call(self._apply_spec, spec)

    def _apply_spec(self, spec: Dict[str, Any]) -> None:
        self.spec = spec

    def fail(self, reason: str) -> None:
        """Fail the request (engine died or shut down)."""
        self._call(self._apply_error, reason)

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody awaits this request any more
            pass

    # ---------------------------------------------------------------- loop side
    def _apply(self, item: tuple) -> None:
        finish, text, ids, completion, cached, out_lp, out_top, in_lp, in_top = item
        self.text += text
        self.output_ids.extend(ids)
        self.completion_tokens, self.cached_tokens = completion, cached
        self.out_lp += [[v, t] for v, t in out_lp]
        self.out_top += [[vals, idx] for vals, idx in out_top]
        self.in_lp += [[v, t] for v, t in in_lp]
        self.in_top += [[vals, idx] if vals else None for vals, idx in in_top]
        if finish is not None:
            self.finish_reason = finish
            self.finished = True
            self.finished_time = time.perf_counter()
            if finish.get("type") == "abort" and finish.get("status_code") == 400:
                self.bad_request_message = finish.get("message")
        self.updates += 1
        self.event.set()

    def _apply_error(self, reason: str) -> None:
        if not self.finished:
            self.error = reason
        self.event.set()

    # ---------------------------------------------------------------- output
    def _token_text(self, token_id: int) -> Optional[str]:
        if not self.obj.return_text_in_logprobs or self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _entries(self, pairs: List[list]) -> List[list]:
        return [[v, t, self._token_text(t)] for v, t in pairs]

    def _top_entries(self, rows: List[Optional[list]]) -> List[Optional[list]]:
        return [None if row is None else self._entries(list(zip(row[0], row[1]))) for row in rows]

    def _spec_meta(self) -> Dict[str, Any]:
        """Upstream's speculative meta_info fields, over the request's ``spec_verify_ct``
        verify rounds:

        * ``spec_accept_length`` = ``completion_tokens / spec_verify_ct``: it counts the
          prefill's first token in the numerator although it was not verified (as upstream).
        * ``spec_correct_drafts_histogram[k]``: rounds that accepted exactly ``k`` drafts (bonus
          token excluded), ``k = 0 ..`` the drafts proposed per round; it sums to
          ``spec_verify_ct`` and ``sum(k * h[k])`` is ``spec_num_correct_drafts``.

        Only when the worker plans a verify length ("cap": the most drafts a round may accept,
        ``0 ..`` the drafts proposed, bonus not counted) per round (DSPARK):

        * ``spec_cap_length``: the mean planned length per round;
          ``spec_cap_lens_histogram[l]``: rounds planned with length ``l``.
        * ``spec_block_accept_length``: output tokens the verify rounds committed (each round's
          accepted drafts + its bonus token, minus tokens past the request's finish point) /
          ``spec_verify_ct``. Unlike ``spec_accept_length`` it leaves out the prefill's first
          token, so it is the mean tokens a round gave the output: ``(completion_tokens - 1)
          / spec_verify_ct``.
        """
        spec = self.spec
        ct, correct = spec["spec_verify_ct"], spec["spec_num_correct_drafts"]
        proposed = spec["spec_num_proposed_drafts"]
        meta: Dict[str, Any] = {
            "spec_verify_ct": ct,
            "spec_accept_length": self.completion_tokens / ct,
            "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": proposed,
            "spec_accept_rate": correct / proposed if proposed else 0.0,
            "spec_correct_drafts_histogram": spec["spec_correct_drafts_histogram"],
        }
        if "spec_cap_lens_histogram" in spec:
            meta.update(spec_cap_length=spec["spec_num_cap_tokens"] / ct,
                        spec_cap_lens_histogram=spec["spec_cap_lens_histogram"],
                        spec_block_accept_length=spec["spec_num_block_accept_tokens"] / ct)
        return meta

    def to_output(self) -> Dict[str, Any]:
        """SGLang's output dict with cumulative text and ids."""
        meta: Dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "weight_version": "default",
            "num_retractions": 0,
        }
        if self.finished:
            meta["e2e_latency"] = self.finished_time - self.created_time
            if self.spec is not None and self.spec["spec_verify_ct"] > 0:
                meta.update(self._spec_meta())
        if self.obj.return_logprob:
            meta["input_token_logprobs"] = self._entries(self.in_lp)
            meta["output_token_logprobs"] = self._entries(self.out_lp)
            if self.obj.top_logprobs_num > 0:
                meta["input_top_logprobs"] = self._top_entries(self.in_top)
                meta["output_top_logprobs"] = self._top_entries(self.out_top)
        if self.obj.return_hidden_states:
            meta["hidden_states"] = list(self.hidden_states)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}
