"""``POST /v1/completions``: OpenAI text completions on top of the TokenizerManager.

Choices are prompt-major (choice ``p * n + s`` is sample ``s`` of prompt ``p``); a client's
``rid`` and ``seed`` apply per choice as ``serving_base`` describes.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional, Union

from sglang.srt.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    LogProbs,
    UsageInfo,
)
from sglang.srt.entrypoints.openai.serving_base import (
    SSE_DONE,
    OpenAIServingBase,
    check_top_logprobs,
    check_unsupported_fields,
    choice_rids,
    fan_out,
    finish_reason_to_openai,
    last_hidden_state,
    sampling_params_per_choice,
    sse_event,
    token_logprob_entries,
    usage_from_metas,
)
from sglang.srt.managers.io_struct import GenerateReqInput


def _prompt_list(prompt: Union[str, List[str], List[int], List[List[int]]]) -> List[Any]:
    """One entry per prompt: a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


class OpenAIServingCompletion(OpenAIServingBase):
    """Handler of ``/v1/completions`` (streaming, ``n``, ``stop``, ``logprobs``, ``echo``)."""

    def convert_request(self, request: CompletionRequest) -> GenerateReqInput:
        """One ``GenerateReqInput``; several prompts or ``n > 1`` make it a batch."""
        check_unsupported_fields(request)
        if request.suffix:
            raise ValueError("'suffix' is not supported by this server")
        if request.best_of not in (None, 1, request.n):
            raise ValueError("'best_of' other than n is not supported by this server")
        check_top_logprobs("logprobs", request.logprobs)
        prompts = _prompt_list(request.prompt)
        if not prompts:
            raise ValueError("'prompt' must not be empty")
        entries = fan_out(prompts, request.n)
        single = len(entries) == 1
        is_text = isinstance(entries[0], str)
        if any(isinstance(e, str) != is_text for e in entries):
            raise ValueError("'prompt' must not mix strings and token ids")
        if self.tokenizer_manager.tokenizer is None:
            # Named here, in this endpoint's terms: the TokenizerManager's own message speaks
            # of /generate's 'text' and 'input_ids', which a /v1 client does not send.
            if is_text:
                raise ValueError(
                    "this model has no tokenizer, so a text 'prompt' cannot be tokenized: send "
                    "the prompt as token ids ('prompt': a list of ints such as [1, 2, 3], or a "
                    "list of such lists for several prompts)")
            if request.echo:
                raise ValueError("'echo' needs a tokenizer to turn the prompt's ids into text, "
                                 "and this model has none")
        batch = entries[0] if single else entries
        rids = choice_rids(request.rid, len(entries))
        return GenerateReqInput(
            text=batch if is_text else None,
            input_ids=None if is_text else batch,
            sampling_params=sampling_params_per_choice(request, request.max_tokens,
                                                       len(entries)),
            rid=rids[0] if single else rids,
            return_logprob=request.logprobs is not None,
            top_logprobs_num=request.logprobs or 0,
            return_text_in_logprobs=True,
            stream=request.stream,
            return_hidden_states=request.return_hidden_states,
        )

    # --- shaping ------------------------------------------------------------------------
    def _echo_prefixes(self, request: CompletionRequest) -> List[str]:
        """Per-choice prompt text for ``echo`` (empty strings without echo)."""
        prompts = _prompt_list(request.prompt)
        if not request.echo:
            return [""] * (len(prompts) * request.n)
        tokenizer = self.tokenizer_manager.tokenizer
        texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
        return fan_out(texts, request.n)

    def _logprobs(
        self, request: CompletionRequest, meta: Dict[str, Any], start: int, offset: int
    ) -> Optional[LogProbs]:
        if request.logprobs is None:
            return None
        lp = LogProbs()
        tokenizer = self.tokenizer_manager.tokenizer
        for text, logprob, alts in token_logprob_entries(meta, start, tokenizer):
            lp.tokens.append(text)
            lp.token_logprobs.append(logprob)
            lp.top_logprobs.append({t: v for t, v in alts} if request.logprobs else None)
            lp.text_offset.append(offset)
            offset += len(text)
        return lp

    def build_response(self, request: CompletionRequest,
                       outputs: List[Dict[str, Any]]) -> Dict[str, Any]:
        """Non-streamed ``text_completion`` body."""
        prefixes = self._echo_prefixes(request)
        choices = []
        for i, out in enumerate(outputs):
            meta = out["meta_info"]
            reason, matched = finish_reason_to_openai(meta.get("finish_reason"))
            choices.append(CompletionResponseChoice(
                index=i,
                text=prefixes[i] + out["text"],
                logprobs=self._logprobs(request, meta, 0, len(prefixes[i])),
                finish_reason=reason,
                matched_stop=matched,
                hidden_states=last_hidden_state(meta) if request.return_hidden_states else None,
            ))
        usage = usage_from_metas([o["meta_info"] for o in outputs], request.n)
        resp = CompletionResponse(model=request.model, choices=choices, usage=usage)
        return resp.model_dump()

    async def stream_chunks(
        self, request: CompletionRequest, chunks: AsyncIterator[Dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        """Text deltas per choice, then an optional usage chunk, then ``[DONE]``."""
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prefixes = self._echo_prefixes(request)
        sent_text: Dict[int, int] = {}
        sent_tokens: Dict[int, int] = {}
        metas: Dict[int, Dict[str, Any]] = {}
        options = request.stream_options
        async for item in chunks:
            index = int(item.get("index", 0))
            meta = item["meta_info"]
            metas[index] = meta
            text = item["text"]
            delta = text[sent_text.get(index, 0):]
            first = index not in sent_text
            if first:
                delta = prefixes[index] + delta
            reason, matched = finish_reason_to_openai(meta.get("finish_reason"))
            logprobs = self._logprobs(request, meta, sent_tokens.get(index, 0),
                                      sent_text.get(index, 0))
            sent_text[index] = len(text)
            sent_tokens[index] = len(meta.get("output_token_logprobs") or [])
            if not delta and reason is None:
                continue
            usage = None
            if options is not None and options.continuous_usage_stats:
                usage = UsageInfo(
                    prompt_tokens=meta.get("prompt_tokens", 0),
                    completion_tokens=meta.get("completion_tokens", 0),
                    total_tokens=meta.get("prompt_tokens", 0) + meta.get("completion_tokens", 0),
                )
            chunk = CompletionStreamResponse(
                id=rid, created=created, model=request.model, usage=usage,
                choices=[CompletionResponseStreamChoice(
                    index=index, text=delta, logprobs=logprobs,
                    finish_reason=reason, matched_stop=matched,
                )],
            )
            yield sse_event(chunk.model_dump_json())
        if request.return_hidden_states:  # as upstream: one more chunk per choice at the end
            for index in sorted(metas):
                chunk = CompletionStreamResponse(
                    id=rid, created=created, model=request.model,
                    choices=[CompletionResponseStreamChoice(
                        index=index, text="", hidden_states=last_hidden_state(metas[index]))])
                yield sse_event(chunk.model_dump_json())
        if options is not None and options.include_usage:
            ordered = [metas[i] for i in sorted(metas)]
            final = CompletionStreamResponse(
                id=rid, created=created, model=request.model, choices=[],
                usage=usage_from_metas(ordered, request.n),
            )
            yield sse_event(final.model_dump_json())
        yield SSE_DONE
