"""The MoE shapes of ``bench/moe.py`` as random-init miles models (built through the model family
adapters from an HF config dict, no checkpoint on disk), prepared as a run's rollout backend prepares
them for a precision, and the weight bytes and FLOPs their bounds are computed from."""

from __future__ import annotations

import torch

#: HF config dicts of the benchmarked shapes (the adapters map them to native configs)
SHAPES = {
    "qwen3_30b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "dsv3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=4,
        first_k_dense_replace=0, num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512,
        q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, rope_theta=10000.0, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=False, num_nextn_predict_layers=0,
    ),
    "tiny_dsv3": dict(
        model_type="deepseek_v3", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        first_k_dense_replace=0, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=96,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=128, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=4096,
        tie_word_embeddings=False, num_nextn_predict_layers=0,
    ),
    "small": dict(  # every decode kernel of the big shape (small-M linears, fused router), tiny weights
        model_type="qwen3_moe", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=64, num_experts_per_tok=4,
        moe_intermediate_size=128, norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "tiny": dict(
        model_type="qwen3_moe", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
    ),
}






# ---------------------------------------------------------------------- models


def _meta_model(shape: str, dtype: torch.dtype):
    """The miles model of ``shape`` on the meta device, in ``dtype``."""
    from miles_host.models.loading import default_family_lookup, native_config
    from miles_host.models.model import CausalLM

    hf = dict(SHAPES[shape])
    config = native_config(hf, default_family_lookup(hf["model_type"]))
    with torch.device("meta"):
        return CausalLM(config).to(dtype)  # allocated in ``dtype``: float32 first would not fit the DeepSeek-V3 shape


@torch.no_grad()
def _materialize(module: torch.nn.Module, prefix: str, device: str) -> None:
    """``module`` (named ``prefix`` in the model) allocated on ``device`` and initialized: weights ~ N(0, 0.02),
    norms 1, router biases ~ N(0, 1e-3), each tensor from a generator seeded by its name in the model (so a
    module initialized alone gets what it gets in the whole model); the fp32 router and bias where the family
    keeps them (DeepSeek)."""
    import zlib

    module.to_empty(device=device)
    generator = torch.Generator(device=device)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        generator.manual_seed(zlib.crc32(f"{prefix}{name}".encode()))
        if name.endswith("expert_bias"):
            tensor.normal_(0.0, 1e-3, generator=generator)
        elif tensor.dim() == 1:
            tensor.fill_(1.0)  # norms
        else:
            tensor.normal_(0.0, 0.02, generator=generator)
    for child in module.modules():
        if getattr(child, "keep_fp32", False):
            child.weight.data = child.weight.data.float()
        if getattr(child, "expert_bias", None) is not None:
            child.expert_bias = child.expert_bias.float()


def build_model(shape: str, dtype: torch.dtype, device: str):
    """A random-init miles model of ``shape`` (see :func:`_materialize`)."""
    model = _meta_model(shape, dtype)
    _materialize(model, "", device)
    return model.eval()


def build_prepared(shape: str, dtype: torch.dtype, device: str, precision: str):
    """:func:`build_model` prepared for ``precision`` as :func:`prepare` does, a decoder layer at a time: each
    layer is allocated, initialized and quantized before the next, so the 16-bit weights never all exist at
    once (the DeepSeek-V3 shape's 4 layers: ~95 GB in bf16, ~48 GB in FP8). The same weights as
    ``prepare(build_model(...))``."""
    if precision == "bf16":
        return prepare(build_model(shape, dtype, device), precision)
    model = _meta_model(shape, dtype)
    record, config, _ = _precision_record(precision)
    for name, child in model.named_children():
        if name != "layers":
            _materialize(child, f"{name}.", device)
    for index, layer in enumerate(model.layers):
        _materialize(layer, f"layers.{index}.", device)
        if record.prepare_rollout_model is not None:
            model.layers[index] = record.prepare_rollout_model(layer, config) or layer
    return prepare(model.eval(), precision)  # what the layers left (the LM head, ...), then the hook


def precision_flags(name: str) -> dict:
    if name == "int4":
        return dict(int4_group_size=128, int4_target="experts", int4_rollout_gemm="auto", true_on_policy=False)
    if name == "fp8":
        return dict(fp8_format="e4m3", fp8_recipe="blockwise", fp8_power_of_two_scales=False)
    return {}


def prepare(model, precision: str):
    """The rollout model as the embedded backend prepares it for ``--precision``."""
    record, config, manager = _precision_record(precision)
    if record.prepare_rollout_model is not None:
        model = record.prepare_rollout_model(model, config) or model
    manager.hook.miles_prepare_model(model=model, role="rollout", config=config)
    return model


def _precision_record(precision: str):
    """``(precision record, run config namespace, plugin manager)`` of ``precision``'s plugin."""
    from types import SimpleNamespace

    from miles_host.plugin_manager import create_plugin_manager

    manager = create_plugin_manager(plugins=[] if precision == "bf16" else [precision])
    record = manager.registries.precisions.get(precision)
    config = SimpleNamespace(precision=precision, **precision_flags(precision))
    return record, config, manager


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def expert_stacks(model):
    """``(experts modules, bytes of one expert as the fused path reads it)`` per MoE layer."""
    rows = []
    for module in model.modules():
        if not hasattr(module, "moe_kernel"):
            continue
        if hasattr(module, "_fused_operands"):  # miles-int4
            read = _nbytes([*module._fused_operands("gate_up_proj"), *module._fused_operands("down_proj")])
        else:
            read = _nbytes([*module.parameters(recurse=False), *module.buffers(recurse=False)])
        rows.append((module, read / module.num_experts))
    return rows


def step_bytes(model, batch: int) -> tuple[float, float]:
    """(bytes a decode step of ``batch`` tokens reads from weights, active params per token)."""
    stacks = expert_stacks(model)
    expert_ids = set()
    expert_total = 0
    for module, _ in stacks:
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            expert_ids.add(id(t))
            expert_total += t.numel() * t.element_size()
        if hasattr(module, "_compressed"):
            for pair in module._compressed.values():
                expert_ids.update(id(t) for t in pair)
        for copies in getattr(module, "_kernel_copies", {}).values():
            for pack in copies:
                expert_ids.update((id(pack.weight), id(pack.scales)))
    other = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in expert_ids or name.startswith("embed_tokens"):
            continue
        other += t.numel() * t.element_size()
    if model.lm_head is None:
        other += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    touched = 0.0
    active_params = 0.0
    config = model.config
    for module, per_expert in stacks:
        e, k = module.num_experts, config.moe.top_k
        touched += e * (1 - (1 - k / e) ** batch) * per_expert
        active_params += k * 3 * config.hidden_size * config.moe.intermediate_size
    dense_params = sum(t.numel() for n, t in [*model.named_parameters(), *model.named_buffers()]
                       if t.dim() >= 2 and id(t) not in expert_ids and not n.startswith("embed_tokens")
                       and "scale" not in n)
    return other + touched, active_params + dense_params


def attention_flops(model, seqs: int, length: int) -> float:
    """Causal attention FLOPs of a prefill: 2 matmuls x 2 FLOPs x L^2/2 x heads x head dims, per layer."""
    c = model.config
    heads = c.num_heads
    qk = c.mla.qk_head_dim if c.mla else c.head_dim
    v = c.mla.v_head_dim if c.mla else c.head_dim
    return seqs * c.num_layers * heads * 2 * (length * length / 2) * (qk + v)
