"""--tool-key: each record's tool definitions reach sample.metadata["tools"], the chat template
(with --apply-chat-template) and the custom generate function."""

from __future__ import annotations

import json

import pytest

from miles_host.config import MilesConfig
from miles_host.data import PromptDataset
from tests.agentic import trajectories
from tests.agentic.scripted import make_manager

CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "evaluate an expression",
                                               "parameters": {"type": "object",
                                                              "properties": {"expression": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "clock", "description": "the time", "parameters": {}}}


def write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_tools_as_a_list_or_a_json_string_go_into_the_metadata(tmp_path):
    data = write_records(tmp_path / "d.jsonl", [
        {"input": "1+1", "tools": [CALCULATOR], "metadata": {"level": 1}},
        {"input": "2+2", "tools": json.dumps([CALCULATOR, CLOCK])},
        {"input": "3+3"},
    ])
    dataset = PromptDataset.from_file(str(data), "input", None, "metadata", False, 0, tool_key="tools")
    assert [p.metadata for p in dataset.prompts] == [
        {"level": 1, "tools": [CALCULATOR]}, {"tools": [CALCULATOR, CLOCK]}, {}]
    plain = PromptDataset.from_file(str(data), "input", None, "metadata", False, 0)
    assert "tools" not in plain.prompts[0].metadata  # without --tool-key the key is not read


@pytest.mark.parametrize("tools, message", [("{not json", "is a string but not JSON"),
                                            ({"name": "calculator"}, "must be a list of tool definitions")])
def test_bad_tools_are_refused_naming_the_line(tmp_path, tools, message):
    data = write_records(tmp_path / "d.jsonl", [{"input": "1+1", "tools": [CALCULATOR]}, {"input": "x", "tools": tools}])
    with pytest.raises(ValueError, match=f"d.jsonl:2: tools 'tools' {message}"):
        PromptDataset.from_file(str(data), "input", None, "metadata", False, 0, tool_key="tools")


def test_the_tools_reach_the_chat_template_and_the_custom_generate_function(tmp_path, chat_model, chat_tokenizer):
    data = write_records(tmp_path / "d.jsonl", [{"input": "1+1", "label": "2", "tools": [CALCULATOR, CLOCK]}] * 4)
    manager, _ = make_manager("tests.agentic.trajectories.record_tools", apply_chat_template=True, tool_key="tools")
    manager.tokenizer = chat_tokenizer
    manager.dataset = PromptDataset.from_file(str(data), "input", "label", "metadata", False, 0,
                                              apply_chat_template=True, tool_key="tools")
    trajectories.SEEN_TOOLS.clear()
    groups, _ = manager.generate(0)
    assert len(trajectories.SEEN_TOOLS) == 4
    # the reference: the template rendered as text by jinja, then tokenized
    text = chat_tokenizer.apply_chat_template([{"role": "user", "content": "1+1"}], tools=[CALCULATOR, CLOCK],
                                              add_generation_prompt=True, tokenize=False)
    assert json.dumps(CALCULATOR) in text and json.dumps(CLOCK) in text  # the template lists the tools
    want = chat_tokenizer(text, add_special_tokens=False)["input_ids"]
    for prompt, tools, tokens in trajectories.SEEN_TOOLS:
        assert tools == [CALCULATOR, CLOCK] and tokens == want
    assert all(s.metadata["tools"] == [CALCULATOR, CLOCK] for g in groups for s in g)


def test_tool_key_is_accepted_by_validation():
    from miles_host.validation.host_checks import check_unsupported_flags

    check_unsupported_flags(MilesConfig(tool_key="tools"), None)
