"""The CUDA-graph path of the speculative step, its data flow checked on the CPU.

:class:`miles_spec.graphs.SpecGraphs` is built here with a stand-in for capture: a
"graph" replay runs the captured body again over the static input buffers. So the
staging (one int64 vector, floats as float64 bits), the padded batch, the fixed
extend with prompt rows merged in, the slab and the block tables are the GPU path's;
only the kernels are eager. Its outputs must be the eager path's (the reference).
The same equality on CUDA with real graphs: ``test_gpu_spec.py``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from miles_host.rollout.model_runner import paged_metadata
from miles_spec.plan import build_plan
from tests.plugins.spec.conftest import spec_engine
from tests.rollout.conftest import PROMPTS
from tests.rollout.test_requests import capture_hooks

#: unequal lengths (rows finish at different steps, the batch shrinks and pads), n=2 forks
SAMPLING = [
    {"temperature": 0.0, "max_new_tokens": 21, "ignore_eos": True, "n": 2},
    {"temperature": 1.0, "max_new_tokens": 9, "ignore_eos": True, "sampling_seed": 4},
    {"temperature": 1.0, "max_new_tokens": 17, "ignore_eos": True, "sampling_seed": 5, "n": 2},
    {"temperature": 0.0, "max_new_tokens": 13, "ignore_eos": True},
]


class _Rerun:
    """Stands in for a captured graph: a replay runs the body again over the static inputs."""

    def __init__(self, outputs: dict, key, body):
        self.outputs, self.key, self.body = outputs, key, body

    def replay(self) -> None:
        self.outputs[self.key] = self.body()


def emulate_graphs(engine, monkeypatch):
    """Give ``engine``'s strategy CPU stand-ins of its CUDA graphs (see the module doc)."""
    from miles_spec.graphs import SpecGraphs

    class Emulated(SpecGraphs):
        def _record(self, key, body):
            self.outputs[key] = body()
            self.graphs[key] = _Rerun(self.outputs, key, body)

        def _forward(self, cache, size, count, stem, suffix=""):
            forward = super()._forward(cache, size, count, stem, suffix)
            meta = forward.attention.metadata  # the CPU reference attention reads host lists
            meta.cu_seqlens_q_host = meta.cu_seqlens_q.tolist()
            meta.context_lens_host = meta.context_lens_B.tolist()
            return forward

    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *args, pin_memory=False, **kwargs: zeros(*args, **kwargs))
    engine.strategy.graphs = Emulated(engine.strategy)
    return engine.strategy.graphs


def _run(engine, sampling=SAMPLING, **kwargs):
    outputs = engine.generate(PROMPTS, sampling, **kwargs)
    return outputs, engine.strategy.pop_counters()


@pytest.mark.parametrize("draft", ["mtp", "self", "bad"])
def test_graph_path_equals_eager_path(policy, bad_draft, draft, monkeypatch):
    """Token for token (greedy and seeded T=1), with the policy's logprobs, and the same
    acceptance; the policy drafting for itself is accepted every time on both paths."""
    _, path = policy
    draft_path = {"mtp": None, "self": path, "bad": bad_draft[1]}[draft]
    eager = spec_engine(path, draft_path=draft_path, num_steps=3, max_num_seqs=8, block_size=4)
    expected, expected_counters = _run(eager)
    engine = spec_engine(path, draft_path=draft_path, num_steps=3, max_num_seqs=8, block_size=4)
    graphs = emulate_graphs(engine, monkeypatch)
    got, counters = _run(engine)
    assert graphs.num_replays > 0
    for a, b in zip(got, expected):
        assert a["output_ids"] == b["output_ids"]
        np.testing.assert_allclose([e[0] for e in a["meta_info"]["output_token_logprobs"]],
                                   [e[0] for e in b["meta_info"]["output_token_logprobs"]], atol=1e-5, rtol=0)
    assert counters == expected_counters
    if draft == "self":
        assert counters.accepted_tokens == counters.draft_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


@pytest.mark.parametrize("num_steps", [1, 5])
def test_graph_path_with_lookahead_past_a_block_and_min_new_tokens(policy, bad_draft, num_steps, monkeypatch):
    """One draft token (no draft steps), or J = 6 tokens per sequence over 4-slot blocks; a
    min_new_tokens request runs its steps eagerly (banned tokens) between graph steps, and
    both kinds hand over to each other."""
    _, path = policy
    sampling = [dict(s, min_new_tokens=6 if i == 1 else 0) for i, s in enumerate(SAMPLING)]
    eager = spec_engine(path, draft_path=bad_draft[1], num_steps=num_steps, max_num_seqs=8, block_size=4)
    expected, _ = _run(eager, sampling)
    engine = spec_engine(path, draft_path=bad_draft[1], num_steps=num_steps, max_num_seqs=8, block_size=4)
    graphs = emulate_graphs(engine, monkeypatch)
    got, _ = _run(engine, sampling)
    assert graphs.num_replays > 0
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]


def test_graph_path_routes_of_kept_tokens(moe_policy, bad_draft, monkeypatch):
    """R3 through the graph path: the routes of every kept token, rejected rows dropped."""
    _, path = moe_policy
    hooks = capture_hooks()
    sampling = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    eager = spec_engine(path, draft_path=bad_draft[1], routing_hooks=hooks, max_num_seqs=8)
    expected, _ = _run(eager, sampling, return_routed_experts=True)
    engine = spec_engine(path, draft_path=bad_draft[1], routing_hooks=hooks, max_num_seqs=8)
    graphs = emulate_graphs(engine, monkeypatch)
    got, counters = _run(engine, sampling, return_routed_experts=True)
    assert any(variant.capture_routes for _, variant in graphs.graphs)
    assert counters.accepted_tokens < counters.draft_tokens  # rejected rows had to be dropped
    for a, b in zip(got, expected):
        assert a["output_ids"] == b["output_ids"]
        routes = a["meta_info"]["routed_experts"]
        assert routes.shape == (len(a["meta_info"]["output_token_logprobs"]) + a["meta_info"]["prompt_tokens"] - 1,
                                *routes.shape[1:])
        assert (routes == b["meta_info"]["routed_experts"]).all()


class _Seq:
    def __init__(self, length: int, table: list[int]):
        self.token_ids = list(range(100, 100 + length))
        self.block_table = table
        self.params = type("P", (), {"sampling_seed": 1})()
        self.sample_index = 0
        self.num_output_tokens = length // 2

    def __len__(self):
        return len(self.token_ids)


@pytest.mark.parametrize("offset", [0, 1])
def test_plan_positions_and_slots_are_paged_metadatas(offset):
    """The graph path's host plan puts every forward's tokens where the eager path's metadata does."""
    rng = np.random.default_rng(0)
    block_size, k = 4, 3
    count = k + 1
    seqs, fixed_state = [], []
    for b in range(6):
        length = int(rng.integers(6, 30))
        table = rng.permutation(np.arange(1, 200))[: (length - 1 + k) // block_size + 1].tolist()
        seqs.append(_Seq(length, table))
        kept = int(rng.integers(1, count + 1))
        fixed_state.append(None if b == 2 else (length - 1 - kept, 40 * b))
    plan = build_plan(seqs, fixed_state, k, offset, block_size)

    def reference(contexts, num_new):
        positions, meta = paged_metadata([s.block_table for s in seqs], contexts, num_new, block_size,
                                         torch.device("cpu"), True)
        return positions.view(len(seqs), -1).numpy(), meta.slot_mapping_T.view(len(seqs), -1).numpy()

    fixed = plan.fixed
    positions, slots = reference(plan.ext_context_B.tolist(), [count] * len(seqs))
    assert (plan.ext_positions_BJ[fixed] == positions[fixed]).all()
    assert (plan.ext_slots_BJ[fixed] == slots[fixed]).all()
    assert plan.prompt == [2] and (plan.ext_slots_BJ[2] == 0).all()
    positions, slots = reference(plan.ver_context_B.tolist(), [count] * len(seqs))
    assert (plan.ver_positions_BJ == positions).all() and (plan.ver_slots_BJ == slots).all()
    for i in range(k - 1):
        positions, slots = reference(plan.chain_context_BC[:, i].tolist(), [1] * len(seqs))
        assert (plan.chain_positions_BC[:, i] == positions[:, 0]).all()
        assert (plan.chain_slots_BC[:, i] == slots[:, 0]).all()
    for b in fixed:
        first, source = fixed_state[b]
        kept = len(seqs[b]) - 1 - first
        assert plan.ext_ids_BJ[b, :kept].tolist() == seqs[b].token_ids[first + 1:]
        assert plan.ext_sources_BJ[b].tolist() == list(range(source, source + count))
        assert plan.ext_last_B[b] == b * count + kept - 1


def test_a_failed_capture_falls_back_to_the_eager_step(policy, monkeypatch, caplog):
    """Capture errors are logged and the step runs eagerly."""
    import miles_spec.graphs

    class Broken:
        def __init__(self, strategy):
            raise RuntimeError("no graphs today")

    _, path = policy
    engine = spec_engine(path, max_num_seqs=8)
    expected = engine.generate(PROMPTS, SAMPLING)
    monkeypatch.setattr(miles_spec.graphs, "SpecGraphs", Broken)
    monkeypatch.setattr(engine.runner, "attention_backend", "triton")  # past the torch-backend check
    with caplog.at_level(logging.WARNING, logger="miles_spec.strategy"):
        engine.strategy._build_graphs()
    monkeypatch.undo()
    assert engine.strategy.graphs is None and "no graphs today" in caplog.text
    assert [o["output_ids"] for o in engine.generate(PROMPTS, SAMPLING)] == [o["output_ids"] for o in expected]


def test_a_failed_capture_of_a_new_variant_falls_back_to_the_eager_step(policy, monkeypatch, caplog):
    """A variant first seen mid-rollout (greedy here) whose capture fails: warned once, eager from then on."""
    _, path = policy
    expected, _ = _run(spec_engine(path, max_num_seqs=8))
    engine = spec_engine(path, max_num_seqs=8)
    graphs = emulate_graphs(engine, monkeypatch)

    def broken(size, variant):
        raise RuntimeError("no graphs today")

    monkeypatch.setattr(graphs, "_capture_variant", broken)
    with caplog.at_level(logging.WARNING, logger="miles_spec.strategy"):
        got, _ = _run(engine)
    assert engine.strategy.graphs is None and "no graphs today" in caplog.text
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
