"""Tiny random transformers models of every supported model type, saved once per session.

Each case's config exercises its family's quirks (MoE, MLA with and without
q_lora_rank, sliding windows, soft-capping, partial rotary, tied and untied
embeddings, qkv bias, rope scalings). Norm weights and biases (including the
expert-score bias) are perturbed so that zero/one initialisations hide nothing.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

FAMILY_MODULES = ("qwen", "llama", "deepseek", "glm", "minimax", "gemma")

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.05,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

CASES: dict[str, tuple[str, dict]] = {
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen2_moe": ("qwen2_moe", dict(
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=48,
        mlp_only_layers=[0], norm_topk_prob=False,
    )),
    "qwen3": ("qwen3", dict(
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    )),
    "qwen3_moe": ("qwen3_moe", dict(
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
    )),
    "llama": ("llama", dict(
        attention_bias=True, mlp_bias=True,
        rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0,
        },
    )),
    "deepseek_v3": ("deepseek_v3", dict(
        head_dim=None, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
        },
    )),
    "deepseek_v3_no_q_lora": ("deepseek_v3", dict(
        head_dim=None, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
        first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=16, n_group=1, topk_group=1, rope_interleave=False, norm_topk_prob=False,
    )),
    "glm4": ("glm4", dict(attention_bias=True, partial_rotary_factor=0.5)),
    "glm4_moe": ("glm4_moe", dict(
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, partial_rotary_factor=0.5, use_qk_norm=True, routed_scaling_factor=1.5,
        n_group=2, topk_group=1,
    )),
    "minimax_m2": ("minimax_m2", dict(num_local_experts=4, num_experts_per_tok=2, rotary_dim=8, intermediate_size=48)),
    "gemma2": ("gemma2", dict(
        sliding_window=4, attn_logit_softcapping=0.5, final_logit_softcapping=0.7, query_pre_attn_scalar=16,
        tie_word_embeddings=True,
    )),
    "gemma3_text": ("gemma3_text", dict(
        sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
        final_logit_softcapping=2.0, tie_word_embeddings=False,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )),
}

MODEL_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "llama", "deepseek_v3", "glm4", "glm4_moe", "minimax_m2",
               "gemma2", "gemma3_text")
assert set(MODEL_TYPES) == {model_type for model_type, _ in CASES.values()}


def family_records() -> dict[str, object]:
    """model_type -> ModelFamily, from the family modules imported directly."""
    records = {}
    for name in FAMILY_MODULES:
        module = importlib.import_module(f"miles_models.{name}")
        for record in module.miles_register_model_families():
            for model_type in record.model_types:
                records[model_type] = record
    return records


RECORDS = family_records()


def family_lookup(model_type: str):
    """Test lookup mirroring the registry's error for unknown types."""
    if model_type not in RECORDS:
        raise ValueError(f"unsupported model_type {model_type!r}; supported model types: {', '.join(sorted(RECORDS))}")
    return RECORDS[model_type]


def build_hf_model(case: str):
    """A random-initialised tiny transformers model of ``case`` (float32, eval, eager attention)."""
    model_type, extra = CASES[case]
    kwargs = {**BASE, **extra}
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k != "head_dim"}
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(sum(map(ord, case)))
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.dim() == 1 and tensor.dtype.is_floating_point:
                tensor.add_(torch.randn_like(tensor) * 0.1)
    return model


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Lazily saved HF checkpoints, one directory per case."""
    root = tmp_path_factory.mktemp("hf")
    cache: dict[str, Path] = {}

    class _Lazy(dict):
        def __getitem__(self, case: str) -> Path:
            if case not in cache:
                model = build_hf_model(case)
                path = root / case
                model.save_pretrained(path)
                cache[case] = path
            return cache[case]

    return _Lazy()


def prompts_batch(vocab_size: int = 128, lengths=(11, 6, 9), seed: int = 0):
    """Right-padded ``input_ids`` and ``attention_mask`` of unequal-length prompts."""
    generator = torch.Generator().manual_seed(seed)
    batch = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, length in enumerate(lengths):
        batch[row, :length] = torch.randint(3, vocab_size, (length,), generator=generator)
        mask[row, :length] = 1
    return batch, mask


def hf_logits(path: Path, input_ids, attention_mask):
    """Reference logits from transformers (eager attention, float32)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model.eval()(input_ids=input_ids, attention_mask=attention_mask).logits
