"""GPU: the speculative step in CUDA graphs gives what the eager step gives (the reference).

Run on a CUDA machine with ``pytest -q -m gpu tests/plugins/spec``. The same data flow
without CUDA (graph replay stood in by re-running the captured body): ``test_graph_path.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.plugins.spec.conftest import load
from tests.plugins.spec.test_graph_path import SAMPLING
from tests.rollout.conftest import PROMPTS
from tests.rollout.test_requests import capture_hooks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _engine(path, *, draft_path=None, num_steps=3, routing_hooks=None, token_map=None, **kwargs):
    """A float32 engine on CUDA running the eagle strategy (fresh seeded MTP head or a draft model)."""
    from miles_host.rollout import Engine
    from miles_spec.draft import MTPDraft, ModelDraft, attach_mtp
    from miles_spec.strategy import EagleStrategy

    def factory(engine):
        if draft_path is not None:
            draft = ModelDraft(load(draft_path).cuda(), engine.model.config.vocab_size, token_map)
            return EagleStrategy(engine, draft, num_steps)
        torch.manual_seed(1)
        attach_mtp(engine.model)
        return EagleStrategy(engine, MTPDraft(engine.model, token_map), num_steps)

    return Engine(load(path, routing_hooks).cuda(), decoding_strategy=factory, max_num_seqs=8,
                  mem_fraction_static=0.3, max_kv_cache_tokens=4096, block_size=4, **kwargs)


def _results(outputs) -> list[tuple[list[int], np.ndarray]]:
    return [(o["output_ids"], np.array([e[0] for e in o["meta_info"]["output_token_logprobs"]])) for o in outputs]


def _assert_same(got, expected) -> None:
    for (tokens, logprobs), (tokens_ref, logprobs_ref) in zip(_results(got), _results(expected)):
        assert tokens == tokens_ref
        np.testing.assert_allclose(logprobs, logprobs_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("draft", ["mtp", "model"])
@pytest.mark.parametrize("num_steps", [3, 5])
def test_graph_spec_decode_equals_eager_spec_decode(policy, bad_draft, draft, num_steps):
    """Greedy and seeded temperature-1 requests (the same uniforms on both paths): the same
    tokens, logprobs and accepted drafts; J = 6 tokens per sequence spans 4-slot blocks."""
    _, path = policy
    draft_path = bad_draft[1] if draft == "model" else None
    graphs = _engine(path, draft_path=draft_path, num_steps=num_steps)
    eager = _engine(path, draft_path=draft_path, num_steps=num_steps, enforce_eager=True)
    assert graphs.strategy.graphs is not None and eager.strategy.graphs is None
    got = graphs.generate(PROMPTS, SAMPLING)
    expected = eager.generate(PROMPTS, SAMPLING)
    assert graphs.strategy.graphs.num_replays > 0
    _assert_same(got, expected)
    assert graphs.strategy.pop_counters() == eager.strategy.pop_counters()
    assert graphs.block_manager.num_free_blocks == graphs.block_manager.num_usable_blocks


def test_graph_spec_with_a_token_map_equals_eager(policy, bad_draft):
    """FR-Spec in graphs: the restricted head (and its refresh after a weight update, in place)
    gives the eager path's tokens, logprobs and acceptance."""
    _, path = policy
    hot = torch.arange(0, 128, 3)
    engines = [_engine(path, draft_path=bad_draft[1], token_map=hot),
               _engine(path, draft_path=bad_draft[1], token_map=hot, enforce_eager=True)]
    for engine in engines:
        engine.strategy.draft.hot.refresh()
    got, expected = (engine.generate(PROMPTS, SAMPLING) for engine in engines)
    assert engines[0].strategy.graphs.num_replays > 0
    _assert_same(got, expected)
    assert engines[0].strategy.pop_counters() == engines[1].strategy.pop_counters()


def test_graph_spec_greedy_equals_plain_greedy(policy):
    """The policy drafting for itself in graphs: every draft accepted, the plain engine's tokens."""
    from miles_host.rollout import Engine

    _, path = policy
    greedy = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    engine = _engine(path, draft_path=path)
    got = engine.generate(PROMPTS, greedy)
    plain = Engine(load(path).cuda(), max_num_seqs=8, mem_fraction_static=0.3, max_kv_cache_tokens=4096, block_size=4)
    _assert_same(got, plain.generate(PROMPTS, greedy))
    counters = engine.strategy.pop_counters()
    assert counters.accepted_tokens == counters.draft_tokens


def test_graph_spec_returns_the_routes_of_every_kept_token(moe_policy, bad_draft):
    """R3 in graphs: the routes of the kept tokens, rejected rows dropped, as eagerly and as plain decode."""
    from miles_host.rollout import Engine

    _, path = moe_policy
    hooks = capture_hooks()
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True, "n": 2}
    engine = _engine(path, draft_path=bad_draft[1], routing_hooks=hooks)
    got = engine.generate(PROMPTS, params, return_routed_experts=True)
    assert any(variant.capture_routes for _, variant in engine.strategy.graphs.graphs)
    counters = engine.strategy.pop_counters()
    assert counters.accepted_tokens < counters.draft_tokens  # rejected rows had to be dropped
    eager = _engine(path, draft_path=bad_draft[1], routing_hooks=hooks, enforce_eager=True)
    expected = eager.generate(PROMPTS, params, return_routed_experts=True)
    plain = Engine(load(path, hooks).cuda(), max_num_seqs=8, mem_fraction_static=0.3, max_kv_cache_tokens=4096,
                   block_size=4).generate(PROMPTS, params, return_routed_experts=True)
    for a, b, c in zip(got, expected, plain):
        assert a["output_ids"] == b["output_ids"] == c["output_ids"]
        routes = np.sort(a["meta_info"]["routed_experts"], -1)  # (the order of a token's experts may differ)
        assert routes.shape == c["meta_info"]["routed_experts"].shape
        assert (routes == np.sort(b["meta_info"]["routed_experts"], -1)).all()
        assert (routes == np.sort(c["meta_info"]["routed_experts"], -1)).all()


def test_graph_spec_after_release_and_resume(policy):
    """The graphs go with the memory (they hold the caches' and weights' addresses) and are
    captured again on resume; outputs are unchanged."""
    _, path = policy
    engine = _engine(path)
    expected = engine.generate(PROMPTS, SAMPLING)
    engine.release_memory_occupation()
    assert engine.strategy.graphs is None
    engine.resume_memory_occupation()
    assert engine.strategy.graphs is not None
    _assert_same(engine.generate(PROMPTS, SAMPLING), expected)
    assert engine.strategy.graphs.num_replays > 0
