"""``convert_checkpoint``: compressed-tensors pack-quantized INT4 as SGLang/vLLM load it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from miles_host.cli.main import main
from miles_int4.convert import convert_checkpoint
from tests.plugins.int4.test_quant import reference


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def _decode(packed: torch.Tensor, shape: list[int]) -> np.ndarray:
    """Independent unpacking: word g, bits 4i..4i+3 hold column 8g+i as q + 8."""
    words = packed.numpy().view(np.uint32)
    columns = np.stack([(words >> np.uint32(4 * i)) & np.uint32(0xF) for i in range(8)], axis=-1)
    return columns.reshape(shape).astype(np.int64) - 8


@pytest.mark.parametrize("name,target,group_size", [("qwen3_moe", "experts", 32), ("qwen3", "all", 64)])
def test_checkpoint_format(tiny_checkpoints, tmp_path, name, target, group_size):
    src = tiny_checkpoints[name]
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    dst = tmp_path / "int4"
    summary = convert_checkpoint(src, dst, group_size, target)
    before, after = _tensors(src), _tensors(dst)

    def quantized(hf_name: str) -> bool:
        if target == "experts":
            return ".mlp.experts." in hf_name
        return hf_name.endswith("_proj.weight")

    expected_names = set()
    for hf_name, tensor in before.items():
        if quantized(hf_name):
            base = hf_name
            expected_names |= {f"{base}_packed", f"{base}_scale", f"{base}_shape"}
            packed, scale, shape = after[f"{base}_packed"], after[f"{base}_scale"], after[f"{base}_shape"]
            assert (packed.dtype, scale.dtype, shape.dtype) == (torch.int32, torch.bfloat16, torch.int64)
            rows, cols = tensor.shape
            assert shape.tolist() == [rows, cols]
            assert packed.shape == (rows, cols // 8) and scale.shape == (rows, cols // group_size)
            ref_q, ref_scale, _, _ = reference(tensor.numpy(), group_size)
            np.testing.assert_array_equal(scale.float().numpy(), ref_scale)
            assert (_decode(packed, [rows, cols]) != ref_q).sum() <= 2  # float32 division near exact .5 ties
        else:
            expected_names.add(hf_name)
            assert torch.equal(after[hf_name], tensor), hf_name
    assert set(after) == expected_names
    assert summary["quantized"] == sum(map(quantized, before))

    config = json.loads((dst / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == json.loads((src / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed"
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    weights = group["weights"]
    assert (weights["num_bits"], weights["type"], weights["symmetric"], weights["strategy"], weights["group_size"]) == (
        4, "int", True, "group", group_size,
    )
    assert "lm_head" in qc["ignore"]
    if target == "experts":
        assert "model.layers.0.self_attn.q_proj" in qc["ignore"] and "model.layers.0.mlp.down_proj" in qc["ignore"]
        assert "model.layers.1.mlp.gate" in qc["ignore"]
        assert not any(".experts." in name for name in qc["ignore"])
    else:
        assert qc["ignore"] == ["lm_head"]
    assert json.loads((dst / "generation_config.json").read_text()) == {"eos_token_id": 1}


def test_command_and_errors(tiny_checkpoints, tmp_path, capsys):
    src = tiny_checkpoints["qwen3_moe"]
    assert main(["convert", "--to", "int4", str(src), str(tmp_path / "out"), "--group-size", "64", "--target", "all"]) == 0
    assert "INT4 weights (group size 64)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="already quantized"):
        convert_checkpoint(tmp_path / "out", tmp_path / "again")
    with pytest.raises(ValueError, match="is the source"):
        convert_checkpoint(src, src)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight has shape \(128, 160\)"):
        convert_checkpoint(tiny_checkpoints["qwen3_odd"], tmp_path / "odd", 64, "all")


def test_checkpoint_holds_the_rollout_models_int4_weights(tiny_checkpoints, tmp_path):
    from miles_host.models import load_pretrained
    from miles_int4.rollout import quantize_rollout_model

    src = tiny_checkpoints["qwen3_moe"]
    convert_checkpoint(src, tmp_path / "int4", 32, "experts")
    after = _tensors(tmp_path / "int4")
    rollout = load_pretrained(src)
    quantize_rollout_model(rollout, 32, "experts", use_kernel=False)
    experts = rollout.layers[1].mlp.experts
    for expert in range(4):
        gate_up = experts.gate_up_proj_packed[expert]
        prefix = f"model.layers.1.mlp.experts.{expert}"
        assert torch.equal(after[f"{prefix}.gate_proj.weight_packed"], gate_up[:64])
        assert torch.equal(after[f"{prefix}.up_proj.weight_packed"], gate_up[64:])
        assert torch.equal(after[f"{prefix}.down_proj.weight_scale"], experts.down_proj_scale[expert])
