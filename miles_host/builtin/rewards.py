"""Built-in plugin: the ``--rm-type`` rewards (math, deepscaler, f1, exact)."""

from __future__ import annotations

from miles_host.records import RewardFunction
from miles_host.rewards import answers


def _per_sample(score):
    def reward(sample, config=None):
        if sample.label is None:
            raise ValueError("this reward needs a label: set --label-key to the label's key in the data")
        return score(sample.response, sample.label)

    reward.__doc__ = score.__doc__
    return reward


def miles_register_reward_functions():
    """The host's built-in rewards."""
    return [
        RewardFunction("math", "last \\boxed{} answer vs label (math-verify)", fn=_per_sample(answers.math_reward)),
        RewardFunction("deepscaler", "answer after </think> (or ###Response), then as math", fn=_per_sample(answers.deepscaler_reward)),
        RewardFunction("f1", "token-level F1 against the label", fn=_per_sample(answers.f1_reward)),
        RewardFunction("exact", "normalised exact match against the label", fn=_per_sample(answers.exact_reward)),
    ]
