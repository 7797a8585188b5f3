"""Greedy ids and logprobs against transformers (dense and MoE, float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.conftest import PROMPTS, engine_logprobs, hf_logprobs, make_engine


def hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' batched greedy generate with left padding, EOS off."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
        )
    return out[:, width:].tolist()


@pytest.mark.parametrize("fixture", ["qwen3_dense", "llama_dense", "qwen3_moe"])
def test_greedy_matches_transformers_generate(fixture, request):
    hf_model, path = request.getfixturevalue(fixture)
    engine = make_engine(path)
    outputs = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    expected = hf_greedy(hf_model, PROMPTS, 24)
    assert [o["output_ids"] for o in outputs] == expected
    for prompt, output in zip(PROMPTS, outputs):
        assert output["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
        assert output["meta_info"]["completion_tokens"] == 24
        assert output["meta_info"]["prompt_tokens"] == len(prompt)
        diff = (engine_logprobs(output) - hf_logprobs(hf_model, prompt, output["output_ids"])).abs().max()
        assert diff <= 1e-5, diff


@pytest.mark.parametrize("fixture", ["qwen3_dense", "qwen3_moe"])
def test_sampled_logprobs_are_log_softmax_over_temperature(fixture, request):
    hf_model, path = request.getfixturevalue(fixture)
    engine = make_engine(path)
    params = [
        {"temperature": 0.7, "top_p": 0.8, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 1},
        {"temperature": 1.3, "top_k": 5, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 2},
        {"temperature": 1.0, "min_p": 0.1, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 3},
        {"temperature": 0.5, "max_new_tokens": 16, "ignore_eos": True, "n": 2, "sampling_seed": 4},
    ]
    outputs = engine.generate(PROMPTS, params)
    temperatures = [0.7, 1.3, 1.0, 0.5, 0.5]
    prompts = PROMPTS[:3] + [PROMPTS[3], PROMPTS[3]]
    for prompt, output, temperature in zip(prompts, outputs, temperatures):
        reference = hf_logprobs(hf_model, prompt, output["output_ids"], temperature)
        assert (engine_logprobs(output) - reference).abs().max() <= 1e-5


def test_eos_and_stop_token_ids_finish_with_stop(qwen3_dense):
    hf_model, path = qwen3_dense
    engine = make_engine(path)
    free = engine.generate([PROMPTS[1]], {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})[0]
    stop_at = free["output_ids"][5]
    first = free["output_ids"].index(stop_at)
    stopped = engine.generate([PROMPTS[1]], {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [stop_at]})[0]
    assert stopped["output_ids"] == free["output_ids"][: first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    # EOS stops unless ignore_eos
    eos_engine = make_engine(path, eos_token_ids=[stop_at])
    by_eos = eos_engine.generate([PROMPTS[1]], {"temperature": 0, "max_new_tokens": 12})[0]
    assert by_eos["output_ids"] == free["output_ids"][: first + 1]
    ignoring = eos_engine.generate([PROMPTS[1]], {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})[0]
    assert ignoring["output_ids"] == free["output_ids"]


def test_preemption_when_the_cache_is_small_keeps_results_exact(qwen3_dense):
    hf_model, path = qwen3_dense
    reference = make_engine(path).generate(PROMPTS, {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
    small = make_engine(path, kv_cache_tokens=112, block_size=8)  # 14 blocks for 4 sequences of up to 71 tokens
    outputs = small.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
    assert small.scheduler.num_preemptions > 0
    assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in reference]
    for prompt, output in zip(PROMPTS, outputs):
        assert (engine_logprobs(output) - hf_logprobs(hf_model, prompt, output["output_ids"])).abs().max() <= 1e-5
