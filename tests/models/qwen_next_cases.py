"""Tiny random Qwen3-Next / Qwen3.5 checkpoints: both layer types (Gated DeltaNet with more value
than key heads, gated full attention), MoE with a gated shared expert and a dense layer."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
    eos_token_id=127, tie_word_embeddings=False, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
CASES = {
    "qwen3_next": dict(MOE, mlp_only_layers=[2], norm_topk_prob=True),
    "qwen3_5_text": dict(),
    "qwen3_5_moe_text": dict(MOE),
}


def family_lookup(model_type: str):
    """The qwen_next family records, imported directly (no entry-point registry needed)."""
    from miles_models import qwen_next

    records = {t: record for record in qwen_next.miles_register_model_families() for t in record.model_types}
    return records[model_type]


def save_case(model_type: str, directory: Path, peaky: bool = False, **overrides) -> Path:
    """Save a random tiny transformers model of ``model_type`` (float32) and return its directory.

    Norm weights and biases are perturbed so zero/one initialisations hide nothing; ``peaky``
    draws matrices with std 0.15 (greedy comparisons meet no near-ties)."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **CASES[model_type], **overrides})
    torch.manual_seed(sum(map(ord, model_type)))
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter) * 0.1)
            elif peaky:
                parameter.normal_(0.0, 0.15)
    model.save_pretrained(directory)
    return directory


def hf_model(path: Path):
    """The saved checkpoint in transformers (float32, eager attention, eval)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
