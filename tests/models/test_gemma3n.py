"""Gemma-3n text (``gemma3n_text``) on the tiny model of ``family_acceptance.CASES`` (sliding and
full layers, two KV-sharing layers, activation sparsity on two layers, per-layer MLP widths,
per-layer-input ids past their table): config and cache layout, training logits against
transformers, gradients (recomputed or not), the multimodal checkpoint's language model. The
checks every family passes: ``test_family_acceptance.py``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_host.models import load_pretrained, save_pretrained
from miles_models import gemma3n

from .conftest import hf_logits, prompts_batch
from .family_acceptance import VOCAB, family_lookup, tiny_checkpoint

transformers = pytest.importorskip("transformers")

lookup = family_lookup("gemma3n")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint("gemma3n", tmp_path_factory)


def test_config_mapping_and_kv_sharing_layout(checkpoint):
    hf_model, path = checkpoint
    model = load_pretrained(path, family=lookup)
    assert hf_model.config.kv_sharing_modes == [None, "store", "store", "reuse", "reuse"]
    assert model.config.gemma3n.kv_source == [None, None, None, 1, 2]
    # the sharing layers keep no cache of their own
    expected = [(2, 16, 16, 4), (2, 16, 16, None), (2, 16, 16, 4), (2, 0, 0, None), (2, 0, 0, 4)]
    assert model.attention_layout() == expected


def test_logits_match_transformers(checkpoint):
    _, path = checkpoint
    input_ids, attention_mask = prompts_batch(VOCAB, lengths=(15, 6, 9))
    valid = attention_mask.bool()
    assert (input_ids[valid] >= 64).any()  # ids past the per-layer table read its row 0
    reference = hf_logits(path, input_ids, attention_mask)
    with torch.no_grad():
        logits = load_pretrained(path, family=lookup)(input_ids, attention_mask)
    assert (logits[valid] - reference[valid]).abs().max().item() <= 1e-4


def test_every_weight_trains_and_recomputed_layers_give_the_same_gradients(checkpoint):
    tokens = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(0))
    gradients = []
    for recompute in (False, True):
        model = load_pretrained(checkpoint[1], family=lookup).train()
        model.gradient_checkpointing = recompute
        log_probs, _ = model.packed_log_probs(
            tokens, torch.cat([torch.arange(12), torch.arange(8)]), torch.tensor([0, 12, 20], dtype=torch.int32),
            torch.roll(tokens, -1),
        )
        log_probs.sum().backward()
        gradients.append({name: p.grad for name, p in model.named_parameters()})
    assert all(g is not None for g in gradients[0].values())  # KV sources get gradients from their sharers too
    assert all(torch.equal(gradients[0][name], gradients[1][name]) for name in gradients[0])


def test_published_kv_weights_of_sharing_layers_are_ignored(checkpoint):
    weight = torch.ones(32, 64)
    assert gemma3n.WEIGHTS.convert_hf_tensor("model.layers.3.self_attn.k_proj.weight", weight, load_pretrained(
        checkpoint[1], family=lookup).config) == []



def test_the_multimodal_checkpoints_language_model_loads_and_round_trips(checkpoint, tmp_path):
    """The language model of a ``gemma3n`` checkpoint (``text_config``, ``model.language_model.*``)
    is the text model; the towers are skipped."""
    _, path = checkpoint
    multimodal = tmp_path / "multimodal"
    multimodal.mkdir()
    text = json.loads((path / "config.json").read_text())
    (multimodal / "config.json").write_text(json.dumps({"model_type": "gemma3n", "text_config": text}))
    text_tensors = load_file(path / "model.safetensors")
    tensors = {name.replace("model.", "model.language_model.", 1): t for name, t in text_tensors.items()}
    save_file({**tensors, "model.vision_tower.stem.weight": torch.ones(3)}, multimodal / "model.safetensors")
    input_ids, attention_mask = prompts_batch(VOCAB, lengths=(9, 4))
    with torch.no_grad():
        expected = load_pretrained(path, family=lookup)(input_ids, attention_mask)
        model = load_pretrained(multimodal, family=lookup)
        assert torch.equal(model(input_ids, attention_mask), expected)
    save_pretrained(model, tmp_path / "saved", family=lookup)
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert sorted(saved) == sorted(tensors)
    assert all(torch.equal(saved[name], t) for name, t in tensors.items())
