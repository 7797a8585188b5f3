"""Who holds the device in each phase of an RL step: ``--colocate``, ``--offload-train``,
``--offload-rollout``.

Colocated (training and rollout on the same GPUs; in one process they always are),
the two phases take turns, as in slime and verl::

    rollout --to_train()--> train --to_rollout(sync)--> rollout (and eval) ...

``to_train``
    the engines release their memory (KV cache and the decode CUDA graphs over it;
    their weights too with ``--offload-rollout``), then the trainer's state comes back
    to its device if it was offloaded.
``to_rollout``
    the trainer's parameters, gradients and optimizer state go to CPU
    (``--offload-train``), the engines take their weights back, the new weights are
    synced, the trainer hands its allocator's free blocks (its activations, the sync's
    staging copies) back to the device when colocated, then the engines take their KV
    cache back (slime's order: the sync's buffers never sit beside the KV cache).

The loop calls these two methods and nothing else; without the flags they only sync.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from miles_host.protocols import RolloutBackend, Trainer


@dataclass(frozen=True)
class PhasePlan:
    """What moves between phases."""

    #: what the engines release during training (``kv_cache``, ``weights``); empty: nothing
    rollout_tags: tuple[str, ...] = ()
    #: the trainer's state goes to CPU during rollout
    offload_train: bool = False
    #: the trainer hands its free cached blocks back before the engines' KV cache returns (colocated)
    empty_train_cache: bool = False

    @classmethod
    def from_config(cls, config: Any) -> "PhasePlan":
        """``--colocate`` or ``--offload-rollout``: the engines release their KV cache while
        training (and their weights with ``--offload-rollout``); ``--offload-train``. With
        ``--fully-async`` there are no phases to take turns in: colocated engines keep their
        memory and generate while the trainer trains on the same GPUs (the validation refuses
        the offload flags there)."""
        if config.fully_async:
            return cls()
        release = bool(config.colocate or config.offload_rollout)
        tags = ("kv_cache", "weights") if config.offload_rollout else ("kv_cache",) if release else ()
        return cls(tags, bool(config.offload_train), bool(config.colocate))

    @property
    def active(self) -> bool:
        return bool(self.rollout_tags or self.offload_train or self.empty_train_cache)


class Phases:
    """Runs a :class:`PhasePlan` over a trainer and a rollout backend."""

    def __init__(self, plan: PhasePlan, trainer: Trainer, backend: RolloutBackend, config: Any = None):
        self.plan = plan
        self.trainer = trainer
        self.backend = backend
        #: seconds spent moving memory since the last :meth:`pop_switch_time`
        self.switch_time_s = 0.0
        self._rollout_released = False
        if plan.rollout_tags and not backend.releases_memory:
            name = config.rollout_backend if config is not None else type(backend).__name__
            raise ValueError(
                f"--colocate / --offload-rollout: the rollout backend {name!r} cannot release its memory between "
                "phases; use --rollout-backend embedded or process"
            )
        if plan.offload_train and not trainer.can_offload_train_state:
            name = config.train_backend if config is not None else type(trainer).__name__
            raise ValueError(f"--offload-train: the training backend {name!r} cannot offload its state")

    @classmethod
    def from_config(cls, config: Any, trainer: Trainer, backend: RolloutBackend) -> "Phases":
        return cls(PhasePlan.from_config(config), trainer, backend, config)

    def to_train(self) -> None:
        """Rollout is over: the engines release their memory, the trainer's state comes back."""
        start = time.perf_counter()
        if self.plan.rollout_tags:
            self.backend.release_memory_occupation(list(self.plan.rollout_tags))
            self._rollout_released = True
        if self.plan.offload_train:
            self.trainer.onload_train_state()
        self.switch_time_s += time.perf_counter() - start

    def to_rollout(self, sync: Callable[[], float]) -> float:
        """Training is over: the trainer's state goes, the engines come back around ``sync()``
        (the weight sync, which returns its seconds); returns ``sync()``'s result."""
        start = time.perf_counter()
        if self.plan.offload_train:
            self.trainer.offload_train_state()
        if self._rollout_released and "weights" in self.plan.rollout_tags:
            self.backend.resume_memory_occupation(["weights"])
        before_sync = time.perf_counter()
        sync_time = sync()
        after_sync = time.perf_counter()
        if self.plan.empty_train_cache:
            self.trainer.empty_device_cache()
        if self._rollout_released:
            self.backend.resume_memory_occupation(None)
            self._rollout_released = False
        self.switch_time_s += (before_sync - start) + (time.perf_counter() - after_sync)
        return sync_time

    def pop_switch_time(self) -> float:
        """Seconds spent switching phases since the last call."""
        spent, self.switch_time_s = self.switch_time_s, 0.0
        return spent
