"""A small blocking HTTP client of one SGLang server (standard library only).

Retries: a refused or reset connection and HTTP 5xx are retried ``max_retries``
times with exponential backoff; 4xx answers are the caller's mistake and are
never retried; a timeout is not retried either (the server may still be
generating, and a second ``/generate`` would duplicate the work).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any

_MAX_BACKOFF_S = 5.0


class SGLangHTTPError(RuntimeError):
    """The server answered with an error status; ``status`` and its message."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status = status
        self.message = message


class SGLangUnavailableError(RuntimeError):
    """No answer from the server (refused, reset, timed out) after the retries."""


def _error_message(raw: bytes) -> str:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw.decode(errors="replace")[:500]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if error is not None:
            return str(error)
        if "message" in data:
            return str(data["message"])
    return str(data)[:500]


class SGLangClient:
    """Calls one server's endpoints; JSON in, JSON (or text) out."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0,
                 max_retries: int = 3, backoff: float = 0.5):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff

    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None,
                retries: int | None = None) -> Any:
        """``method path`` with a JSON body; the decoded answer (None for an empty one)."""
        retries = self.max_retries if retries is None else retries
        last: Exception | None = None
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), _MAX_BACKOFF_S))
            try:
                return self._once(method, path, body, timeout or self.timeout)
            except SGLangHTTPError as error:
                if error.status < 500:
                    raise
                last = error
            except (ConnectionError, urllib.error.URLError) as error:
                reason = getattr(error, "reason", error)
                if isinstance(reason, (socket.timeout, TimeoutError)):
                    raise SGLangUnavailableError(f"{self.url}{path}: timed out after {timeout or self.timeout}s") from error
                last = error
            except (socket.timeout, TimeoutError) as error:
                raise SGLangUnavailableError(f"{self.url}{path}: timed out after {timeout or self.timeout}s") from error
        if isinstance(last, SGLangHTTPError):
            raise last
        raise SGLangUnavailableError(f"{self.url}{path}: no answer after {retries + 1} tries: {last}") from last

    def _once(self, method: str, path: str, body: Any, timeout: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
                kind = response.headers.get("Content-Type", "")
        except urllib.error.HTTPError as error:
            raise SGLangHTTPError(self.url + path, error.code, _error_message(error.read())) from None
        if not raw:
            return None
        if "json" in kind:
            try:
                return json.loads(raw)
            except json.JSONDecodeError as error:
                raise ValueError(f"{self.url}{path}: the answer is not valid JSON: {error}") from error
        return raw.decode(errors="replace")

    def wait_healthy(self, attempts: int = 20, interval: float = 0.5) -> None:
        """Poll ``/health`` until it answers 200; RuntimeError naming the URL otherwise."""
        last: Exception | None = None
        for attempt in range(max(1, attempts)):
            try:
                self._once("GET", "/health", None, timeout=10.0)
                return
            except (SGLangHTTPError, ConnectionError, urllib.error.URLError, OSError) as error:
                last = error
            if attempt + 1 < attempts:
                time.sleep(interval)
        raise RuntimeError(
            f"no SGLang server answered at {self.url}/health after {attempts} tries ({last}); start one "
            "(`miles serve --hf-checkpoint PATH` or `python -m sglang.launch_server`) or fix --sglang-url"
        )
