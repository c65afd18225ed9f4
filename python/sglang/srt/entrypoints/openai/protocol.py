"""Pydantic models of the OpenAI-compatible API (requests, responses, stream chunks, errors).

Field names follow OpenAI's API and SGLang's ``entrypoints/openai/protocol.py``; SGLang's sampling
extensions (``top_k``, ``min_p``, ``ignore_eos``, ...) are accepted on both request types. Unknown
request keys are ignored, as upstream does, so that clients sending newer fields keep working.
Fields of features this server does not implement (LoRA, custom logit processors, constrained
decoding, legacy ``functions``) are declared so that the handlers can refuse them when set
(``serving_base.check_unsupported_fields``) instead of ignoring them. ``return_hidden_states``
(plain decoding only) gives each choice ``hidden_states``: the last generated token's final
hidden state, as upstream (absent from choices that did not ask).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_serializer,
                      model_validator)


def _now() -> int:
    return int(time.time())


def _uid(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


# ----------------------------------------------------------------------------- common
class ErrorInfo(BaseModel):
    """The body of an error: what went wrong, its class and the HTTP status."""

    message: str
    type: str = "BadRequestError"
    code: int = 400
    param: Optional[str] = None


class ErrorResponse(BaseModel):
    """``{"error": {...}}``: the shape the ``openai`` client and SGLang's native API both read."""

    error: ErrorInfo


class StreamOptions(BaseModel):
    """``include_usage``: a final usage chunk; ``continuous_usage_stats``: usage on every chunk."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class UsageInfo(BaseModel):
    """Token counts of a response (prompt counted once per distinct prompt)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[Dict[str, int]] = None
    reasoning_tokens: Optional[int] = 0


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: str = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "sglang"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: str = "list"
    data: List[ModelCard] = Field(default_factory=list)


class SamplingExtensions(BaseModel):
    """Request fields shared by completions and chat: OpenAI's plus SGLang's extensions."""

    model_config = ConfigDict(extra="ignore")

    model: str = "default"
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Optional[Dict[str, float]] = None
    n: StrictInt = 1
    seed: Optional[StrictInt] = None
    stop: Optional[Union[str, List[str]]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    user: Optional[str] = None
    # SGLang extensions
    top_k: StrictInt = -1
    min_p: float = 0.0
    min_tokens: StrictInt = 0
    repetition_penalty: float = 1.0
    stop_token_ids: Optional[List[StrictInt]] = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    # One rid per choice (a string when there is one choice); kept, so /abort_request finds it.
    rid: Optional[Union[str, List[str]]] = None
    return_hidden_states: StrictBool = False  # each choice's last hidden state
    # Declared only to be refused when set (see the module docstring).
    lora_path: Optional[Any] = None
    custom_logit_processor: Optional[Any] = None
    regex: Optional[Any] = None
    json_schema: Optional[Any] = None
    ebnf: Optional[Any] = None
    structural_tag: Optional[Any] = None

    @model_validator(mode="after")
    def _check_n(self) -> "SamplingExtensions":
        # Fan-out multiplies scheduler work; a cap keeps one request from flooding the queue.
        if not 1 <= self.n <= 128:
            raise ValueError(f"n must be in [1, 128], got {self.n}")
        return self


class HiddenStatesChoice(BaseModel):
    """A response choice with upstream's optional ``hidden_states``: serialised only when set,
    so that responses of requests without ``return_hidden_states`` keep their shape."""

    hidden_states: Optional[List[float]] = None

    @model_serializer(mode="wrap")
    def _drop_unset_hidden_states(self, handler: Any) -> Dict[str, Any]:
        data = handler(self)
        if data.get("hidden_states") is None:
            data.pop("hidden_states", None)
        return data


# ----------------------------------------------------------------------------- completions
class CompletionRequest(SamplingExtensions):
    """``POST /v1/completions``."""

    prompt: Union[str, List[str], List[StrictInt], List[List[StrictInt]]]
    max_tokens: Optional[StrictInt] = 16
    echo: StrictBool = False
    logprobs: Optional[StrictInt] = None  # number of top alternatives per token
    suffix: Optional[str] = None
    best_of: Optional[StrictInt] = None


class LogProbs(BaseModel):
    """Completion logprobs (legacy OpenAI shape)."""

    text_offset: List[int] = Field(default_factory=list)
    token_logprobs: List[Optional[float]] = Field(default_factory=list)
    tokens: List[str] = Field(default_factory=list)
    top_logprobs: List[Optional[Dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(HiddenStatesChoice):
    """One choice of a non-streamed completion."""

    index: int
    text: str
    logprobs: Optional[LogProbs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[None, int, str] = None


class CompletionResponse(BaseModel):
    """Body of a non-streamed ``/v1/completions`` response."""

    id: str = Field(default_factory=lambda: _uid("cmpl-"))
    object: str = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: List[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(HiddenStatesChoice):
    """The text delta of one choice in a stream chunk."""

    index: int
    text: str
    logprobs: Optional[LogProbs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[None, int, str] = None


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed completion."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: List[CompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


# ----------------------------------------------------------------------------- chat
class ChatContentPart(BaseModel):
    """A part of a message's content; only text parts can be served by a text-only model."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    """A message in a chat request (``content`` may be a list of text parts)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[None, str, List[ChatContentPart]] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingExtensions):
    """``POST /v1/chat/completions``."""

    messages: List[ChatMessage]
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None
    response_format: Optional[Dict[str, Any]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    continue_final_message: StrictBool = False
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    # OpenAI's legacy function calling; declared only to be refused when set.
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    # Output modalities (OpenAI's audio output); a text-only server serves ["text"] alone.
    modalities: Optional[List[str]] = None
    audio: Optional[Any] = None


class TopLogprob(BaseModel):
    """One alternative token of a chat logprob entry."""

    token: str
    bytes: List[int]
    logprob: float


class ChatCompletionTokenLogprob(BaseModel):
    """Logprob of one generated token (chat shape)."""

    token: str
    bytes: List[int]
    logprob: float
    top_logprobs: List[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    """Per-token logprobs of one chat choice."""

    content: List[ChatCompletionTokenLogprob] = Field(default_factory=list)


class ChatCompletionMessage(BaseModel):
    """The assistant message of a non-streamed choice."""

    role: str = "assistant"
    content: Optional[str] = None


class ChatCompletionResponseChoice(HiddenStatesChoice):
    """One choice of a non-streamed chat completion."""

    index: int
    message: ChatCompletionMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[None, int, str] = None


class ChatCompletionResponse(BaseModel):
    """Body of a non-streamed ``/v1/chat/completions`` response."""

    id: str = Field(default_factory=lambda: _uid("chatcmpl-"))
    object: str = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: List[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """What a stream chunk adds to a chat message."""

    role: Optional[str] = None
    content: Optional[str] = None


class ChatCompletionResponseStreamChoice(HiddenStatesChoice):
    """The delta of one choice in a chat stream chunk."""

    index: int
    delta: DeltaMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[None, int, str] = None


class ChatCompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed chat completion."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: List[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None
