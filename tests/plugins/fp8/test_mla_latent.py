"""FP8 DeepSeek rollouts over the latent MLA cache: the quantized ``kv_b_proj`` is read as its
dequantized weight (an independent float64 model of the E4M3 blocks), kept in step with weight sync."""

from __future__ import annotations

import pytest
import torch

from miles_fp8 import recipe
from miles_fp8.linear import Fp8InferenceLinear
from miles_host.kernels import switches
from miles_host.rollout import Engine
from tests.models.mla_checkpoints import save_deepseek_v3_128

from .conftest import fp8_config, load, quantize64

PROMPTS = [[5, 9, 3, 17, 4], [8, 2, 2, 11, 40, 41, 7]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def deepseek_path(tmp_path_factory):
    return str(save_deepseek_v3_128(tmp_path_factory.mktemp("fp8_dsv3")))


@pytest.fixture(autouse=True)
def latent_cache():
    """The latent cache, prefill absorbed too: every attention step reads the dequantized copy (the default
    expanded prefill runs ``kv_b_proj``'s FP8 GEMM on the latents, as the per-head cache does)."""
    with switches.switched(mla_kv_cache="latent", mla_prefill="absorbed"):
        yield


def _fp8_rollout_model(path: str):
    return recipe.prepare_rollout_model(load(path), fp8_config())


def _dequantized64(weight: torch.Tensor) -> torch.Tensor:
    q, _, expanded = quantize64(weight, 128)
    return (q * expanded).float()


def _generate(engine: Engine):
    outputs = engine.generate(PROMPTS, GREEDY)
    return [o["output_ids"] for o in outputs], [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outputs]


def test_quantized_kv_b_proj_is_absorbed_dequantized(deepseek_path):
    model = _fp8_rollout_model(deepseek_path)
    attn = model.layers[0].attn
    assert isinstance(attn.kv_b_proj, Fp8InferenceLinear) and attn.can_cache_latents()
    engine = Engine(model, kv_cache_tokens=256, block_size=4)
    mla = model.config.mla
    assert set(engine.kv_cache.layout) == {(1, mla.kv_lora_rank + mla.qk_rope_head_dim, 0, None)}
    tokens, logprobs = _generate(engine)

    reference = _fp8_rollout_model(deepseek_path)
    master = load(deepseek_path)
    for layer, master_layer in zip(reference.layers, master.layers):
        dense = torch.nn.Linear(mla.kv_lora_rank, layer.attn.kv_b_proj.out_features, bias=False)
        dense.weight.data = _dequantized64(master_layer.attn.kv_b_proj.weight.detach())
        layer.attn.kv_b_proj = dense
    for layer, ref_layer in zip(model.layers, reference.layers):
        assert torch.equal(layer.attn.absorbed_kv_b, ref_layer.attn.kv_b_proj.weight)
    assert _generate(Engine(reference, kv_cache_tokens=256, block_size=4)) == (tokens, logprobs)


def test_weight_sync_refreshes_the_absorbed_copy(deepseek_path):
    engine = Engine(_fp8_rollout_model(deepseek_path), kv_cache_tokens=256, block_size=4)
    _generate(engine)  # the absorbed copies exist
    absorbed = engine.model.layers[1].attn.absorbed_kv_b
    before = absorbed.clone()
    trained = load(deepseek_path)
    with torch.no_grad():  # stands in for an optimizer step
        generator = torch.Generator().manual_seed(3)
        for parameter in trained.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    engine.update_weights(recipe.convert_for_rollout(trained.state_dict().items(), fp8_config()))
    assert engine.model.layers[1].attn.absorbed_kv_b is absorbed  # in place: CUDA graphs read its address
    assert not torch.equal(absorbed, before)
    assert torch.equal(absorbed, _dequantized64(trained.layers[1].attn.kv_b_proj.weight.detach()))

    fresh = recipe.prepare_rollout_model(trained, fp8_config())
    assert _generate(engine) == _generate(Engine(fresh, kv_cache_tokens=256, block_size=4))

