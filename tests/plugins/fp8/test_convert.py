"""``convert_checkpoint`` / ``miles convert --to fp8``: a block-FP8 HF checkpoint that round-trips."""

from __future__ import annotations

import json

import pytest
import torch

from miles_fp8.convert import QUANTIZATION_CONFIG, convert_checkpoint, iter_dequantized
from miles_host.models.loading import iter_safetensors, load_hf_tensors, safetensors_files

from .conftest import VOCAB, load, quantize64


def _tensors(path):
    return dict(iter_safetensors(safetensors_files(path)))


def test_convert_writes_block_fp8_checkpoint(qwen3_moe_path, tmp_path):
    dst = tmp_path / "fp8"
    summary = convert_checkpoint(qwen3_moe_path, dst)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG
    assert config["model_type"] == "qwen3_moe"
    source, converted = _tensors(qwen3_moe_path), _tensors(dst)
    fp8_names = [n for n, t in converted.items() if t.dtype == torch.float8_e4m3fn]
    assert sorted(fp8_names) == sorted(summary.quantized) and fp8_names
    assert "model.layers.0.self_attn.q_proj.weight" in fp8_names
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight", "model.norm.weight"):
        assert torch.equal(converted[name], source[name])  # high precision, untouched
    for name in fp8_names:
        original, q, scale = source[name].double(), converted[name], converted[name + "_scale_inv"]
        assert scale.dtype == torch.float32
        assert scale.shape == (*original.shape[:-2], original.shape[-2] // 128, original.shape[-1] // 128)
        # dequantized weights are within half an E4M3 ulp of the original, block by block
        flat = original.reshape(-1, original.shape[-1])
        _, _, expanded = quantize64(flat, 128)
        back = (q.double() * scale.double().repeat_interleave(128, -2).repeat_interleave(128, -1)).reshape(flat.shape)
        bound = torch.maximum(flat.abs() * 2.0**-4, expanded * 2.0**-10)
        assert torch.all((back - flat).abs() <= bound * (1 + 1e-6)), name


def test_converted_checkpoint_round_trips_into_the_model(qwen3_path, tmp_path):
    """Dequantized FP8 weights load into the native model and give logits close to the original's."""
    dst = tmp_path / "fp8"
    convert_checkpoint(qwen3_path, dst)
    original = load(qwen3_path)
    restored = load(qwen3_path)
    from miles_host.plugin_manager import model_family_for

    load_hf_tensors(restored, model_family_for("qwen3"), iter_dequantized(dst, torch.float32))
    input_ids = torch.randint(2, VOCAB - 1, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = original(input_ids), restored(input_ids)
    assert not torch.equal(a, b)
    # each weight matrix carries ~2.6% E4M3 noise (Gaussian weights); 8 of them in 2 layers
    assert (a - b).norm() / a.norm() < 0.15


def test_command_line(qwen3_path, tmp_path, capsys):
    from miles_host.cli.main import main

    assert main(["convert", "--to", "fp8", qwen3_path, str(tmp_path / "out"), "--fp8-power-of-two-scales"]) == 0
    assert "weights in block FP8" in capsys.readouterr().out
    scales = [t for n, t in _tensors(tmp_path / "out").items() if n.endswith("_scale_inv")]
    assert scales and all(torch.all(torch.frexp(s)[0] == 0.5) for s in scales)


def test_convert_errors(qwen3_path, tmp_path):
    with pytest.raises(FileNotFoundError):
        convert_checkpoint(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(ValueError, match="DST .* is SRC"):
        convert_checkpoint(qwen3_path, qwen3_path)
    convert_checkpoint(qwen3_path, tmp_path / "once")
    with pytest.raises(ValueError, match="already quantized"):
        convert_checkpoint(tmp_path / "once", tmp_path / "twice")
