"""DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3 with DeepSeek Sparse Attention.

Every layer's MLA gets a lightning indexer (``self_attn.indexer.{wq_b, wk, k_norm,
weights_proj}``, see :mod:`miles_host.models.dsa`) that picks the ``index_topk`` keys each
query attends to. The MLA always has a ``q_lora_rank`` (the indexer reads the q latent) and
always uses interleaved rotary (transformers' ``DeepseekV32Attention``; the indexer's own
rotary is half-split). The rest (sigmoid group-limited MoE, shared experts, dense first
layers, MTP layers stored as ``model.layers.{num_hidden_layers + j}``) is DeepSeek-V3's.
"""

from __future__ import annotations

from typing import Any, Mapping

from miles_host.models.config import DSAConfig, ModelConfig

from miles_models import deepseek
from miles_models._family import model_family
from miles_models._weights import MTPWeightMap, Rule

always_active = True

#: the indexer's tensors, named alike in HF checkpoints (``self_attn.indexer.*``) and natively (``attn.indexer.*``)
INDEXER_TENSORS = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


#: what ``layer_types`` calls a DSA layer (transformers before 5.2x spelled it the second way)
SPARSE_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Native config of a DeepSeek-V3.2 model."""
    if not hf.get("q_lora_rank"):
        raise ValueError("deepseek_v32: config.json needs a q_lora_rank (the indexer's queries read the q latent)")
    unused = sorted(t for t in hf.get("layer_types") or () if t not in SPARSE_LAYER_TYPES)
    if unused:
        raise ValueError(f"deepseek_v32: layer types {unused} are not supported (every layer is sparse attention: "
                         f"one of {list(SPARSE_LAYER_TYPES)})")
    config = deepseek.config_from_hf({**hf, "rope_interleave": True})
    config.dsa = DSAConfig(
        index_n_heads=int(hf.get("index_n_heads", 64)),
        index_head_dim=int(hf.get("index_head_dim", 128)),
        index_topk=int(hf.get("index_topk", 2048)),
    )
    if config.dsa.index_head_dim < config.mla.qk_rope_head_dim:
        raise ValueError(
            f"deepseek_v32: index_head_dim ({config.dsa.index_head_dim}) is smaller than qk_rope_head_dim "
            f"({config.mla.qk_rope_head_dim}), which its rotary covers"
        )
    config.hf_config = dict(hf)
    return config


WEIGHTS = MTPWeightMap(
    deepseek.WEIGHTS.rules
    + [
        Rule(f"layers.{{i}}.attn.indexer.{name}", (f"model.layers.{{i}}.self_attn.indexer.{name}",))
        for name in INDEXER_TENSORS
    ]
)


def miles_register_model_families():
    """The DeepSeek-V3.2 family record."""
    return [
        model_family(
            "deepseek_v32",
            ("deepseek_v32",),
            config_from_hf,
            WEIGHTS,
            description="DeepSeek-V3.2 (MLA with DeepSeek Sparse Attention's lightning indexer, MoE, MTP)",
            chat_defaults={"eos_tokens": ["<｜end▁of▁sentence｜>"]},
        )
    ]
