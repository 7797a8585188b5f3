"""Every supported model type matches transformers: logits, save round trip, log-probs."""

from __future__ import annotations

import pytest
import torch

from miles_host.models import load_pretrained, save_pretrained, token_log_probs

from .conftest import CASES, family_lookup, hf_logits, prompts_batch

transformers = pytest.importorskip("transformers")


def _packed(input_ids, attention_mask):
    """Packed tokens, positions, cu_seqlens and next-token targets of a right-padded batch."""
    lengths = attention_mask.sum(1)
    tokens = [input_ids[row, :n] for row, n in enumerate(lengths.tolist())]
    input_ids_T = torch.cat(tokens)
    positions_T = torch.cat([torch.arange(len(t)) for t in tokens])
    targets_T = torch.cat([torch.roll(t, -1) for t in tokens])
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return input_ids_T, positions_T, cu_seqlens, targets_T


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, checkpoints):
    input_ids, attention_mask = prompts_batch()
    reference = hf_logits(checkpoints[case], input_ids, attention_mask)
    model = load_pretrained(checkpoints[case], family=family_lookup)
    with torch.no_grad():
        logits = model(input_ids, attention_mask)
    valid = attention_mask.bool()
    assert logits.shape == reference.shape
    assert (logits[valid] - reference[valid]).abs().max().item() <= 1e-4
    assert torch.all(logits[~valid] == 0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_save_round_trip_loads_in_transformers(case, checkpoints, tmp_path):
    input_ids, attention_mask = prompts_batch(seed=1)
    model = load_pretrained(checkpoints[case], family=family_lookup)
    save_pretrained(model, tmp_path, family=family_lookup)
    reference = hf_logits(checkpoints[case], input_ids, attention_mask)
    round_trip = hf_logits(tmp_path, input_ids, attention_mask)
    valid = attention_mask.bool()
    assert (round_trip[valid] - reference[valid]).abs().max().item() <= 1e-6
    reloaded = load_pretrained(tmp_path, family=family_lookup)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_log_probs_match_reference_logits(case, temperature, checkpoints):
    input_ids, attention_mask = prompts_batch(seed=2)
    reference = hf_logits(checkpoints[case], input_ids, attention_mask)
    input_ids_T, positions_T, cu_seqlens, targets_T = _packed(input_ids, attention_mask)
    model = load_pretrained(checkpoints[case], family=family_lookup)
    with torch.no_grad():
        log_probs_T, entropy_T = model.packed_log_probs(
            input_ids_T, positions_T, cu_seqlens, targets_T, temperature=temperature, chunk_size=7, return_entropy=True
        )
    expected_T, expected_entropy_T = token_log_probs(
        reference[attention_mask.bool()], targets_T, temperature=temperature, return_entropy=True
    )
    assert log_probs_T.dtype == torch.float32
    assert (log_probs_T - expected_T).abs().max().item() <= 1e-5
    assert (entropy_T - expected_entropy_T).abs().max().item() <= 1e-5
