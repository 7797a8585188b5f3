"""Request-level API: abort, per-request errors, pause/resume, weight updates, asyncio, routes."""

from __future__ import annotations

import asyncio

import pluggy
import pytest
import torch

import miles_host.models  # noqa: F401  (importing miles_host.routing first is circular today)
from miles_host import hookspecs
from miles_host.routing import RoutingHooks
from tests.rollout.conftest import PROMPTS, engine_logprobs, hf_logprobs, make_engine

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


def test_abort_returns_partial_outputs(qwen3_dense):
    hf_model, path = qwen3_dense
    engine = make_engine(path)
    engine.add_request("a", PROMPTS[0], {**GREEDY, "max_new_tokens": 50})
    engine.add_request("b", PROMPTS[1], {**GREEDY, "max_new_tokens": 50, "n": 2})
    for _ in range(5):
        engine.step()
    partial_a = engine.abort("a")
    assert len(partial_a) == 1
    meta = partial_a[0]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 50
    assert (engine_logprobs(partial_a[0]) - hf_logprobs(hf_model, PROMPTS[0], partial_a[0]["output_ids"])).abs().max() <= 1e-5
    engine.step()
    rest = engine.abort()  # everything left
    assert {(o["meta_info"]["id"], o["meta_info"]["index"]) for o in rest} == {("b", 0), ("b", 1)}
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in rest)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


@pytest.mark.parametrize(
    "bad_prompt, bad_params, message",
    [
        ([], GREEDY, "empty"),
        (list(range(1, 100)) * 3, GREEDY, "max_model_len"),
        ([1, 2, 3], {**GREEDY, "top_p": 7}, "top_p"),
        ([1, 2, 3], {**GREEDY, "stop": ["x"]}, "tokenizer"),
        ([1, 5000], GREEDY, "vocabulary"),
    ],
)
def test_a_bad_request_fails_alone_with_a_clear_message(qwen3_dense, bad_prompt, bad_params, message):
    _, path = qwen3_dense
    engine = make_engine(path)
    good = engine.generate(PROMPTS[:2], GREEDY)
    mixed = engine.generate([PROMPTS[0], bad_prompt, PROMPTS[1]], [GREEDY, bad_params, GREEDY])
    assert [o["output_ids"] for o in (mixed[0], mixed[2])] == [o["output_ids"] for o in good]
    reason = mixed[1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and message in reason["message"]
    assert mixed[1]["output_ids"] == []
    with pytest.raises(ValueError, match=message):
        engine.add_request(None, bad_prompt, bad_params)


def test_update_weights_changes_outputs_and_bumps_the_version(qwen3_dense):
    _, path = qwen3_dense
    engine = make_engine(path)
    before = engine.generate(PROMPTS, GREEDY)
    assert all(o["meta_info"]["weight_version"] == 0 for o in before)
    new_weights = {name: p + 0.05 * torch.randn_like(p) for name, p in engine.model.named_parameters()
                   if name.endswith("weight") and p.dim() == 2}
    assert engine.update_weights(new_weights) == 1
    after = engine.generate(PROMPTS, GREEDY)
    assert all(o["meta_info"]["weight_version"] == 1 for o in after)
    assert [o["output_ids"] for o in after] != [o["output_ids"] for o in before]
    # same result as an engine built on the new weights (the prefix cache was flushed)
    fresh = make_engine(path)
    fresh.update_weights(new_weights, weight_version="v7")
    assert [o["output_ids"] for o in fresh.generate(PROMPTS, GREEDY)] == [o["output_ids"] for o in after]
    assert fresh.weight_version == "v7"
    with pytest.raises(ValueError, match="does not have"):
        engine.update_weights({"no.such.weight": torch.zeros(1)})


def test_pause_resume_and_async_generate(qwen3_dense):
    _, path = qwen3_dense
    engine = make_engine(path)
    expected = engine.generate(PROMPTS, GREEDY)

    async def main():
        engine.pause()
        tasks = [asyncio.create_task(engine.async_generate(p, GREEDY)) for p in PROMPTS]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in tasks) and engine.has_unfinished()
        engine.resume()
        singles = await asyncio.gather(*tasks)
        batch = await engine.async_generate(PROMPTS[:2], {**GREEDY, "n": 2})
        bad = await engine.async_generate([], GREEDY)
        return singles, batch, bad

    singles, batch, bad = asyncio.run(main())
    assert [o["output_ids"] for o in singles] == [o["output_ids"] for o in expected]
    assert [o["output_ids"] for o in batch] == [expected[0]["output_ids"]] * 2 + [expected[1]["output_ids"]] * 2
    assert bad["meta_info"]["finish_reason"]["type"] == "abort" and "empty" in bad["meta_info"]["finish_reason"]["message"]


class CapturePlugin:
    """A routing plugin that records the experts of rollout forwards (as R3 will)."""

    @hookspecs.hookimpl
    def miles_experts_selected(self, layer_index, expert_ids, routing_context):
        if routing_context.phase == "rollout":
            routing_context.captured[layer_index] = expert_ids.clone()


def capture_hooks() -> RoutingHooks:
    """Routing hooks of a plugin manager holding only :class:`CapturePlugin` (the engine's route capture)."""
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    manager.register(CapturePlugin())
    return RoutingHooks(manager.hook)


def test_routed_experts_are_returned_per_token_and_layer(qwen3_moe):
    _, path = qwen3_moe
    hooks = capture_hooks()
    engine = make_engine(path, routing_hooks=hooks, block_size=4)
    prompts = [PROMPTS[0], PROMPTS[1]]
    outputs = engine.generate(prompts, {**GREEDY, "n": 2}, return_routed_experts=True)
    # independent reference: one training-style forward over prompt + output
    model = engine.model
    for prompt, output in zip([prompts[0]] * 2 + [prompts[1]] * 2, outputs):
        routes = output["meta_info"]["routed_experts"]
        tokens = prompt + output["output_ids"]
        assert routes.shape == (len(tokens) - 1, 2, 2)
        from miles_host.models import ForwardContext, PackedAttention, RoutingContext

        context = ForwardContext(
            attention=PackedAttention(torch.tensor([0, len(tokens) - 1], dtype=torch.int32)),
            routing=RoutingContext(phase="rollout"),
        )
        with torch.no_grad():
            model.forward_hidden(torch.tensor(tokens[:-1]), torch.arange(len(tokens) - 1), context)
        reference = torch.stack([context.routing.captured[i] for i in sorted(context.routing.captured)], dim=1)
        assert torch.equal(torch.as_tensor(routes).long().sort(-1).values, reference.sort(-1).values)
    plain = engine.generate(prompts, GREEDY)
    assert "routed_experts" not in plain[0]["meta_info"]


def test_zero_new_tokens_comes_back_from_step(qwen3_dense):
    """max_new_tokens=0 (prompt only, as SGLang allows) is answered by the next step()."""
    from tests.rollout.conftest import load
    from miles_host.rollout import Engine

    _, path = qwen3_dense
    engine = Engine(load(str(path)), kv_cache_tokens=256)
    engine.add_request("empty", [3, 4, 5], {"max_new_tokens": 0})
    assert engine.has_unfinished()
    outputs = engine.step()
    assert [o["meta_info"]["id"] for o in outputs] == ["empty"]
    assert outputs[0]["output_ids"] == [] and outputs[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert not engine.has_unfinished() and engine.step() == []
    # generate() keeps its own zero-token results to itself
    assert engine.generate([[3, 4]], {"max_new_tokens": 0})[0]["output_ids"] == []
    assert engine.step() == []


def test_a_request_in_flight_across_a_weight_update_says_which_weights_made_each_token(qwen3_dense):
    """In-place update (SGLang's ``in_place`` pause): the request keeps its KV cache and goes on
    with the new weights; ``weight_version_spans`` records where the weights changed."""
    from miles_host.sample import output_token_versions

    _, path = qwen3_dense
    params = {**GREEDY, "max_new_tokens": 8, "ignore_eos": True}
    untouched = make_engine(path).generate([PROMPTS[0]], params)[0]
    engine = make_engine(path, overlap_schedule=False)
    engine.add_request("r", PROMPTS[0], params, return_logprob=True)
    outputs = []
    for _ in range(3):  # prefill (first token), then two decode steps
        outputs += engine.step()
    new_weights = {name: p + 0.05 * torch.randn_like(p) for name, p in engine.model.named_parameters()
                   if name.endswith("weight") and p.dim() == 2}
    engine.update_weights(new_weights, weight_version=1)
    while engine.has_unfinished():
        outputs += engine.step()
    (output,) = outputs
    meta = output["meta_info"]
    assert meta["weight_version_spans"] == [[0, 0], [3, 1]] and meta["weight_version"] == 1
    assert output_token_versions(meta, 8) == [0, 0, 0, 1, 1, 1, 1, 1]
    assert output["output_ids"][:3] == untouched["output_ids"][:3]  # generated before the update
    fresh = make_engine(path).generate([PROMPTS[0]], params)[0]
    assert fresh["meta_info"]["weight_version_spans"] == [[0, 0]]
