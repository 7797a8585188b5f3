"""`miles serve` under hostile and heavy clients: body and header limits before reading,
disk loads confined to their directory, bounded weight-group joins, a loopback load test."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection

import pytest

from miles_sglang.limits import ServerLimits
from tests.plugins.sglang.conftest import http, make_engine, serve

KEY = "sekrit"
HUGE = 256 * 2**20  # declared, never sent


def _raw_exchange(url: str, head: bytes, payload: bytes = b"", timeout: float = 10.0) -> tuple[int | None, bytes, float]:
    """Send ``head`` + ``payload`` on a fresh socket and read until the server closes or
    answers; ``(status or None, raw answer, seconds)``."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head + payload)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < _answer_length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else None
    return status, data, time.monotonic() - started


def _answer_length(data: bytes) -> int:
    """Bytes of the whole answer once its headers are in: headers + ``Content-Length`` (the
    body may come in a later packet than the headers)."""
    head, _, _ = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value.strip())
    return len(head) + 4


def _head(path: str, length: int | None, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{size}{extra}\r\n").encode()


@pytest.fixture(scope="module")
def keyed(dense_model):
    """A server with an API key and small limits, so every limit trips fast."""
    limits = ServerLimits(max_body_bytes=4096, body_timeout_s=1.0, header_timeout_s=1.0)
    handle = serve(dense_model, api_key=KEY, limits=limits)
    yield handle
    handle.shutdown()


@pytest.mark.parametrize("path", ["/generate", "/update_weights_from_tensor", "/v1/chat/completions"])
def test_oversized_unauthenticated_body_is_refused_unread(keyed, path):
    """256 MB declared, 10 bytes sent: the answer is 401 or 413, not the 408 a server
    waiting for the rest of the body would give after body_timeout_s (1 s here)."""
    status, answer, seconds = _raw_exchange(keyed.url, _head(path, HUGE), b'{"text": "')
    assert status in (401, 413), answer
    assert seconds < 3.0, f"{path}: {seconds:.2f}s"


def test_body_limits_with_a_valid_key(keyed):
    auth = f"Authorization: Bearer {KEY}\r\n"
    status, answer, seconds = _raw_exchange(keyed.url, _head("/generate", HUGE, auth), b"{")
    assert status == 413 and b"4096" in answer and seconds < 3.0
    chunk = b'{"text": "' + b"1" * 5000 + b'"}'  # chunked: counted as it streams
    body = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n"
    status, answer, _ = _raw_exchange(keyed.url, _head("/generate", None, auth), body)
    assert status == 413, answer
    status, answer, seconds = _raw_exchange(keyed.url, _head("/generate", 100, auth), b'{"in')  # stalls
    assert status == 408 and 0.9 < seconds < 5.0, (answer, seconds)
    status, answer = http(keyed.url, "/generate", {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}},
                          headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and len(answer["output_ids"]) == 2


def test_slow_headers_are_cut_off(keyed):
    host, port = keyed.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: te")  # ... and nothing more
        closed = sock.recv(1024)
        seconds = time.monotonic() - started
    assert closed == b"" and 0.9 < seconds < 5.0, (closed, seconds)  # header_timeout_s is 1 s


def test_listen_backlog_is_sglangs(server):
    assert server.server.config.backlog == 2048
    if shutil.which("ss"):
        listing = subprocess.run(["ss", "-ltnH", f"sport = :{server.port}"], capture_output=True, text=True).stdout
        assert listing.split()[2] == "2048", listing  # Send-Q of a listening socket: its backlog


# ----------------------------------------------------------------------------
# weights: disk paths, group timeouts
# ----------------------------------------------------------------------------


def _model_copy(source, directory):
    directory.mkdir()
    for item in source.iterdir():
        shutil.copy(item, directory / item.name)
    return directory


def test_disk_load_refuses_shards_outside_the_directory(fresh_server, dense_model, tmp_path):
    outside = _model_copy(dense_model, tmp_path / "outside")
    by_index = _model_copy(dense_model, tmp_path / "by_index")
    (by_index / "model.safetensors").unlink()
    (by_index / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.norm.weight": "../outside/model.safetensors"}}))
    by_link = _model_copy(dense_model, tmp_path / "by_link")
    (by_link / "model.safetensors").unlink()
    (by_link / "model.safetensors").symlink_to(outside / "model.safetensors")
    for directory in (by_index, by_link):
        status, answer = http(fresh_server.url, "/update_weights_from_disk", {"model_path": str(directory)})
        assert status == 400 and answer["success"] is False, answer
        assert "outside" in answer["message"] and str(outside) in answer["message"], answer
    inside = _model_copy(dense_model, tmp_path / "inside")
    (inside / "shards").mkdir()
    (inside / "model.safetensors").rename(inside / "shards" / "model.safetensors")
    (inside / "model.safetensors").symlink_to(inside / "shards" / "model.safetensors")  # a link that stays inside
    status, answer = http(fresh_server.url, "/update_weights_from_disk", {"model_path": str(inside), "weight_version": "in"})
    assert status == 200 and answer["success"], answer


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_weight_group_init_honours_its_timeout(server):
    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        for port, bound in ((silent.getsockname()[1], 2.0), (_free_port(), 1.0)):
            started = time.monotonic()
            status, answer = http(server.url, "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "backend": "gloo", "timeout": 2})
            seconds = time.monotonic() - started
            assert status == 400 and answer["success"] is False, answer
            assert f"127.0.0.1:{port}" in answer["message"], answer
            assert seconds < bound + 1.5, f"took {seconds:.1f}s for a 2 s timeout"
    finally:
        silent.close()
    status, answer = http(server.url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "gloo",
        "timeout": "soon"})
    assert status == 400 and "timeout" in answer["message"]


# ----------------------------------------------------------------------------
# load on loopback
# ----------------------------------------------------------------------------

PROMPTS = [[2, 3, 4], [5, 6], [7, 8, 9, 10], [11, 12, 2], [3, 3], [4, 12, 5, 13], [9], [6, 7, 8]]
SHORT = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}


def _post(connection: HTTPConnection, path: str, body: dict) -> tuple[int, dict]:
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def test_load_256_requests_from_64_clients_then_abort(dense_model):
    engine_kwargs = {"batch_invariant": True}  # answers independent of what else is in the batch
    reference = make_engine(dense_model, **engine_kwargs)
    expected = [reference.generate(p, SHORT)[0]["output_ids"] for p in PROMPTS]
    handle = serve(dense_model, engine_kwargs=engine_kwargs)
    host, port = handle.url.removeprefix("http://").rsplit(":", 1)
    failures, answers = [], {}

    def client(index: int) -> None:
        """4 requests: even clients on one keep-alive connection, odd ones dial for each."""
        connection = HTTPConnection(host, int(port), timeout=60)
        try:
            for i in range(index * 4, index * 4 + 4):
                if index % 2:
                    connection.close()
                    connection = HTTPConnection(host, int(port), timeout=60)
                status, answer = _post(connection, "/generate", {
                    "input_ids": PROMPTS[i % len(PROMPTS)], "sampling_params": SHORT, "rid": f"load-{i}"})
                answers[i] = (status, answer)
        except Exception as error:  # noqa: BLE001 - a reset or a lost answer is the failure
            failures.append(f"client {index}: {type(error).__name__}: {error}")
        finally:
            connection.close()

    try:
        with ThreadPoolExecutor(64) as pool:
            list(pool.map(client, range(64)))
        assert not failures, failures[:5]
        assert sorted(answers) == list(range(256))
        for i, (status, answer) in answers.items():
            assert status == 200 and answer["meta_info"]["id"] == f"load-{i}", answer
            assert answer["output_ids"] == expected[i % len(PROMPTS)], i
            assert answer["text"] == reference.tokenizer.decode(answer["output_ids"])
        _abort_while_loaded(handle, host, int(port))
    finally:
        handle.shutdown()


def _abort_while_loaded(handle, host: str, port: int) -> None:
    long = {"temperature": 0.0, "max_new_tokens": 100, "ignore_eos": True}
    results = {}

    def client(i: int) -> None:
        connection = HTTPConnection(host, port, timeout=60)
        results[i] = _post(connection, "/generate", {"input_ids": PROMPTS[i % len(PROMPTS)],
                                                     "sampling_params": long, "rid": f"long-{i}"})
        connection.close()

    http(handle.url, "/pause_generation", {"mode": "in_place"})  # all 16 in before any can finish
    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for _ in range(500):  # bounded: until the engine holds them all
        _, loads = http(handle.url, "/v1/loads")
        if loads["aggregate"]["total_reqs"] == 16:
            break
        time.sleep(0.01)
    assert loads["aggregate"]["total_reqs"] == 16, loads
    http(handle.url, "/continue_generation", {})
    assert http(handle.url, "/abort_request", {"rid": "long-3"})[0] == 200  # while the 16 generate
    for thread in threads:
        thread.join(60)
    assert sorted(results) == list(range(16))
    for i, (status, answer) in results.items():
        assert status == 200, answer
        reason = answer["meta_info"]["finish_reason"]
        if i == 3:
            assert reason["type"] == "abort" and len(answer["output_ids"]) < 100, answer["meta_info"]
        else:
            assert reason == {"type": "length", "length": 100}
    _, loads = http(handle.url, "/v1/loads")
    assert loads["aggregate"]["total_reqs"] == 0


def test_waiting_requests_hold_no_threads(fresh_server):
    """48 requests held by a paused engine are all admitted, and the server still answers:
    a handler awaiting its result holds no thread (the thread pool has 40)."""
    host, port = fresh_server.url.removeprefix("http://").rsplit(":", 1)
    http(fresh_server.url, "/pause_generation", {"mode": "in_place"})
    results = {}

    def client(i: int) -> None:
        connection = HTTPConnection(host, int(port), timeout=60)
        results[i] = _post(connection, "/generate", {"input_ids": PROMPTS[i % len(PROMPTS)], "sampling_params": SHORT})
        connection.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(48)]
    for thread in threads:
        thread.start()
    for _ in range(500):  # bounded: until every request is in the engine
        load = http(fresh_server.url, "/v1/loads")[1]["loads"][0]
        if load["num_total_reqs"] == 48:
            break
        time.sleep(0.01)
    assert load["num_total_reqs"] == 48, load
    started = time.monotonic()
    assert http(fresh_server.url, "/health")[0] == 200 and time.monotonic() - started < 2.0
    http(fresh_server.url, "/continue_generation", {})
    for thread in threads:
        thread.join(60)
    assert len(results) == 48 and all(status == 200 for status, _ in results.values())
