"""Tiny transformers checkpoints (dense qwen3, MoE qwen3_moe) with dims that INT4 groups divide."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=96, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
)

CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(intermediate_size=256, **COMMON),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        intermediate_size=256, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0], **COMMON,
    ),
    # down_proj's input dim 160 splits into groups of 32 but not of 64 or 128
    "qwen3_odd": lambda: transformers.Qwen3Config(intermediate_size=160, **COMMON),
}


def save_tiny(name: str, directory: Path) -> Path:
    """Save a random tiny model ``name`` (norm weights perturbed) to ``directory``."""
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).float().eval()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.dim() == 1:
                tensor.add_(torch.randn_like(tensor) * 0.1)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> saved checkpoint directory (built on first use)."""
    root = tmp_path_factory.mktemp("int4_tiny")
    cache: dict[str, Path] = {}

    class _Lazy(dict):
        def __getitem__(self, name: str) -> Path:
            if name not in cache:
                cache[name] = save_tiny(name, root / name)
            return cache[name]

    return _Lazy()


class Flags:
    """The int4 flags as a run config carries them."""

    def __init__(self, group_size: int = 128, target: str = "experts", rollout_gemm: str = "auto", **extra):
        self.int4_group_size = group_size
        self.int4_target = target
        self.int4_rollout_gemm = rollout_gemm
        self.__dict__.update(extra)
