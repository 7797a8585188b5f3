"""What the host's HTTP servers share: the API-key rule and a uvicorn server on a thread.

The rule (SGLang's, used by ``miles serve`` and the dashboard): a server bound to a
loopback address may go without an API key; one reachable from the network must have
one, and then a request needs ``Authorization: Bearer <key>`` (compared in constant time).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer_matches(api_key: str | None, authorization: bytes | None) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <api_key>`` (always, without a key)."""
    if not api_key:
        return True
    return hmac.compare_digest(authorization or b"", f"Bearer {api_key}".encode())


def require_key_off_loopback(host: str, api_key: str | None, what: str, key_flag: str) -> None:
    """ValueError when ``what`` would listen on a non-loopback ``host`` without an API key."""
    if not is_loopback(host) and not api_key:
        raise ValueError(f"refusing to serve {what} on non-loopback host {host!r} without {key_flag}: it would be "
                         f"open to the network; pass {key_flag} KEY or bind 127.0.0.1")


def bind_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: a free one); OSError names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {error} (pick another port, or 0 for a free one)") from error
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


@dataclass
class ThreadedServer:
    """A uvicorn server answering on a daemon thread; :meth:`stop` ends it."""

    server: Any
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting requests and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout_s)


def serve_in_thread(app: Any, host: str, port: int, name: str, timeout_s: float = 30.0) -> ThreadedServer:
    """Serve the ASGI ``app`` on ``host:port`` from a daemon thread; returns once it accepts
    connections (RuntimeError when it does not start within ``timeout_s``)."""
    import uvicorn

    sock = bind_socket(host, port)
    config = uvicorn.Config(app, loop="asyncio", lifespan="off", log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"{name} did not start on {host}:{sock.getsockname()[1]} (see the log above)")
        time.sleep(0.01)
    return ThreadedServer(server, thread, host, sock.getsockname()[1])
