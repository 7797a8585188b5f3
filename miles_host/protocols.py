"""The interfaces the RL loop calls: what a plugin's backend object must provide.

Each registry whose records build objects (``factory``) has one protocol here:

==================  ==========================================  ===========================
record              the object its factory returns              optional members from
==================  ==========================================  ===========================
``TrainBackend``    :class:`Trainer`                            :class:`TrainerBase`
``RolloutBackend``  :class:`RolloutBackend`                     :class:`RolloutBackendBase`
``WeightSyncTransport``  :class:`WeightSyncTransport`           (none)
``Logger``          :class:`MetricsLogger`                      (none)
==================  ==========================================  ===========================

Every member of a protocol is required on the object. Members marked *optional* have a
default on the matching base class: a backend that subclasses the base gets them and
overrides only what it supports (e.g. a rollout backend that can free its KV cache sets
``releases_memory = True`` and implements the two memory methods). The loop calls the
members directly; it never probes for them.

:func:`check_conforms` is run on every object a factory returns (the loop builds its
components through :func:`build`); a missing member is a ``TypeError`` that names the
plugin, its distribution and the members it lacks.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, runtime_checkable

import torch

from miles_host.registry import Registry

NamedTensors = Iterable[tuple[str, torch.Tensor]]


# ----------------------------------------------------------------------------
# training backend
# ----------------------------------------------------------------------------


@runtime_checkable
class Trainer(Protocol):
    """What ``TrainBackend.factory(config, manager)`` returns.

    Required: ``model`` (the policy module; ``--save-hf`` saves it), ``consecutive_nan_steps``
    (optimizer steps in a row skipped on a NaN/Inf loss), ``train``, ``rank_counters``,
    ``named_weights_for_rollout``, ``state_dict`` / ``load_state_dict``.
    Optional (:class:`TrainerBase`): ``full_state_dict``, ``save_shards``, ``reads_megatron_checkpoints``, ``can_offload_train_state`` with
    ``offload_train_state`` / ``onload_train_state``, ``empty_device_cache``, ``optimizer_steps``,
    ``close``.
    """

    model: torch.nn.Module
    consecutive_nan_steps: int
    can_offload_train_state: bool
    reads_megatron_checkpoints: bool

    def train(self, samples: list) -> dict[str, float]:
        """Train on one rollout's samples; the step's ``train/*`` metrics."""

    def rank_counters(self) -> dict[str, float]:
        """The step's plugin counters (:func:`~miles_host.hookspecs.miles_rank_counters`) of
        every trainer process; a trainer in this process returns ``manager.rank_counters(config)``."""

    def named_weights_for_rollout(self) -> NamedTensors:
        """``(name, tensor)`` pairs the rollout engine loads, after the precision's conversion."""

    def state_dict(self) -> dict:
        """Everything a checkpoint needs to resume training."""

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Optional. The whole model's weights when ``model.state_dict()`` holds only this
        rank's shard (sharded trainers); ``None``: ``model.state_dict()`` is whole."""

    def save_shards(self, folder: str) -> list[str]:
        """Optional. Write each rank's own shards of the training state into the checkpoint
        folder ``folder`` (every rank of a trainer group calls it), before :meth:`state_dict`'s
        file; the files (relative to ``folder``) whose checksums the manifest records. The
        state then names their subfolder as ``"shards"``, which loading turns into its path."""

    def offload_train_state(self) -> None:
        """Optional (``can_offload_train_state``). Parameters, gradients and optimizer state
        to CPU for the rollout phase (``--offload-train``)."""

    def onload_train_state(self) -> None:
        """Optional. Back on the device after :meth:`offload_train_state` (no-op otherwise)."""

    def empty_device_cache(self) -> None:
        """Optional. Hand the allocator's free blocks back to the device (``--colocate``)."""

    def close(self) -> None:
        """Optional. Release process groups and other resources at the end of the run."""


class TrainerBase:
    """Defaults of the optional :class:`Trainer` members: no offloading, nothing to free."""

    #: the trainer implements ``offload_train_state`` / ``onload_train_state`` (``--offload-train``)
    can_offload_train_state: bool = False
    #: ``state_dict`` is a collective that every rank of a trainer group calls (sharded trainers)
    collective_state_dict: bool = False
    #: the trainer starts from the weights of a Megatron torch_dist ``--load`` / ``--ref-load`` directory
    reads_megatron_checkpoints: bool = False

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return None

    def save_shards(self, folder: str) -> list[str]:
        return []

    def offload_train_state(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot offload its training state")

    def onload_train_state(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot offload its training state")

    def empty_device_cache(self) -> None:
        return None

    def optimizer_steps(self) -> int | None:
        """Optimizer steps taken so far (a failure between two readings that give the same
        count left the trainer's state unchanged); ``None``: not known."""
        return None

    def close(self) -> None:
        return None


def writes_shards(trainer: Any) -> bool:
    """Whether ``trainer`` writes checkpoint shards of its own (overrides :meth:`TrainerBase.save_shards`)."""
    method = getattr(type(trainer), "save_shards", None)
    return method is not None and method is not TrainerBase.save_shards


# ----------------------------------------------------------------------------
# rollout backend
# ----------------------------------------------------------------------------


@runtime_checkable
class RolloutBackend(Protocol):
    """What ``RolloutBackend.factory(config, manager)`` returns: a request-level engine
    interface that the rollout manager drives.

    Required: ``weight_version``, ``submit``, ``step``, ``has_unfinished``, ``abort_all``,
    ``update_weights``. Optional (:class:`RolloutBackendBase`): ``releases_memory`` with
    ``release_memory_occupation`` / ``resume_memory_occupation`` (``--colocate``,
    ``--offload-rollout``), ``close`` at the run's end.

    Outputs are SGLang-shaped dicts: ``output_ids``, ``meta_info`` with ``id``, ``index``
    (sample of an ``n > 1`` request), ``finish_reason``, ``output_token_logprobs``,
    ``weight_version`` and optionally ``routed_experts``.
    """

    weight_version: Any
    releases_memory: bool

    def submit(self, rid: str, input_ids: list[int], sampling_params: dict, return_routed_experts: bool = False) -> None:
        """Queue a request of ``sampling_params["n"]`` samples; ``ValueError`` if it is bad."""

    def step(self) -> list[dict]:
        """Advance generation; the outputs of samples that finished in this step."""

    def has_unfinished(self) -> bool:
        """True while some submitted sample is still generating."""

    def abort_all(self) -> list[dict]:
        """Abort everything in flight; their partial outputs."""

    def update_weights(self, named_tensors: Any, weight_version: Any = None) -> Any:
        """Load new weights; returns the engine's new version."""

    def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        """Optional (``releases_memory``). Free the KV cache (and weights: tag ``weights``)."""

    def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        """Optional (``releases_memory``). Take the released memory back before generating."""


class RolloutBackendBase:
    """Defaults of the optional :class:`RolloutBackend` members: memory is never released."""

    #: the backend implements ``release_memory_occupation`` / ``resume_memory_occupation``
    releases_memory: bool = False
    #: outputs carry ``weight_version_spans`` (which weights generated which tokens of a request
    #: that spans a weight update): ``--pause-generation-mode in_place`` needs it
    reports_token_weight_versions: bool = False

    def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot release its memory between phases")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot release its memory between phases")

    def step_metrics(self) -> dict:
        """Counters of the backend itself for each step's metrics (a restarting router's
        ``ft/engine_restarts``); none by default."""
        return {}

    def close(self) -> None:
        """The run's end: free what the backend holds (an in-process engine's device memory);
        nothing by default. Nothing is generated after it."""


# ----------------------------------------------------------------------------
# weight sync and loggers
# ----------------------------------------------------------------------------


@runtime_checkable
class WeightSyncTransport(Protocol):
    """What ``WeightSyncTransport.factory(config)`` returns."""

    def push(self, named_tensors: NamedTensors, backend: RolloutBackend, weight_version: Any) -> Any:
        """Move ``named_tensors`` into ``backend``'s engines as ``weight_version``."""


@runtime_checkable
class MetricsLogger(Protocol):
    """What ``Logger.factory(config)`` returns. Optional (:class:`MetricsLoggerBase`):
    ``required``, whether the run stops when the logger fails (otherwise it is dropped
    with a warning)."""

    required: bool

    def log(self, metrics: dict, step: int) -> None:
        """Record one step's metrics."""

    def close(self) -> None:
        """Flush and release at the end of the run."""


class MetricsLoggerBase:
    """Defaults of the optional :class:`MetricsLogger` members: a logger that fails is dropped."""

    #: the run stops when this logger cannot write (the metrics.jsonl record of last resort)
    required: bool = False


# ----------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------


def protocol_members(protocol: type) -> list[str]:
    """The members a protocol declares (methods and annotated attributes), sorted."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}
    return sorted(names)


def missing_members(obj: Any, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``obj`` lacks (class attributes and properties are
    looked up on the class, so checking runs no property)."""
    return [
        name for name in protocol_members(protocol)
        if not (hasattr(type(obj), name) or name in getattr(obj, "__dict__", {}) or hasattr(obj, name))
    ]


def check_conforms(obj: Any, protocol: type, what: str) -> Any:
    """``obj`` if it has every member of ``protocol``; a ``TypeError`` naming ``what`` (the
    record and the plugin that registered it) and the missing members otherwise."""
    missing = missing_members(obj, protocol)
    if missing:
        base = {Trainer: "TrainerBase", RolloutBackend: "RolloutBackendBase", MetricsLogger: "MetricsLoggerBase"}.get(protocol)
        hint = f"; subclass miles_host.protocols.{base} for the optional ones' defaults" if base else ""
        raise TypeError(
            f"{what} returned a {type(obj).__name__} without {', '.join(missing)}: it must implement "
            f"miles_host.protocols.{protocol.__name__}{hint}"
        )
    return obj


def build(registry: Registry, name: str, protocol: type, *args: Any) -> Any:
    """``registry``'s record ``name``'s ``factory(*args)``, checked against ``protocol``."""
    entry = registry.entry(name)
    what = f"{registry.kind} {name!r} (plugin {entry.plugin!r}, distribution {entry.distribution!r})"
    return check_conforms(entry.record.factory(*args), protocol, what)
