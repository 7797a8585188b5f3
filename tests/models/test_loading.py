"""Loading and saving: clear errors for bad input, shards, MTP layers, dtypes, the registry."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_host.models import load_pretrained, save_pretrained

from .conftest import family_lookup, prompts_batch


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_weights(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_unsupported_model_type_is_named_with_supported_list(checkpoints, tmp_path):
    path = _copy(checkpoints["llama"], tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "my_unknown_arch"
    (path / "config.json").write_text(json.dumps(config))
    for lookup in (family_lookup, None):  # the test lookup and the plugin registries
        with pytest.raises(ValueError) as info:
            load_pretrained(path, family=lookup)
        assert "my_unknown_arch" in str(info.value)
        assert "qwen3_moe" in str(info.value) and "gemma3_text" in str(info.value)


def test_missing_weights_are_listed(checkpoints, tmp_path):
    path = _copy(checkpoints["qwen3_moe"], tmp_path / "ckpt")
    dropped = ["model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight", "model.norm.weight"]
    _edit_weights(path, lambda t: [t.pop(name) for name in dropped])
    with pytest.raises(ValueError, match="missing weights") as info:
        load_pretrained(path, family=family_lookup)
    for name in dropped:
        assert name in str(info.value)
    assert "q_proj" not in str(info.value)


def test_unexpected_weights_are_listed(checkpoints, tmp_path):
    path = _copy(checkpoints["llama"], tmp_path / "ckpt")
    _edit_weights(path, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(3), "extra_head.bias": torch.zeros(2)}))
    with pytest.raises(ValueError, match="unexpected weights") as info:
        load_pretrained(path, family=family_lookup)
    assert "model.layers.0.mystery.weight" in str(info.value) and "extra_head.bias" in str(info.value)


def test_shape_mismatch_names_the_tensor_and_both_shapes(checkpoints, tmp_path):
    path = _copy(checkpoints["llama"], tmp_path / "ckpt")
    _edit_weights(path, lambda t: t.update({"model.layers.1.self_attn.v_proj.weight": torch.zeros(31, 64)}))
    with pytest.raises(ValueError) as info:
        load_pretrained(path, family=family_lookup)
    message = str(info.value)
    assert "model.layers.1.self_attn.v_proj.weight" in message and "(31, 64)" in message and "(32, 64)" in message


def test_corrupt_safetensors_file_is_named(checkpoints, tmp_path):
    path = _copy(checkpoints["llama"], tmp_path / "ckpt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_pretrained(path, family=family_lookup)
    (path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_pretrained(path, family=family_lookup)


def test_missing_files_raise_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path, family=family_lookup)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises((FileNotFoundError, ValueError)):
        load_pretrained(tmp_path, family=family_lookup)


def test_sharded_save_and_load(checkpoints, tmp_path):
    model = load_pretrained(checkpoints["glm4_moe"], family=family_lookup)
    save_pretrained(model, tmp_path, family=family_lookup, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    reloaded = load_pretrained(tmp_path, family=family_lookup)
    input_ids, attention_mask = prompts_batch()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids, attention_mask), model(input_ids, attention_mask), atol=0, rtol=0)


def test_fused_expert_layout_loads(checkpoints, tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2I, H]) is accepted too."""
    path = _copy(checkpoints["qwen3_moe"], tmp_path / "ckpt")

    def fuse(tensors):
        prefix = "model.layers.1.mlp.experts"
        gate_up = [torch.cat([tensors.pop(f"{prefix}.{e}.gate_proj.weight"), tensors.pop(f"{prefix}.{e}.up_proj.weight")])
                   for e in range(4)]
        down = [tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(4)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack(down)

    _edit_weights(path, fuse)
    fused = load_pretrained(path, family=family_lookup)
    plain = load_pretrained(checkpoints["qwen3_moe"], family=family_lookup)
    for (name, a), (_, b) in zip(fused.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name


def test_deepseek_mtp_layers_load_and_save(checkpoints, tmp_path):
    model = load_pretrained(checkpoints["deepseek_v3"], family=family_lookup)
    assert model.config.num_mtp_layers == 0 and len(model.mtp) == 0  # transformers saves none
    path = _copy(checkpoints["deepseek_v3"], tmp_path / "ckpt")
    num_layers = model.config.num_layers

    def add_mtp(tensors):
        generator = torch.Generator().manual_seed(0)
        for name in [n for n in tensors if n.startswith("model.layers.1.")]:
            new = name.replace("model.layers.1.", f"model.layers.{num_layers}.")
            tensors[new] = torch.randn(tensors[name].shape, generator=generator)
        prefix = f"model.layers.{num_layers}."
        for extra, shape in [("enorm.weight", (64,)), ("hnorm.weight", (64,)), ("eh_proj.weight", (64, 128)),
                             ("shared_head.norm.weight", (64,)), ("shared_head.head.weight", (128, 64)),
                             ("embed_tokens.weight", (128, 64))]:
            tensors[prefix + extra] = torch.randn(shape, generator=generator)

    _edit_weights(path, add_mtp)
    with_mtp = load_pretrained(path, family=family_lookup)
    assert with_mtp.config.num_mtp_layers == 1 and len(with_mtp.mtp) == 1
    save_pretrained(with_mtp, tmp_path / "saved", family=family_lookup)
    original, saved = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(original) == sorted(saved)
    for name in original:
        assert torch.equal(original[name], saved[name]), name


def test_bfloat16_load_keeps_router_in_float32(checkpoints):
    model = load_pretrained(checkpoints["deepseek_v3"], dtype=torch.bfloat16, family=family_lookup)
    router = model.layers[1].mlp.router
    assert router.weight.dtype == torch.float32 and router.expert_bias.dtype == torch.float32
    assert model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    input_ids, attention_mask = prompts_batch()
    with torch.no_grad():
        logits = model(input_ids, attention_mask)
        reference = load_pretrained(checkpoints["deepseek_v3"], family=family_lookup)(input_ids, attention_mask)
    valid = attention_mask.bool()
    # bf16 may flip a near-tied expert choice for a token, so compare the typical error
    assert (logits[valid].float() - reference[valid]).abs().mean() < 0.02


def test_default_lookup_uses_the_plugin_registries(checkpoints):
    model = load_pretrained(checkpoints["gemma2"])
    assert model.config.model_type == "gemma2"
