"""``--true-on-policy`` on CUDA in bf16: the batch-invariant kernels
(:mod:`miles_host.models.invariant_gpu`) make a token's log-prob one number whether
the engine computes it in a decode step (CUDA graphs, overlapped scheduling) or next
to other requests, and the trainer in any micro-batching. Prefill == decode == training
and the rarer blocks run on the GPU as the ``cuda_bf16`` cases of
``test_invariance.py``."""

from __future__ import annotations

import math

import pytest
import torch

from miles_host.rollout import Engine

from tests.true_on_policy.conftest import QUICKSTART_MODEL
from tests.true_on_policy.test_grpo_exact import DIFF, DIFF_MAX, grpo_rows
from tests.true_on_policy.test_invariance import PROMPTS, engine_results, packed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16 = dict(dtype=torch.bfloat16, device="cuda")


@pytest.fixture(params=["dense", "moe"])
def policy_path(request):
    return QUICKSTART_MODEL if request.param == "dense" else request.getfixturevalue("moe_policy")


def _trainer_model(path):
    from miles_host.models import load_pretrained

    return load_pretrained(str(path), **BF16)


def test_engine_uses_the_invariant_kernels_with_graphs():
    engine = Engine.from_pretrained(str(QUICKSTART_MODEL), batch_invariant=True, **BF16)
    assert engine.config.attention_backend == "triton_invariant"
    assert engine.runner.graphs is not None and not engine.runner.token_by_token


def test_sampled_tokens_match_the_trainer_in_any_micro_batching(policy_path):
    params = {"temperature": 0.8, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 3, "n": 4}
    runs = engine_results(policy_path, PROMPTS, params, max_num_seqs=5, **BF16)
    model = _trainer_model(policy_path)
    prompts = [p for p in PROMPTS for _ in range(4)]
    sequences = [p + ids for p, (ids, _) in zip(prompts, runs)]
    for micro in (sequences, sequences[:1], sequences[1:7], sequences[7:]):
        recomputed = packed(model, micro, temperature=0.8)
        for sequence, lp in zip(micro, recomputed):
            i = sequences.index(sequence)
            assert lp[len(prompts[i]) - 1 :].tolist() == runs[i][1]


def test_engine_results_do_not_depend_on_the_other_requests(policy_path):
    params = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 7, "n": 2}
    alone = [r for p in PROMPTS for r in engine_results(policy_path, [p], params, **BF16)]
    crowded = engine_results(policy_path, PROMPTS, params, max_num_seqs=3, **BF16)
    eager = engine_results(policy_path, PROMPTS, params, enforce_eager=True, **BF16)
    assert crowded == alone and eager == alone


def test_grpo_on_the_gpu_is_exactly_on_policy(moe_policy, mixed_data, tmp_path):
    """bf16 engine (graphs, overlap), float32 master weights, micro-batches: diff exactly 0."""
    for name, model, extra in (
        ("dense", QUICKSTART_MODEL, ("--micro-batch-size", "5")),
        ("moe_r3", moe_policy, ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "40", "--plugins", "r3")),
    ):
        out = tmp_path / name
        out.mkdir()
        rows = grpo_rows(model, mixed_data, out, "--true-on-policy", "--device", "cuda", "--dtype", "bfloat16", *extra)
        for row in rows:
            assert row[DIFF] == 0.0 and row[DIFF_MAX] == 0.0, (name, row)
            assert row["train/ppo_kl"] == 0.0
    out = tmp_path / "off"
    out.mkdir()
    rows = grpo_rows(QUICKSTART_MODEL, mixed_data, out, "--device", "cuda", "--dtype", "bfloat16",
                     "--micro-batch-size", "5")
    assert all(math.isfinite(row[DIFF]) and row[DIFF] > 0.0 for row in rows)
    print(f"\nGPU bf16 without the flag: abs diff mean {[r[DIFF] for r in rows]}, max {[r[DIFF_MAX] for r in rows]}")
