"""Request and response models of ``miles serve``'s OpenAI-compatible API.

Field names and meanings are OpenAI's (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``), with the extensions SGLang's ``entrypoints/openai/protocol.py``
accepts (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``no_stop_trim``,
``chat_template_kwargs``, ``rid``; ``matched_stop`` on choices). Unknown request
fields are kept and ignored, as OpenAI clients send fields a server may not know
(``metadata``, ``store``, ``service_tier``); fields that would change the result and
that this server cannot honour are refused by the router with a 400 naming them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


def random_id(prefix: str) -> str:
    """``prefix-<hex>``: ids of completions and chunks, as OpenAI's ``cmpl-`` / ``chatcmpl-``."""
    return f"{prefix}-{uuid.uuid4().hex}"


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


# ----------------------------------------------------------------------------
# errors and models
# ----------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    """OpenAI's error object: ``type`` is ``invalid_request_error`` for the client's mistakes."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "miles"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# ----------------------------------------------------------------------------
# requests
# ----------------------------------------------------------------------------


class _SamplingRequest(_Lenient):
    """The sampling fields /v1/completions and /v1/chat/completions share."""

    model: str
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # SGLang's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: str | None = None


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is text, texts, token ids or lists of token ids."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class FunctionDefinition(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(_Lenient):
    name: str


class ToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatMessage(_Lenient):
    """One chat message; ``content`` may be text, a list of text parts, or null beside ``tool_calls``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], ToolChoice, None] = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # SGLang / vLLM extensions
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


# ----------------------------------------------------------------------------
# completions responses
# ----------------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    """The legacy completions form: per-token lists side by side."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ----------------------------------------------------------------------------
# chat responses
# ----------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    """A completions stream event (OpenAI sends ``object: "text_completion"`` here too)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
