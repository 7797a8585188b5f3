"""``miles serve``'s OpenAI-compatible API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

:func:`build_openai_router` returns a FastAPI router over the server's
:class:`~miles_sglang.service.ServerState`. Requests become ordinary engine jobs
(:class:`~miles_sglang.service.GenerateJob`, run on the engine thread) that the
event loop awaits without blocking (:func:`~miles_sglang.service.wait_job`,
:func:`~miles_sglang.service.iter_chunks`); a client that goes away aborts its job.
Chat prompts are rendered with the checkpoint's chat template
(:mod:`miles_host.agentic.chat`); with ``tools`` the reply is split into content and
``tool_calls`` by the model family's parser (:mod:`miles_host.agentic.tool_parsers`;
``--tool-call-parser`` names one, otherwise it is detected from the chat template and
the model type). A forced call (``tool_choice`` ``"required"`` or a named function)
constrains the reply to JSON calls with a schema, as vLLM and SGLang do;
``logit_bias`` and a JSON ``response_format`` go to the engine (``logit_bias``,
``json_schema``), which applies them or refuses them with a message naming the key.

Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``: 400 for a
bad request (``param`` names the field), 404 for an unknown model, 503 while the
engine cannot serve. The API key is checked by the application the router is
mounted in (:func:`miles_sglang.app.build_app`).
"""

from __future__ import annotations

import asyncio
import json
import re
from functools import wraps
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from miles_host.agentic.chat import ChatTemplateError, render_chat
from miles_host.agentic.tool_parsers import ToolParser, detect_tool_parser, forced_tool_calls, get_tool_parser
from miles_sglang import openai_output as output
from miles_sglang.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from miles_sglang.openai_responses import chat_response, chat_stream, completion_response, completion_stream
from miles_sglang.service import GenerateJob, iter_chunks, new_rid, wait_job


class OpenAIError(Exception):
    """An error answered as OpenAI's error JSON with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorDetail(message=str(self), type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status)


def _bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


# ----------------------------------------------------------------------------
# request -> engine sampling_params
# ----------------------------------------------------------------------------

#: (request field, engine sampling_params key, neutral value): a field at its neutral
#: value is not sent, so the engine only sees what the request asks for
SAMPLING_FIELDS = (
    ("temperature", "temperature", None),
    ("top_p", "top_p", None),
    ("top_k", "top_k", None),
    ("min_p", "min_p", None),
    ("presence_penalty", "presence_penalty", None),
    ("frequency_penalty", "frequency_penalty", None),
    ("repetition_penalty", "repetition_penalty", None),
    ("min_tokens", "min_new_tokens", 0),
    ("stop_token_ids", "stop_token_ids", None),
    ("ignore_eos", "ignore_eos", False),
    ("seed", "sampling_seed", None),
    ("n", "n", 1),
)

#: (request field, is it set to something this server cannot honour?, why / what to do)
UNSUPPORTED = (
    ("best_of", lambda v: v not in (None, 1), "best_of is not supported by miles serve; use n"),
    ("suffix", lambda v: bool(v), "suffix (insertion) is not supported by miles serve"),
)


def _refuse_unsupported(request: BaseModel) -> None:
    for name, is_set, why in UNSUPPORTED:
        if name in type(request).model_fields and is_set(getattr(request, name)):
            raise _bad(why, param=name)


def _stops(request: BaseModel) -> list[str]:
    stop = request.stop
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(stops):
        raise _bad("stop strings must be non-empty", param="stop")
    return stops


def sampling_params(request: BaseModel, max_new_tokens: int) -> dict[str, Any]:
    """The engine's ``sampling_params`` (SGLang names) for an OpenAI request."""
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    for field, key, neutral in SAMPLING_FIELDS:
        value = getattr(request, field)
        if value is not None and value != neutral:
            params[key] = value
    stops = _stops(request)
    if stops:
        params["stop"] = stops
    if request.logit_bias:
        params["logit_bias"] = _logit_bias(request.logit_bias)
    schema = _response_schema(getattr(request, "response_format", None))
    if schema is not None:
        params["json_schema"] = schema
    return params


#: engine sampling_params key -> the request field it came from (beside SAMPLING_FIELDS)
_ENGINE_KEY_FIELDS = {"max_new_tokens": "max_tokens", "stop": "stop", "logit_bias": "logit_bias",
                      "json_schema": "response_format", **{key: field for field, key, _ in SAMPLING_FIELDS}}
_ENGINE_KEY = re.compile(r"sampling_params: (\w+)|sampling parameter\(s\) \['(\w+)'|\(`(\w+)`\)")


def _field_named_in(message: str, grammar_field: str) -> str | None:
    """The request field an engine error is about (its messages name the sampling_params key);
    ``grammar_field`` is the field that asked for ``json_schema``."""
    match = _ENGINE_KEY.search(message)
    key = match and (match.group(1) or match.group(2) or match.group(3))
    if key == "json_schema":
        return grammar_field
    return _ENGINE_KEY_FIELDS.get(key) if key else None


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` (string keys) -> the engine's ``{token_id: bias}``."""
    try:
        return {int(token): float(value) for token, value in bias.items()}
    except ValueError:
        raise _bad("logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None


def _response_schema(response_format: Any) -> str | None:
    """``response_format`` -> the engine's ``json_schema`` (constrained decoding), as SGLang maps it."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return json.dumps({"type": "object"})
    spec = getattr(response_format, "json_schema", None)
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise _bad("response_format json_schema needs {'json_schema': {'name', 'schema': {...}}}",
                   param="response_format.json_schema")
    return json.dumps(schema)


# ----------------------------------------------------------------------------
# the server
# ----------------------------------------------------------------------------


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise _bad(f"invalid value for '{param}': {first['msg']}" if param else first["msg"], param=param) from error


class OpenAIServer:
    """The handlers, bound to one server's state."""

    def __init__(self, state: Any):
        self.state = state
        self.parser = self._tool_parser()

    # -- shared ----------------------------------------------------------------

    @property
    def engine(self) -> Any:
        return self.state.worker.engine

    @property
    def model_id(self) -> str:
        return self.state.server_args.get("served_model_name") or self.state.model_path

    def check_model(self, name: str) -> None:
        """404 unless ``name`` is the served model (its id, its path, or SGLang's ``"default"``)."""
        if name not in (self.model_id, self.state.model_path, "default"):
            raise OpenAIError(404, f"The model '{name}' does not exist; this server serves '{self.model_id}'",
                              param="model", code="model_not_found")

    def _tool_parser(self) -> ToolParser | None:
        """The server's tool-call parser: named by ``server_args["tool_call_parser"]`` (SGLang's
        ``--tool-call-parser``), else detected from the chat template and the HF ``model_type``."""
        name = self.state.server_args.get("tool_call_parser")
        if name:
            return get_tool_parser(name)
        return detect_tool_parser(model_type=self._hf_model_type(),
                                  chat_template=getattr(self.engine.tokenizer, "chat_template", None))

    def _hf_model_type(self) -> str | None:
        try:
            return json.loads((Path(self.state.model_path) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            return None

    def max_new_tokens(self, asked: int | None, prompt_lens: list[int], param: str) -> int:
        """``asked`` (or what the context leaves), checked against the context length."""
        context = self.engine.config.max_model_len
        longest = max(prompt_lens)
        if longest >= context:
            raise _bad(f"the prompt has {longest} tokens but this model's context length is {context}",
                       param="messages" if param == "max_completion_tokens" else "prompt")
        if asked is None:
            return context - longest
        if longest + asked > context:
            raise _bad(f"this model's maximum context length is {context} tokens; you requested {longest + asked} "
                       f"({longest} in the prompt, {asked} for the completion): lower {param}", param=param)
        return asked

    async def submit(self, prompts: list[list[int]], params: dict, *, return_logprob: bool, stream: bool,
                     rid: str | None, logprob_start_len: int = -1, top_logprobs_num: int = 0,
                     grammar_field: str = "response_format") -> tuple[GenerateJob, asyncio.Event]:
        """Queue one engine job (all prompts, ``n`` samples each) and the event its progress sets;
        a ValueError from the engine is the request's fault (400, naming the field it is about)."""
        if self.state.released_tags:
            raise OpenAIError(503, f"memory {sorted(self.state.released_tags)} is released: call "
                              "/resume_memory_occupation first",
                              type="service_unavailable")
        base = rid or new_rid()
        rids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
        n = params.get("n", 1)
        job = GenerateJob(
            keys=[(r, k) for r in rids for k in range(n)], prompts=dict(zip(rids, prompts)),
            return_logprob=return_logprob, return_routed_experts=False, logprob_start_len=logprob_start_len,
            stream=stream, incremental=False, top_logprobs_num=top_logprobs_num if return_logprob else 0,
        )
        event = job.bind_loop(asyncio.get_running_loop())
        try:
            await self.state.worker.submit_async(job, prompts, [dict(params) for _ in prompts], rids)
        except ValueError as error:
            raise _bad(str(error), param=_field_named_in(str(error), grammar_field)) from error
        except RuntimeError as error:
            raise OpenAIError(503, str(error), type="service_unavailable") from error
        return job, event

    async def results(self, request: Request, job: GenerateJob, event: asyncio.Event) -> list[dict]:
        """The job's results (its requests are aborted if the client goes away)."""
        try:
            return await wait_job(job, self.state.worker, event, request.is_disconnected)
        except RuntimeError as error:
            raise OpenAIError(503, str(error), type="service_unavailable") from error

    def chunks(self, job: GenerateJob, event: asyncio.Event) -> AsyncIterator[dict]:
        """The job's stream chunks (its requests are aborted if the stream stops early)."""
        return iter_chunks(job, self.state.worker, event)

    # -- endpoints ---------------------------------------------------------------

    async def models(self, request: Request) -> JSONResponse:
        """GET /v1/models: the one served model."""
        return JSONResponse(ModelList(data=[self._card()]).model_dump())

    async def model(self, request: Request, model_id: str) -> JSONResponse:
        """GET /v1/models/{id}."""
        self.check_model(model_id)
        return JSONResponse(self._card().model_dump())

    def _card(self) -> ModelCard:
        return ModelCard(id=self.model_id, root=self.state.model_path, max_model_len=self.engine.config.max_model_len)

    async def completions(self, request: Request) -> Any:
        """POST /v1/completions."""
        req: CompletionRequest = _parse(CompletionRequest, await _json_body(request))
        self.check_model(req.model)
        _refuse_unsupported(req)
        has_text = isinstance(req.prompt, str) or any(isinstance(p, str) for p in req.prompt)
        # tokenizing text is CPU work: in the thread pool, off the event loop (as /generate does)
        prompts = await run_in_threadpool(self._completion_prompts, req.prompt) if has_text \
            else self._completion_prompts(req.prompt)
        params = sampling_params(req, self.max_new_tokens(req.max_tokens, [len(p) for p in prompts], "max_tokens"))
        rules = output.TextRules(self.engine.tokenizer, tuple(_stops(req)), req.skip_special_tokens, req.no_stop_trim)
        job, event = await self.submit(prompts, params, return_logprob=req.logprobs is not None, stream=req.stream,
                                       rid=req.rid, logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
                                       top_logprobs_num=req.logprobs or 0)
        if req.stream:
            return _sse(completion_stream(self.chunks(job, event), job, req, rules, prompts))
        results = await self.results(request, job, event)
        return JSONResponse(completion_response(results, req, rules, prompts).model_dump())

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        prompts = self._tokenize_prompts([prompt] if isinstance(prompt, str) else prompt)
        if not prompts or not all(prompts):
            raise _bad("prompt must not be empty (nor contain an empty prompt)", param="prompt")
        return prompts

    def _tokenize_prompts(self, prompt: list) -> list[list[int]]:
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)] if prompt else []
        if all(isinstance(p, list) for p in prompt):
            return [list(p) for p in prompt]
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise _bad("text prompts need a tokenizer and this checkpoint has none: send token ids", param="prompt")
        return [list(tokenizer(p)["input_ids"]) for p in prompt]

    async def chat_completions(self, request: Request) -> Any:
        """POST /v1/chat/completions."""
        req: ChatCompletionRequest = _parse(ChatCompletionRequest, await _json_body(request))
        self.check_model(req.model)
        _refuse_unsupported(req)
        if req.top_logprobs and not req.logprobs:
            raise _bad("top_logprobs needs logprobs: true", param="top_logprobs")
        if req.tool_choice not in (None, "none", "auto") and not req.tools:
            raise _bad("tool_choice forces a tool call but the request has no tools", param="tool_choice")
        use_tools = bool(req.tools) and req.tool_choice != "none"
        parser, forced_schema = self._chat_tool_parser(req) if use_tools else (None, None)
        prompt = await self._chat_prompt(req, use_tools)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = sampling_params(req, self.max_new_tokens(asked, [len(prompt)], field))
        if forced_schema is not None:
            params["json_schema"] = json.dumps(forced_schema)
        rules = output.TextRules(self.engine.tokenizer, tuple(_stops(req)), req.skip_special_tokens, req.no_stop_trim)
        job, event = await self.submit([prompt], params, return_logprob=req.logprobs, stream=req.stream, rid=req.rid,
                                       top_logprobs_num=req.top_logprobs or 0, grammar_field="tool_choice" if forced_schema is not None else "response_format")
        if req.stream:
            return _sse(chat_stream(self.chunks(job, event), job, req, rules, parser, len(prompt)))
        results = await self.results(request, job, event)
        return JSONResponse(chat_response(results, req, rules, parser, len(prompt)).model_dump())

    async def _chat_prompt(self, req: ChatCompletionRequest, use_tools: bool) -> list[int]:
        """The prompt token ids of the request's messages under the checkpoint's chat template."""
        try:
            return await run_in_threadpool(
                render_chat, self.engine.tokenizer, [m.model_dump(exclude_none=True) for m in req.messages],
                tools=[t.model_dump(exclude_none=True) for t in req.tools] if use_tools else None,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message, chat_template_kwargs=req.chat_template_kwargs,
            )
        except ChatTemplateError as error:
            raise _bad(str(error), param="messages") from error

    def _chat_tool_parser(self, req: ChatCompletionRequest) -> tuple[ToolParser, dict | None]:
        """How the reply's tool calls are read, and the JSON schema that forces one (or None):
        ``tool_choice`` "auto" uses the model family's format, "required" or a named
        function constrain the reply to JSON (:func:`~miles_host.agentic.tool_parsers.forced_tool_calls`)."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        if req.tool_choice in (None, "auto"):
            if self.parser is None:
                raise _bad("this model's tool-call format is unknown, so tool calls cannot be parsed: start the "
                           "server with --tool-call-parser (qwen25, llama3, deepseekv3)", param="tools")
            return self.parser, None
        if req.response_format is not None and req.response_format.type != "text":
            raise _bad("a forced tool call and response_format both constrain the reply: use one", param="tool_choice")
        choice = req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()
        try:
            return forced_tool_calls(tools, choice)
        except ValueError as error:
            raise _bad(str(error), param="tool_choice") from error


async def _json_body(request: Request) -> Any:
    body = await request.body()
    try:
        return json.loads(body) if body.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _bad(f"the request body is not valid JSON: {error}") from error


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _guarded(server: OpenAIServer, handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Answer OpenAIError / ValueError as OpenAI's error JSON."""

    @wraps(handler)
    async def endpoint(request: Request, **path: Any) -> Any:
        try:
            return await handler(request, **path)
        except OpenAIError as error:
            return error.response()
        except ValueError as error:
            return _bad(str(error)).response()
        except ConnectionAbortedError:
            return Response(status_code=499)  # the client left; nobody reads this

    return endpoint


def build_openai_router(state: Any) -> APIRouter:
    """The OpenAI routes over ``state`` (a :class:`~miles_sglang.service.ServerState`)."""
    server = OpenAIServer(state)
    router = APIRouter()
    router.add_api_route("/v1/models", _guarded(server, server.models), methods=["GET"])
    router.add_api_route("/v1/models/{model_id:path}", _guarded(server, server.model), methods=["GET"])
    router.add_api_route("/v1/completions", _guarded(server, server.completions), methods=["POST"])
    router.add_api_route("/v1/chat/completions", _guarded(server, server.chat_completions), methods=["POST"])
    return router
