"""The ``sglang`` rollout backend sends slime's /generate body and reads the answer as slime
does: checked through a recording proxy in front of ``miles serve`` against the request
re-implemented from slime's rollout in :mod:`tests.plugins.sglang.test_slime_request`."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles_sglang.backend import SGLangRolloutBackend
from miles_sglang.client import generate_payload, response_tokens
from tests.plugins.sglang.test_backend import backend_config, drain
from tests.plugins.sglang.test_slime_request import slime_args, slime_payload, slime_sampling_params

PROMPT = [2, 3, 12, 4, 13]


class RecordingProxy:
    """Forwards every request to ``upstream``; records /generate bodies; can drop ``output_ids``
    from answers (SGLang's answers need not carry them: slime reads the logprob entries)."""

    def __init__(self, upstream: str, drop_output_ids: bool = False):
        self.bodies: list[dict] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _forward(self, method):
                data = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
                if self.path == "/generate" and data:
                    proxy.bodies.append(json.loads(data))
                request = urllib.request.Request(upstream + self.path, data=data, method=method,
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=60) as response:
                    status, payload = response.status, response.read()
                if self.path == "/generate" and drop_output_ids:
                    answer = json.loads(payload)
                    for result in answer if isinstance(answer, list) else [answer]:
                        result.pop("output_ids", None)
                    payload = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_payload_is_slimes(top_p):
    """The manager's params (--rollout-* flags, a seed, n=1) become slime's body for the same flags."""
    args = slime_args(rollout_top_p=top_p, rollout_max_response_len=7)
    manager_params = {"max_new_tokens": 7, "temperature": 1.0, "top_p": top_p, "top_k": -1, "sampling_seed": 5, "n": 1}
    expected = slime_payload(args, PROMPT, {**slime_sampling_params(args), "sampling_seed": 5})
    assert generate_payload(PROMPT, manager_params) == expected
    routed = slime_payload(slime_args(use_rollout_routing_replay=True), PROMPT, {})
    assert set(generate_payload(PROMPT, {}, return_routed_experts=True)) == set(routed)


def test_backend_sends_slimes_body_and_parses_like_slime(server, dense_model):
    proxy = RecordingProxy(server.url, drop_output_ids=True)
    backend = SGLangRolloutBackend(backend_config(proxy.url, dense_model))
    try:
        params = {"max_new_tokens": 5, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "sampling_seed": 1, "n": 1}
        backend.submit("s0", PROMPT, params)
        (output,) = drain(backend)
        (body,) = proxy.bodies
        assert body == slime_payload(slime_args(rollout_max_response_len=5), PROMPT,
                                     {**slime_sampling_params(slime_args(rollout_max_response_len=5)), "sampling_seed": 1})
        tokens, logprobs = response_tokens(output)
        assert output["output_ids"] == tokens and len(tokens) == output["meta_info"]["completion_tokens"]
        assert [e[0] for e in output["meta_info"]["output_token_logprobs"]] == logprobs
        assert output["meta_info"]["id"] == "s0" and output["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    finally:
        backend.shutdown()
        proxy.close()
