"""Batch-invariant mode: a request's tokens and logprobs do not depend on its neighbours."""

from __future__ import annotations

import pytest

from tests.rollout.conftest import PROMPTS, make_engine


@pytest.mark.parametrize("fixture", ["qwen3_dense", "qwen3_moe"])
def test_batch_invariant_results_equal_the_request_run_alone(fixture, request):
    _, path = request.getfixturevalue(fixture)
    params = [
        {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
        {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 11},
        {"temperature": 1.1, "top_k": 7, "max_new_tokens": 9, "ignore_eos": True, "sampling_seed": 5, "n": 2},
        {"temperature": 0, "max_new_tokens": 15, "ignore_eos": True},
    ]
    engine = make_engine(path, batch_invariant=True)
    together = engine.generate(PROMPTS, params)
    alone = []
    for prompt, p in zip(PROMPTS, params):
        alone.extend(make_engine(path, batch_invariant=True).generate([prompt], p))
    # Also alone after unrelated traffic in the same engine.
    engine.generate([[3, 4, 5, 6, 7, 8, 9, 10, 11]] * 3, {"temperature": 0, "max_new_tokens": 5})
    again = engine.generate([PROMPTS[1]], params[1])
    assert len(together) == len(alone) == 5
    for a, b in zip(together, alone):
        assert a["output_ids"] == b["output_ids"]
        # bitwise: the float logprobs compare equal exactly
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    assert again[0]["meta_info"]["output_token_logprobs"] == alone[1]["meta_info"]["output_token_logprobs"]
