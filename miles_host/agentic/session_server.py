"""The session server of ``miles run --use-session-server``: an OpenAI base URL per trajectory.

A loopback FastAPI app (served by uvicorn in a thread of its own) answers

- ``GET  {base_url}/sessions/{session_id}/v1/models``
- ``POST {base_url}/sessions/{session_id}/v1/chat/completions``

so an agent loop written with the official ``openai`` client
(``OpenAI(base_url=session_url, api_key="none")``) drives one trajectory of the run's
rollout engine. A chat request is rendered with the checkpoint's chat template
(:func:`miles_host.agentic.chat.render_chat`), checked against the session's token record
(:class:`miles_host.agentic.sessions.Trajectory`), generated from those token ids by the
rollout's engine driver, and answered in OpenAI's shape: the reply text, tool calls parsed
in the model family's format (:mod:`miles_host.agentic.tool_parsers`, when the request has
``tools`` and ``tool_choice`` is not ``"none"``), log-probs when asked, usage; with
``stream`` as server-sent events. Requests of one session run one at a time.

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): 404 for an
unknown session, 400 for a bad request, a prompt the engine refuses, or a prefix mismatch
under ``--session-prefix-mismatch error``.
"""

import asyncio
import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from miles_host.agentic.sessions import SessionPrefixMismatch, Trajectory

#: OpenAI request fields -> SGLang sampling-param names they set
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "seed": "sampling_seed",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
#: SGLang finish reason type -> OpenAI finish_reason (an aborted turn ends the agent's turn like a cut-off one)
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "length"}


class OpenAIError(Exception):
    """An error answered as OpenAI does: ``status`` and ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass
class SessionHandle:
    """One open session: its token record, how to generate (``generate(input_ids, params)``
    returns a ``concurrent.futures.Future`` of the engine's output) and the trajectory's
    sampling params (the run's, which a request may narrow)."""

    session_id: str
    trajectory: Trajectory
    generate: Callable[[list[int], dict], Any]
    sampling_params: dict
    lock: asyncio.Lock | None = None
    requests: int = 0


def sampling_overrides(body: dict, defaults: dict) -> dict:
    """The sampling params of a chat request: the trajectory's, with what the request sets.
    ``max_tokens`` / ``max_completion_tokens`` can only lower the trajectory's limit."""
    params = dict(defaults)
    for name, key in SAMPLING_FIELDS.items():
        if body.get(name) is not None:
            params[key] = body[name]
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        if not isinstance(limit, int) or limit < 1:
            raise OpenAIError(400, f"max_tokens must be a positive integer, got {limit!r}", "max_tokens")
        params["max_new_tokens"] = min(limit, params.get("max_new_tokens", limit))
    stop = body.get("stop")
    if stop is not None:
        params["stop"] = [stop] if isinstance(stop, str) else list(stop)
    return params


def check_chat_request(body: Any) -> None:
    """The parts of a chat request sessions support; OpenAIError naming the field otherwise."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise OpenAIError(400, "messages must be a non-empty list", "messages")
    if body.get("n") not in (None, 1):
        raise OpenAIError(400, f"n={body['n']}: a session records one trajectory; send n=1", "n")


def stream_chunks(completion: dict, include_usage: bool) -> list:
    """A chat completion as OpenAI's stream of ``chat.completion.chunk`` objects: the whole
    reply (content or tool calls, with log-probs) in one delta, then the finish reason, then
    the usage if asked. (A session turn is generated whole before it is answered.)"""
    choice = completion["choices"][0]
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{**call, "index": index} for index, call in enumerate(message["tool_calls"])]
    head = {key: completion[key] for key in ("id", "created", "model")}
    chunks: list = [
        {**head, "object": "chat.completion.chunk",
         "choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": choice["logprobs"]}]},
        {**head, "object": "chat.completion.chunk",
         "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"], "logprobs": None}]},
    ]
    if include_usage:
        chunks.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": completion["usage"]})
    return chunks


class SessionServer:
    """Sessions over HTTP (see the module docstring). ``tokenizer`` renders and decodes,
    ``tool_parser`` (or None) reads tool calls, ``render(tokenizer, messages, tools=...,
    chat_template_kwargs=...)`` gives prompt ids."""

    def __init__(self, tokenizer: Any, model_name: str, tool_parser: Any = None, host: str = "127.0.0.1",
                 port: int = 0, render: Callable | None = None):
        if render is None:
            from miles_host.agentic.chat import render_chat as render
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.tool_parser = tool_parser
        self.render = render
        self.host = host
        self.port = port
        self.sessions: dict[str, SessionHandle] = {}
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- lifecycle -----------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> "SessionServer":
        """Serve on a thread of its own; returns once the socket accepts connections."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as error:
            raise ValueError(f"--session-server-port {self.port}: cannot listen on {self.host}: {error}; "
                             "give a free port, or 0 for any") from error
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", access_log=False, backlog=2048)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="miles-session-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the session server on {self.base_url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving (open sessions are answered no more)."""
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    def open(self, handle: SessionHandle) -> str:
        """Register a session; its OpenAI base URL (``.../sessions/{id}/v1``)."""
        self.sessions[handle.session_id] = handle
        return f"{self.base_url}/sessions/{handle.session_id}/v1"

    def close(self, session_id: str) -> SessionHandle | None:
        """Forget a session (later requests get 404)."""
        return self.sessions.pop(session_id, None)

    @staticmethod
    def new_session_id() -> str:
        return uuid.uuid4().hex

    # -- the app ---------------------------------------------------------------

    def app(self):
        """The FastAPI application."""
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI(title="miles rollout sessions")

        @app.exception_handler(OpenAIError)
        async def openai_error(request: Request, error: OpenAIError):
            return JSONResponse(error.body(), status_code=error.status)

        @app.get("/sessions/{session_id}/v1/models")
        async def models(session_id: str):
            self._handle(session_id)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "miles"}]}

        @app.post("/sessions/{session_id}/v1/chat/completions")
        async def chat_completions(session_id: str, request: Request):
            handle = self._handle(session_id)
            try:
                body = await request.json()
            except ValueError as error:
                raise OpenAIError(400, f"the request body is not JSON: {error}") from error
            check_chat_request(body)
            if handle.lock is None:
                handle.lock = asyncio.Lock()
            async with handle.lock:
                completion = await self._chat(handle, body)
            if not body.get("stream"):
                return completion
            chunks = stream_chunks(completion, bool((body.get("stream_options") or {}).get("include_usage")))
            events = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]
            return StreamingResponse(iter(events), media_type="text/event-stream")

        return app

    def _handle(self, session_id: str) -> SessionHandle:
        handle = self.sessions.get(session_id)
        if handle is None:
            raise OpenAIError(404, f"no open session {session_id!r} (it ended with its trajectory, or never "
                                   "existed); use the session_url of a running trajectory", kind="not_found_error")
        return handle

    async def _chat(self, handle: SessionHandle, body: dict) -> dict:
        from miles_host.agentic.chat import ChatTemplateError

        tools = body.get("tools") or None
        try:
            prompt_ids = self.render(self.tokenizer, body["messages"], tools=tools,
                                     chat_template_kwargs=body.get("chat_template_kwargs"))
        except ChatTemplateError as error:
            raise OpenAIError(400, str(error), "messages") from error
        try:
            input_ids = handle.trajectory.begin_turn(prompt_ids, self._describe)
        except SessionPrefixMismatch as error:
            raise OpenAIError(400, str(error), "messages") from error
        params = sampling_overrides(body, handle.sampling_params)
        handle.requests += 1
        try:
            output = await asyncio.wrap_future(handle.generate(input_ids, params))
        except ValueError as error:  # the engine refused the request (too long, bad params)
            handle.trajectory.error = f"turn {handle.trajectory.turns + 1}: the engine refused the request: {error}"
            raise OpenAIError(400, str(error)) from error
        meta = output["meta_info"]
        output_ids = list(output["output_ids"])
        log_probs = [entry[0] for entry in meta.get("output_token_logprobs", [])]
        handle.trajectory.record_output(output_ids, log_probs, meta.get("finish_reason"), meta.get("weight_version"),
                                        meta.get("routed_experts"), meta.get("weight_version_spans"))
        return self._completion(body, input_ids, output_ids, log_probs, meta.get("finish_reason") or {}, tools)

    def _describe(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _reply_text(self, output_ids: list[int], reason: dict) -> str:
        """The reply as text: every generated token, special ones too (so the template renders
        it back to the same ids), less the stop token that ended it."""
        if reason.get("type") == "stop" and isinstance(reason.get("matched"), int) and output_ids \
                and output_ids[-1] == reason["matched"]:
            output_ids = output_ids[:-1]
        text = self.tokenizer.decode(output_ids, skip_special_tokens=False)
        matched = reason.get("matched")
        if reason.get("type") == "stop" and isinstance(matched, str) and text.endswith(matched):
            text = text[: -len(matched)]
        return text

    def _completion(self, body, input_ids, output_ids, log_probs, reason, tools) -> dict:
        text = self._reply_text(output_ids, reason)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = FINISH_REASONS.get(reason.get("type"), "stop")
        if tools and self.tool_parser is not None and body.get("tool_choice") != "none":
            content, calls = self.tool_parser.parse(text)
            if calls:
                message = {"role": "assistant", "content": content or None,
                           "tool_calls": [call.to_openai() for call in calls]}
                finish = "tool_calls"
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            entries = []
            for token_id, log_prob in zip(output_ids, log_probs):
                token = self.tokenizer.decode([token_id], skip_special_tokens=False)
                entries.append({"token": token, "logprob": log_prob, "bytes": list(token.encode()),
                                "top_logprobs": []})
            choice["logprobs"] = {"content": entries}
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or self.model_name, "choices": [choice],
            "usage": {"prompt_tokens": len(input_ids), "completion_tokens": len(output_ids),
                      "total_tokens": len(input_ids) + len(output_ids)},
        }
