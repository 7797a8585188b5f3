"""OpenAI chat messages rendered through the tokenizer's chat template."""

from __future__ import annotations

import pytest

from miles_host.agentic.chat import ChatTemplateError, normalize_messages, render_chat, render_chat_text

transformers = pytest.importorskip("transformers")

from tests.agentic.chat_fixtures import chat_tokenizer  # noqa: E402

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_conversation_renders_as_the_qwen_format_writes_it(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}]
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert render_chat_text(tokenizer, messages) == expected
    ids = render_chat(tokenizer, messages)
    assert ids == ids_of(tokenizer, expected)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # markup is one token, not characters


def test_generation_prompt_and_continue_final_message(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    assert render_chat_text(tokenizer, messages, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"
    prefill = [*messages, {"role": "assistant", "content": "Hel"}]
    text = render_chat_text(tokenizer, prefill, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHel")
    with pytest.raises(ChatTemplateError, match="cannot both"):
        render_chat(tokenizer, prefill, add_generation_prompt=True, continue_final_message=True)


def test_chat_template_kwargs_reach_the_template(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    plain = render_chat_text(tokenizer, messages)
    no_think = render_chat_text(tokenizer, messages, chat_template_kwargs={"enable_thinking": False})
    assert no_think == plain + "<think>\n\n</think>\n\n"
    with pytest.raises(ChatTemplateError, match="tools"):
        render_chat(tokenizer, messages, chat_template_kwargs={"tools": []})


def test_tools_and_tool_turns(tokenizer):
    messages = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    text = render_chat_text(tokenizer, messages, tools=[ADD_TOOL])
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>\n")
    assert '"name": "add", "description": "Add two integers."' in text
    # the arguments string was handed to the template as an object: encoded once, not twice
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in text
    assert render_chat(tokenizer, messages, tools=[ADD_TOOL]) == ids_of(tokenizer, text)


def test_content_parts_and_developer_role():
    messages = normalize_messages([
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ])
    assert messages == [{"role": "system", "content": "Rules."}, {"role": "user", "content": "ab"}]


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], r"messages\[0\]\.content\[0\]"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], r"messages\[0\] has tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     r"messages\[0\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"),
])
def test_malformed_messages_name_the_field(tokenizer, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(tokenizer, messages)


def test_a_tokenizer_without_a_template_is_a_clear_error():
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(chat_tokenizer(chat_template=None), [{"role": "user", "content": "Hi"}])
    with pytest.raises(ChatTemplateError, match="no tokenizer"):
        render_chat(None, [{"role": "user", "content": "Hi"}])


def test_a_template_error_is_a_chat_template_error():
    broken = chat_tokenizer(chat_template="{{ raise_exception('only user turns') }}")
    with pytest.raises(ChatTemplateError, match="only user turns"):
        render_chat(broken, [{"role": "user", "content": "Hi"}])
