"""A tiny dense and a tiny MoE checkpoint, `miles serve` on loopback, and HTTP helpers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.loop.conftest import build_tiny_policy, write_addition_data

transformers = pytest.importorskip("transformers")

ENGINE_KWARGS = {"kv_cache_tokens": 4096}


def char_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("0123456789+=")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")


def build_tiny_moe(directory: Path) -> Path:
    """hidden 64, 2 MoE layers of 8 experts, top-2."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=14, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True, max_position_embeddings=128,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    char_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def dense_model(tmp_path_factory) -> Path:
    return build_tiny_policy(tmp_path_factory.mktemp("sglang_dense") / "model")


@pytest.fixture(scope="session")
def moe_model(tmp_path_factory) -> Path:
    return build_tiny_moe(tmp_path_factory.mktemp("sglang_moe") / "model")


@pytest.fixture(scope="session")
def addition_data(tmp_path_factory) -> Path:
    return write_addition_data(tmp_path_factory.mktemp("sglang_data") / "data.jsonl", 32)


def make_engine(path: Path, **kwargs):
    from miles_sglang.serve_cli import build_engine

    return build_engine(str(path), "float32", "cpu", **{**ENGINE_KWARGS, **kwargs})


def serve(path: Path, **kwargs):
    """A running ``miles serve`` (in-process threads, free loopback port)."""
    from miles_sglang.server import start_server

    engine_kwargs = kwargs.pop("engine_kwargs", {})
    return start_server(make_engine(path, **engine_kwargs), str(path), "127.0.0.1", 0, **kwargs)


@pytest.fixture(scope="module")
def server(dense_model):
    """Shared by tests that do not change weights or server state."""
    handle = serve(dense_model)
    yield handle
    handle.shutdown()


@pytest.fixture
def fresh_server(dense_model):
    """A server of its own (weights or state get changed)."""
    handle = serve(dense_model)
    yield handle
    handle.shutdown()


def http(url: str, path: str, body=None, method: str | None = None, headers: dict | None = None, raw: bytes | None = None):
    """(status, decoded JSON or text) of one request."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, payload, kind = response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as error:
        status, payload, kind = error.code, error.read(), error.headers.get("Content-Type", "")
    if "json" in kind and payload:
        return status, json.loads(payload)
    return status, payload.decode()


def sse_events(text: str) -> list:
    """``data: ...`` events of an SSE body, JSON-decoded (``[DONE]`` kept as a string)."""
    events = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
