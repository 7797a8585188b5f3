"""Built-in plugin: the GRPO family of advantage estimators.

The math lives in :mod:`miles_host.algorithms.advantages`; this module only
registers each estimator under the name ``--advantage-estimator`` takes.
"""

from __future__ import annotations

from miles_host.records import AdvantageEstimator

_ESTIMATORS = {
    "grpo": "group-normalised rewards (Dr.GRPO with --disable-grpo-std-normalization)",
    "gspo": "GRPO advantages with GSPO's sequence-level ratio in the loss",
    "cispo": "GRPO advantages with CISPO's clipped-IS-weight policy loss",
    "reinforce_plus_plus": "discounted returns with KL shaping, globally whitened",
    "reinforce_plus_plus_baseline": "group-mean baseline, globally whitened",
    "rloo": "leave-one-out baseline",
    "ppo": "GAE over a learned critic (--gamma, --lambd)",
}


def _estimator(name):
    def estimate(inputs, config):
        from miles_host.algorithms.advantages import compute_advantages

        return compute_advantages(name, inputs, config)

    return estimate


def miles_register_advantage_estimators():
    """The host's advantage estimators."""
    return [
        AdvantageEstimator(name, description, fn=_estimator(name), needs_critic=(name == "ppo"))
        for name, description in _ESTIMATORS.items()
    ]
