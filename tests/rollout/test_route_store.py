"""Captured routes kept per KV-cache slot (:class:`RouteStore`), and the engine's routes with
preemption, ``n > 1`` forks and aborts, plain and overlapped, against a packed forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles_host.rollout.route_store import RouteStore
from miles_host.rollout.sequence import SequenceStatus
from tests.rollout.conftest import PROMPTS, make_engine
from tests.rollout.test_requests import capture_hooks


def test_store_matches_a_slot_by_slot_reference():
    rng = np.random.default_rng(0)
    num_blocks, block_size = 6, 4
    store, reference = RouteStore(num_blocks, block_size), {}
    assert store.gather([1, 2], 5) is None  # nothing written yet
    for _ in range(300):
        action = rng.integers(3)
        if action == 0:  # a forward's rows at arbitrary distinct slots, some rows left out
            slots = rng.choice(num_blocks * block_size, size=int(rng.integers(1, 9)), replace=False)
            routes = rng.integers(0, 64, (len(slots), 3, 2)).astype(np.int32)
            skip = sorted(set(rng.integers(0, len(slots), int(rng.integers(0, 3))).tolist()))
            store.write(slots, routes, skip)
            reference.update({int(s): r for t, (s, r) in enumerate(zip(slots, routes)) if t not in skip})
        elif action == 1:  # copy-on-write of whole blocks
            source, destination = rng.choice(num_blocks, size=2, replace=False)
            store.copy_blocks([(int(source), int(destination))])
            for offset in range(block_size):
                row = reference.get(int(source) * block_size + offset)
                if row is None:
                    reference.pop(int(destination) * block_size + offset, None)
                else:
                    reference[int(destination) * block_size + offset] = row
        else:  # a sequence's positions written, then gathered
            table = rng.choice(num_blocks, size=3, replace=False).tolist()
            start, routes = int(rng.integers(0, 8)), rng.integers(0, 64, (int(rng.integers(1, 8)), 3, 2))
            store.write_positions(table, start, torch.from_numpy(routes.astype(np.int32)))
            for offset, row in enumerate(routes[:len(table) * block_size - start]):
                position = start + offset
                reference[table[position // block_size] * block_size + position % block_size] = row
            num_rows = int(rng.integers(0, 3 * block_size + 1))
            got = store.gather(table, num_rows)
            assert got.shape == (num_rows, 3, 2) and got.dtype == np.int32
            for position in range(num_rows):
                slot = table[position // block_size] * block_size + position % block_size
                expected = reference.get(slot, np.zeros((3, 2)))
                assert np.array_equal(got[position], expected)


def _packed_routes(model, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens) - 1, layers, K]`` experts of one training-style forward, sorted per row."""
    from miles_host.models import ForwardContext, PackedAttention, RoutingContext

    context = ForwardContext(
        attention=PackedAttention(torch.tensor([0, len(tokens) - 1], dtype=torch.int32)),
        routing=RoutingContext(phase="rollout"),
    )
    with torch.no_grad():
        model.forward_hidden(torch.tensor(tokens[:-1]), torch.arange(len(tokens) - 1), context)
    return torch.stack([context.routing.captured[i] for i in sorted(context.routing.captured)], dim=1).sort(-1).values


@pytest.mark.parametrize("overlap", [False, True])
def test_routes_with_preemption_forks_and_abort_match_a_packed_forward(qwen3_moe, overlap):
    _, path = qwen3_moe
    engine = make_engine(path, routing_hooks=capture_hooks(), kv_cache_tokens=64, block_size=4,
                         overlap_schedule=overlap)
    params = {"temperature": 1.0, "max_new_tokens": 20, "sampling_seed": 3, "ignore_eos": True}
    for rid, prompt in zip("abc", PROMPTS[:3]):
        engine.add_request(rid, prompt, {**params, "n": 2 if rid == "a" else 1}, return_routed_experts=True)
    outputs, aborted = [], None
    while engine.has_unfinished():
        outputs += engine.step()
        preempted = [seq for request in engine._requests.values() for seq in request.samples
                     if seq.status == SequenceStatus.WAITING and seq.num_output_tokens > 0]
        if aborted is None and preempted:  # abort a sequence that holds no blocks now
            aborted = preempted[0].rid
            outputs += engine.abort(aborted)
    assert engine.scheduler.num_preemptions > 0 and aborted is not None
    assert sorted((o["meta_info"]["id"], o["meta_info"]["index"]) for o in outputs) == [
        ("a", 0), ("a", 1), ("b", 0), ("c", 0)]
    prompts = dict(zip("abc", PROMPTS[:3]))
    for output in outputs:
        tokens = prompts[output["meta_info"]["id"]] + output["output_ids"]
        routes = output["meta_info"]["routed_experts"]
        assert routes.dtype == np.int32 and routes.shape == (len(tokens) - 1, 2, 2)
        assert torch.equal(torch.from_numpy(routes).long().sort(-1).values, _packed_routes(engine.model, tokens))
