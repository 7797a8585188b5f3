"""``miles serve``: the embedded engine behind SGLang's native HTTP endpoints.

Standard library only (``ThreadingHTTPServer``): each connection gets a thread,
the engine has its own (:class:`~miles_sglang.service.EngineWorker`). Request and
response fields follow SGLang's ``io_struct.py`` / ``http_server.py``; errors are
``{"error": {"message": ...}}`` with HTTP 400; with an API key every endpoint but
``/health*`` needs ``Authorization: Bearer <key>`` (401 otherwise), as SGLang's
``add_api_key_middleware``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from miles_sglang import __version__, endpoints
from miles_sglang.protocol import error_body
from miles_sglang.service import EngineWorker

logger = logging.getLogger(__name__)


class HTTPError(Exception):
    """An error answered with ``status`` and SGLang's error JSON."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class ServerState:
    """What the handlers share: the engine worker and the server's settings."""

    worker: EngineWorker
    model_path: str
    api_key: str | None = None
    incremental_streaming_output: bool = False
    server_args: dict[str, Any] = field(default_factory=dict)
    family: Any = None
    released_tags: set[str] = field(default_factory=set)
    weight_groups: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def new_rid() -> str:
    return uuid.uuid4().hex


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: ServerState  # set on the subclass made per server
    server_version = f"miles-serve/{__version__}"

    # -- plumbing ----------------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
        logger.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        route = endpoints.ROUTES.get(path)
        try:
            body = self._read_body()
            if route is None:
                raise HTTPError(HTTPStatus.NOT_FOUND, f"no endpoint {path}")
            methods, handler = route
            if method not in methods:
                raise HTTPError(HTTPStatus.METHOD_NOT_ALLOWED, f"{path} takes {'/'.join(methods)}")
            self._authorize(path)
            handler(self, self._parse_json(body))
        except HTTPError as error:
            self.send_json(error_body(str(error)) if error.status != 401 else {"error": "Unauthorized"}, error.status)
        except ValueError as error:
            self.send_json(error_body(str(error)), HTTPStatus.BAD_REQUEST)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as error:  # noqa: BLE001 - a server bug answers 500, the server lives on
            logger.exception("%s failed", path)
            self.send_json(error_body(f"internal error: {type(error).__name__}: {error}"), HTTPStatus.INTERNAL_SERVER_ERROR)

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    @staticmethod
    def _parse_json(body: bytes) -> dict:
        if not body.strip():
            return {}
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"the request body is not valid JSON: {error}") from error
        if not isinstance(data, dict):
            raise ValueError(f"the request body must be a JSON object, got {type(data).__name__}")
        return data

    def _authorize(self, path: str) -> None:
        key = self.state.api_key
        if key is None or path.startswith("/health"):
            return
        given = self.headers.get("Authorization") or ""
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise HTTPError(HTTPStatus.UNAUTHORIZED, "Unauthorized")

    # -- responses -----------------------------------------------------------------

    def send_json(self, payload: Any, status: int = HTTPStatus.OK) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_text(self, text: str, status: int = HTTPStatus.OK) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_sse(self) -> None:
        """Server-sent events: ``data: {json}\\n\\n`` chunks, connection closed at the end."""
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def send_event(self, payload: Any) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self.wfile.write(b"data: " + data.encode() + b"\n\n")
        self.wfile.flush()


@dataclass
class ServerHandle:
    """A running ``miles serve``: its URL, and :meth:`shutdown`."""

    httpd: ThreadingHTTPServer
    state: ServerState
    thread: threading.Thread

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def shutdown(self) -> None:
        """Stop accepting requests, abort generation, end the threads."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.state.worker.stop()
        self.thread.join(10)


def start_server(
    engine: Any,
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    incremental_streaming_output: bool = False,
    server_args: dict | None = None,
) -> ServerHandle:
    """Serve ``engine`` in background threads; ``port=0`` picks a free port."""
    if not is_loopback(host) and not api_key:
        raise ValueError(
            f"refusing to serve on non-loopback host {host!r} without --api-key: weight-update endpoints "
            "would be open to the network; pass --api-key KEY or bind 127.0.0.1"
        )
    from miles_sglang.weights import family_and_config

    worker = EngineWorker(engine).start()
    state = ServerState(
        worker=worker, model_path=model_path, api_key=api_key,
        incremental_streaming_output=incremental_streaming_output,
        server_args=dict(server_args or {}), family=family_and_config(model_path)[0],
    )
    handler = type("MilesServeHandler", (_Handler,), {"state": state})
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                              name="miles-serve-http", daemon=True)
    thread.start()
    state.server_args.update({"host": host, "port": httpd.server_address[1], "model_path": model_path})
    return ServerHandle(httpd, state, thread)


def wait_forever(handle: ServerHandle, should_stop: Callable[[], bool] = lambda: False) -> None:
    """Block until interrupted (Ctrl-C) or ``should_stop()``; then shut down."""
    try:
        while not should_stop() and handle.thread.is_alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        handle.shutdown()
