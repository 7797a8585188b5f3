"""Built-in plugin: the GRPO family of advantage estimators.

The math and the records (what each estimator whitens, whether it needs a critic,
which policy loss it pairs with) live in :mod:`miles_host.algorithms.advantages`;
this module registers them under the names ``--advantage-estimator`` takes.
"""

from __future__ import annotations


def miles_register_advantage_estimators():
    """The host's advantage estimators."""
    from miles_host.algorithms.advantages import ADVANTAGE_ESTIMATORS

    return list(ADVANTAGE_ESTIMATORS.values())
