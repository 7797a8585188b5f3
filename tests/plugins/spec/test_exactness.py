"""Greedy speculative output == greedy plain output; logprobs are the policy's."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.test_requests import capture_hooks

from tests.plugins.spec.conftest import plain_engine, spec_engine
from tests.rollout.conftest import PROMPTS, engine_logprobs, hf_logprobs

GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.mark.parametrize("draft", ["mtp", "self", "bad"])
def test_greedy_equals_plain(policy, bad_draft, draft):
    _, path = policy
    draft_path = {"mtp": None, "self": path, "bad": bad_draft[1]}[draft]
    expected = plain_engine(path).generate(PROMPTS, GREEDY)
    engine = spec_engine(path, draft_path=draft_path, num_steps=3)
    got = engine.generate(PROMPTS, GREEDY)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    counters = engine.strategy.pop_counters()
    assert counters.verify_steps < 24 * len(PROMPTS)
    if draft == "self":  # the policy drafting for itself is always accepted
        assert counters.accepted_tokens == counters.draft_tokens
        assert all(o["meta_info"]["spec_accept_length"] > 3 for o in got)


def test_greedy_with_eos_n_samples_and_continuous_batching(policy):
    """Stops mid-chain, n > 1 forks and requests joining while others decode."""
    _, path = policy
    params = {"temperature": 0.0, "max_new_tokens": 30, "n": 2}
    plain = plain_engine(path)
    spec = spec_engine(path, draft_path=path, num_steps=4)
    for engine in (plain, spec):
        engine.add_request("a", PROMPTS[0], params)
        engine.step(), engine.step()
        engine.add_request("b", PROMPTS[1], {**params, "min_new_tokens": 5, "max_new_tokens": 7})
    outputs = {}
    for name, engine in (("plain", plain), ("spec", spec)):
        results = []
        while engine.has_unfinished():
            results.extend(engine.step())
        outputs[name] = sorted((o["meta_info"]["id"], o["meta_info"]["index"], tuple(o["output_ids"]),
                                o["meta_info"]["finish_reason"]["type"]) for o in results)
    assert outputs["spec"] == outputs["plain"]
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_usable_blocks


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_are_the_policys(policy, bad_draft, temperature):
    hf_model, path = policy
    engine = spec_engine(path, draft_path=bad_draft[1], num_steps=3)
    params = {"temperature": temperature, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 5}
    for prompt, output in zip(PROMPTS, engine.generate(PROMPTS, params)):
        reference = hf_logprobs(hf_model, prompt, output["output_ids"], temperature or 1.0)
        torch.testing.assert_close(engine_logprobs(output), reference, atol=1e-5, rtol=0)
    counters = engine.strategy.pop_counters()
    assert 0 < counters.accepted_tokens < counters.draft_tokens


def test_routed_experts_of_kept_tokens(moe_policy, bad_draft):
    """Routes of every kept token (rows of rejected drafts dropped) equal the plain engine's."""
    _, path = moe_policy
    hooks = capture_hooks()
    params = {**GREEDY, "max_new_tokens": 12}
    plain = plain_engine(path, routing_hooks=hooks).generate(PROMPTS[:2], params, return_routed_experts=True)
    engine = spec_engine(path, draft_path=bad_draft[1], routing_hooks=hooks)
    spec = engine.generate(PROMPTS[:2], params, return_routed_experts=True)
    counters = engine.strategy.pop_counters()
    assert counters.accepted_tokens < counters.draft_tokens  # rejected rows had to be dropped
    for p, s in zip(plain, spec):
        assert s["output_ids"] == p["output_ids"]
        routes = s["meta_info"]["routed_experts"]
        assert routes.shape == p["meta_info"]["routed_experts"].shape
        assert (routes == p["meta_info"]["routed_experts"]).all()
