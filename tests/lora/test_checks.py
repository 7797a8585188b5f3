"""The LoRA flags' validation: refused settings name the flag and what to do, and
``--dry-run`` refuses them as the run does."""

from __future__ import annotations

import pytest
import torch

from miles_host.cli.main import main
from miles_host.config import MilesConfig
from miles_host.lora import apply_lora
from miles_host.models import load_pretrained
from miles_host.plugin_manager import MilesPluginManager
from miles_host.records import TrainBackend
from miles_host.validation import validate
from tests.lora.conftest import build_checkpoint
from tests.run_inputs import run_inputs

REFUSED = [
    (["--lora-rank", "-1"], "--lora-rank must be >= 0"),
    (["--target-modules", "q_proj"], "--target-modules configure LoRA, which --lora-rank 0 turns off"),
    (["--lora-rank", "8", "--lora-alpha", "0"], "--lora-alpha must be positive"),
    (["--lora-rank", "8", "--lora-dropout", "1.0"], "--lora-dropout must be in [0, 1)"),
    (["--lora-rank", "8", "--true-on-policy"], "--true-on-policy with --lora-rank"),
    (["--lora-rank", "8", "--merge-lora"], "--merge-lora chooses what --save-hf writes"),
    (["--lora-rank", "8", "--lora-adapter-path", "/nonexistent/adapter"], "needs adapter_config.json"),
    (["--lora-rank", "8", "--plugins", "int4"], "with --precision int4 needs --lora-sync adapter"),
    (["--lora-rank", "8", "--plugins", "int4", "--lora-sync", "adapter", "--true-on-policy"], "--true-on-policy with --lora-rank"),
]


@pytest.mark.parametrize("argv, message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_dry_run_refuses(argv, message, tmp_path, capsys):
    code = main(["run", *run_inputs(), "--output-dir", str(tmp_path / "out"), *argv, "--dry-run"])
    assert code == 2 and message in capsys.readouterr().err


def test_lora_rank_zero_is_off_and_accepted(tmp_path):
    assert main(["run", *run_inputs(), "--output-dir", str(tmp_path / "out"), "--lora-rank", "0", "--dry-run"]) == 0
    model = load_pretrained(str(build_checkpoint(tmp_path / "m", "qwen3")), dtype=torch.float32)
    assert apply_lora(model, MilesConfig(lora_rank=0)) is None
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("plugin", ["int4", "fp8"])
def test_a_quantized_base_is_accepted_with_adapter_sync(plugin, tmp_path):
    assert main(["run", *run_inputs(), "--output-dir", str(tmp_path / "out"), "--plugins", plugin, "--lora-rank", "8",
                 "--lora-sync", "adapter", "--dry-run"]) == 0


def test_a_backend_without_lora_in_its_record_is_refused():
    """A training backend whose record does not declare ``lora`` (the megatron backend's
    does not) is refused with the reason."""

    class PlainBackend:
        @staticmethod
        def miles_register_train_backends():
            return [TrainBackend("plain", "a backend without adapter layers", factory=lambda config, manager: None)]

    manager = MilesPluginManager()
    manager.add_inline_plugin(PlainBackend(), "plain-backend")
    manager.activate()
    folder = run_inputs()
    config = MilesConfig(hf_checkpoint=folder[1], prompt_data=folder[3], rm_type="exact", n_samples_per_prompt=2,
                         train_backend="plain", lora_rank=8)
    with pytest.raises(ValueError, match="--train-backend plain does not train LoRA adapters"):
        validate(config, manager.registries, manager.hook)
    assert not manager.registries.train_backends.get("plain").lora
    assert all(manager.registries.train_backends.get(name).lora for name in ("native", "native_dp", "fsdp"))


def test_target_names_that_match_nothing_list_the_available_ones(tmp_path):
    path = build_checkpoint(tmp_path / "m", "qwen3")
    model = load_pretrained(str(path), dtype=torch.float32)
    with pytest.raises(ValueError) as error:
        apply_lora(model, MilesConfig(hf_checkpoint=str(path), lora_rank=4, target_modules="q_proj,qkv_proj"))
    message = str(error.value)
    assert "qkv_proj matches no adaptable module" in message
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in message
    with pytest.raises(ValueError, match="lm_head matches no adaptable module"):
        apply_lora(model, MilesConfig(hf_checkpoint=str(path), lora_rank=4, target_modules="lm_head"))
    with pytest.raises(ValueError, match="leaves no module"):
        apply_lora(model, MilesConfig(hf_checkpoint=str(path), lora_rank=4, target_modules="o_proj",
                                      exclude_modules="o_proj"))


def test_an_adapter_of_another_rank_names_the_flags_to_give(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    path = build_checkpoint(tmp_path / "m", "qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])).save_pretrained(
        str(tmp_path / "adapter"))
    model = load_pretrained(str(path), dtype=torch.float32)
    config = MilesConfig(hf_checkpoint=str(path), lora_rank=8, lora_adapter_path=str(tmp_path / "adapter"))
    with pytest.raises(ValueError, match="give --lora-rank 2 --lora-alpha 4"):
        apply_lora(model, config)
    mismatched = MilesConfig(hf_checkpoint=str(path), lora_rank=2, lora_alpha=4, target_modules="v_proj",
                             lora_adapter_path=str(tmp_path / "adapter"))
    with pytest.raises(ValueError, match="does not fit the adapted modules"):
        apply_lora(model, mismatched)


def test_an_adapter_with_a_rank_pattern_on_a_linear_is_refused_before_loading(tmp_path):
    """Per-module ranks are read for routed-expert stacks only: a ``rank_pattern`` on a linear is
    refused by the validation stage (the meta model) and by ``apply_lora``, naming the module."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    path = build_checkpoint(tmp_path / "m", "qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                            rank_pattern={"q_proj": 4})).save_pretrained(str(tmp_path / "adapter"))
    config = MilesConfig(hf_checkpoint=str(path), prompt_data=run_inputs()[3], rm_type="exact", n_samples_per_prompt=2,
                         lora_rank=2, lora_alpha=4, lora_adapter_path=str(tmp_path / "adapter"))
    manager = MilesPluginManager()
    manager.activate()
    with pytest.raises(ValueError, match=r"self_attn.q_proj r=4.*routed-expert stacks only"):
        validate(config, manager.registries, manager.hook)
    with pytest.raises(ValueError, match=r"self_attn.q_proj r=4.*routed-expert stacks only"):
        apply_lora(load_pretrained(str(path), dtype=torch.float32), config)


def test_upstream_spellings_of_target_modules(tmp_path):
    """Megatron's module names (upstream scripts) and all / all_linear pick the same modules."""
    from miles_host.lora import lora_modules

    path = build_checkpoint(tmp_path / "m", "qwen3")

    def adapted(targets: str) -> set[str]:
        model = load_pretrained(str(path), dtype=torch.float32)
        apply_lora(model, MilesConfig(hf_checkpoint=str(path), lora_rank=2, target_modules=targets))
        return {p.hf_module for m in lora_modules(model).values() for p in m.parts}

    every = adapted("all-linear")
    assert adapted("all") == adapted("all_linear") == every
    assert adapted("linear_qkv,linear_proj,linear_fc1,linear_fc2") == every
    assert adapted("linear_qkv") == adapted("q_proj,k_proj,v_proj")
