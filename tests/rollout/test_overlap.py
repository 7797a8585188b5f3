"""``overlap_schedule``: decode steps launched before the previous step's tokens are read give
exactly the outputs of the plain engine (greedy and seeded sampling, stops, n > 1,
preemption, abort, weight updates between steps)."""

from __future__ import annotations

import torch

from tests.rollout.conftest import PROMPTS, make_engine


def _outputs(engine, prompts, params):
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
             o["meta_info"]["finish_reason"]) for o in engine.generate(prompts, params)]


def _same(a, b):
    assert len(a) == len(b)
    for (ids_a, lps_a, reason_a), (ids_b, lps_b, reason_b) in zip(a, b):
        assert ids_a == ids_b and reason_a == reason_b
        assert torch.allclose(torch.tensor(lps_a), torch.tensor(lps_b), atol=1e-6)


def test_overlapped_decode_equals_plain_decode(qwen3_dense):
    _, path = qwen3_dense
    params = [
        {"temperature": 0, "max_new_tokens": 17},                                           # greedy, EOS allowed
        {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 25, "sampling_seed": 3, "n": 2},  # seeded, forks
        {"temperature": 0.8, "max_new_tokens": 9, "sampling_seed": 11, "stop_token_ids": [5, 17, 33, 60]},
        {"temperature": 1.0, "max_new_tokens": 30, "ignore_eos": True, "sampling_seed": 7, "min_new_tokens": 4},
    ]
    for kwargs in ({}, {"kv_cache_tokens": 96, "block_size": 4}):  # the second run preempts
        plain = _outputs(make_engine(path, **kwargs), PROMPTS, params)
        overlapped_engine = make_engine(path, overlap_schedule=True, **kwargs)
        _same(_outputs(overlapped_engine, PROMPTS, params), plain)
        assert overlapped_engine._pending is None and not overlapped_engine.has_unfinished()
        if kwargs:
            assert overlapped_engine.scheduler.num_preemptions > 0


def test_overlapped_async_generate_completes_every_request(qwen3_dense):
    import asyncio

    _, path = qwen3_dense
    params = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 9}
    plain = make_engine(path).generate(PROMPTS, params)
    engine = make_engine(path, overlap_schedule=True)

    async def main():
        return await asyncio.gather(*(engine.async_generate(p, params) for p in PROMPTS))

    results = asyncio.run(main())
    assert [r["output_ids"] for r in results] == [o["output_ids"] for o in plain]


def test_overlapped_abort_and_weight_update_read_the_launched_step_first(qwen3_dense):
    _, path = qwen3_dense
    engine = make_engine(path, overlap_schedule=True)
    params = {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 1}
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[1], params)
    for _ in range(6):
        engine.step()
    assert engine._pending is not None  # a step is in flight
    engine.update_weights(dict(engine.model.named_parameters()))  # same weights: nothing changes
    assert engine._pending is None
    partial = engine.abort("a")
    ids = partial[0]["output_ids"]
    assert partial[0]["meta_info"]["finish_reason"]["type"] == "abort" and -1 not in ids and len(ids) >= 5
    rest = []
    while engine.has_unfinished():
        rest += engine.step()
    plain = make_engine(path).generate([PROMPTS[1]], params)[0]["output_ids"]
    assert [o["output_ids"] for o in rest] == [plain]


def test_overlapped_decode_returns_the_plain_engines_routes(qwen3_moe, monkeypatch):
    """Route capture (R3) overlaps: every token's routes, and the tokens, as the plain engine
    returns them (seeded sampling, stops, n > 1; the second run preempts)."""
    from miles_host.rollout import overlap
    from tests.rollout.test_requests import capture_hooks

    _, path = qwen3_moe
    params = [
        {"temperature": 1.0, "max_new_tokens": 21, "sampling_seed": 3, "n": 2},
        {"temperature": 0.8, "max_new_tokens": 9, "sampling_seed": 11, "stop_token_ids": [5, 17, 33, 60]},
        {"temperature": 0, "max_new_tokens": 14},
    ]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2]]  # (the first request samples twice)
    launched = []
    launch = overlap.launch
    monkeypatch.setattr(overlap, "launch", lambda *args: launched.append(args[1]) or launch(*args))
    for kwargs in ({}, {"kv_cache_tokens": 64, "block_size": 4}):
        plain = make_engine(path, routing_hooks=capture_hooks(), **kwargs).generate(
            PROMPTS[:3], params, return_routed_experts=True)
        assert not launched
        engine = make_engine(path, routing_hooks=capture_hooks(), overlap_schedule=True, **kwargs)
        overlapped = engine.generate(PROMPTS[:3], params, return_routed_experts=True)
        assert len(launched) > 10  # the decode steps ran overlapped
        launched.clear()
        assert len(overlapped) == len(plain) == 4
        for prompt, got, want in zip(prompts, overlapped, plain):
            assert got["output_ids"] == want["output_ids"]
            routes, expected = got["meta_info"]["routed_experts"], want["meta_info"]["routed_experts"]
            assert routes.shape == (len(prompt) + len(got["output_ids"]) - 1, 2, 2)
            assert (routes == expected).all()
        if kwargs:
            assert engine.scheduler.num_preemptions > 0
