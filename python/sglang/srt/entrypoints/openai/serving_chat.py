"""``POST /v1/chat/completions``: chat on top of the TokenizerManager.

The prompt is rendered with the tokenizer's own chat template (``tokenizer_config.json``), or
the one ``--chat-template`` names (``managers/template_manager.py`` installs it on the tokenizer),
and tokenized here, so the template's special tokens are not re-added by the TokenizerManager. A
tokenizer without a template is a 400 that says so instead of guessing a format.

``chat_template_kwargs`` reach the template only through an allow-list
(:data:`ALLOWED_CHAT_TEMPLATE_KWARGS`): ``apply_chat_template`` also takes ``chat_template``
(a client-supplied Jinja template), ``tokenize``, ``return_*`` and the like, which would let a
client choose what runs on the server or what comes back. Prompt length is capped in characters
(``SGLANG_MAX_PROMPT_CHARS``) twice: the messages' total before the template runs, and the
rendered prompt before it is tokenized.

Refused rather than ignored (400 naming the field): function calling (``tools``, a
``tool_choice`` without ``tools``, the legacy ``functions`` / ``function_call``), and a message
without ``content`` in a role whose content OpenAI requires (every role but ``assistant``).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional

from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTokenLogprob,
    ChatMessage,
    ChoiceLogprobs,
    DeltaMessage,
    TopLogprob,
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
from sglang.srt.managers.request_state import check_prompt_chars

# The template variables a client may set, with the type each value must have. These are the
# switches chat templates read (Qwen3 / Ling-style ``enable_thinking``, DeepSeek's ``thinking``,
# ``reasoning_effort``); none of them chooses which template runs or how its output is used.
ALLOWED_CHAT_TEMPLATE_KWARGS: Dict[str, type] = {
    "enable_thinking": bool,
    "thinking": bool,
    "reasoning_effort": str,
    "add_generation_prompt": bool,
}


def check_chat_template_kwargs(kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """A copy of ``kwargs`` once every key is allowed and typed right; else ``ValueError``."""
    out: Dict[str, Any] = {}
    for key, value in (kwargs or {}).items():
        want = ALLOWED_CHAT_TEMPLATE_KWARGS.get(key)
        if want is None:
            raise ValueError(
                f"chat_template_kwargs key {key!r} is not allowed; allowed keys: "
                f"{', '.join(sorted(ALLOWED_CHAT_TEMPLATE_KWARGS))}")
        if not isinstance(value, want):
            raise ValueError(f"chat_template_kwargs[{key!r}] must be a {want.__name__}, "
                             f"got {type(value).__name__}")
        out[key] = value
    return out


def check_chat_fields(request: ChatCompletionRequest) -> None:
    """``ValueError`` naming the field for chat features this server does not implement, and
    for messages that lack the content their role requires."""
    check_unsupported_fields(request)
    if request.tools:
        raise ValueError("'tools' (function calling) is not supported by this server")
    if request.tool_choice is not None:
        raise ValueError("'tool_choice' needs 'tools', and function calling is not supported "
                         "by this server")
    for name in ("functions", "function_call"):
        if getattr(request, name) is not None:
            raise ValueError(f"'{name}' (legacy function calling) is not supported by this "
                             "server")
    other = [m for m in request.modalities or [] if m != "text"]
    if other:
        raise ValueError(f"'modalities' {other} is not supported: this server answers in text "
                         "only (send [\"text\"] or leave it unset)")
    if request.audio is not None:
        raise ValueError("'audio' (audio output) is not supported: this server answers in text "
                         "only")
    for i, message in enumerate(request.messages):
        if message.content is None and message.role != "assistant":
            raise ValueError(f"messages[{i}].content is required for a {message.role!r} "
                             "message")


def _message_text(message: ChatMessage) -> str:
    """A message's content as one string; only text parts can be served by a text model."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise ValueError(f"message content of type {part.type!r} is not supported (text only)")
        texts.append(part.text)
    return "".join(texts)


class OpenAIServingChat(OpenAIServingBase):
    """Handler of ``/v1/chat/completions`` (streaming, ``n``, ``stop``, ``logprobs``)."""

    def render_prompt(self, request: ChatCompletionRequest) -> List[int]:
        """Apply the chat template (the tokenizer's, or ``--chat-template``) and tokenize (no
        extra special tokens)."""
        tokenizer = self.tokenizer_manager.tokenizer
        if tokenizer is None:
            raise ValueError(
                "this model has no tokenizer, so /v1/chat/completions cannot be served ('messages' "
                "are text, rendered by the tokenizer's chat template); send token ids instead: "
                "as 'prompt' (a list of ints) to /v1/completions or as 'input_ids' to /generate")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the model's tokenizer has no chat template (tokenizer_config.json "
                "'chat_template'); start the server with --chat-template, or use "
                "/v1/completions or /generate with a formatted prompt"
            )
        if not request.messages:
            raise ValueError("'messages' must not be empty")
        kwargs = check_chat_template_kwargs(request.chat_template_kwargs)
        messages = [{"role": m.role, "content": _message_text(m)} for m in request.messages]
        context_len = self.tokenizer_manager.context_len
        check_prompt_chars(sum(len(m["content"]) for m in messages), context_len,
                           "the messages' content")
        if request.continue_final_message:
            if messages[-1]["role"] != "assistant":
                raise ValueError("continue_final_message needs the last message to be 'assistant'")
            kwargs.update(add_generation_prompt=False, continue_final_message=True)
        else:
            kwargs.setdefault("add_generation_prompt", True)
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as e:  # jinja errors (e.g. a role the template rejects) are bad input
            raise ValueError(f"cannot apply the chat template: {e}") from e
        check_prompt_chars(len(text), context_len, "the prompt (after the chat template)")
        return list(tokenizer.encode(text, add_special_tokens=False))

    def convert_request(self, request: ChatCompletionRequest) -> GenerateReqInput:
        """One ``GenerateReqInput``; ``n > 1`` makes it a batch of the same prompt."""
        check_chat_fields(request)
        fmt = (request.response_format or {}).get("type", "text")
        if fmt != "text":
            raise ValueError(f"response_format {fmt!r} is not supported (only 'text')")
        check_top_logprobs("top_logprobs", request.top_logprobs)
        if request.top_logprobs and not request.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        ids = self.render_prompt(request)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        n = request.n
        rids = choice_rids(request.rid, n)
        return GenerateReqInput(
            input_ids=ids if n == 1 else fan_out([ids], n),
            sampling_params=sampling_params_per_choice(request, max_tokens, n),
            rid=rids[0] if n == 1 else rids,
            return_logprob=request.logprobs,
            top_logprobs_num=request.top_logprobs or 0,
            return_text_in_logprobs=True,
            stream=request.stream,
            return_hidden_states=request.return_hidden_states,
        )

    # --- shaping ------------------------------------------------------------------------
    def _logprobs(self, request: ChatCompletionRequest, meta: Dict[str, Any],
                  start: int) -> Optional[ChoiceLogprobs]:
        if not request.logprobs:
            return None
        content = []
        tokenizer = self.tokenizer_manager.tokenizer
        for text, logprob, alts in token_logprob_entries(meta, start, tokenizer):
            content.append(ChatCompletionTokenLogprob(
                token=text, bytes=list(text.encode("utf-8")), logprob=logprob,
                top_logprobs=[TopLogprob(token=t, bytes=list(t.encode("utf-8")), logprob=v)
                              for t, v in alts],
            ))
        return ChoiceLogprobs(content=content)

    def build_response(self, request: ChatCompletionRequest,
                       outputs: List[Dict[str, Any]]) -> Dict[str, Any]:
        """Non-streamed ``chat.completion`` body."""
        choices = []
        for i, out in enumerate(outputs):
            meta = out["meta_info"]
            reason, matched = finish_reason_to_openai(meta.get("finish_reason"))
            choices.append(ChatCompletionResponseChoice(
                index=i,
                message=ChatCompletionMessage(content=out["text"]),
                logprobs=self._logprobs(request, meta, 0),
                finish_reason=reason,
                matched_stop=matched,
                hidden_states=last_hidden_state(meta) if request.return_hidden_states else None,
            ))
        usage = usage_from_metas([o["meta_info"] for o in outputs], request.n)
        resp = ChatCompletionResponse(model=request.model, choices=choices, usage=usage)
        return resp.model_dump()

    async def stream_chunks(
        self, request: ChatCompletionRequest, chunks: AsyncIterator[Dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        """A role chunk per choice, content deltas, an optional usage chunk, ``[DONE]``."""
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        sent_text: Dict[int, int] = {}
        sent_tokens: Dict[int, int] = {}
        metas: Dict[int, Dict[str, Any]] = {}
        options = request.stream_options

        def chunk(index: int, delta: DeltaMessage, meta: Optional[Dict[str, Any]] = None,
                  **extra: Any) -> bytes:
            usage = None
            if meta is not None and options is not None and options.continuous_usage_stats:
                p, c = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
                usage = UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)
            body = ChatCompletionStreamResponse(
                id=rid, created=created, model=request.model, usage=usage,
                choices=[ChatCompletionResponseStreamChoice(index=index, delta=delta, **extra)],
            )
            return sse_event(body.model_dump_json())

        async for item in chunks:
            index = int(item.get("index", 0))
            meta = item["meta_info"]
            metas[index] = meta
            if index not in sent_text:
                # OpenAI opens every choice with the role.
                yield chunk(index, DeltaMessage(role="assistant", content=""))
                sent_text[index] = 0
            text = item["text"]
            delta = text[sent_text[index]:]
            reason, matched = finish_reason_to_openai(meta.get("finish_reason"))
            logprobs = self._logprobs(request, meta, sent_tokens.get(index, 0))
            sent_text[index] = len(text)
            sent_tokens[index] = len(meta.get("output_token_logprobs") or [])
            if not delta and reason is None:
                continue
            yield chunk(index, DeltaMessage(content=delta or None), meta,
                        logprobs=logprobs, finish_reason=reason, matched_stop=matched)
        if request.return_hidden_states:  # as upstream: one more chunk per choice at the end
            for index in sorted(metas):
                yield chunk(index, DeltaMessage(), hidden_states=last_hidden_state(metas[index]))
        if options is not None and options.include_usage:
            ordered = [metas[i] for i in sorted(metas)]
            final = ChatCompletionStreamResponse(
                id=rid, created=created, model=request.model, choices=[],
                usage=usage_from_metas(ordered, request.n),
            )
            yield sse_event(final.model_dump_json())
        yield SSE_DONE
