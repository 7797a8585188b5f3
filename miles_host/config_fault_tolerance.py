"""Flags of rollout-engine fault tolerance, upstream miles' spellings and defaults.

``--use-fault-tolerance`` runs the rollout engines in their own processes (as
``--rollout-backend process``) and keeps the run going when one of them dies or stops
answering: the engine is killed if needed, started again on its device, given the
current weights and handed its unfinished requests again
(:mod:`miles_host.distributed.engine_restarts`). Without it a failed engine stops the
run with a checkpoint and exit code 3.

An engine process sends a heartbeat every ``--rollout-health-check-interval`` seconds;
one whose last heartbeat is older than ``--rollout-health-check-timeout`` seconds more
than that is hung (a stopped or frozen process). ``--max-engine-restarts`` bounds the
restarts of each engine (upstream has no such bound; the name is this host's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_host.config_fields import flag


@dataclass
class FaultToleranceArgs:
    use_fault_tolerance: bool = flag(False, "restart a rollout engine that dies or stops answering (its unfinished requests "
                                     "are generated again, with the current weights) instead of stopping the run; engines "
                                     "run in their own processes", group="fault tolerance")
    rollout_health_check_interval: float = flag(30.0, "seconds between two heartbeats of a rollout engine process",
                                                type=float, group="fault tolerance")
    rollout_health_check_timeout: float = flag(30.0, "seconds past a missed heartbeat before an engine counts as hung and "
                                               "is killed and restarted (--use-fault-tolerance)", type=float,
                                               group="fault tolerance")
    rollout_health_check_first_wait: float = flag(0.0, "seconds after an engine process starts before its heartbeat is "
                                                  "checked (model compilation, CUDA-graph capture)", type=float,
                                                  group="fault tolerance")
    max_engine_restarts: int = flag(3, "restarts of one rollout engine before its failure stops the run "
                                    "(--use-fault-tolerance; 0: none)", type=int, group="fault tolerance")


def check_fault_tolerant_backend(config: Any, registries: Any) -> None:
    """``--use-fault-tolerance`` needs a rollout backend that carries on when an engine fails
    (its record's ``fault_tolerant``, or that of its ``distributed_variant``)."""
    if not config.use_fault_tolerance:
        return
    record = registries.rollout_backends.get(config.rollout_backend)
    variant = registries.rollout_backends.get(record.distributed_variant) if record.distributed_variant else None
    if not (record.fault_tolerant or (variant is not None and variant.fault_tolerant)):
        able = sorted(r.name for r in registries.rollout_backends if r.fault_tolerant)
        raise ValueError(f"--use-fault-tolerance: the rollout backend {config.rollout_backend!r} cannot replace a failed "
                         f"engine; use one that can ({', '.join(able)}) or drop --use-fault-tolerance")


def check_fault_tolerance(config: Any) -> None:
    """The values of the fault-tolerance flags (raises ValueError)."""
    for name in ("rollout_health_check_interval", "rollout_health_check_timeout"):
        if not getattr(config, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {getattr(config, name):g}")
    if config.rollout_health_check_first_wait < 0:
        raise ValueError("--rollout-health-check-first-wait must be >= 0 seconds, got "
                         f"{config.rollout_health_check_first_wait:g}")
    if config.max_engine_restarts < 0:
        raise ValueError(f"--max-engine-restarts must be >= 0, got {config.max_engine_restarts}")
    if config.use_fault_tolerance and config.fully_async:
        raise ValueError("--use-fault-tolerance with --fully-async is not supported yet: a restarted engine gets the "
                         "trainer's weights, which the trainer changes while the producer generates; drop one of the two")
