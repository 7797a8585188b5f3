"""Rollout backend ``sglang``: a client of the HTTP API, and its faults."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from miles_sglang.backend import SGLangRolloutBackend, split_buckets
from miles_sglang.client import SGLangClient, SGLangHTTPError, SGLangUnavailableError
from tests.plugins.sglang.conftest import http, make_engine

GREEDY = {"temperature": 0.0, "max_new_tokens": 5, "n": 1}


def backend_config(url: str, model, **overrides) -> SimpleNamespace:
    flags = dict(
        sglang_url=[url], sglang_router_ip=None, sglang_router_port=None, sglang_api_key=None,
        sglang_request_timeout=30.0, sglang_max_retries=2, sglang_retry_backoff=0.01, sglang_health_retries=3,
        sglang_concurrency=8, sglang_weight_names="hf", sglang_weight_encoding="safetensors",
        hf_checkpoint=str(model), update_weight_buffer_size=1 << 20,
    )
    return SimpleNamespace(**{**flags, **overrides})


def drain(backend, limit_s: float = 30.0) -> list[dict]:
    outputs, deadline = [], time.monotonic() + limit_s
    while backend.has_unfinished() and time.monotonic() < deadline:
        outputs.extend(backend.step())
    return outputs


def test_submit_step_matches_server(server, dense_model):
    backend = SGLangRolloutBackend(backend_config(server.url, dense_model))
    try:
        backend.submit("a", [2, 3, 4], GREEDY)
        backend.submit("b", [5, 6], {**GREEDY, "n": 2})
        outputs = drain(backend)
        assert sorted((o["meta_info"]["id"], o["meta_info"]["index"]) for o in outputs) == [("a", 0), ("b", 0), ("b", 1)]
        a = next(o for o in outputs if o["meta_info"]["id"] == "a")
        reference = make_engine(dense_model).generate([2, 3, 4], GREEDY)[0]
        assert a["output_ids"] == reference["output_ids"]
        np.testing.assert_allclose([e[0] for e in a["meta_info"]["output_token_logprobs"]],
                                   [e[0] for e in reference["meta_info"]["output_token_logprobs"]], atol=1e-5)
        with pytest.raises(ValueError, match="empty"):
            backend.submit("c", [], GREEDY)
    finally:
        backend.shutdown()


def test_abort_all_returns_partial_outputs(fresh_server, dense_model):
    backend = SGLangRolloutBackend(backend_config(fresh_server.url, dense_model))
    try:
        http(fresh_server.url, "/pause_generation", {"mode": "in_place"})  # nothing finishes before the abort
        backend.submit("long", [2, 3], {"temperature": 1.0, "max_new_tokens": 100, "ignore_eos": True, "n": 2})
        for _ in range(200):
            if http(fresh_server.url, "/get_server_info")[1]["internal_states"][0]["has_unfinished"]:
                break
            time.sleep(0.01)
        http(fresh_server.url, "/continue_generation", {})
        outputs = backend.abort_all()
        assert len(outputs) == 2 and not backend.has_unfinished()
        for output in outputs:
            assert output["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted"}
            assert len(output["output_ids"]) < 100
            assert len(output["meta_info"]["output_token_logprobs"]) == len(output["output_ids"])
        assert backend.step() == []
    finally:
        backend.shutdown()


def test_update_weights_in_buckets(fresh_server, dense_model):
    backend = SGLangRolloutBackend(backend_config(fresh_server.url, dense_model, update_weight_buffer_size=8192))
    reference = make_engine(dense_model)
    torch.manual_seed(2)
    native = [(n, t + 0.3 * torch.randn_like(t)) for n, t in reference.model.state_dict().items()]
    assert len(split_buckets(native, 8192)) > 2
    try:
        assert backend.update_weights(native, weight_version=3) == 3
        reference.update_weights(native)
        backend.submit("w", [2, 3, 4], GREEDY)
        (output,) = drain(backend)
        assert output["meta_info"]["weight_version"] == "3"
        assert output["output_ids"] == reference.generate([2, 3, 4], GREEDY)[0]["output_ids"]
    finally:
        backend.shutdown()


def _free_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def test_server_not_up_is_a_clear_error(dense_model):
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(RuntimeError, match="no SGLang server answered at .*after 3 tries"):
        SGLangRolloutBackend(backend_config(url, dense_model))
    with pytest.raises(SGLangUnavailableError, match="no answer after 3 tries"):
        SGLangClient(url, max_retries=2, backoff=0.01).request("GET", "/get_model_info")


class FakeSGLang:
    """A loopback server answering /health and a scripted /generate."""

    def __init__(self, generate):
        self.hits = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer(200, {})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/generate":
                    fake.hits += 1
                    self._answer(*generate())
                else:
                    self._answer(200, {})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("case", ["http_500", "malformed", "http_400"])
def test_a_failing_request_becomes_one_failed_output(case, dense_model):
    answers = {
        "http_500": (500, {"error": {"message": "boom"}}),
        "malformed": (200, {"output_ids": [3], "meta_info": {"id": "x"}}),
        "http_400": (400, {"error": {"message": "bad sampling"}}),
    }
    fake = FakeSGLang(lambda: answers[case])
    backend = SGLangRolloutBackend(backend_config(fake.url, dense_model))
    try:
        backend.submit("r", [2, 3], GREEDY)
        (output,) = drain(backend)
        reason = output["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and output["meta_info"]["id"] == "r"
        expected = {"http_500": "HTTP 500: boom", "malformed": "meta_info.finish_reason", "http_400": "HTTP 400: bad sampling"}
        assert expected[case] in reason["message"]
        assert fake.hits == (3 if case == "http_500" else 1)  # 5xx: 2 retries; 4xx and bad answers: none
    finally:
        backend.shutdown()
        fake.close()


def test_client_raises_http_errors_with_the_server_message():
    fake = FakeSGLang(lambda: (400, {"error": {"message": "nope"}}))
    try:
        with pytest.raises(SGLangHTTPError, match="HTTP 400: nope"):
            SGLangClient(fake.url).request("POST", "/generate", {})
    finally:
        fake.close()
