"""A third-party distribution adds a model type through the ``miles.plugins`` entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_host.models import load_pretrained, save_pretrained

from .conftest import hf_logits, prompts_batch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "third_party_model"


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    """The example installed (non-editable) into a temporary target on sys.path."""
    target = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "--target", str(target), str(EXAMPLE)],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot pip install the example here: {result.stderr[-500:]}")
    sys.path.insert(0, str(target))
    yield target
    sys.path.remove(str(target))
    for name in [m for m in sys.modules if m.startswith("tinyllama_alias")]:
        del sys.modules[name]


def _my_llama_checkpoint(llama_path: Path, out: Path) -> Path:
    """Rewrite a transformers Llama checkpoint with my_llama's names and model_type."""
    out.mkdir()
    config = json.loads((llama_path / "config.json").read_text())
    config["model_type"] = "my_llama"
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    (out / "config.json").write_text(json.dumps(config))
    renames = {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2", "self_attn.q_proj": "attn.wq",
               "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv", "self_attn.o_proj": "attn.wo",
               "mlp.gate_proj": "mlp.w_gate", "mlp.up_proj": "mlp.w_up", "mlp.down_proj": "mlp.w_down"}
    tensors = {}
    for name, tensor in load_file(str(llama_path / "model.safetensors")).items():
        name = name.replace("model.embed_tokens", "transformer.wte").replace("model.norm", "transformer.ln_f")
        name = name.replace("model.layers.", "transformer.h.")
        for old, new in renames.items():
            name = name.replace(f".{old}.", f".{new}.")
        tensors[name] = tensor
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_example_plugin_loads_its_model_type(installed_example, checkpoints, tmp_path):
    from miles_host.plugin_manager import create_plugin_manager

    manager = create_plugin_manager()
    assert manager.plugins["tinyllama_alias"].distribution == "miles-tinyllama-alias"
    families = manager.registries.model_families
    assert families.by_model_type("my_llama").name == "my_llama"

    # a plain Llama without biases and with default rope, so the alias describes it fully
    llama_path = tmp_path / "llama"
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(llama_path)
    path = _my_llama_checkpoint(llama_path, tmp_path / "my_llama")

    model = load_pretrained(path, family=families.by_model_type)
    input_ids, attention_mask = prompts_batch()
    reference = hf_logits(llama_path, input_ids, attention_mask)
    with torch.no_grad():
        logits = model(input_ids, attention_mask)
    valid = attention_mask.bool()
    assert (logits[valid] - reference[valid]).abs().max() <= 1e-4

    save_pretrained(model, tmp_path / "saved", family=families.by_model_type)
    original, saved = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(original) == sorted(saved)
    assert all(torch.equal(original[name], saved[name]) for name in original)
