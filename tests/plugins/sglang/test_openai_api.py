"""`miles serve`'s OpenAI API, driven by the official `openai` Python client.

References: texts and logprobs are checked against transformers running the same
checkpoint (greedy tokens, float64 log-softmax), prompt sizes against the
tokenizer's own ``apply_chat_template``, response objects are parsed by the
client's own types. Tool calls come from a test model whose greedy reply is set up
to be a Qwen-format call (:func:`tests.agentic.chat_fixtures.build_successor_model`),
so the whole path runs: engine, text, parser, ``tool_calls``.
"""

from __future__ import annotations

import json

import pytest
import torch

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

from tests.agentic.chat_fixtures import build_chat_model, build_successor_model  # noqa: E402
from tests.plugins.sglang.conftest import serve  # noqa: E402

CALL_JSON = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
TOOL_REPLY = ["\n", "Sure", "<tool_call>", CALL_JSON, "</tool_call>", "<|im_end|>"]
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}}
HELLO = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("openai_chat") / "model")


@pytest.fixture(scope="module")
def chat_server(chat_model):
    handle = serve(chat_model)
    yield handle
    handle.shutdown()


@pytest.fixture(scope="module")
def client(chat_server):
    return openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(chat_model):
    return str(chat_model)


@pytest.fixture(scope="module")
def reference(chat_model):
    """The checkpoint in transformers, float64: greedy continuations and their logprobs."""
    model = transformers.AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float64).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model)

    @torch.no_grad()
    def greedy(prompt_ids: list[int], steps: int) -> tuple[list[int], list[list[float]]]:
        ids, logprob_rows = list(prompt_ids), []
        for _ in range(steps):
            row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1)
            logprob_rows.append(row.tolist())
            ids.append(int(row.argmax()))
        return ids[len(prompt_ids):], logprob_rows

    return tokenizer, greedy


def until_eos(tokenizer, ids: list[int]) -> list[int]:
    """The ids before the first ``<|im_end|>`` (the EOS), which OpenAI text leaves out."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return ids[:ids.index(eos)] if eos in ids else ids


def chat_prompt(tokenizer, messages, **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)


# ----------------------------------------------------------------------------
# models, completions, chat
# ----------------------------------------------------------------------------


def test_models(client, model_id):
    listed = client.models.list()
    assert [m.id for m in listed.data] == [model_id]
    assert client.models.retrieve(model_id).id == model_id


def test_completion_is_the_greedy_continuation(client, model_id, reference):
    tokenizer, greedy = reference
    prompt = "12+3="
    expected_ids, _ = greedy(tokenizer(prompt)["input_ids"], 6)
    kept = until_eos(tokenizer, expected_ids)
    result = client.completions.create(model=model_id, prompt=prompt, max_tokens=6, temperature=0)
    choice = result.choices[0]
    assert choice.text == tokenizer.decode(kept, skip_special_tokens=True)
    assert choice.finish_reason == ("length" if kept == expected_ids else "stop")
    assert result.object == "text_completion" and result.model == model_id
    assert result.usage.prompt_tokens == len(prompt)
    assert result.usage.completion_tokens == min(len(kept) + 1, 6)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_completion_streaming_equals_whole(client, model_id):
    kwargs = dict(model=model_id, prompt=["1+1=", "2+2="], max_tokens=8, temperature=0)
    whole = client.completions.create(**kwargs)
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert [reasons[0], reasons[1]] == [c.finish_reason for c in whole.choices]


def test_chat_renders_the_template_and_streams_the_same_text(client, model_id, reference):
    tokenizer, greedy = reference
    prompt_ids = chat_prompt(tokenizer, HELLO)
    expected_ids, _ = greedy(prompt_ids, 5)
    whole = client.chat.completions.create(model=model_id, messages=HELLO, max_completion_tokens=5, temperature=0)
    choice = whole.choices[0]
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert choice.message.role == "assistant"
    kept = until_eos(tokenizer, expected_ids)
    assert choice.message.content == tokenizer.decode(kept, skip_special_tokens=True)
    assert choice.finish_reason == ("length" if kept == expected_ids else "stop")

    streamed, roles, finish = "", [], None
    for chunk in client.chat.completions.create(model=model_id, messages=HELLO, max_completion_tokens=5,
                                                temperature=0, stream=True):
        delta = chunk.choices[0].delta
        roles += [delta.role] if delta.role else []
        streamed += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"] and streamed == choice.message.content and finish == choice.finish_reason


def test_chat_template_kwargs_change_the_prompt(client, model_id, reference):
    tokenizer, _ = reference
    result = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=1, temperature=0,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert result.usage.prompt_tokens == len(chat_prompt(tokenizer, HELLO, enable_thinking=False))
    assert result.usage.prompt_tokens > len(chat_prompt(tokenizer, HELLO))


# ----------------------------------------------------------------------------
# sampling fields
# ----------------------------------------------------------------------------


def test_n_and_seed(client, model_id):
    kwargs = dict(model=model_id, messages=HELLO, max_tokens=8, temperature=1.0, n=3)
    first = client.chat.completions.create(seed=7, **kwargs)
    again = client.chat.completions.create(seed=7, **kwargs)
    other = client.chat.completions.create(seed=8, **kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert texts != [c.message.content for c in other.choices]
    assert len(set(texts)) > 1  # the samples differ from each other
    assert first.usage.prompt_tokens == again.usage.prompt_tokens  # the prompt counts once, not per sample


def test_streamed_samples_equal_whole_ones(client, model_id):
    kwargs = dict(model=model_id, messages=HELLO, max_tokens=6, temperature=1.0, n=2, seed=3)
    whole = client.chat.completions.create(**kwargs)
    texts, usage = ["", ""], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens and usage.prompt_tokens == whole.usage.prompt_tokens


def test_greedy_is_deterministic(client, model_id):
    kwargs = dict(model=model_id, messages=HELLO, max_tokens=8, temperature=0)
    assert len({client.chat.completions.create(seed=s, **kwargs).choices[0].message.content for s in (1, 2, 3)}) == 1


def test_max_tokens_and_stop(client, model_id, reference):
    tokenizer, greedy = reference
    prompt = "7+8="
    expected_ids, _ = greedy(tokenizer(prompt)["input_ids"], 12)
    text = tokenizer.decode(expected_ids)
    assert "<|im_end|>" not in text[:12], "the random model ended early; pick another prompt"
    stop = text[4]
    cut = text.index(stop)
    result = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    choice = result.choices[0]
    assert choice.text == text[:cut] and choice.finish_reason == "stop"
    assert choice.model_extra.get("matched_stop") == stop
    short = client.completions.create(model=model_id, prompt=prompt, max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    assert short.choices[0].text == text[:3]


def test_chat_logprobs_and_top_logprobs(client, model_id, reference):
    tokenizer, greedy = reference
    expected_ids, rows = greedy(chat_prompt(tokenizer, HELLO), 4)
    result = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=4, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = result.choices[0].logprobs.content
    assert len(content) >= 1
    for position, entry in enumerate(content):
        token_id = expected_ids[position]
        assert entry.token == tokenizer.decode([token_id])
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(rows[position][token_id], abs=1e-4)
    for position, top in enumerate(entry.top_logprobs for entry in content):
        best = sorted(range(len(rows[position])), key=lambda i: -rows[position][i])[:3]
        assert [t.token for t in top] == [tokenizer.decode([i]) for i in best]
        assert [t.logprob for t in top] == pytest.approx([rows[position][i] for i in best], abs=1e-4)


def test_completion_logprobs(client, model_id, reference):
    tokenizer, greedy = reference
    prompt = "3+4="
    expected_ids, rows = greedy(tokenizer(prompt)["input_ids"], 4)
    result = client.completions.create(model=model_id, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    logprobs = result.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([i]) for i in expected_ids[:len(logprobs.tokens)]]
    assert logprobs.token_logprobs == pytest.approx([rows[p][i] for p, i in enumerate(expected_ids[:len(logprobs.tokens)])],
                                                    abs=1e-4)
    assert logprobs.text_offset[0] == 0 and len(logprobs.top_logprobs) == len(logprobs.tokens)
    for position, top in enumerate(logprobs.top_logprobs):
        best = sorted(range(len(rows[position])), key=lambda i: -rows[position][i])[:2]
        assert top == pytest.approx({tokenizer.decode([i]): rows[position][i] for i in best}, abs=1e-4)


# ----------------------------------------------------------------------------
# tools
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_client(tmp_path_factory):
    path = build_successor_model(tmp_path_factory.mktemp("openai_tools") / "model", TOOL_REPLY)
    handle = serve(path)
    yield openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0, timeout=60), str(path)
    handle.shutdown()


def test_a_tool_call_is_parsed(tool_client):
    client, model = tool_client
    messages = [{"role": "user", "content": "What is 2+3?"}]
    result = client.chat.completions.create(model=model, messages=messages, tools=[ADD_TOOL], temperature=0)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}

    # the call goes back into the conversation and renders again
    follow = [*messages, choice.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    again = client.chat.completions.create(model=model, messages=follow, tools=[ADD_TOOL], temperature=0)
    assert again.choices[0].finish_reason == "tool_calls"


def test_a_streamed_tool_call(tool_client):
    client, model = tool_client
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "2+3?"}],
                                                tools=[ADD_TOOL], temperature=0, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        assert "<tool_call>" not in content
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Sure" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("add", {"a": 2, "b": 3})]


def test_tool_choice_none_leaves_the_text_alone(tool_client):
    client, model = tool_client
    result = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "2+3?"}],
                                            tools=[ADD_TOOL], tool_choice="none", temperature=0)
    choice = result.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == f"Sure<tool_call>{CALL_JSON}</tool_call>"


STRICT_ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}
STRICT_NEG = {"type": "function", "function": {"name": "neg", "parameters": {
    "type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"], "additionalProperties": False}}}


def forced(client, model_id, **kwargs):
    """A chat call whose tool_choice forces a call (constrained decoding); skipped without a grammar backend.

    Sampled, not greedy: the schema allows whitespace between JSON tokens, and a random
    model's argmax among the allowed tokens can be whitespace forever."""
    try:
        return client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "2+3?"}],
                                              tools=[STRICT_ADD, STRICT_NEG], max_tokens=600, temperature=1.0, seed=0,
                                              **kwargs)
    except openai.BadRequestError as error:
        if "xgrammar" in str(error) or "json_schema" in str(error):
            pytest.skip(f"the engine has no grammar backend here: {error.body['message']}")
        raise


def test_tool_choice_required_forces_a_call_even_from_a_random_model(client, model_id):
    choice = forced(client, model_id, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and not choice.message.content
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments)
        expected = {"add": {"a", "b"}, "neg": {"x"}}[call.function.name]
        assert set(arguments) == expected


def test_a_named_tool_choice_calls_that_function(client, model_id):
    choice = forced(client, model_id, tool_choice={"type": "function", "function": {"name": "neg"}}).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "neg"
    assert isinstance(json.loads(call.function.arguments)["x"], bool)


# ----------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": 5}, "temperature"),
    ({"n": 0}, "n"),
    ({"top_p": 0}, "top_p"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD_TOOL], "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"extra_body": {"top_k": -5}}, "top_k"),  # refused by the engine's own check, named in the request's terms
])
def test_bad_chat_requests_are_openai_400s(client, model_id, kwargs, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**{"model": model_id, "messages": HELLO, **kwargs})
    assert raised.value.status_code == 400
    error = raised.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_bad_completion_request(client, model_id):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model_id, prompt="1+1=", best_of=3)
    assert raised.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model_id, prompt="", max_tokens=2)
    assert raised.value.body["param"] == "prompt"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert raised.value.body["code"] == "model_not_found" and raised.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_a_body_that_is_not_json(chat_server):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(chat_server.url + "/v1/chat/completions", data=b"{nope", method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=30)
    assert raised.value.code == 400
    assert json.loads(raised.value.read())["error"]["type"] == "invalid_request_error"


def test_echo_puts_the_prompt_first(client, model_id, reference):
    tokenizer, greedy = reference
    prompt = "5+5="
    plain = client.completions.create(model=model_id, prompt=prompt, max_tokens=3, temperature=0)
    echoed = client.completions.create(model=model_id, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                       logprobs=0)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    logprobs = echoed.choices[0].logprobs
    assert logprobs.tokens[:len(prompt)] == list(prompt)
    assert logprobs.token_logprobs[0] is None  # the first prompt token has no logprob
    ids = tokenizer(prompt)["input_ids"]
    _, rows = greedy(ids[:1], 1)
    assert logprobs.token_logprobs[1] == pytest.approx(rows[0][ids[1]], abs=1e-4)


def test_the_api_key_guards_the_openai_routes(chat_model):
    handle = serve(chat_model, api_key="sesame")
    try:
        url = handle.url + "/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=url, api_key="sesame", max_retries=0).models.list().data
    finally:
        handle.shutdown()


def test_served_model_name_and_tool_call_parser_flags(chat_model):
    import argparse

    from miles_sglang.serve_cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model-path", str(chat_model), "--served-model-name", "tiny-chat",
                              "--tool-call-parser", "llama3"])
    handle = serve(chat_model, server_args=vars(args))
    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-chat"]
        assert client.chat.completions.create(model="tiny-chat", messages=HELLO, max_tokens=1).choices
    finally:
        handle.shutdown()
    from types import SimpleNamespace

    from miles_sglang.openai_api import build_openai_router

    state = SimpleNamespace(server_args={"tool_call_parser": "nope"}, model_path=str(chat_model),
                            worker=SimpleNamespace(engine=SimpleNamespace(tokenizer=None)))
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        build_openai_router(state)
