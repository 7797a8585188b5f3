"""A small blocking HTTP client of one SGLang server (standard library only), and the
``/generate`` request and answer as slime's rollout writes and reads them.

:func:`generate_payload` builds the body slime's default ``generate``
(``slime/rollout/sglang_rollout.py``) sends: ``input_ids``, ``sampling_params`` with
slime's keys (``stop`` / ``stop_token_ids`` present even when null,
``skip_special_tokens`` false unless asked, ``no_stop_trim`` true,
``spaces_between_special_tokens`` false, ``custom_params.return_top_p_token_ids``
when ``top_p`` < 1), ``return_logprob`` true, ``return_routed_experts`` only when
asked, no ``rid`` (the server names the request) and no ``n`` of 1. :func:`response_tokens` reads the
answer as slime does: the generated ids and their logprobs from
``meta_info.output_token_logprobs`` (``item[1]`` and ``item[0]``).

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

#: sampling-param keys slime's rollout always sends, with its values where the caller gives none
SLIME_SAMPLING_DEFAULTS = {"stop": None, "stop_token_ids": None, "skip_special_tokens": False,
                           "no_stop_trim": True, "spaces_between_special_tokens": False}


def generate_payload(input_ids: list[int], sampling_params: dict, return_routed_experts: bool = False) -> dict:
    """The ``/generate`` body slime's rollout sends for a text prompt (see the module docstring)."""
    params = {**SLIME_SAMPLING_DEFAULTS, **sampling_params}
    if params.get("n") == 1:
        del params["n"]  # SGLang's default; slime never sends it
    if params.get("top_p", 1.0) != 1.0:
        params["custom_params"] = {**(params.get("custom_params") or {}), "return_top_p_token_ids": True}
    payload: dict[str, Any] = {"sampling_params": params, "return_logprob": True}
    if return_routed_experts:
        payload["return_routed_experts"] = True
    payload["input_ids"] = list(input_ids)
    return payload


def response_tokens(result: dict) -> tuple[list[int], list[float]]:
    """``(token ids, logprobs)`` of one ``/generate`` result, read as slime reads them; ValueError
    if ``meta_info.output_token_logprobs`` is not a list of ``[logprob, token id, ...]``."""
    entries = (result.get("meta_info") or {}).get("output_token_logprobs", [])
    if not isinstance(entries, list) or not all(
        isinstance(e, (list, tuple)) and len(e) >= 2 and isinstance(e[0], (int, float))
        and isinstance(e[1], int) and not isinstance(e[1], bool) for e in entries
    ):
        raise ValueError("malformed /generate response: meta_info.output_token_logprobs does not hold "
                         "[logprob, token_id, text] entries")
    return [int(e[1]) for e in entries], [float(e[0]) for e in entries]


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

    def generate(self, input_ids: list[int], sampling_params: dict, return_routed_experts: bool = False) -> Any:
        """POST ``/generate`` with slime's body (:func:`generate_payload`); the decoded answer."""
        return self.request("POST", "/generate", generate_payload(input_ids, sampling_params, return_routed_experts))

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
