"""The FastAPI application of ``miles serve`` (SGLang's HTTP stack: FastAPI + uvicorn).

:func:`build_app` routes every endpoint of :mod:`miles_sglang.endpoints` and
:mod:`miles_sglang.weight_endpoints`, plus any extra ``routers`` (the OpenAI API).
Around them:

- **Auth** (as SGLang's ``add_api_key_middleware``): with an API key every path
  but ``/health*`` needs ``Authorization: Bearer <key>``, compared in constant
  time; otherwise HTTP 401 ``{"error": "Unauthorized"}``. Every route carries it
  as a dependency, and :class:`RequestGuardMiddleware` applies the same check
  before anything reads the body (FastAPI reads a pydantic body *before* running
  dependencies, so a router's endpoints alone would read unauthenticated bodies).
- **Body limit** (:class:`RequestGuardMiddleware`, pure ASGI): a declared
  ``Content-Length`` over the limit is refused with 413 before a byte of the body
  is read; a chunked body is counted as it streams and cut off at the limit; a
  body that stalls longer than ``body_timeout_s`` is answered 408.
- **Errors**: ``ValueError`` from an endpoint is 400 ``{"error": {"message": ...}}``,
  unknown paths 404 and wrong methods 405 in the same shape, a bug 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus
from typing import Any, Callable, Iterable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from miles_host.http_serving import bearer_matches
from miles_sglang import endpoints, weight_endpoints
from miles_sglang.limits import ServerLimits
from miles_sglang.service import ServerState

__all__ = ["ROUTES", "RequestGuardMiddleware", "ServerLimits", "api_key_dependency", "build_app", "is_authorized"]

logger = logging.getLogger(__name__)

#: every native endpoint: path -> (HTTP methods, endpoint)
ROUTES = {**endpoints.ROUTES, **weight_endpoints.ROUTES}

#: bodies up to this size are decoded on the event loop, larger ones in the thread pool
_INLINE_JSON_BYTES = 2**20

#: paths that never need the API key (SGLang exempts ``/health*``)
_OPEN_PREFIXES = ("/health",)


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": {"message": str(message)}}, status_code=status)


class RequestRefused(Exception):
    """A body over its limit (413) or too slow to arrive (408), raised while it is read."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def is_authorized(api_key: str | None, path: str, authorization: bytes | None) -> bool:
    """Whether a request to ``path`` with this ``Authorization`` header may proceed."""
    return path.startswith(_OPEN_PREFIXES) or bearer_matches(api_key, authorization)


class RequestGuardMiddleware:
    """Refuses, before reading the body: requests without the API key (401), bodies
    declared over the path's limit (413); then cuts off bodies that grow past it (413)
    or arrive too slowly (408). Pure ASGI, so it sees the stream before anything buffers it."""

    def __init__(self, app: Callable, limits: ServerLimits, api_key: str | None):
        self.app = app
        self.limits = limits
        self.api_key = api_key

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if not is_authorized(self.api_key, scope["path"], headers.get(b"authorization")):
            await self._send_json(send, HTTPStatus.UNAUTHORIZED, {"error": "Unauthorized"})
            return
        path = scope["path"]
        limit = self.limits.max_weight_body_bytes if path in weight_endpoints.ROUTES else self.limits.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await self._refuse(send, HTTPStatus.BAD_REQUEST, f"bad Content-Length {declared!r}")
                return
            if size > limit:
                await self._refuse(send, HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                   f"the request body is {size} bytes; {scope['path']} takes at most {limit}")
                return
        received = 0
        body_done = False
        deadline = asyncio.get_running_loop().time() + self.limits.body_timeout_s
        started = False

        async def limited_receive() -> dict:
            nonlocal received, body_done
            if body_done:  # after the body only a disconnect comes: no deadline
                return await receive()
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.001))
            except asyncio.TimeoutError:
                raise RequestRefused(HTTPStatus.REQUEST_TIMEOUT,
                                     f"the request body did not arrive within {self.limits.body_timeout_s:g}s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestRefused(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                         f"the request body exceeds {limit} bytes, the limit of {scope['path']}")
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except RequestRefused as error:
            if started:
                raise
            await self._refuse(send, error.status, str(error))

    @classmethod
    async def _refuse(cls, send: Callable, status: int, message: str) -> None:
        await cls._send_json(send, status, {"error": {"message": message}})

    @staticmethod
    async def _send_json(send: Callable, status: int, payload: Any) -> None:
        """Answer and close: the unread rest of the body must not be taken for a next request."""
        data = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": int(status),
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": data})


def api_key_dependency(api_key: str | None) -> Callable:
    """A FastAPI dependency: 401 unless the request carries ``Bearer <api_key>``
    (constant-time compare); ``/health*`` and servers without a key are open."""
    async def authorize(request: Request) -> None:
        given = request.headers.get("authorization")
        if not is_authorized(api_key, request.url.path, None if given is None else given.encode("latin-1")):
            raise StarletteHTTPException(HTTPStatus.UNAUTHORIZED, "Unauthorized")

    return authorize


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object (empty body: ``{}``); ValueError otherwise."""
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"the request body is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def _route(state: ServerState, path: str, endpoint: Callable) -> Callable:
    async def handle(request: Request) -> Response:
        try:
            raw = await request.body()
            # a weight bucket is hundreds of MB of JSON: decode it off the event loop
            body = await run_in_threadpool(parse_json_body, raw) if len(raw) > _INLINE_JSON_BYTES else parse_json_body(raw)
            result = await endpoint(state, request, body)
        except RequestRefused as error:  # the connection's unread rest must not be parsed as a request
            return JSONResponse({"error": {"message": str(error)}}, status_code=error.status,
                                headers={"Connection": "close"})
        except ValueError as error:
            return _error(str(error), HTTPStatus.BAD_REQUEST)
        except ConnectionAbortedError:
            return Response(status_code=499)  # the client left; nobody reads this
        except Exception as error:  # noqa: BLE001 - a server bug answers 500, the server lives on
            logger.exception("%s failed", path)
            return _error(f"internal error: {type(error).__name__}: {error}", HTTPStatus.INTERNAL_SERVER_ERROR)
        return result if isinstance(result, Response) else JSONResponse(result)

    handle.__name__ = path.strip("/").replace("/", "_") or "root"
    handle.__doc__ = endpoint.__doc__
    return handle


async def _http_error(request: Request, error: StarletteHTTPException) -> Response:
    if error.status_code == HTTPStatus.UNAUTHORIZED:
        return JSONResponse({"error": "Unauthorized"}, status_code=401)
    message = error.detail
    if error.status_code == HTTPStatus.NOT_FOUND:
        message = f"no endpoint {request.url.path}"
    elif error.status_code == HTTPStatus.METHOD_NOT_ALLOWED:
        message = f"{request.url.path} does not take {request.method}"
    return JSONResponse({"error": {"message": message}}, status_code=error.status_code, headers=error.headers)


async def _validation_error(request: Request, error: RequestValidationError) -> Response:
    return _error(f"invalid request: {error.errors()}", HTTPStatus.BAD_REQUEST)


def build_app(state: ServerState, routers: Iterable[APIRouter] = (), limits: ServerLimits | None = None) -> FastAPI:
    """The ``miles serve`` application over ``state``: SGLang's native endpoints, then
    ``routers`` (each gets the same auth dependency), inside the body limit."""
    limits = limits or ServerLimits()
    app = FastAPI(title="miles serve", docs_url=None, redoc_url=None, openapi_url=None)
    auth = Depends(api_key_dependency(state.api_key))
    for path, (methods, endpoint) in ROUTES.items():
        app.add_api_route(path, _route(state, path, endpoint), methods=list(methods), dependencies=[auth])
    for router in routers:
        app.include_router(router, dependencies=[auth])
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(RequestGuardMiddleware, limits=limits, api_key=state.api_key)
    app.state.miles = state
    return app
