"""/generate's logprob, batch and streaming fields in SGLang's ``meta_info`` layout
(``tokenizer_manager``: ``[logprob, token id, text or None]`` triples), checked against
transformers' own float64 log-softmax of the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles_sglang.protocol import decode_routed_experts
from tests.plugins.sglang.conftest import http, serve, sse_events

PROMPT = [2, 3, 12, 4, 13, 5]
GREEDY = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(dense_model):
    """``logprobs(ids)``: float64 log-softmax of transformers' logits at every position."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(dense_model).double().eval()

    def logprobs(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0], -1).numpy()

    return logprobs


@pytest.fixture(scope="module")
def tokenizer(dense_model):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(dense_model)


def test_token_ids_logprob_and_text_in_logprobs(server, reference, tokenizer):
    asked = [3, 7, 1]
    status, out = http(server.url, "/generate", {
        "input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "token_ids_logprob": asked,
        "return_text_in_logprobs": True, "top_logprobs_num": 2})
    assert status == 200, out
    meta = out["meta_info"]
    ids = out["output_ids"]
    expected = reference(PROMPT + ids)[len(PROMPT) - 1:-1]
    assert [e[1] for e in meta["output_token_logprobs"]] == ids
    np.testing.assert_allclose([e[0] for e in meta["output_token_logprobs"]], expected[np.arange(len(ids)), ids], atol=1e-4)
    assert [e[2] for e in meta["output_token_logprobs"]] == [tokenizer.decode([t]) for t in ids]
    rows = meta["output_token_ids_logprobs"]
    assert len(rows) == len(ids)
    for row, position in zip(rows, expected):
        assert [e[1] for e in row] == asked and [e[2] for e in row] == [tokenizer.decode([t]) for t in asked]
        np.testing.assert_allclose([e[0] for e in row], position[asked], atol=1e-4)
    for row, position in zip(meta["output_top_logprobs"], expected):
        assert [e[1] for e in row] == list(np.argsort(-position)[:2])
    # logprob_start_len -1: SGLang starts the prompt's logprobs at its last token, which has none
    assert meta["input_token_logprobs"] == [[None, PROMPT[-1], tokenizer.decode([PROMPT[-1]])]]
    assert meta["input_token_ids_logprobs"] == [None] and meta["input_top_logprobs"] == [None]


def test_logprob_start_len_gives_input_logprobs_and_top(server, reference):
    status, out = http(server.url, "/generate", {
        "input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 1}, "return_logprob": True,
        "logprob_start_len": 2, "top_logprobs_num": 3, "token_ids_logprob": [4]})
    assert status == 200, out
    meta, expected = out["meta_info"], reference(PROMPT)
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT[2:] and entries[0][0] is None and all(e[2] is None for e in entries)
    np.testing.assert_allclose([e[0] for e in entries[1:]], expected[np.arange(2, len(PROMPT) - 1), PROMPT[3:]], atol=1e-4)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(PROMPT) - 2
    for row, position in zip(meta["input_top_logprobs"][1:], expected[2:-1]):
        assert [e[1] for e in row] == list(np.argsort(-position)[:3])
        np.testing.assert_allclose([e[0] for e in row], np.sort(position)[::-1][:3], atol=1e-4)
    assert [row[0][1] for row in meta["input_token_ids_logprobs"][1:]] == [4] * (len(PROMPT) - 3)


def test_without_return_logprob_no_logprob_fields(server):
    _, out = http(server.url, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, "top_logprobs_num": 2})
    assert not [k for k in out["meta_info"] if "logprobs" in k]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": GREEDY["max_new_tokens"]}  # SGLang's FINISH_LENGTH
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == len(out["output_ids"])
    assert isinstance(meta["weight_version"], str) and isinstance(meta["e2e_latency"], float)
    assert {"id", "cached_tokens"} <= set(meta)


def test_batch_with_rid_list_per_prompt_params_and_per_prompt_logprob_fields(server):
    body = {"input_ids": [PROMPT, [5, 6]], "rid": ["batch-a", "batch-b"],
            "sampling_params": [{**GREEDY, "max_new_tokens": 2}, {**GREEDY, "max_new_tokens": 3}],
            "return_logprob": [True, False], "top_logprobs_num": [2, 0], "token_ids_logprob": [[3], None]}
    status, results = http(server.url, "/generate", body)
    assert status == 200, results
    first, second = results
    assert [r["meta_info"]["id"] for r in results] == ["batch-a", "batch-b"]
    assert [len(r["output_ids"]) for r in results] == [2, 3]
    assert len(first["meta_info"]["output_top_logprobs"][0]) == 2
    assert [row[0][1] for row in first["meta_info"]["output_token_ids_logprobs"]] == [3, 3]
    assert "output_token_logprobs" not in second["meta_info"]
    status, answer = http(server.url, "/generate", {**body, "rid": ["only-one"]})
    assert status == 400 and "'rid'" in answer["error"]["message"]


def test_batch_of_texts_equals_ids(server, tokenizer):
    texts = ["1+2=", "3+4="]
    _, by_text = http(server.url, "/generate", {"text": texts, "sampling_params": GREEDY, "return_logprob": True})
    ids = [tokenizer(t)["input_ids"] for t in texts]
    _, by_ids = http(server.url, "/generate", {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True})
    assert [r["output_ids"] for r in by_text] == [r["output_ids"] for r in by_ids]
    assert [r["text"] for r in by_text] == [r["text"] for r in by_ids]


def _stream(url: str, body: dict) -> list[dict]:
    status, text = http(url, "/generate", {**body, "stream": True})
    events = sse_events(text)
    assert status == 200 and events[-1] == "[DONE]"
    return events[:-1]


LOGPROB_BODY = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 8}, "return_logprob": True,
                "top_logprobs_num": 2, "token_ids_logprob": [3], "logprob_start_len": 3}
OUTPUT_FIELDS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def test_stream_with_logprobs_cumulative(server):
    _, whole = http(server.url, "/generate", LOGPROB_BODY)
    chunks = _stream(server.url, LOGPROB_BODY)
    assert len(chunks) >= 2
    for chunk in chunks:
        assert all(len(chunk["meta_info"][name]) == len(chunk["output_ids"]) for name in OUTPUT_FIELDS)
    last = chunks[-1]["meta_info"]
    for name in (*OUTPUT_FIELDS, "input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
        assert last[name] == whole["meta_info"][name], name


def test_stream_with_logprobs_incremental(dense_model):
    handle = serve(dense_model, incremental_streaming_output=True)
    try:
        _, whole = http(handle.url, "/generate", LOGPROB_BODY)
        chunks = _stream(handle.url, LOGPROB_BODY)
    finally:
        handle.shutdown()
    assert sum(len(c["output_ids"]) for c in chunks) == len(whole["output_ids"])
    for name in OUTPUT_FIELDS:
        assert [e for c in chunks for e in c["meta_info"][name]] == whole["meta_info"][name], name
    inputs = [c["meta_info"]["input_token_logprobs"] for c in chunks]
    assert inputs[0] == whole["meta_info"]["input_token_logprobs"] and not any(inputs[1:])


def test_routed_experts_from_start_len(moe_model):
    handle = serve(moe_model)
    try:
        body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_routed_experts": True}
        _, full = http(handle.url, "/generate", body)
        _, tail = http(handle.url, "/generate", {**body, "routed_experts_start_len": 3})
    finally:
        handle.shutdown()
    rows = len(PROMPT) + len(full["output_ids"]) - 1
    routes = decode_routed_experts(full["meta_info"]["routed_experts"], rows, 2)
    assert tail["output_ids"] == full["output_ids"] and tail["meta_info"]["routed_experts_start_len"] == 3
    np.testing.assert_array_equal(decode_routed_experts(tail["meta_info"]["routed_experts"], rows - 3, 2), routes[3:])
