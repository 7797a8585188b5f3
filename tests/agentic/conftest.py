"""Fixtures of the agentic tests: a tiny chat model (:mod:`tests.agentic.chat_fixtures`) on disk."""

from __future__ import annotations

import pytest

from tests.agentic.chat_fixtures import build_chat_model


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory):
    """A tiny random chat model directory (character tokenizer, Qwen-style chat template)."""
    return build_chat_model(tmp_path_factory.mktemp("chat_model"))


@pytest.fixture(scope="session")
def chat_tokenizer(chat_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_model))
