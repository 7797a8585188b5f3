"""The acceptance checks of every case of :data:`family_acceptance.CASES` against transformers:
the HF -> miles -> HF weight round trip bit for bit, the engine's greedy tokens and log-probs at
temperature 0.7 (CPU, and on a GPU with CUDA graphs), the refusal of ``--true-on-policy``,
preemption with prefix sharing and chunked prefill, one GRPO step."""

from __future__ import annotations

import pytest
import torch

from miles_host.models import load_pretrained

from .family_acceptance import (
    CASES,
    assert_engine_matches_transformers,
    assert_gpu_engine_matches_transformers,
    assert_round_trip_bit_for_bit,
    assert_small_cache_engine_matches,
    assert_true_on_policy_refused,
    family_lookup,
    grpo_step,
    tiny_checkpoint,
)

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """``(lookup, transformers model, checkpoint path)`` of one case."""
    return (family_lookup(request.param), *tiny_checkpoint(request.param, tmp_path_factory))


def test_weights_round_trip_bit_for_bit(case, tmp_path):
    lookup, _, path = case
    assert_round_trip_bit_for_bit(path, lookup, tmp_path)


def test_engine_greedy_tokens_and_log_probs_match_transformers(case):
    lookup, hf_model, path = case
    assert_engine_matches_transformers(hf_model, load_pretrained(path, family=lookup))


def test_true_on_policy_is_refused_with_the_reason(case):
    lookup, _, path = case
    assert_true_on_policy_refused(load_pretrained(path, family=lookup))


@pytest.mark.slow
def test_preemption_prefix_sharing_and_chunked_prefill_keep_the_tokens(case):
    """The cache's extra entries (DSA's indexer keys, the zero-width entries of gemma3n's KV-sharing
    layers) follow the blocks through sharing, copy-on-write and recompute."""
    lookup, _, path = case
    assert_small_cache_engine_matches(load_pretrained(path, family=lookup))


@pytest.mark.slow
def test_a_grpo_step_runs(case, tmp_path):
    assert grpo_step(case[2], tmp_path)["train/train_rollout_logprob_abs_diff"] < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_matches_transformers(case):
    lookup, hf_model, path = case
    assert_gpu_engine_matches_transformers(hf_model, load_pretrained(path, family=lookup))
