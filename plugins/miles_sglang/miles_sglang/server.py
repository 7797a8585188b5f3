"""``miles serve``: the embedded engine behind SGLang's HTTP API, on uvicorn.

:func:`start_server` starts the engine thread (:class:`~miles_sglang.service.EngineWorker`)
and a uvicorn server, in a background thread with its own event loop, over the
FastAPI app of :mod:`miles_sglang.app`. It binds the listening socket itself
(``port=0`` picks a free port, so the URL is known at once) with SGLang's backlog
of 2048. Slow clients are bounded: the request line and headers must arrive
within ``header_timeout_s`` (:class:`_HeaderTimeoutH11Protocol`), the body within
``body_timeout_s`` (the app's guard), idle keep-alive connections close after
``timeout_keep_alive_s``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from miles_host.http_serving import ThreadedServer, bind_socket, is_loopback
from miles_sglang.app import build_app
from miles_sglang.limits import ServerLimits
from miles_sglang.openai_api import build_openai_router
from miles_sglang.service import EngineWorker, ServerState, new_rid

__all__ = ["ServerHandle", "ServerLimits", "ServerState", "is_loopback", "new_rid", "start_server", "wait_forever"]

logger = logging.getLogger(__name__)

#: the weight version of a fresh server, as SGLang's ``--weight-version`` default
DEFAULT_WEIGHT_VERSION = "default"


class _HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose request line and headers do
    not arrive within ``header_timeout_s`` (uvicorn bounds only idle keep-alive time,
    so a client trickling header bytes would hold a connection forever)."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm_header_timer()  # part of a next request's head is in: it gets the same bound
        elif self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm_header_timer()  # idle until the next request: the keep-alive timeout applies

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.info("closing a connection whose request headers took over %.0fs", self.header_timeout_s)
            self.transport.close()


@dataclass
class ServerHandle(ThreadedServer):
    """A running ``miles serve``: its URL, and :meth:`shutdown`."""

    state: ServerState | None = None

    def shutdown(self) -> None:
        """Stop accepting requests, abort generation, end the threads."""
        self.state.worker.stop()  # in-flight requests finish as aborted, so handlers return
        self.server.should_exit = True
        self.thread.join(15)

    def stop(self, timeout_s: float = 15.0) -> None:
        """:meth:`shutdown` (the engine thread stops too)."""
        self.shutdown()


def start_server(
    engine: Any,
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    incremental_streaming_output: bool = False,
    server_args: dict | None = None,
    limits: ServerLimits | None = None,
    routers: list | None = None,
) -> ServerHandle:
    """Serve ``engine`` in background threads; ``port=0`` picks a free port. ``routers``
    are the FastAPI routers served next to SGLang's native endpoints (default:
    :func:`default_routers`, the OpenAI API of :mod:`miles_sglang.openai_api`)."""
    if not is_loopback(host) and not api_key:
        raise ValueError(
            f"refusing to serve on non-loopback host {host!r} without --api-key: weight-update endpoints "
            "would be open to the network; pass --api-key KEY or bind 127.0.0.1"
        )
    from miles_sglang.weights import family_and_config

    limits = limits or ServerLimits()
    server_args = dict(server_args or {})
    if server_args.get("weight_version") is not None:
        engine.weight_version = str(server_args["weight_version"])
    elif not isinstance(engine.weight_version, str):  # a fresh engine counts from 0; SGLang says "default"
        engine.weight_version = DEFAULT_WEIGHT_VERSION if engine.weight_version == 0 else str(engine.weight_version)
    worker = EngineWorker(engine)  # started once everything that can fail has been built
    state = ServerState(
        worker=worker, model_path=model_path, api_key=api_key,
        incremental_streaming_output=incremental_streaming_output,
        server_args=server_args, family=family_and_config(model_path)[0],
    )
    sock = bind_socket(host, port, limits.backlog)
    bound_port = sock.getsockname()[1]
    state.server_args.update({"host": host, "port": bound_port, "model_path": model_path})
    try:
        app = build_app(state, default_routers(state) if routers is None else routers, limits)
    except BaseException:
        sock.close()
        raise
    worker.start()
    protocol = type("MilesServeH11Protocol", (_HeaderTimeoutH11Protocol,), {"header_timeout_s": limits.header_timeout_s})
    config = uvicorn.Config(
        app, http=protocol, loop="asyncio", lifespan="off", log_level="warning", access_log=False,
        backlog=limits.backlog, timeout_keep_alive=int(max(1, limits.timeout_keep_alive_s)),
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])),
                              name="miles-serve-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        worker.stop()
        sock.close()
        raise RuntimeError(f"miles serve did not start on {host}:{bound_port} (see the log above)")
    return ServerHandle(server=server, thread=thread, host=host, port=bound_port, state=state)


def default_routers(state: ServerState) -> list:
    """The routers served next to SGLang's native endpoints: the OpenAI API."""
    return [build_openai_router(state)]


def wait_forever(handle: ServerHandle, should_stop: Callable[[], bool] = lambda: False) -> None:
    """Block until interrupted (Ctrl-C) or ``should_stop()``; then shut down."""
    try:
        while not should_stop() and handle.thread.is_alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        handle.shutdown()
