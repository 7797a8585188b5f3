"""Tiny policies for the true on-policy tests: the quickstart (dense), a Qwen3-MoE
with the quickstart's char tokenizer, and native models with the rarer blocks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from miles_host.quickstart_preset import QUICKSTART_DIR

QUICKSTART_MODEL = QUICKSTART_DIR / "model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

#: mixed prompt lengths (4, 6 and 8 characters)
MIXED_PROMPTS = [
    ("7+5=", "12"), ("37+45=", "82"), ("123+456=", "579"), ("9+9=", "18"),
    ("61+8=", "69"), ("500+25=", "525"), ("3+44=", "47"), ("88+88=", "176"),
]


@pytest.fixture(scope="session")
def mixed_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("true_on_policy_data") / "mixed.jsonl"
    path.write_text("".join(json.dumps({"input": p, "label": a}) + "\n" for p, a in MIXED_PROMPTS))
    return path


@pytest.fixture(scope="session")
def moe_policy(tmp_path_factory) -> Path:
    """A 2-layer Qwen3-MoE (8 experts, top-2) saved with the quickstart's tokenizer."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("tiny_qwen3_moe")
    quick = json.loads((QUICKSTART_MODEL / "config.json").read_text())
    config = transformers.Qwen3MoeConfig(
        vocab_size=quick["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=True,
        eos_token_id=quick["eos_token_id"], pad_token_id=quick["pad_token_id"],
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # peakier than the default init: routing and sampling far from uniform
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.15)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy(QUICKSTART_MODEL / name, directory / name)
    return directory


def native_model(**overrides):
    """A random native CausalLM (float32, CPU) from a small ModelConfig plus overrides."""
    from miles_host.models import CausalLM, ModelConfig, RopeConfig

    fields = dict(
        model_type="test", vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, intermediate_size=48, rope=RopeConfig(rotary_dim=8), tie_word_embeddings=False,
    )
    fields.update(overrides)
    torch.manual_seed(1)
    model = CausalLM(ModelConfig(**fields))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.3)
            elif "norm" in name:
                parameter.uniform_(0.8, 1.2) if parameter.abs().sum() else parameter.uniform_(-0.1, 0.1)
    return model.float().eval()
