"""slime's and miles' contracts of --custom-rm-path, --dynamic-sampling-filter-path and
--custom-generate-function-path, told apart from the signature (or a declared marker)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from miles_host.function_contracts import DynamicFilterOutput, adapt, contract_of, load_adapted
from miles_host.reward import RewardScorer
from miles_host.sample import Sample, Status

HERE = __name__


# -- functions written as slime's examples and as miles' are ---------------------------

async def slime_reward(args, sample, **kwargs):
    return float(sample.response.strip() == sample.label) * args.scale


def miles_reward(sample, config=None):
    return float(sample.response.strip() == sample.label) * 10


def slime_group_reward(args, samples, **kwargs):
    return [float(len(s.response)) for s in samples]


@dataclass
class SlimeFilterOutput:  # slime's own record (keep, reason), as a filter importing slime returns it
    keep: bool
    reason: str | None = None


def slime_filter(args, samples, **kwargs):
    rewards = [s.get_reward_value(args) for s in samples]
    keep = max(rewards) > min(rewards)
    return SlimeFilterOutput(keep=keep, reason=None if keep else f"zero_std_{rewards[0]}")


def miles_output_filter(args, samples):
    return DynamicFilterOutput(keep=len(samples) > 1)


def slime_bool_filter(args, samples, **kwargs):
    return len(samples) > args.min_group


def miles_filter(group, scalar):
    return sum(scalar(s.reward) for s in group) > 0


def args_named_sample_reward(args, sample):  # declared: the marker wins over the name
    return 1.0


args_named_sample_reward.miles_contract = "miles"


async def slime_generate(args, sample, sampling_params):
    return sample


async def miles_generate(args, sample, sampling_params, session):
    return sample


def _sample(response: str, label: str, reward=None) -> Sample:
    sample = Sample(prompt="p", tokens=[1, 2, 3], response=response, response_length=1, label=label)
    sample.reward = reward
    return sample


def _config(**values):
    defaults = dict(group_rm=False, rm_timeout=None, custom_rm_path=None, rm_url=None, rm_type=None,
                    reward_key=None, scale=3.0, min_group=2)
    return SimpleNamespace(**{**defaults, **values})


@pytest.mark.parametrize("function, field, expected", [
    (slime_reward, "custom_rm_path", "slime"), (miles_reward, "custom_rm_path", "miles"),
    (slime_group_reward, "custom_rm_path", "slime"), (args_named_sample_reward, "custom_rm_path", "miles"),
    (slime_filter, "dynamic_sampling_filter_path", "slime"), (miles_filter, "dynamic_sampling_filter_path", "miles"),
    (slime_generate, "custom_generate_function_path", "slime"),
    (miles_generate, "custom_generate_function_path", "miles"),
])
def test_contract_read_from_the_signature(function, field, expected):
    assert contract_of(function, field) == expected


@pytest.mark.parametrize("path, right, wrong", [(f"{HERE}.slime_reward", 3.0, 0.0), (f"{HERE}.miles_reward", 10.0, 0.0)])
def test_both_reward_contracts_score(path, right, wrong):
    scorer = RewardScorer(_config(custom_rm_path=path), registry=None)
    samples = [_sample(" 4", "4"), _sample("5", "4")]
    scorer.score_group(samples)
    assert [s.reward for s in samples] == [right, wrong]
    assert all(s.status is not Status.FAILED for s in samples)


def test_slime_group_reward():
    config = _config(custom_rm_path=f"{HERE}.slime_group_reward")
    config.group_rm = True
    samples = [_sample("ab", "x"), _sample("abc", "x")]
    RewardScorer(config, registry=None).score_group(samples)
    assert [s.reward for s in samples] == [2.0, 3.0]


@pytest.mark.parametrize("path, rewards, kept", [
    (f"{HERE}.slime_filter", [1.0, 0.0], True), (f"{HERE}.slime_filter", [1.0, 1.0], False),
    (f"{HERE}.slime_bool_filter", [1.0, 1.0], False), (f"{HERE}.miles_filter", [0.0, 1.0], True),
    (f"{HERE}.miles_filter", [0.0, 0.0], False), (f"{HERE}.miles_output_filter", [0.0, 0.0], True),
    ("slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std", [1.0, 1.0], False),
    ("slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std", [1.0, 0.0], True),
])
def test_filters_of_both_contracts(path, rewards, kept):
    config = _config()
    keep_group = load_adapted(path, "dynamic_sampling_filter_path", config)
    group = [_sample("r", "l", reward) for reward in rewards]
    assert keep_group(group, float) is kept


def test_slime_filter_reads_the_reward_key():
    config = _config(reward_key="acc")
    keep_group = adapt(slime_filter, "dynamic_sampling_filter_path", config)
    group = [_sample("r", "l", {"acc": 1.0, "score": 0.0}), _sample("r", "l", {"acc": 0.0, "score": 0.0})]
    assert keep_group(group, float) is True


def test_a_filter_returning_something_else_is_an_error():
    def bad(args, samples):
        return "yes"
    with pytest.raises(TypeError, match="returns a bool"):
        adapt(bad, "dynamic_sampling_filter_path", _config())([_sample("r", "l", 1.0)], float)


def test_generate_contracts():
    assert adapt(miles_generate, "custom_generate_function_path", _config()) is miles_generate
    with pytest.raises(ValueError, match="session.async_generate"):
        adapt(slime_generate, "custom_generate_function_path", _config())


def test_a_wrong_marker_is_an_error():
    def reward(sample):
        return 0.0
    reward.miles_contract = "verl"
    with pytest.raises(ValueError, match="miles_contract"):
        contract_of(reward, "custom_rm_path")


def test_slime_reward_is_awaited_as_a_coroutine():
    adapted = adapt(slime_reward, "custom_rm_path", _config())
    assert asyncio.run(adapted(_sample("4", "4"), None)) == 3.0
