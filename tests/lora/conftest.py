"""Tiny random transformers checkpoints for the LoRA tests (hidden 64, 2 layers), with
biases on the linears where the family has them, so adapters on fused q/k/v and gate/up
meet every quirk of the weight mapping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.distributed.conftest import signal_reward, tiny_task  # noqa: E402, F401  (the trainer tests' task)

COMMON = dict(vocab_size=99, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, eos_token_id=1)

CASES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    # routed experts (stacked 3-D weights: all-linear adapts them too), the shared expert and its gate
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=48,
        mlp_only_layers=[0])),
}


def build_checkpoint(directory: Path, case: str) -> Path:
    """Save the random HF model of ``case`` (biases perturbed away from zero)."""
    config_name, model_name, extra = CASES[case]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**COMMON, **extra))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.05)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session", params=sorted(CASES))
def hf_checkpoint(request, tmp_path_factory) -> Path:
    """A checkpoint directory per model case."""
    return build_checkpoint(tmp_path_factory.mktemp(f"lora_{request.param}"), request.param)
