"""The OpenAI responses of ``miles serve``: whole (``stream: false``) and SSE streams.

A job's results come in request order: prompt-major, then sample, which is
OpenAI's choice ``index`` (``prompt_index * n + sample``). A stream sends, per
choice, the role first (chat), then text deltas as the engine produces tokens,
then a chunk with ``finish_reason``; with ``stream_options.include_usage`` a last
chunk with empty ``choices`` carries the usage; then ``data: [DONE]``.

With a tool parser, content is streamed only up to where a tool call could begin
(:meth:`~miles_host.agentic.tool_parsers.ToolParser.streamable_prefix`); the calls
are parsed from the finished text and sent whole in the final chunk, each with its
``index``, ``id``, name and arguments, and ``finish_reason`` ``"tool_calls"``.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator

from miles_host.agentic.tool_parsers import ToolCall, ToolParser
from miles_sglang import openai_output as output
from miles_sglang.openai_protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatMessageOut,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    FunctionCall,
    ToolCallOut,
    UsageInfo,
    random_id,
)


def _tool_calls(calls: list[ToolCall], with_index: bool) -> list[ToolCallOut] | None:
    if not calls:
        return None
    return [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments),
                        index=i if with_index else None) for i, c in enumerate(calls)]


def _chat_finish(finish: dict | None, calls: list[ToolCall]) -> str | None:
    reason = output.finish_reason(finish)
    return "tool_calls" if calls and reason == "stop" else reason


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def _dump(model: Any) -> str:
    return f"data: {model.model_dump_json(exclude_none=False)}\n\n"


# ----------------------------------------------------------------------------
# chat
# ----------------------------------------------------------------------------


def chat_response(results: list[dict], req: ChatCompletionRequest, rules: output.TextRules,
                  parser: ToolParser | None, prompt_tokens: int) -> ChatCompletionResponse:
    """The whole ``chat.completion`` of finished results."""
    choices, generated = [], 0
    for index, result in enumerate(results):
        meta, ids = result["meta_info"], result["output_ids"]
        finish = meta.get("finish_reason")
        text = rules.final_text(ids, finish)
        content, calls = parser.parse(text) if parser is not None else (text, [])
        logprobs = None
        if req.logprobs:
            kept = len(rules.kept_ids(ids, finish))
            logprobs = ChoiceLogprobs(content=output.chat_logprobs(rules.tokenizer, meta, 0, kept, req.top_logprobs or 0))
        choices.append(ChatCompletionChoice(
            index=index, message=ChatMessageOut(content=content if content or not calls else None,
                                                tool_calls=_tool_calls(calls, with_index=False)),
            logprobs=logprobs, finish_reason=_chat_finish(finish, calls), matched_stop=output.matched_stop(finish),
        ))
        generated += int(meta.get("completion_tokens", len(ids)))
    return ChatCompletionResponse(model=req.model, choices=choices, usage=_usage(prompt_tokens, generated))


@dataclass
class _ChoiceProgress:
    """What one streamed choice has sent so far."""

    started: bool = False
    text: str = ""
    tokens: int = 0
    completion_tokens: int = 0


def _chat_delta(chunk: dict, progress: _ChoiceProgress, req: ChatCompletionRequest, rules: output.TextRules,
                parser: ToolParser | None) -> ChatCompletionStreamChoice | None:
    meta, ids = chunk["meta_info"], chunk["output_ids"]
    finish = meta.get("finish_reason")
    calls: list[ToolCall] = []
    if finish is None:
        text = rules.partial_text(ids)
        if parser is not None:
            text = text[:parser.streamable_prefix(text)]
        new_text = text[len(progress.text):] if text.startswith(progress.text) else ""
        kept = len(ids)
    else:
        text = rules.final_text(ids, finish)
        if parser is not None:
            text, calls = parser.parse(text)
            sent = progress.text.lstrip()
            new_text = text[len(sent):] if text.startswith(sent) else ""
        else:
            new_text = text[len(progress.text):] if text.startswith(progress.text) else ""
        kept = len(rules.kept_ids(ids, finish))
        progress.completion_tokens = int(meta.get("completion_tokens", len(ids)))
    logprobs = None
    if req.logprobs and kept > progress.tokens:
        logprobs = ChoiceLogprobs(content=output.chat_logprobs(
            rules.tokenizer, meta, progress.tokens, kept, req.top_logprobs or 0))
        progress.tokens = kept
    progress.text += new_text
    if not new_text and logprobs is None and finish is None:
        return None
    return ChatCompletionStreamChoice(
        index=chunk.get("index", 0), delta=DeltaMessage(content=new_text or None, tool_calls=_tool_calls(calls, True)),
        logprobs=logprobs, finish_reason=_chat_finish(finish, calls),
        matched_stop=output.matched_stop(finish),
    )


async def chat_stream(chunks: AsyncIterator[dict], job: Any, req: ChatCompletionRequest, rules: output.TextRules,
                      parser: ToolParser | None, prompt_tokens: int) -> AsyncIterator[str]:
    """SSE events of a streamed chat completion."""
    stream_id, created = random_id("chatcmpl"), int(time.time())
    progress = [_ChoiceProgress() for _ in job.keys]

    def event(choice: ChatCompletionStreamChoice) -> str:
        return _dump(ChatCompletionChunk(id=stream_id, created=created, model=req.model, choices=[choice]))

    async with aclosing(chunks):  # an early stop (client gone) aborts the job now
        async for chunk in chunks:
            index = chunk.get("index", 0)
            if not progress[index].started:
                progress[index].started = True
                yield event(ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
            choice = _chat_delta(chunk, progress[index], req, rules, parser)
            if choice is not None:
                yield event(choice)
    if req.stream_options is not None and req.stream_options.include_usage:
        generated = sum(p.completion_tokens for p in progress)
        yield _dump(ChatCompletionChunk(id=stream_id, created=created, model=req.model, choices=[],
                                        usage=_usage(prompt_tokens, generated)))
    yield "data: [DONE]\n\n"


# ----------------------------------------------------------------------------
# completions
# ----------------------------------------------------------------------------


def _echo_text(rules: output.TextRules, prompt: list[int]) -> str:
    return rules.tokenizer.decode(prompt) if rules.tokenizer is not None else ""


def completion_response(results: list[dict], req: CompletionRequest, rules: output.TextRules,
                        prompts: list[list[int]]) -> CompletionResponse:
    """The whole ``text_completion`` of finished results."""
    choices, generated = [], 0
    for index, result in enumerate(results):
        meta, ids = result["meta_info"], result["output_ids"]
        finish = meta.get("finish_reason")
        prompt = prompts[index // req.n]
        prefix = _echo_text(rules, prompt) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            kept = len(rules.kept_ids(ids, finish))
            echoed = meta.get("input_token_logprobs") if req.echo else None
            logprobs = output.completion_logprobs(rules.tokenizer, meta, 0, kept, req.logprobs, offset=0 if echoed else len(prefix),
                                                  prefix=echoed)
        choices.append(CompletionChoice(index=index, text=prefix + rules.final_text(ids, finish), logprobs=logprobs,
                                        finish_reason=output.finish_reason(finish), matched_stop=output.matched_stop(finish)))
        generated += int(meta.get("completion_tokens", len(ids)))
    prompt_tokens = sum(len(p) for p in prompts)
    return CompletionResponse(model=req.model, choices=choices, usage=_usage(prompt_tokens, generated))


async def completion_stream(chunks: AsyncIterator[dict], job: Any, req: CompletionRequest, rules: output.TextRules,
                            prompts: list[list[int]]) -> AsyncIterator[str]:
    """SSE events of a streamed completion."""
    stream_id, created = random_id("cmpl"), int(time.time())
    progress = [_ChoiceProgress() for _ in job.keys]

    def event(choice: CompletionChoice) -> str:
        return _dump(CompletionChunk(id=stream_id, created=created, model=req.model, choices=[choice]))

    async with aclosing(chunks):  # an early stop (client gone) aborts the job now
        async for chunk in chunks:
            index = chunk.get("index", 0)
            state = progress[index]
            if req.echo and not state.started:
                echo = _echo_text(rules, prompts[index // req.n])
                yield event(CompletionChoice(index=index, text=echo))
            state.started = True
            meta, ids = chunk["meta_info"], chunk["output_ids"]
            finish = meta.get("finish_reason")
            text = rules.final_text(ids, finish) if finish else rules.partial_text(ids)
            kept = len(rules.kept_ids(ids, finish)) if finish else len(ids)
            new_text = text[len(state.text):] if text.startswith(state.text) else ""
            logprobs = None
            if req.logprobs is not None and kept > state.tokens:
                logprobs = output.completion_logprobs(rules.tokenizer, meta, state.tokens, kept, req.logprobs,
                                                      offset=len(state.text))
                state.tokens = kept
            state.text += new_text
            if finish:
                state.completion_tokens = int(meta.get("completion_tokens", len(ids)))
            if new_text or logprobs is not None or finish:
                yield event(CompletionChoice(index=index, text=new_text, logprobs=logprobs,
                                             finish_reason=output.finish_reason(finish),
                                             matched_stop=output.matched_stop(finish)))
    if req.stream_options is not None and req.stream_options.include_usage:
        generated = sum(p.completion_tokens for p in progress)
        yield _dump(CompletionChunk(id=stream_id, created=created, model=req.model, choices=[],
                                    usage=_usage(sum(len(p) for p in prompts), generated)))
    yield "data: [DONE]\n\n"
