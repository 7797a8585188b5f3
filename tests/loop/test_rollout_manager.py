"""Partial rollout and dynamic sampling: nothing lost, nothing counted twice.

A scripted backend finishes each request after a number of steps that depends
on the request, so some are still running when the batch is full.
"""

from __future__ import annotations

from miles_host.config import MilesConfig
from miles_host.data import PromptDataset, PromptRecord
from miles_host.reward import RewardScorer
from miles_host.rollout_manager import RolloutManager
from miles_host.records import RewardFunction
from miles_host.registry import Registry
from miles_host.sample import Status


class ScriptedBackend:
    """Request ``g<k>-s<i>`` emits one token per step and stops after ``length(k, i)`` tokens."""

    def __init__(self, length):
        self.length = length
        self.running = {}
        self.submitted = []
        self.weight_version = 7

    def submit(self, rid, input_ids, params, return_routed_experts=False):
        group = int(rid.split("-g")[1].split("-")[0])
        first = int(rid.split("-s")[1].split("-")[0])
        already = int(rid.rsplit("-", 1)[1])  # the manager puts the response length so far in the id
        for index in range(params["n"]):
            self.running[(rid, index)] = {"target": self.length(group, first + index) - already, "made": 0,
                                          "budget": params["max_new_tokens"]}
        self.submitted.append(rid)

    def _output(self, key, reason):
        state = self.running.pop(key)
        ids = [2 + (i % 5) for i in range(state["made"])]
        return {"output_ids": ids, "meta_info": {"id": key[0], "index": key[1], "finish_reason": reason,
                                                 "weight_version": self.weight_version,
                                                 "output_token_logprobs": [[-0.5, t, None] for t in ids]}}

    def step(self):
        done = []
        for key, state in list(self.running.items()):
            state["made"] += 1
            if state["made"] >= min(state["target"], state["budget"]):
                done.append(self._output(key, {"type": "stop", "matched": 1}))
        return done

    def abort_all(self):
        return [self._output(key, {"type": "abort", "message": "aborted"}) for key in list(self.running)]


class CharTokenizer:
    eos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + (ord(c) % 10) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


def make_manager(length, reward, **flags):
    config = MilesConfig(rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=50,
                         rm_type="scripted", **flags)
    registry = Registry("reward function")
    registry.add(RewardFunction("scripted", fn=reward), "test", "test")
    prompts = [PromptRecord(f"p{i}", str(i), {}, i) for i in range(100)]
    backend = ScriptedBackend(length)
    manager = RolloutManager(config, backend, CharTokenizer(), RewardScorer(config, registry), PromptDataset(prompts, False, 0))
    return manager, backend


def test_partial_rollout_buffers_and_continues_unfinished_samples():
    # groups 0 and 1 finish fast; group 2 and 3 are slow and get aborted in rollout 0
    length = lambda group, position: 3 if group < 2 else 8 + position  # noqa: E731
    manager, backend = make_manager(length, lambda s, c: float(s.index), partial_rollout=True,
                                    over_sampling_batch_size=4)
    groups0, stats0 = manager.generate(0)
    assert [g[0].group_index for g in groups0] == [0, 1]
    assert stats0.buffered_samples == 4 and stats0.dropped_samples == 0
    buffered = {s.group_index: s.response_length for g in manager.buffer for s in g}
    assert set(buffered) == {2, 3} and all(0 < n < 8 for n in buffered.values())
    groups1, stats1 = manager.generate(1)
    assert [g[0].group_index for g in groups1] == [2, 3]  # continued first, not re-sampled
    for group in groups1:
        for position, sample in enumerate(group):
            assert sample.response_length == 8 + position  # partial tokens kept, not generated twice
            assert len(sample.rollout_log_probs) == len(sample.loss_mask) == sample.response_length
            assert sample.weight_versions == [7, 7] and sample.status is Status.COMPLETED
    seen = [s.group_index for g in groups0 + groups1 for s in g]
    assert len(seen) == len(set(seen)) * 2  # every group trained exactly once


def test_mask_offpolicy_in_partial_rollout_masks_earlier_tokens():
    length = lambda group, position: 3 if group < 2 else 6  # noqa: E731
    manager, backend = make_manager(length, lambda s, c: float(s.index), partial_rollout=True,
                                    over_sampling_batch_size=4, mask_offpolicy_in_partial_rollout=True)
    manager.generate(0)
    backend.weight_version = 8  # the weights changed between the two rollouts
    groups, _ = manager.generate(1)
    for sample in groups[0]:
        first = len(sample.loss_mask) - sample.loss_mask.count(1)
        assert first > 0 and sample.loss_mask == [0] * first + [1] * (6 - first)
        assert sample.token_weight_versions == [7] * first + [8] * (6 - first)


def test_mask_offpolicy_keeps_continued_tokens_of_unchanged_weights():
    """Tokens generated before the abort by the same weights as after it are on-policy."""
    length = lambda group, position: 3 if group < 2 else 6  # noqa: E731
    manager, _ = make_manager(length, lambda s, c: float(s.index), partial_rollout=True,
                              over_sampling_batch_size=4, mask_offpolicy_in_partial_rollout=True)
    manager.generate(0)
    groups, _ = manager.generate(1)
    for sample in groups[0]:
        assert sample.loss_mask == [1] * 6 and sample.token_weight_versions == [7] * 6


def test_without_partial_rollout_unfinished_samples_are_dropped_and_counted():
    length = lambda group, position: 3 if group < 2 else 9  # noqa: E731
    manager, _ = make_manager(length, lambda s, c: float(s.index), over_sampling_batch_size=4)
    groups, stats = manager.generate(0)
    assert len(groups) == 2 and stats.dropped_samples == 4 and manager.buffer == []


def test_dynamic_sampling_drops_groups_without_signal():
    # even groups: both samples same length -> same reward -> filtered
    length = lambda group, position: 3 + (position if group % 2 else 0)  # noqa: E731
    manager, backend = make_manager(length, lambda s, c: float(len(s.response)), over_sampling_batch_size=3)
    groups, stats = manager.generate(0)
    kept = [g[0].group_index for g in groups]
    assert len(kept) == 2 and all(k % 2 == 1 for k in kept)
    assert stats.filtered_groups == stats.submitted_groups - len(kept) - stats.dropped_samples // 2
    for group in groups:
        assert len({s.reward for s in group}) == 2
    assert len(backend.submitted) == len(set(backend.submitted))  # no request sent twice


def test_custom_dynamic_sampling_filter(tmp_path, monkeypatch):
    (tmp_path / "my_filter.py").write_text("def keep(group, scalar):\n    return group[0].group_index >= 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    manager, _ = make_manager(lambda g, p: 2, lambda s, c: 1.0, over_sampling_batch_size=2,
                              dynamic_sampling_filter_path="my_filter.keep")
    groups, stats = manager.generate(0)
    assert [g[0].group_index for g in groups] == [3, 4] and stats.filtered_groups == 3
