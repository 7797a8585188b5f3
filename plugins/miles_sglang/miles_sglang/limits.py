"""What one client may cost ``miles serve`` (plain data: the CLI reads its defaults
without importing the server)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """Body sizes and timeouts of the HTTP server. Bodies of the weight-update
    endpoints carry whole weight buckets, so they get their own, larger limit."""

    max_body_bytes: int = 64 * 2**20
    max_weight_body_bytes: int = 4 * 2**30
    body_timeout_s: float = 60.0  # the whole body must arrive within this
    header_timeout_s: float = 10.0  # request line and headers
    timeout_keep_alive_s: float = 30.0  # idle keep-alive connections are closed after this
    backlog: int = 2048  # SGLang's; Python's default of 5 resets clients under load
