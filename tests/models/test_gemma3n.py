"""Gemma-3n text (``gemma3n_text``) against transformers on a tiny random model with sliding and
full layers, two KV-sharing layers (one of each type), activation sparsity on two layers,
per-layer MLP widths and per-layer-input ids beyond their table: training logits, the engine's
greedy tokens and log-probs, the HF -> miles -> HF weight round trip, a GRPO step, and the
refusal of ``--true-on-policy``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_host.models import load_pretrained, save_pretrained
from miles_models import gemma3n

from .conftest import hf_logits, prompts_batch
from .family_acceptance import (
    VOCAB,
    assert_engine_matches_transformers,
    assert_gpu_engine_matches_transformers,
    assert_round_trip_bit_for_bit,
    assert_small_cache_engine_matches,
    assert_true_on_policy_refused,
    grpo_step,
    save_tiny,
)

transformers = pytest.importorskip("transformers")

RECORD = gemma3n.miles_register_model_families()[0]
SLIDING, FULL = "sliding_attention", "full_attention"
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=[96, 80, 96, 64, 96], num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.05,
    pad_token_id=0, bos_token_id=None, eos_token_id=1, layer_types=[SLIDING, FULL, SLIDING, FULL, SLIDING],
    sliding_window=4, num_kv_shared_layers=2, activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0],
    altup_num_inputs=4, laurel_rank=8, hidden_size_per_layer_input=16, vocab_size_per_layer_input=64,
    final_logit_softcapping=30.0,
)


def lookup(model_type: str):
    assert model_type in RECORD.model_types
    return RECORD


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3n")
    return save_tiny("gemma3n_text", CONFIG, path), path


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


def test_weights_round_trip_bit_for_bit(checkpoint, tmp_path):
    assert_round_trip_bit_for_bit(checkpoint[1], lookup, tmp_path)


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


def test_engine_greedy_tokens_and_log_probs_match_transformers(checkpoint):
    hf_model, path = checkpoint
    assert_engine_matches_transformers(hf_model, load_pretrained(path, family=lookup))


@pytest.mark.slow
def test_preemption_prefix_sharing_and_chunked_prefill_keep_the_tokens(checkpoint):
    """The cache's zero-width entries of KV-sharing layers follow the blocks through sharing,
    copy-on-write and recompute."""
    assert_small_cache_engine_matches(load_pretrained(checkpoint[1], family=lookup))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_matches_transformers(checkpoint):
    hf_model, path = checkpoint
    assert_gpu_engine_matches_transformers(hf_model, load_pretrained(path, family=lookup))


def test_true_on_policy_is_refused_with_the_reason(checkpoint):
    assert_true_on_policy_refused(load_pretrained(checkpoint[1], family=lookup))


@pytest.mark.slow
def test_a_grpo_step_runs(checkpoint, tmp_path):
    assert grpo_step(checkpoint[1], tmp_path)["train/train_rollout_logprob_abs_diff"] < 1e-4
