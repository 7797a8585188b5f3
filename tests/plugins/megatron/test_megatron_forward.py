"""A real Megatron-Core GPTModel built from the native config, loaded through the
weight maps, gives the native model's logits (CPU, float32, local layer spec).

Megatron-Core assumes CUDA in a few helpers (rope buffers, the dropout RNG tracker,
the default causal mask) and, in 0.16, TransformerEngine in the router GEMM; the
fixture stands in for them on CPU. Skipped where
megatron-core is not installed.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings

import pytest
import torch

megatron = pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from miles_host.models import load_pretrained  # noqa: E402
from miles_megatron.weights import (  # noqa: E402
    gpt_model_kwargs,
    megatron_to_native,
    megatron_transformer_config_kwargs,
    native_to_megatron,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def megatron_cpu():
    """A one-rank gloo world with Megatron's model-parallel state, CUDA helpers stubbed."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    from miles_host.distributed.comm import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    patches = pytest.MonkeyPatch()
    patches.setattr(torch.cuda, "current_device", lambda: "cpu")
    patches.setattr(megatron_random.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16 names TransformerEngine's GEMM even when TE is absent
    patches.setattr(moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None), raising=False)
    yield
    patches.undo()
    parallel_state.destroy_model_parallel()
    if owns_group:
        dist.destroy_process_group()


CASES = {
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_gpt_model_matches_native_logits(case, megatron_cpu):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    directory = tempfile.mkdtemp()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(CASES[case]()).save_pretrained(directory)
    native = load_pretrained(directory)
    kwargs = megatron_transformer_config_kwargs(native.config)
    kwargs.pop("moe_enable_routing_replay", None)  # replay is switched on per run (R3), not needed here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            **kwargs, use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
            attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
            moe_router_load_balancing_type="none" if native.config.moe is not None else "aux_loss",
        )
        spec = get_gpt_layer_local_spec(
            num_experts=kwargs.get("num_moe_experts"), qk_layernorm=kwargs["qk_layernorm"])
        model = GPTModel(config, spec, **gpt_model_kwargs(native.config))
    state = native_to_megatron(native.state_dict(), native.config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert [m for m in missing if not m.endswith("_extra_state")] == [] and unexpected == []
    model.eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.triu(torch.ones(9, 9, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        logits = model(ids, torch.arange(9)[None].expand(2, 9), attention_mask=mask)
        reference = native(ids)
    assert (logits - reference).abs().max() < 1e-5
    # and Megatron's own state dict maps back to the native weights exactly
    megatron_state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    back = megatron_to_native(megatron_state, native.config)
    for name, tensor in native.state_dict().items():
        assert torch.equal(back[name], tensor), name
