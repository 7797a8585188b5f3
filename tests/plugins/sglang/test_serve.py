"""`miles serve`: the embedded engine behind SGLang's HTTP endpoints."""

from __future__ import annotations

import base64
import json
import pickle
import threading
import time

import numpy as np
import pytest
import torch

from miles_sglang.protocol import (
    decode_routed_experts,
    decode_tensor_payload,
    encode_routed_experts,
    encode_tensor_payload,
)
from miles_sglang.weights import family_and_config, native_to_hf
from tests.plugins.sglang.conftest import http, make_engine, serve, sse_events

GREEDY = {"temperature": 0.0, "max_new_tokens": 6}

# Request/response fields as SGLang names them. Sources (sgl-project/sglang):
#   GenerateReqInput ........ python/sglang/srt/managers/io_struct.py (rid, text, input_ids, sampling_params,
#                             return_logprob, logprob_start_len, stream, return_routed_experts)
#   generate_request / SSE .. python/sglang/srt/entrypoints/http_server.py ("data: " + json + "\n\n", "data: [DONE]")
#   _create_error_response .. http_server.py: {"error": {"message": str(e)}}, HTTP 400
#   add_api_key_middleware .. srt/utils: 401 {"error": "Unauthorized"}, /health* exempt
#   get_model_info .......... http_server.py: model_path, tokenizer_path, is_generation, preferred_sampling_params, weight_version
#   update_weights_* ........ http_server.py: {"success", "message"} (+ "num_paused_requests" from disk), 400 on failure
#   pause/continue .......... http_server.py: {"message": ..., "status": "ok"}
#   meta_info ............... tokenizer_manager: id, finish_reason, prompt_tokens, completion_tokens, cached_tokens,
#                             output_token_logprobs [[logprob, token_id, text|None]], weight_version, e2e_latency
#   /server_info, /model_info  aliases of /get_server_info, /get_model_info (SGLang's newer names)
#   /v1/loads ............... entrypoints/v1_loads.py: timestamp, version, dp_rank_count, loads, aggregate;
#                             each load GetLoadsReqOutput (io_struct.py) + num_total_reqs
#   /update_weight_version .. http_server.py: UpdateWeightVersionReqInput(new_version, abort_all_requests)
#                             -> {"success", "message", "new_version"}
MODEL_INFO = {"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params", "weight_version"}
SERVER_INFO = {"internal_states", "version", "max_total_num_tokens"}
PROTOCOL = {
    "/get_model_info": ("GET", None, MODEL_INFO),
    "/model_info": ("GET", None, MODEL_INFO),
    "/get_server_info": ("GET", None, SERVER_INFO),
    "/server_info": ("GET", None, SERVER_INFO),
    "/get_weight_version": ("GET", None, {"weight_version"}),
    "/v1/loads": ("GET", None, {"timestamp", "version", "dp_rank_count", "loads", "aggregate"}),
}
LOAD_FIELDS = {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens",
               "num_total_tokens", "max_total_num_tokens", "token_usage", "max_running_requests", "utilization"}
AGGREGATE_FIELDS = {"total_running_reqs", "total_waiting_reqs", "total_reqs", "total_used_tokens", "total_tokens",
                    "avg_token_usage", "avg_utilization"}
META_FIELDS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "output_token_logprobs",
               "weight_version", "e2e_latency"}


def without_latency(result: dict) -> dict:
    return {**result, "meta_info": {k: v for k, v in result["meta_info"].items() if k != "e2e_latency"}}


@pytest.mark.parametrize("path", sorted(PROTOCOL))
def test_endpoint_fields(server, path):
    method, body, fields = PROTOCOL[path]
    status, answer = http(server.url, path, body, method=method)
    assert status == 200, answer
    assert fields <= set(answer), f"{path} lacks {fields - set(answer)}"


def test_loads_report(server):
    _, loads = http(server.url, "/v1/loads")
    assert loads["dp_rank_count"] == 1 and len(loads["loads"]) == 1
    load = loads["loads"][0]
    assert LOAD_FIELDS <= set(load) and AGGREGATE_FIELDS <= set(loads["aggregate"])
    assert load["num_total_reqs"] == load["num_running_reqs"] + load["num_waiting_reqs"]
    assert load["max_total_num_tokens"] == http(server.url, "/server_info")[1]["max_total_num_tokens"]
    assert set(load["queues"]) == {"waiting", "grammar", "paused", "retracted"}
    assert "queues" not in http(server.url, "/v1/loads?include=core")[1]["loads"][0]
    assert http(server.url, "/v1/loads?include=nonsense")[0] == 400
    assert http(server.url, "/v1/loads?dp_rank=3")[0] == 400


def test_weight_version_is_a_string_everywhere(fresh_server):
    assert http(fresh_server.url, "/get_weight_version")[1]["weight_version"] == "default"  # SGLang's default
    status, answer = http(fresh_server.url, "/update_weight_version", {"new_version": "v2"})
    assert status == 200 and answer["success"] and answer["new_version"] == "v2", answer
    for path in ("/get_weight_version", "/model_info", "/server_info"):
        assert http(fresh_server.url, path)[1]["weight_version"] == "v2", path
    _, result = http(fresh_server.url, "/generate", {"input_ids": [2, 3], "sampling_params": GREEDY})
    assert result["meta_info"]["weight_version"] == "v2"
    assert http(fresh_server.url, "/update_weight_version", {"new_version": 3})[0] == 400


def _unfinished(url: str) -> bool:
    return http(url, "/get_server_info")[1]["internal_states"][0]["has_unfinished"]


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(fresh_server, stream):
    """Generation is paused, so only an abort can finish the request once its client left."""
    import http.client as httpclient

    host, port = fresh_server.url.removeprefix("http://").rsplit(":", 1)
    http(fresh_server.url, "/pause_generation", {"mode": "in_place"})
    connection = httpclient.HTTPConnection(host, int(port), timeout=30)
    body = {"input_ids": [2, 3], "stream": stream, "rid": "gone",
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 50, "ignore_eos": True}}
    connection.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    for _ in range(300):  # bounded: until the engine holds the request
        if _unfinished(fresh_server.url):
            break
        time.sleep(0.01)
    assert _unfinished(fresh_server.url)
    connection.sock.shutdown(2)  # the client goes away without reading
    connection.close()
    for _ in range(300):  # the server notices (within its 1 s poll) and aborts
        if not _unfinished(fresh_server.url):
            break
        time.sleep(0.01)
    assert not _unfinished(fresh_server.url)
    http(fresh_server.url, "/continue_generation", {})


def test_pause_and_continue(fresh_server):
    for path, body in (("/pause_generation", {"mode": "in_place"}), ("/continue_generation", {})):
        status, answer = http(fresh_server.url, path, body)
        assert status == 200 and answer["status"] == "ok" and "message" in answer
    assert http(fresh_server.url, "/pause_generation", {"mode": "sideways"})[0] == 400


def test_generate_matches_embedded_engine(server, dense_model):
    status, result = http(server.url, "/generate", {"input_ids": [2, 3, 4], "sampling_params": GREEDY, "return_logprob": True})
    assert status == 200, result
    assert META_FIELDS <= set(result["meta_info"])
    reference = make_engine(dense_model).generate([2, 3, 4], GREEDY, return_logprob=True)[0]
    assert result["output_ids"] == reference["output_ids"]
    entries = result["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == result["output_ids"] and all(len(e) == 3 for e in entries)
    np.testing.assert_allclose([e[0] for e in entries], [e[0] for e in reference["meta_info"]["output_token_logprobs"]], atol=1e-5)
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert result["meta_info"]["prompt_tokens"] == 3 and result["meta_info"]["completion_tokens"] == 6


def test_generate_top_logprobs_num(server):
    """SGLang's ``top_logprobs_num``: per generated token ``[[logprob, id, text], ...]``, best first;
    greedy, so the best is the sampled token with its own logprob."""
    body = {"input_ids": [2, 3, 4], "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 3}
    status, result = http(server.url, "/generate", body)
    assert status == 200, result
    meta = result["meta_info"]
    assert len(meta["output_top_logprobs"]) == len(result["output_ids"])
    for chosen, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 3 and [e[0] for e in top] == sorted((e[0] for e in top), reverse=True)
        assert top[0][1] == chosen[1] and top[0][0] == pytest.approx(chosen[0], abs=1e-6)


def test_text_input_and_batches(server):
    _, by_text = http(server.url, "/generate", {"text": "1+2=", "sampling_params": GREEDY})
    _, by_ids = http(server.url, "/generate", {"input_ids": [3, 12, 4, 13], "sampling_params": GREEDY})
    assert by_text["output_ids"] == by_ids["output_ids"]
    status, batch = http(server.url, "/generate", {"input_ids": [[3, 12, 4, 13], [5, 6]], "sampling_params": GREEDY})
    assert status == 200 and isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == by_ids["output_ids"]
    _, n2 = http(server.url, "/generate", {"input_ids": [5, 6], "sampling_params": {**GREEDY, "n": 2}})
    assert isinstance(n2, list) and [r["meta_info"]["index"] for r in n2] == [0, 1]


def test_input_logprobs_match_transformers(server, dense_model):
    """logprob_start_len=0: prompt logprobs against transformers' own forward."""
    import transformers

    prompt = [2, 3, 4, 12, 5]
    _, result = http(server.url, "/generate", {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 1},
                                              "return_logprob": True, "logprob_start_len": 0})
    entries = result["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt and entries[0][0] is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(dense_model).float().eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0]
    expected = torch.log_softmax(logits[:-1], -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    np.testing.assert_allclose([e[0] for e in entries[1:]], expected.numpy(), atol=1e-4)


def test_stream_cumulative_last_chunk_is_the_result(server):
    body = {"input_ids": [2, 3, 4], "sampling_params": GREEDY, "return_logprob": True}
    _, final = http(server.url, "/generate", body)
    status, text = http(server.url, "/generate", {**body, "stream": True})
    events = sse_events(text)
    assert status == 200 and events[-1] == "[DONE]" and len(events) >= 3
    chunks = events[:-1]
    for before, after in zip(chunks, chunks[1:]):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    assert without_latency(chunks[-1])["output_ids"] == final["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == final["meta_info"]["finish_reason"]


def test_stream_incremental_chunks_concatenate(dense_model):
    handle = serve(dense_model, incremental_streaming_output=True)
    try:
        body = {"input_ids": [2, 3, 4], "sampling_params": GREEDY, "return_logprob": True}
        _, final = http(handle.url, "/generate", body)
        _, text = http(handle.url, "/generate", {**body, "stream": True})
        chunks = sse_events(text)[:-1]
        assert sum((c["output_ids"] for c in chunks), []) == final["output_ids"]
        logprobs = sum((c["meta_info"]["output_token_logprobs"] for c in chunks), [])
        assert logprobs == final["meta_info"]["output_token_logprobs"]
    finally:
        handle.shutdown()


def test_abort_mid_generation_returns_partial_output(fresh_server):
    long = {"temperature": 0.0, "max_new_tokens": 100, "ignore_eos": True}
    results = {}
    thread = threading.Thread(target=lambda: results.update(
        answer=http(fresh_server.url, "/generate", {"input_ids": [2, 3], "sampling_params": long, "rid": "long-1",
                                                    "return_logprob": True})))
    http(fresh_server.url, "/pause_generation", {"mode": "in_place"})  # hold it after admission
    thread.start()
    for _ in range(200):  # bounded: until the request is in the engine
        _, info = http(fresh_server.url, "/get_server_info")
        if info["internal_states"][0]["has_unfinished"]:
            break
        time.sleep(0.01)
    http(fresh_server.url, "/continue_generation", {})
    time.sleep(0.02)
    assert http(fresh_server.url, "/abort_request", {"rid": "long-1"})[0] == 200
    thread.join(30)
    status, result = results["answer"]
    assert status == 200
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(result["output_ids"]) < 100
    assert len(result["meta_info"]["output_token_logprobs"]) == len(result["output_ids"])


def test_update_weights_from_tensor_changes_outputs_and_version(fresh_server, dense_model):
    body = {"input_ids": [2, 3, 4], "sampling_params": GREEDY, "return_logprob": True}
    _, before = http(fresh_server.url, "/generate", body)
    reference = make_engine(dense_model)
    torch.manual_seed(1)
    native = [(n, t + 0.5 * torch.randn_like(t)) for n, t in reference.model.state_dict().items() if "norm" not in n]
    reference.update_weights(native)
    family, config = family_and_config(str(dense_model))
    hf = native_to_hf(native, family, config)
    half = len(hf) // 2
    for i, part in enumerate((hf[:half], hf[half:])):  # two buckets, the version on the last
        last = i == 1
        status, answer = http(fresh_server.url, "/update_weights_from_tensor", {
            "serialized_named_tensors": [encode_tensor_payload(part, "flattened_bucket")],
            "load_format": "flattened_bucket", "flush_cache": last, "weight_version": "7" if last else None})
        assert status == 200 and answer["success"], answer
    _, after = http(fresh_server.url, "/generate", body)
    expected = reference.generate([2, 3, 4], GREEDY, return_logprob=True)[0]
    assert after["meta_info"]["weight_version"] == "7"
    assert http(fresh_server.url, "/get_model_info")[1]["weight_version"] == "7"
    assert [e[0] for e in after["meta_info"]["output_token_logprobs"]] != [e[0] for e in before["meta_info"]["output_token_logprobs"]]
    assert after["output_ids"] == expected["output_ids"]
    np.testing.assert_allclose([e[0] for e in after["meta_info"]["output_token_logprobs"]],
                               [e[0] for e in expected["meta_info"]["output_token_logprobs"]], atol=1e-5)


def test_update_weights_from_disk(fresh_server, dense_model):
    status, answer = http(fresh_server.url, "/update_weights_from_disk", {"model_path": str(dense_model), "weight_version": "disk-1"})
    assert status == 200 and answer["success"] and answer["num_paused_requests"] == 0
    assert http(fresh_server.url, "/get_weight_version")[1]["weight_version"] == "disk-1"
    status, answer = http(fresh_server.url, "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert status == 400 and answer["success"] is False


def test_update_weights_from_distributed_over_gloo(fresh_server, dense_model):
    import datetime
    import socket

    import torch.distributed as dist

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    answers = {}
    join = threading.Thread(target=lambda: answers.update(init=http(fresh_server.url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"})))
    join.start()
    group = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=30))
    join.join(30)
    assert answers["init"][0] == 200, answers["init"]
    reference = make_engine(dense_model)
    name, tensor = "model.norm.weight", torch.full((64,), 0.25)
    send = threading.Thread(target=lambda: answers.update(update=http(fresh_server.url, "/update_weights_from_distributed", {
        "names": [name], "dtypes": ["float32"], "shapes": [[64]], "weight_version": "d1"})))
    send.start()
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor.clone()], options).wait()
    send.join(30)
    assert answers["update"][0] == 200 and answers["update"][1]["success"], answers["update"]
    reference.update_weights([("norm.weight", tensor)])
    _, result = http(fresh_server.url, "/generate", {"input_ids": [2, 3, 4], "sampling_params": GREEDY})
    assert result["output_ids"] == reference.generate([2, 3, 4], GREEDY)[0]["output_ids"]
    assert result["meta_info"]["weight_version"] == "d1"


def test_pickled_payload_refuses_arbitrary_globals(server):
    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("echo pwned",))

    payload = base64.b64encode(pickle.dumps(Evil(), protocol=4)).decode()
    status, answer = http(server.url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
    assert status == 400 and answer["success"] is False and "refused to unpickle" in answer["message"]


def test_tensor_payload_round_trip_mixed_dtypes():
    named = [("a", torch.randn(3, 4)), ("b", torch.arange(5, dtype=torch.int64)), ("c", torch.randn(2).bfloat16())]
    for load_format in ("flattened_bucket", None):
        decoded = dict(decode_tensor_payload(encode_tensor_payload(named, load_format), load_format))
        assert sorted(decoded) == ["a", "b", "c"]
        for name, x in named:
            assert x.dtype == decoded[name].dtype and torch.equal(x, decoded[name])


def test_bad_requests_are_400(server):
    cases = [
        ({}, "exactly one of"),
        ({"input_ids": [2, 3], "text": "1"}, "exactly one of"),
        ({"input_ids": "23"}, "input_ids"),
        ({"input_ids": [2, 999]}, "outside the vocabulary"),
        ({"input_ids": [2, 3], "sampling_params": {"temprature": 1.0}}, "unknown sampling parameter"),
        ({"input_ids": [2, 3], "sampling_params": {"top_p": 2.0}}, "top_p"),
        ({"input_ids": [2, 3], "stream": "yes"}, "stream"),
    ]
    for body, words in cases:
        status, answer = http(server.url, "/generate", body)
        assert status == 400, (body, answer)
        assert words in answer["error"]["message"], (body, answer)
    status, answer = http(server.url, "/generate", raw=b"{not json")
    assert status == 400 and "not valid JSON" in answer["error"]["message"]
    assert http(server.url, "/nope") == (404, {"error": {"message": "no endpoint /nope"}})
    status, answer = http(server.url, "/generate", method="GET")
    assert status == 405 and "GET" in answer["error"]["message"]
    assert http(server.url, "/health")[0] == 200
    assert http(server.url, "/health_generate")[0] == 200
    assert http(server.url, "/flush_cache", {})[0] == 200


def test_api_key_required_except_health(dense_model):
    handle = serve(dense_model, api_key="sekrit")
    try:
        assert http(handle.url, "/health")[0] == 200
        status, answer = http(handle.url, "/generate", {"input_ids": [2, 3], "sampling_params": GREEDY})
        assert status == 401 and answer == {"error": "Unauthorized"}
        assert http(handle.url, "/update_weights_from_disk", {"model_path": "x"})[0] == 401
        assert http(handle.url, "/generate", {"input_ids": [2, 3], "sampling_params": GREEDY},
                    headers={"Authorization": "Bearer wrong"})[0] == 401
        assert http(handle.url, "/generate", {"input_ids": [2, 3], "sampling_params": GREEDY},
                    headers={"Authorization": "Bearer sekrit"})[0] == 200
    finally:
        handle.shutdown()


def test_non_loopback_host_needs_an_api_key(dense_model):
    from miles_sglang.server import start_server

    with pytest.raises(ValueError, match="api-key"):
        start_server(make_engine(dense_model), str(dense_model), host="0.0.0.0", port=0)


def test_routed_experts_round_trip_on_moe(moe_model):
    handle = serve(moe_model)
    try:
        prompt = [2, 3, 4, 12]
        status, result = http(handle.url, "/generate", {"input_ids": prompt, "sampling_params": GREEDY,
                                                       "return_routed_experts": True})
        assert status == 200 and isinstance(result["meta_info"]["routed_experts"], str)
        rows = len(prompt) + len(result["output_ids"]) - 1
        routes = decode_routed_experts(result["meta_info"]["routed_experts"], rows, top_k=2)
        assert routes.shape == (rows, 2, 2) and routes.dtype == np.int32
        reference = make_engine(moe_model).generate(prompt, GREEDY, return_routed_experts=True)[0]
        np.testing.assert_array_equal(routes, reference["meta_info"]["routed_experts"])
        assert (routes >= 0).all() and (routes < 8).all()
    finally:
        handle.shutdown()
    array = np.random.default_rng(0).integers(0, 8, size=(5, 3, 2), dtype=np.int32)
    np.testing.assert_array_equal(decode_routed_experts(encode_routed_experts(array), 5, 2), array)
    with pytest.raises(ValueError, match="not a multiple"):
        decode_routed_experts(encode_routed_experts(array), 4, 2)
