"""--apply-chat-template-kwargs reaches the tokenizer's apply_chat_template."""

from __future__ import annotations

import pytest

from miles_host.cli.main import main
from miles_host.config import MilesConfig
from miles_host.rollout_manager import RolloutManager


class Tokenizer:
    eos_token_id = 0

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append(kwargs)
        thinking = kwargs.get("enable_thinking", True)
        return [1, 2] + ([3] if thinking else [])


def test_kwargs_reach_the_template():
    config = MilesConfig(apply_chat_template=True, apply_chat_template_kwargs={"enable_thinking": False})
    manager = RolloutManager.__new__(RolloutManager)
    manager.config, manager.tokenizer = config, Tokenizer()
    assert manager.prompt_ids("hi") == [1, 2]
    assert manager.tokenizer.calls[0]["enable_thinking"] is False
    manager.config = MilesConfig(apply_chat_template=True)
    assert manager.prompt_ids("hi") == [1, 2, 3]


@pytest.mark.parametrize("text, message", [("[1]", "JSON object"), ("{bad", "not JSON")])
def test_the_flag_takes_a_json_object(text, message, capsys):
    with pytest.raises(SystemExit):
        main(["run", "--apply-chat-template-kwargs", text, "--dry-run"])
    err = capsys.readouterr().err
    assert "--apply-chat-template-kwargs" in err and message in err
