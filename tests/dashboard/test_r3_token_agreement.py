"""Routing replay's per-token agreement for the dashboard: for each response token, the share
of MoE layers whose training router chose the replayed experts at the position that generated
it, compared with a plain loop over the same routes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from miles_host.dashboard.samples import EXPERT_AGREEMENT_KEY
from miles_host.sample import Sample

pytest.importorskip("miles_r3")


def test_per_token_agreement_of_a_packed_batch(monkeypatch):
    from miles_r3 import plugin
    from miles_r3.replay import ReplayState

    state = ReplayState()
    monkeypatch.setattr(plugin, "STATE", state)
    torch.manual_seed(0)
    samples = [Sample(tokens=list(range(7)), response_length=4, index=0),
               Sample(tokens=list(range(5)), response_length=2, index=1)]
    cu_seqlens = [0, 7, 12]
    routing = SimpleNamespace(phase="train", replay_expert_ids={})
    state.track_tokens(routing, samples, cu_seqlens)
    layers, agree = 3, torch.zeros(12)
    for layer in range(layers):
        router_ids = torch.randint(0, 8, (12, 2))
        replay = torch.where(torch.rand(12, 1) < 0.5, router_ids.flip(-1), torch.randint(0, 8, (12, 2)))
        replay[[6, 11]] = -1  # each sequence's last token has no recorded route
        routing.replay_expert_ids = {layer: replay}
        plugin.miles_select_experts(layer, None, 2, router_ids, routing)
        for row in range(12):  # the reference: a plain loop
            agree[row] += float(replay[row, 0] >= 0 and sorted(router_ids[row].tolist()) == sorted(replay[row].tolist()))
    counters = plugin.miles_rank_counters(None)
    assert counters["r3/total"] == layers * 10
    # sample 0: response tokens at positions 3..6, generated at input positions 2..5
    assert samples[0].metadata[EXPERT_AGREEMENT_KEY] == pytest.approx((agree[2:6] / layers).tolist())
    assert samples[1].metadata[EXPERT_AGREEMENT_KEY] == pytest.approx((agree[7 + 2 : 7 + 4] / layers).tolist())
    assert state.tracked == {}  # the next step starts afresh


def test_untracked_batches_keep_no_per_token_state(monkeypatch):
    from miles_r3 import plugin
    from miles_r3.replay import ReplayState

    state = ReplayState()
    monkeypatch.setattr(plugin, "STATE", state)
    sample = Sample(tokens=[1, 2, 3], response_length=1, index=0)
    routing = SimpleNamespace(phase="train", replay_expert_ids={0: torch.tensor([[0, 1], [2, 3], [-1, -1]])})
    plugin.miles_select_experts(0, None, 2, torch.tensor([[1, 0], [2, 4], [5, 6]]), routing)
    plugin.miles_rank_counters(None)
    assert EXPERT_AGREEMENT_KEY not in sample.metadata and state.tracked == {}
