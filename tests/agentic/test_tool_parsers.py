"""Tool-call parsers: each family's format -> OpenAI tool calls (checked with the openai client's own types)."""

from __future__ import annotations

import json

import pytest

from miles_host.agentic.tool_parsers import (
    TOOL_PARSERS,
    ToolParser,
    detect_tool_parser,
    get_tool_parser,
    register_tool_parser,
)

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def calls_of(parsed):
    content, calls = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_registry_names_follow_sglang_and_aliases_resolve():
    assert {"qwen25", "qwen", "hermes", "llama3", "deepseekv3", "deepseekv31"} <= set(TOOL_PARSERS)
    assert get_tool_parser("qwen") is get_tool_parser("qwen25") is get_tool_parser("hermes")
    assert get_tool_parser("deepseekv31") is get_tool_parser("deepseekv3")
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'.*qwen25"):
        get_tool_parser("mistral")
    with pytest.raises(ValueError, match="already registered"):
        register_tool_parser(ToolParser(name="llama3", parse=lambda text: (text, [])))


def test_tool_calls_have_the_openai_shape():
    types = pytest.importorskip("openai.types.chat")
    _, calls = get_tool_parser("qwen25").parse('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    entry = types.ChatCompletionMessageToolCall.model_validate(calls[0].to_openai())
    assert entry.function.name == "add" and json.loads(entry.function.arguments) == {"a": 1}
    assert entry.id.startswith("call_") and entry.type == "function"
    assert calls[0].to_openai(index=0)["index"] == 0


# ----------------------------------------------------------------------------
# Qwen / Hermes
# ----------------------------------------------------------------------------


def test_qwen_round_trips_what_its_chat_template_writes():
    """The template's rendering of an assistant turn with tool_calls parses back to those calls."""
    pytest.importorskip("transformers")
    from miles_host.agentic.chat import render_chat_text
    from tests.agentic.chat_fixtures import chat_tokenizer

    sent = [("add", {"a": 2, "b": 3}), ("lookup", {"city": "Zürich", "days": [1, 2]})]
    message = {"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(sent)]}
    text = render_chat_text(chat_tokenizer(), [message], add_generation_prompt=False)
    reply = text.removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    assert calls_of(get_tool_parser("qwen25").parse(reply)) == ("Let me compute.", sent)


def test_qwen_unterminated_and_malformed_blocks():
    parser = get_tool_parser("qwen25")
    assert calls_of(parser.parse('<tool_call>\n{"name": "f", "arguments": {}}')) == ("", [("f", {})])
    # not a call: left in the content, nothing invented
    bad = 'See <tool_call>{"name": "f", "arguments": {</tool_call> end'
    assert parser.parse(bad) == (bad, [])
    assert parser.parse("plain answer ") == ("plain answer", [])
    # arguments written as a JSON string are decoded once
    assert calls_of(parser.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')) == ("", [("f", {"x": 1})])


# ----------------------------------------------------------------------------
# Llama 3
# ----------------------------------------------------------------------------


def test_llama3_json_calls():
    parser = get_tool_parser("llama3")
    assert calls_of(parser.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}')) == (
        "", [("get_weather", {"city": "Paris"})])
    two = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert calls_of(parser.parse(two)) == ("", [("a", {"x": 1}), ("b", {})])
    assert calls_of(parser.parse('Checking.<|python_tag|>{"name": "a", "arguments": {"y": 2}}')) == (
        "Checking.", [("a", {"y": 2})])


def test_llama3_leaves_prose_and_non_calls_alone():
    parser = get_tool_parser("llama3")
    for text in ('The set {1, 2} has two elements.', '{"answer": 4}', '{"name": "a", "parameters": {}} trailing words'):
        assert parser.parse(text) == (text.strip(), [])


# ----------------------------------------------------------------------------
# DeepSeek
# ----------------------------------------------------------------------------


def test_deepseek_v3_form():
    text = (f"Let me check.{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{\"city\": \"Tokyo\"}}\n```{DS_CALL_END}"
            f"{DS_CALL}function{DS_SEP}get_time\n```json\n{{}}\n```{DS_CALL_END}{DS_END}")
    assert calls_of(get_tool_parser("deepseekv3").parse(text)) == (
        "Let me check.", [("get_weather", {"city": "Tokyo"}), ("get_time", {})])


def test_deepseek_v31_form():
    text = f"{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{\"city\": \"Tokyo\"}}{DS_CALL_END}{DS_END}"
    assert calls_of(get_tool_parser("deepseekv31").parse(text)) == ("", [("get_weather", {"city": "Tokyo"})])
    broken = f"{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{\"city\": {DS_CALL_END}{DS_END}"
    assert get_tool_parser("deepseekv3").parse(broken) == (broken, [])


# ----------------------------------------------------------------------------
# choosing a parser; streaming
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("model_type, template, expected", [
    (None, "{{ '<tool_call>' }}", "qwen25"),
    ("llama", "... {{ '<|python_tag|>' + call }} ...", "llama3"),
    ("qwen2", "{{ '<｜tool▁calls▁begin｜>' }}", "deepseekv3"),  # a DeepSeek-R1 distill on a Qwen body
    ("qwen3", None, "qwen25"),
    ("deepseek_v3", "no markers", "deepseekv3"),
    ("gpt2", "no markers", None),
])
def test_detect_by_template_then_model_type(model_type, template, expected):
    parser = detect_tool_parser(model_type=model_type, chat_template=template)
    assert (parser.name if parser else None) == expected


def test_streamable_prefix_never_includes_part_of_a_call():
    qwen, llama = get_tool_parser("qwen25"), get_tool_parser("llama3")
    assert qwen.streamable_prefix("Hello there") == len("Hello there")
    assert qwen.streamable_prefix("Hello <tool") == len("Hello ")  # could be the start of <tool_call>
    assert qwen.streamable_prefix('Hello <tool_call>{"na') == len("Hello ")
    assert qwen.streamable_prefix("  ") == 0
    assert llama.streamable_prefix('{"name"') == 0  # a Llama 3 reply that starts with JSON is a call
    assert llama.streamable_prefix("Sure, <|python") == len("Sure, ")


# ----------------------------------------------------------------------------
# forced calls
# ----------------------------------------------------------------------------

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
NOW = {"type": "function", "function": {"name": "now"}}


def test_required_calls_schema_and_parse():
    from miles_host.agentic.tool_parsers import forced_tool_calls

    parser, schema = forced_tool_calls([ADD, NOW], "required")
    reply = '[{"name": "add", "parameters": {"a": 1}}, {"name": "now", "parameters": {}}]'
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(reply), schema)
    for wrong in ([], [{"name": "sub", "parameters": {"a": 1}}], [{"name": "add", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    assert calls_of(parser.parse(reply)) == ("", [("add", {"a": 1}), ("now", {})])
    assert parser.parse("[{") == ("[{", []) and parser.streamable_prefix("[{") == 0


def test_named_call_schema_and_parse():
    from miles_host.agentic.tool_parsers import forced_tool_calls

    parser, schema = forced_tool_calls([ADD, NOW], {"type": "function", "function": {"name": "add"}})
    assert schema == ADD["function"]["parameters"]
    assert calls_of(parser.parse(' {"a": 7}')) == ("", [("add", {"a": 7})])
    assert forced_tool_calls([NOW], {"type": "function", "function": {"name": "now"}})[1] == {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match="'sub', which is not in tools"):
        forced_tool_calls([ADD], {"type": "function", "function": {"name": "sub"}})
