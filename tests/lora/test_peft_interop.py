"""LoRA adapters cross between miles and PEFT: the logits agree with the transformers
model under ``peft`` (the independent reference) within float32 tolerance, both ways."""

from __future__ import annotations

import json

import pytest
import torch

from miles_host.config import MilesConfig
from miles_host.lora import apply_lora, lora_modules, merged_state_dict, save_adapter
from miles_host.models import load_pretrained

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

RANK, ALPHA = 4, 8


def _input_ids() -> torch.Tensor:
    return torch.randint(2, 99, (2, 11), generator=torch.Generator().manual_seed(3))


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _merged_model(path, lora_model):
    merged = load_pretrained(str(path), dtype=torch.float32)
    merged.load_state_dict(merged_state_dict(lora_model))
    return merged


def _assert_close(have: torch.Tensor, want: torch.Tensor) -> None:
    assert (have - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item()), (have - want).abs().max()


@pytest.mark.parametrize("targets", [None, "q_proj,v_proj,down_proj", "all-linear"])
def test_adapter_saved_by_miles_gives_the_same_logits_under_peft(hf_checkpoint, tmp_path, targets):
    config = MilesConfig(hf_checkpoint=str(hf_checkpoint), lora_rank=RANK, lora_alpha=ALPHA, target_modules=targets,
                         exclude_modules="layers.1.self_attn.q_proj" if targets == "all-linear" else None)
    model = load_pretrained(str(hf_checkpoint), dtype=torch.float32)
    apply_lora(model, config)
    torch.manual_seed(1)
    with torch.no_grad():  # a trained adapter: B away from its zero start
        for module in lora_modules(model).values():
            for b in module.lora_B.values():
                b.normal_(0, 0.2)
    save_adapter(model, tmp_path / "adapter", config)
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == RANK and saved["lora_alpha"] == ALPHA
    reference = peft.PeftModel.from_pretrained(_hf_model(hf_checkpoint), str(tmp_path / "adapter")).eval()
    adapted = {name for name, m in reference.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    ids = _input_ids()
    with torch.no_grad():
        want = reference(ids).logits
        merged = _merged_model(hf_checkpoint, model)(ids)
        unmerged = model(ids)
        base = _hf_model(hf_checkpoint)(ids).logits
    assert len(adapted) == sum(len(m.parts) for m in lora_modules(model).values())
    assert (want - base).abs().max() > 1e-2  # the adapter changes the model
    _assert_close(merged, want)
    _assert_close(unmerged, want)


def peft_adapter_in_miles(checkpoint, tmp_path, **peft_fields):
    """A PEFT adapter (``LoraConfig(**peft_fields)``, random A and B: a non-trivial adapter)
    saved by ``peft``, and the native model that loads it through ``--lora-adapter-path`` with no
    ``--target-modules``: ``(peft reference model, native model, LoraSummary)``."""
    torch.manual_seed(2)
    peft_config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, init_lora_weights=False, **peft_fields)
    reference = peft.get_peft_model(_hf_model(checkpoint), peft_config).eval()
    reference.save_pretrained(str(tmp_path / "peft_adapter"))
    config = MilesConfig(hf_checkpoint=str(checkpoint), lora_rank=RANK, lora_alpha=ALPHA,
                         lora_adapter_path=str(tmp_path / "peft_adapter"))
    model = load_pretrained(str(checkpoint), dtype=torch.float32)
    return reference, model, apply_lora(model, config)


def _peft_adapted(reference) -> set[str]:
    """The modules PEFT's model carries a LoRA pair in (a routed-experts module once per stack)."""
    adapted = set()
    for name, module in reference.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            parameter = getattr(module, "parameter_name", None)
            adapted.add(name.replace(".base_layer", "") + (f".{parameter}" if parameter else ""))
    return adapted


def test_adapter_trained_by_peft_gives_the_same_logits_in_miles(hf_checkpoint, tmp_path):
    """``gate_proj`` + ``up_proj``: on a MoE model PEFT >= 0.22 also adapts the fused expert stack
    ``gate_up_proj``, at twice the rank and alpha (its ``rank_pattern`` / ``alpha_pattern``); miles
    gives that stack the adapter's shape."""
    reference, model, summary = peft_adapter_in_miles(
        hf_checkpoint, tmp_path, target_modules=["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"])
    assert summary.adapted_modules == len(_peft_adapted(reference))
    ids = _input_ids()
    with torch.no_grad():
        want = reference(ids).logits
        _assert_close(model(ids), want)
        _assert_close(_merged_model(hf_checkpoint, model)(ids), want)


def test_an_adapter_with_a_fused_stack_rank_goes_back_to_peft(hf_checkpoint, tmp_path):
    """PEFT's adapter -> miles -> miles' save -> PEFT: the same logits; the fused stack's own rank
    and alpha are in the saved ``rank_pattern`` / ``alpha_pattern``."""
    reference, model, _ = peft_adapter_in_miles(
        hf_checkpoint, tmp_path, target_modules=["q_proj", "gate_proj", "up_proj"])
    peft_saved = json.loads((tmp_path / "peft_adapter" / "adapter_config.json").read_text())
    config = MilesConfig(hf_checkpoint=str(hf_checkpoint), lora_rank=RANK, lora_alpha=ALPHA)
    save_adapter(model, tmp_path / "again", config)
    saved = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    stacks = [m for m in lora_modules(model).values() if hasattr(m, "ranks")]
    if peft_saved.get("rank_pattern"):  # PEFT >= 0.22 on a fused-experts model
        assert stacks and all(m.ranks["gate_up_proj"] == 2 * RANK for m in stacks)
        assert saved["rank_pattern"] == {r"experts\.gate_up_proj": 2 * RANK}
        assert saved["alpha_pattern"] == {r"experts\.gate_up_proj": 2 * ALPHA}
    again = peft.PeftModel.from_pretrained(_hf_model(hf_checkpoint), str(tmp_path / "again")).eval()
    assert _peft_adapted(again) == _peft_adapted(reference)
    ids = _input_ids()
    with torch.no_grad():
        _assert_close(again(ids).logits, reference(ids).logits)


def test_round_trip_through_peft_keeps_every_tensor(hf_checkpoint, tmp_path):
    """miles -> adapter files -> miles: the same A and B, PEFT's key names."""
    from safetensors.torch import load_file

    config = MilesConfig(hf_checkpoint=str(hf_checkpoint), lora_rank=RANK, lora_alpha=ALPHA)
    first = load_pretrained(str(hf_checkpoint), dtype=torch.float32)
    apply_lora(first, config)
    save_adapter(first, tmp_path / "a", config)
    keys = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight" in keys
    second = load_pretrained(str(hf_checkpoint), dtype=torch.float32)
    config.lora_adapter_path = str(tmp_path / "a")
    apply_lora(second, config)
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_peft_adapter_on_a_moe_router_is_refused_naming_it(hf_checkpoint, tmp_path):
    """PEFT >= 0.22's all-linear on a MoE model adapts the router (``mlp.gate``, a parameter
    target): miles has no router adapters, and says so naming the module; where PEFT leaves the
    router alone, the adapter loads with PEFT's logits."""
    peft_config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, init_lora_weights=False, target_modules="all-linear")
    reference = peft.get_peft_model(_hf_model(hf_checkpoint), peft_config).eval()
    reference.save_pretrained(str(tmp_path / "peft_adapter"))
    routers = [name for name in _peft_adapted(reference) if name.endswith("mlp.gate") or name.endswith("mlp.gate.weight")]
    config = MilesConfig(hf_checkpoint=str(hf_checkpoint), lora_rank=RANK, lora_alpha=ALPHA,
                         lora_adapter_path=str(tmp_path / "peft_adapter"))
    model = load_pretrained(str(hf_checkpoint), dtype=torch.float32)
    if routers:
        with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate .*no router adapters"):
            apply_lora(model, config)
        return
    apply_lora(model, config)
    ids = _input_ids()
    with torch.no_grad():
        _assert_close(model(ids), reference(ids).logits)
