"""The ``fp8`` precision recipe on tiny models: swaps, weight sync, unified train = rollout."""

from __future__ import annotations

import logging

import pytest
import torch

from miles_fp8 import recipe
from miles_fp8.experts import Fp8Experts, Fp8InferenceExperts
from miles_fp8.linear import Fp8InferenceLinear, Fp8Linear
from miles_host.rollout.weights import copy_named_tensors

from .conftest import VOCAB, fp8_config, load


def _prompts(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, VOCAB - 1, (3, 11), generator=generator)
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    mask[1, :4] = False  # left padding
    return input_ids, mask


def _simulate_training_step(model, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)


@pytest.fixture(params=["qwen3_path", "qwen3_moe_path"])
def model_path(request):
    return request.getfixturevalue(request.param)


def test_swaps_the_eligible_layers_and_keeps_heads_high_precision(qwen3_moe_path):
    config = fp8_config()
    train = recipe.prepare_train_model(load(qwen3_moe_path), config)
    rollout = recipe.prepare_rollout_model(load(qwen3_moe_path), config)
    assert isinstance(train.layers[0].attn.qkv_proj, Fp8Linear)
    assert isinstance(train.layers[0].mlp.gate_up_proj, Fp8Linear)  # layer 0 is dense (mlp_only_layers)
    assert isinstance(train.layers[1].mlp.experts, Fp8Experts)
    assert isinstance(rollout.layers[1].mlp.experts, Fp8InferenceExperts)
    assert isinstance(rollout.layers[1].attn.o_proj, Fp8InferenceLinear)
    assert type(train.lm_head) is torch.nn.Linear and type(rollout.lm_head) is torch.nn.Linear
    assert rollout.layers[1].mlp.router.weight.dtype == torch.float32
    names = dict(rollout.state_dict())
    assert names["layers.1.mlp.experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    assert names["layers.1.mlp.experts.gate_up_proj_scale_inv"].shape == (4, 2, 1)
    assert names["layers.0.attn.qkv_proj.weight_scale_inv"].shape == (4, 1)
    # training keeps the checkpoint's parameter names (checkpoints and optimizers unchanged)
    assert set(train.state_dict()) == set(load(qwen3_moe_path).state_dict())


def test_convert_for_rollout_names_match_the_rollout_model(model_path):
    config = fp8_config()
    train = recipe.prepare_train_model(load(model_path), config)
    rollout = recipe.prepare_rollout_model(load(model_path), config)
    converted = recipe.convert_for_rollout(train.state_dict().items(), config)
    assert {name for name, _ in converted} == set(rollout.state_dict())
    assert copy_named_tensors(rollout, converted) == len(converted)


def test_unified_fp8_training_forward_equals_rollout_forward(model_path):
    """After a training step and a weight sync, both sides compute bitwise the same logits."""
    config = fp8_config()
    train = recipe.prepare_train_model(load(model_path), config)
    rollout = recipe.prepare_rollout_model(load(model_path), config)
    _simulate_training_step(train)
    copy_named_tensors(rollout, recipe.convert_for_rollout(train.state_dict().items(), config))
    input_ids, mask = _prompts()
    with torch.no_grad():
        train_logits, rollout_logits = train(input_ids, mask), rollout(input_ids, mask)
    assert torch.equal(train_logits, rollout_logits)
    # ... and they are not the high-precision logits (FP8 really is in use)
    with torch.no_grad():
        dense = load(model_path)
        copy_named_tensors(dense, train.state_dict().items())
        assert not torch.equal(dense(input_ids, mask), train_logits)


def test_power_of_two_unified_and_scales(qwen3_path):
    config = fp8_config(power_of_two=True)
    train = recipe.prepare_train_model(load(qwen3_path), config)
    rollout = recipe.prepare_rollout_model(load(qwen3_path), config)
    converted = dict(recipe.convert_for_rollout(train.state_dict().items(), config))
    scale = converted["layers.0.mlp.down_proj.weight_scale_inv"]
    assert torch.all(torch.frexp(scale)[0] == 0.5)
    copy_named_tensors(rollout, converted.items())
    input_ids, mask = _prompts(3)
    with torch.no_grad():
        assert torch.equal(train(input_ids, mask), rollout(input_ids, mask))


def test_training_gradients_reach_every_master_weight(qwen3_moe_path):
    train = recipe.prepare_train_model(load(qwen3_moe_path), fp8_config()).train()
    input_ids, mask = _prompts(4)
    logits = train(input_ids, mask)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1)).backward()
    grads = {name: p.grad for name, p in train.named_parameters()}
    assert grads["layers.0.attn.qkv_proj.weight"].abs().sum() > 0
    assert grads["layers.1.mlp.experts.gate_up_proj"].abs().sum() > 0
    assert grads["layers.1.mlp.experts.down_proj"].abs().sum() > 0
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())


class _Odd(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(128, 256)
        self.kv_a_proj = torch.nn.Linear(128, 192)
        self.lm_head = torch.nn.Linear(128, 256)


def test_layers_with_other_dims_stay_high_precision_with_a_note(caplog):
    with caplog.at_level(logging.INFO, logger="miles_fp8.recipe"):
        model = recipe.prepare_train_model(_Odd(), fp8_config())
    assert isinstance(model.up, Fp8Linear)
    assert type(model.kv_a_proj) is torch.nn.Linear and type(model.lm_head) is torch.nn.Linear
    assert "kv_a_proj (192, 128)" in caplog.text and "not multiples of 128" in caplog.text
    named = dict(recipe.convert_for_rollout(model.state_dict().items(), fp8_config()))
    assert "up.weight_scale_inv" in named and "kv_a_proj.weight_scale_inv" not in named


def test_unsupported_flags_are_clear_errors():
    config = fp8_config()
    config.fp8_format = "hybrid"
    with pytest.raises(ValueError, match="--fp8-format hybrid is not supported"):
        recipe.prepare_train_model(_Odd(), config)


def test_plugin_registers_fp8_precision_and_command():
    from miles_host.plugin_manager import MilesPluginManager

    manager = MilesPluginManager()
    manager.discover()
    manager.activate(selected=["fp8"])
    precision = manager.registries.precisions.get("fp8")
    assert precision.convert_for_rollout is recipe.convert_for_rollout
    assert manager.registries.checkpoint_converters.get("fp8").convert is not None
