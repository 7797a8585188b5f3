"""Sample: validation messages and lossless JSON round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from miles_host.sample import Sample, Status


def _sample(**overrides) -> Sample:
    values = dict(
        prompt=[{"role": "user", "content": "2+2?"}],
        tokens=[5, 6, 7, 8, 9],
        response="4",
        reward={"score": 1.0, "acc": True},
        loss_mask=[1, 0],
        status=Status.COMPLETED,
        metadata={"source": "gsm8k"},
        rollout_log_probs=[-0.25, -1.5],
        rollout_routed_experts=np.arange(4 * 3 * 2).reshape(4, 3, 2) % 7,
        group_index=3,
        index=17,
        label="4",
        response_length=2,
        weight_versions=[1, 2],
        spec_info={"accepted": [2, 1]},
    )
    values.update(overrides)
    return Sample(**values)


def test_round_trip_through_json_is_lossless():
    sample = _sample()
    text = json.dumps(sample.to_dict())
    restored = Sample.from_dict(json.loads(text))
    assert restored == sample
    assert restored.status is Status.COMPLETED
    assert restored.rollout_routed_experts.dtype == np.uint8
    np.testing.assert_array_equal(restored.rollout_routed_experts, sample.rollout_routed_experts)


def test_routed_experts_stored_compactly():
    small = _sample(rollout_routed_experts=torch.full((4, 2, 8), 255))
    assert small.rollout_routed_experts.dtype == np.uint8
    large = _sample(rollout_routed_experts=[[[300, 1]]] * 4)
    assert large.rollout_routed_experts.dtype == np.uint16
    assert large.rollout_routed_experts.itemsize <= 2
    restored = Sample.from_dict(json.loads(json.dumps(large.to_dict())))
    assert restored.rollout_routed_experts.tolist() == [[[300, 1]]] * 4
    with pytest.raises(ValueError, match="65535"):
        _sample(rollout_routed_experts=[[[70000]]] * 4)
    with pytest.raises(ValueError, match="shape"):
        _sample(rollout_routed_experts=[[1, 2]])


def test_float_reward_and_empty_fields_round_trip():
    sample = Sample(prompt="hi", tokens=[1, 2], response="x", reward=0.5, response_length=1)
    assert Sample.from_dict(json.loads(json.dumps(sample.to_dict()))) == sample


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"loss_mask": [1]}, "loss_mask"),
        ({"loss_mask": [1, 2]}, "loss_mask"),
        ({"rollout_log_probs": [-0.1]}, "rollout_log_probs"),
        ({"rollout_log_probs": [0.5, -1.0]}, "rollout_log_probs"),
        ({"response_length": 9}, "response_length"),
        ({"rollout_routed_experts": np.zeros((2, 3, 2), dtype=np.int64)}, "rollout_routed_experts"),
        ({"tokens": [1, "a", 3, 4, 5]}, "tokens"),
        ({"reward": float("nan")}, "reward"),
    ],
)
def test_validate_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        _sample(**overrides).validate()


def test_valid_sample_passes_and_unknown_keys_are_named():
    _sample().validate()
    data = _sample().to_dict()
    data["rollout_logprobs"] = []
    with pytest.raises(ValueError, match="rollout_logprobs"):
        Sample.from_dict(data)


def test_status_values():
    assert [s.name for s in Status] == ["PENDING", "COMPLETED", "TRUNCATED", "ABORTED", "FAILED"]
