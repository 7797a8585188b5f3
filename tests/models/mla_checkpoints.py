"""A tiny DeepSeek-V3 checkpoint whose MLA linears are multiples of 128, so that FP8 blocks
(128 x 128) and INT4 groups (128) quantize them: ``kv_b_proj`` [2 x (64 + 64), 128]."""

from __future__ import annotations

from pathlib import Path

import torch


def save_deepseek_v3_128(directory: Path) -> Path:
    """Save the random model (norm weights perturbed) to ``directory`` and return it."""
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
        qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, max_position_embeddings=256, initializer_range=0.05,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    torch.manual_seed(128)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.dim() == 1 and tensor.dtype.is_floating_point:
                tensor.add_(torch.randn_like(tensor) * 0.1)
    model.save_pretrained(directory)
    return directory
