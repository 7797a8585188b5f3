"""The QAT training forward and the INT4 rollout forward give identical logits (dense and MoE)."""

from __future__ import annotations

import pytest
import torch

from miles_host.models import load_pretrained
from miles_host.rollout.weights import copy_named_tensors
from miles_int4.plugin import miles_register_precisions
from miles_int4.qat import Int4FakeQuantMixin
from miles_int4.rollout import Int4Experts, Int4Linear
from tests.plugins.int4.conftest import Flags

INT4 = miles_register_precisions()[0]


def _batch(vocab: int = 96, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (3, 10), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    return ids, mask


def _train_step(model: torch.nn.Module, seed: int) -> None:
    """One optimizer step on the QAT model, so the master weights move off the checkpoint."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids, mask = _batch(seed=seed)
    logits = model(ids, mask)
    loss = -torch.log_softmax(logits, dim=-1)[..., 5].mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _sync(train: torch.nn.Module, rollout: torch.nn.Module, flags) -> int:
    named = [(name, tensor.detach()) for name, tensor in train.state_dict().items()]
    return copy_named_tensors(rollout, INT4.convert_for_rollout(named, flags))


CASES = [("qwen3", "all", 32), ("qwen3", "all", 128), ("qwen3_moe", "experts", 64), ("qwen3_moe", "all", 32)]


@pytest.mark.parametrize("name,target,group_size", CASES)
def test_qat_forward_equals_int4_rollout_forward_bit_for_bit(tiny_checkpoints, name, target, group_size):
    path = tiny_checkpoints[name]
    flags = Flags(group_size, target, rollout_gemm="dequant")
    plain = load_pretrained(path)
    train = INT4.prepare_train_model(load_pretrained(path), flags)
    rollout = INT4.prepare_rollout_model(load_pretrained(path), flags)
    ids, mask = _batch()
    with torch.no_grad():
        assert torch.equal(train(ids, mask), rollout(ids, mask))  # before any training
        assert not torch.equal(train(ids, mask), plain(ids, mask))  # quantization is on
    for step in range(2):
        _train_step(train, seed=step + 1)
        _sync(train, rollout, flags)
        with torch.no_grad():
            train_logits, rollout_logits = train(ids, mask), rollout(ids, mask)
        assert torch.equal(train_logits, rollout_logits), (train_logits - rollout_logits).abs().max()
    int4_modules = [m for m in rollout.modules() if isinstance(m, (Int4Linear, Int4Experts))]
    expected = {"experts": 1, "all": 2 * 4 - (1 if name == "qwen3_moe" else 0)}[target]
    assert len(int4_modules) == expected  # per layer qkv, o, gate_up, down (the MoE layer: experts)


def test_names_stay_and_sync_fills_every_rollout_tensor(tiny_checkpoints):
    path = tiny_checkpoints["qwen3_moe"]
    flags = Flags(32, "all", rollout_gemm="dequant")
    before = {k: v.shape for k, v in load_pretrained(path).state_dict().items()}
    train = INT4.prepare_train_model(load_pretrained(path), flags)
    assert {k: v.shape for k, v in train.state_dict().items()} == before
    assert {k for k, _ in train.named_parameters()} == {k for k in before}
    assert all(isinstance(p, torch.nn.Parameter) for p in train.parameters())
    assert isinstance(train.layers[1].mlp.experts, Int4FakeQuantMixin)
    rollout = INT4.prepare_rollout_model(load_pretrained(path), flags)
    synced = dict(INT4.convert_for_rollout(list(train.state_dict().items()), flags))
    expected = {name: tensor for name, tensor in rollout.state_dict().items()}
    assert set(synced) == set(expected)
    for name, tensor in synced.items():
        assert (tensor.shape, tensor.dtype) == (expected[name].shape, expected[name].dtype), name
    assert "layers.1.mlp.experts.gate_up_proj_packed" in synced and "lm_head.weight" in synced
    assert "layers.1.mlp.router.weight" in synced and "embed_tokens.weight" in synced


def test_gradients_reach_the_master_weights(tiny_checkpoints):
    train = INT4.prepare_train_model(load_pretrained(tiny_checkpoints["qwen3_moe"]), Flags(64, "all"))
    before = {k: v.clone() for k, v in train.state_dict().items()}
    ids, mask = _batch()
    train(ids, mask).logsumexp(-1).mean().backward()
    experts = train.layers[1].mlp.experts
    for parameter in (experts._parameters["gate_up_proj"], train.layers[0].attn.qkv_proj._parameters["weight"]):
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0
    _train_step(train, seed=3)
    after = train.state_dict()
    assert not torch.equal(after["layers.1.mlp.experts.down_proj"], before["layers.1.mlp.experts.down_proj"])
    # outside forward the attribute is the float master weight
    assert experts.gate_up_proj is experts._parameters["gate_up_proj"]


def test_group_size_not_dividing_a_layer_names_it(tiny_checkpoints):
    path = tiny_checkpoints["qwen3_odd"]
    flags = Flags(64, "all")
    message = r"layers\.0\.mlp\.down_proj\.weight has shape \(128, 160\)"
    with pytest.raises(ValueError, match=message):
        INT4.prepare_train_model(load_pretrained(path), flags)
    with pytest.raises(ValueError, match=message):
        INT4.prepare_rollout_model(load_pretrained(path), flags)
    with pytest.raises(ValueError, match=message):
        INT4.convert_for_rollout(list(load_pretrained(path).state_dict().items()), flags)
    INT4.prepare_train_model(load_pretrained(path), Flags(32, "all"))  # 32 divides 160


@pytest.mark.parametrize("name,target", [("qwen3", "all"), ("qwen3_moe", "all")])
def test_packed_kernel_rollout_tracks_weight_updates(tiny_checkpoints, name, target):
    """torch's CPU int4 kernel: close to the QAT forward (own accumulation order), re-packed after each sync."""
    path = tiny_checkpoints[name]
    flags = Flags(32, target, rollout_gemm="packed")
    train = INT4.prepare_train_model(load_pretrained(path), flags)
    rollout = INT4.prepare_rollout_model(load_pretrained(path), flags)
    assert all(m.use_kernel for m in rollout.modules() if isinstance(m, (Int4Linear, Int4Experts)))
    ids, mask = _batch()
    with torch.no_grad():
        old = rollout(ids, mask)
        torch.testing.assert_close(old, train(ids, mask), rtol=1e-4, atol=1e-4)
    _train_step(train, seed=5)
    _sync(train, rollout, flags)
    with torch.no_grad():
        new, expected = rollout(ids, mask), train(ids, mask)
    torch.testing.assert_close(new, expected, rtol=1e-4, atol=1e-4)
    assert (new - old).abs().max() > 100 * (new - expected).abs().max()


def test_refresh_repacks_in_place_for_captured_graphs(tiny_checkpoints):
    """Kernel copies exist after prepare and keep their storage across updates (CUDA graphs read them)."""
    from miles_int4.rollout import refresh_int4_weights

    path = tiny_checkpoints["qwen3_moe"]
    flags = Flags(32, "all", rollout_gemm="packed")
    train = INT4.prepare_train_model(load_pretrained(path), flags)
    rollout = INT4.prepare_rollout_model(load_pretrained(path), flags)
    experts = rollout.layers[1].mlp.experts
    assert experts._kernel_copies and not experts._staged  # built at prepare time, not in a first (captured) forward
    address = experts._kernel_copies["down_proj"][3].weight.data_ptr()
    _train_step(train, seed=7)
    _sync(train, rollout, flags)
    modules = [m for m in rollout.modules() if isinstance(m, (Int4Linear, Int4Experts))]
    assert refresh_int4_weights(rollout) == len(modules)
    assert not experts._staged
    assert experts._kernel_copies["down_proj"][3].weight.data_ptr() == address
    ids, mask = _batch()
    with torch.no_grad():
        torch.testing.assert_close(rollout(ids, mask), train(ids, mask), rtol=1e-4, atol=1e-4)


def test_packed_rollout_holds_int4_weights_once(tiny_checkpoints):
    """Packed path: no compressed-tensors buffers, only the kernel layout; the sync names
    are claimed as weight sinks, so every synced name still has a destination."""
    from miles_host.rollout.weights import weight_targets

    path = tiny_checkpoints["qwen3_moe"]
    flags = Flags(32, "all", rollout_gemm="packed")
    train = INT4.prepare_train_model(load_pretrained(path), flags)
    rollout = INT4.prepare_rollout_model(load_pretrained(path), flags)
    assert not any(name.endswith(("_packed", "_scale", "_shape")) for name, _ in rollout.named_buffers())
    synced = dict(INT4.convert_for_rollout(list(train.state_dict().items()), flags))
    targets = weight_targets(rollout)
    assert set(synced) == set(targets)
    for name, tensor in synced.items():
        assert (tuple(tensor.shape), tensor.dtype) == (tuple(targets[name].shape), targets[name].dtype), name
    # a half-sent pair waits for its other half; a wrong shape triple is refused by name
    linear = rollout.layers[0].attn.qkv_proj
    packed = synced["layers.0.attn.qkv_proj.weight_packed"]
    copy_named_tensors(rollout, [("layers.0.attn.qkv_proj.weight_packed", packed)])
    assert set(linear._staged["weight"]) == {"packed"}
    copy_named_tensors(rollout, [("layers.0.attn.qkv_proj.weight_scale", synced["layers.0.attn.qkv_proj.weight_scale"])])
    assert not linear._staged
    with pytest.raises(ValueError, match="qkv_proj|weight"):
        copy_named_tensors(rollout, [("layers.0.attn.qkv_proj.weight_shape", torch.tensor([1, 2]))])
