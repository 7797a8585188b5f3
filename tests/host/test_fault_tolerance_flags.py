"""The fault-tolerance flags: upstream miles' spellings and defaults, their checks, and the
rollout backends that can honour ``--use-fault-tolerance``."""

from __future__ import annotations

import pytest

from miles_host.config import MilesConfig, validate_config
from miles_host.config_fault_tolerance import check_fault_tolerant_backend
from miles_host.distributed.placement import wants_distributed
from miles_host.records import RolloutBackend
from tests.host.test_hooks import manager_with


def test_upstream_defaults():
    config = MilesConfig()
    assert (config.use_fault_tolerance, config.rollout_health_check_interval, config.rollout_health_check_timeout,
            config.rollout_health_check_first_wait, config.max_engine_restarts) == (False, 30.0, 30.0, 0.0, 3)


@pytest.mark.parametrize("field, value, message", [
    ("rollout_health_check_interval", 0.0, "--rollout-health-check-interval must be a positive"),
    ("rollout_health_check_timeout", -1.0, "--rollout-health-check-timeout must be a positive"),
    ("rollout_health_check_first_wait", -1.0, "--rollout-health-check-first-wait must be >= 0"),
    ("max_engine_restarts", -1, "--max-engine-restarts must be >= 0"),
    ("fully_async", True, "--use-fault-tolerance with --fully-async is not supported"),
])
def test_bad_values_are_refused(field, value, message):
    config = MilesConfig(use_fault_tolerance=True)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=message):
        validate_config(config)


def test_backends_that_can_replace_an_engine():
    class Plugin:
        @staticmethod
        def miles_register_rollout_backends():
            return [RolloutBackend("remote", factory=lambda config, manager: None)]

    registries = manager_with(Plugin()).registries
    config = MilesConfig(use_fault_tolerance=True)
    check_fault_tolerant_backend(config, registries)  # embedded: through its process variant
    assert wants_distributed(config, registries)  # the engine moves into a process of its own
    assert not wants_distributed(MilesConfig(), registries)
    config.rollout_backend = "process"
    check_fault_tolerant_backend(config, registries)
    config.rollout_backend = "remote"
    with pytest.raises(ValueError, match="the rollout backend 'remote' cannot replace a failed engine; use one that can "
                                         r"\(process\)"):
        check_fault_tolerant_backend(config, registries)
    assert not wants_distributed(config, registries)  # no process variant: it keeps its own engines
