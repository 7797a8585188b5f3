"""A tiny random Qwen3 policy, a character tokenizer and an addition task."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest


def build_tiny_policy(directory: Path) -> Path:
    """Save a hidden-64, 2-layer random Qwen3 model and a char tokenizer there."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("0123456789+=")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=True,
        eos_token_id=1, pad_token_id=0, max_position_embeddings=128,
    )
    Qwen3ForCausalLM(config).save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


def write_addition_data(path: Path, count: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as handle:
        for _ in range(count):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            handle.write(json.dumps({"input": f"{a}+{b}=", "label": str(a + b)}) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    """(model dir, data file) shared by the loop tests."""
    root = tmp_path_factory.mktemp("tiny_task")
    model = build_tiny_policy(root / "model")
    data = write_addition_data(root / "data.jsonl", 64)
    return model, data


def base_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """Flags of a fast CPU run on the tiny task."""
    return [
        "run", "--hf-checkpoint", str(model), "--prompt-data", str(data), "--label-key", "label",
        "--rm-type", "exact", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "3", "--lr", "1e-3", "--output-dir", str(out), "--no-progress",
        "--rollout-shuffle", *extra,
    ]


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
