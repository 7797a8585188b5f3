"""Batch-invariant mode, unit level: a token's log-prob is one number whether the
engine computes it in a prefill or a decode step, next to any other requests, or
the trainer in any packing; the mode computes the same function as the fast path."""

from __future__ import annotations

import pytest
import torch

from miles_host.models import ForwardContext, MLAConfig, MoEConfig, PackedAttention, load_pretrained
from miles_host.rollout import Engine

from tests.true_on_policy.conftest import QUICKSTART_MODEL, native_model


def packed(model, sequences, *, invariant=True, temperature=1.0, grad=False, entropy=False):
    """Per-sequence next-token log-probs ``[len - 1]`` of the sequences packed in one forward
    (on the model's device)."""
    device = next(model.parameters()).device
    ids = torch.tensor([t for s in sequences for t in s], device=device)
    positions = torch.cat([torch.arange(len(s)) for s in sequences]).to(device)
    cu = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0).to(torch.int32).to(device)
    targets = torch.cat([torch.tensor(s[1:] + [0]) for s in sequences]).to(device)
    ctx = ForwardContext(attention=PackedAttention(cu), batch_invariant=invariant)
    with torch.set_grad_enabled(grad):
        log_probs, ent = model.packed_log_probs(
            ids, positions, cu, targets, temperature=temperature, ctx=ctx, return_entropy=entropy
        )
    parts = torch.split(log_probs, [len(s) for s in sequences])
    out = [p[:-1] for p in parts]
    return (out, log_probs, ent) if grad else out


def engine_results(model_or_path, prompts, params, dtype=torch.float32, device="cpu", **kwargs):
    if isinstance(model_or_path, torch.nn.Module):
        engine = Engine(model_or_path, batch_invariant=True, **kwargs)
    else:
        engine = Engine.from_pretrained(str(model_or_path), dtype=dtype, device=device, batch_invariant=True, **kwargs)
    results = engine.generate(prompts, params)
    return [(r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]) for r in results]


PROMPTS = [[4, 9, 12, 3, 13], [5, 12], [3, 4, 5, 12, 6, 7, 8, 13, 2], [11, 11, 12, 9, 13]]


@pytest.fixture(params=["dense", "moe"])
def policy_path(request):
    return QUICKSTART_MODEL if request.param == "dense" else request.getfixturevalue("moe_policy")


#: (device, dtype): the CPU float32 construction, and the batch-invariant kernels on a GPU in bf16
TARGETS = [
    pytest.param(("cpu", torch.float32), id="cpu"),
    pytest.param(("cuda", torch.bfloat16), id="cuda_bf16", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


@pytest.mark.parametrize("target", TARGETS)
def test_prefill_decode_and_training_give_one_logprob_per_token(policy_path, target):
    """Greedy run A decodes token k; run B prefills prompt + A[:k] and produces it again;
    the trainer recomputes all of them packed with unrelated sequences: all bitwise equal."""
    device, dtype = target
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    run_a = engine_results(policy_path, PROMPTS, greedy, dtype=dtype, device=device)
    prompt, (ids, logprobs) = PROMPTS[2], run_a[2]
    for k in (1, 3, 5):
        run_b = engine_results(policy_path, [prompt + ids[:k]], {**greedy, "max_new_tokens": 1}, dtype=dtype,
                               device=device)
        assert run_b[0][0] == [ids[k]]
        assert run_b[0][1][0] == logprobs[k]  # prefill == decode, bitwise
    trainer_model = load_pretrained(str(policy_path), dtype=dtype, device=device)
    sequences = [p + ids for p, (ids, _) in zip(PROMPTS, run_a)]
    noise = [[7, 8, 9, 10, 11, 12, 13, 2, 3], [6]]
    recomputed = packed(trainer_model, [noise[0], *reversed(sequences), noise[1]])[1:-1][::-1]
    for sequence_lp, prompt, (_, rollout_lp) in zip(recomputed, PROMPTS, run_a):
        assert sequence_lp[len(prompt) - 1 :].tolist() == rollout_lp


def test_sampled_tokens_match_the_trainer_at_the_rollout_temperature(policy_path):
    params = {"temperature": 0.8, "max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 3, "n": 2}
    runs = engine_results(policy_path, PROMPTS[:3], params, max_num_seqs=3)
    trainer_model = load_pretrained(str(policy_path), dtype=torch.float32, device="cpu")
    prompts = [p for p in PROMPTS[:3] for _ in range(2)]
    sequences = [p + ids for p, (ids, _) in zip(prompts, runs)]
    for micro in (sequences, sequences[:1], sequences[1:4], sequences[4:]):  # any micro-batching
        recomputed = packed(trainer_model, micro, temperature=0.8)
        for sequence, lp in zip(micro, recomputed):
            i = sequences.index(sequence)
            assert lp[len(prompts[i]) - 1 :].tolist() == runs[i][1]


def test_engine_results_do_not_depend_on_the_other_requests():
    params = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 7, "n": 2}
    alone = [r for p in PROMPTS for r in engine_results(QUICKSTART_MODEL, [p], params)]
    crowded = engine_results(QUICKSTART_MODEL, PROMPTS, params, max_num_seqs=3)
    # a KV cache too small for all: sequences are preempted and recomputed from their tokens
    engine = Engine.from_pretrained(str(QUICKSTART_MODEL), dtype=torch.float32, device="cpu", batch_invariant=True,
                                    kv_cache_tokens=48, block_size=4)
    squeezed = [(r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]])
                for r in engine.generate(PROMPTS, params)]
    assert engine.scheduler.num_preemptions > 0
    assert crowded == alone and squeezed == alone


# -- native models with the rarer blocks --------------------------------------------

NATIVE = {
    "gemma_like": dict(
        layer_types=["sliding_attention", "full_attention"], sliding_window=3, attn_logit_softcap=20.0,
        final_logit_softcap=15.0, sandwich_norm=True, norm_unit_offset=True, qk_norm="head",
        hidden_act="gelu_tanh", embed_scale=32**0.5, tie_word_embeddings=True,
    ),
    "mla": dict(mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=12),
                num_kv_heads=4, rope=__import__("miles_host.models", fromlist=["RopeConfig"]).RopeConfig(rotary_dim=4)),
    "moe_sigmoid_grouped": dict(
        moe=MoEConfig(num_experts=8, top_k=3, intermediate_size=16, score_func="sigmoid", n_group=4, topk_group=2,
                      expert_bias=True, routed_scaling_factor=2.5, shared_intermediate_size=16, shared_expert_gate=True),
        moe_layers=[False, True], qkv_bias=True,
    ),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(NATIVE))
def test_native_blocks_engine_equals_trainer_in_any_packing(name, target):
    """Sliding windows, soft-capping, sandwich norms, MLA, sigmoid grouped MoE with shared experts."""
    device, dtype = target
    model = native_model(**NATIVE[name]).to(device=device, dtype=dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 40, (n,), generator=generator).tolist() for n in (7, 3, 9, 1, 5)]
    together = packed(model, sequences)
    for order in ([4, 2, 0], [1], [3, 0]):
        again = packed(model, [sequences[i] for i in order])
        for i, lp in zip(order, again):
            assert lp.tolist() == together[i].tolist()
    fast = packed(model, sequences, invariant=False)
    for a, b in zip(together, fast):  # the same function as the fast path (within the dtype)
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)
    runs = engine_results(model, sequences[:3], {"temperature": 0.9, "max_new_tokens": 4, "ignore_eos": True,
                                                "sampling_seed": 1}, max_num_seqs=2, eos_token_ids=[])
    full = [s + ids for s, (ids, _) in zip(sequences[:3], runs)]
    for s, lp, (_, rollout_lp) in zip(sequences, packed(model, full, temperature=0.9), runs):
        assert lp[len(s) - 1 :].tolist() == rollout_lp


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=TARGETS[1].marks)])
@pytest.mark.parametrize("name", ["gemma_like", "moe_sigmoid_grouped"])
def test_gradients_match_the_fast_path(name, device):
    """float32: the invariant forward's gradients (eager / fast backward) are the fast path's."""
    model = native_model(**NATIVE[name]).to(device)
    sequences = [[1, 5, 9, 3, 2], [7, 7, 1], [3, 9, 27, 1, 1, 4]]
    grads = []
    for invariant in (True, False):
        model.zero_grad()
        _, log_probs, entropy = packed(model, sequences, invariant=invariant, temperature=0.7, grad=True, entropy=True)
        (log_probs.sum() + 0.1 * entropy.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    # (float32, two summation orders: on a CPU with AVX-512 one of the 1,024 gradients of the MoE model's
    # first o_proj, 0.033, differs by 1.7e-5 where its terms cancel)
    rtol, atol = (1e-4, 3e-5) if device == "cpu" else (1e-3, 1e-4)
    for key in grads[0]:
        torch.testing.assert_close(grads[0][key], grads[1][key], rtol=rtol, atol=atol)
