"""``--true-on-policy`` on CUDA in bf16: the batch-invariant kernels
(:mod:`miles_host.models.invariant_gpu`) make a token's log-prob one number whether
the engine computes it in a prefill, a decode step (CUDA graphs, overlapped
scheduling) or next to other requests, and the trainer in any packing."""

from __future__ import annotations

import math

import pytest
import torch

from miles_host.rollout import Engine

from tests.true_on_policy.conftest import QUICKSTART_MODEL, native_model
from tests.true_on_policy.test_grpo_exact import DIFF, DIFF_MAX, grpo_rows
from tests.true_on_policy.test_invariance import NATIVE, PROMPTS, engine_results, packed

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


def test_prefill_decode_and_training_give_one_logprob_per_token(policy_path):
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    run_a = engine_results(policy_path, PROMPTS, greedy, **BF16)
    prompt, (ids, logprobs) = PROMPTS[2], run_a[2]
    for k in (1, 3, 5):
        run_b = engine_results(policy_path, [prompt + ids[:k]], {**greedy, "max_new_tokens": 1}, **BF16)
        assert run_b[0][0] == [ids[k]]
        assert run_b[0][1][0] == logprobs[k]  # prefill == decode, bitwise
    model = _trainer_model(policy_path)
    sequences = [p + ids for p, (ids, _) in zip(PROMPTS, run_a)]
    noise = [[7, 8, 9, 10, 11, 12, 13, 2, 3], [6]]
    recomputed = packed(model, [noise[0], *reversed(sequences), noise[1]])[1:-1][::-1]
    for sequence_lp, prompt, (_, rollout_lp) in zip(recomputed, PROMPTS, run_a):
        assert sequence_lp[len(prompt) - 1 :].tolist() == rollout_lp


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


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_native_blocks_engine_equals_trainer_in_any_packing(name):
    """Sliding windows, soft-capping, sandwich norms, MLA, sigmoid grouped MoE with shared experts."""
    model = native_model(**NATIVE[name]).to(**BF16)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 40, (n,), generator=generator).tolist() for n in (7, 3, 9, 1, 5)]
    together = packed(model, sequences)
    for order in ([4, 2, 0], [1], [3, 0]):
        for i, lp in zip(order, packed(model, [sequences[i] for i in order])):
            assert lp.tolist() == together[i].tolist()
    fast = packed(model, sequences, invariant=False)
    for a, b in zip(together, fast):  # the same function as the fast path, within bf16
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
    runs = engine_results(model, sequences[:3], {"temperature": 0.9, "max_new_tokens": 4, "ignore_eos": True,
                                                "sampling_seed": 1}, max_num_seqs=2, eos_token_ids=[])
    full = [s + ids for s, (ids, _) in zip(sequences[:3], runs)]
    for s, lp, (_, rollout_lp) in zip(sequences, packed(model, full, temperature=0.9), runs):
        assert lp[len(s) - 1 :].tolist() == rollout_lp


def test_gradients_close_to_the_fast_path():
    model = native_model(**NATIVE["moe_sigmoid_grouped"]).to(device="cuda")
    sequences = [[1, 5, 9, 3, 2], [7, 7, 1], [3, 9, 27, 1, 1, 4]]
    grads = []
    for invariant in (True, False):
        model.zero_grad()
        _, log_probs, entropy = packed(model, sequences, invariant=invariant, temperature=0.7, grad=True, entropy=True)
        (log_probs.sum() + 0.1 * entropy.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for key in grads[0]:
        torch.testing.assert_close(grads[0][key], grads[1][key], rtol=1e-3, atol=1e-4)


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
