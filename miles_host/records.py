"""Records that registration hooks return.

Every registration hook (``miles_register_*``) returns an iterable of these small
frozen dataclasses. Each carries the ``name`` a user types (``--advantage-estimator
grpo``, ``--rm-type math``, ``--precision fp8``); the plugin manager puts them in a
:class:`~miles_host.registry.Registry` and rejects two records of one kind with the
same name, naming both distributions. A record may set ``override=True`` to replace
a built-in of the same name on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence


@dataclass(frozen=True)
class Record:
    """Base of all registration records: a unique ``name`` within its kind.

    ``validate(config, registries)``: the record's own checks, run by
    :func:`miles_host.validation.validate` when the run selects or enables the
    record (``--precision``, ``--train-backend``, an enabled correction, ...);
    raise a ValueError naming the flag. ``None``: nothing to check.
    """

    #: fields that must hold a callable: a record without one is refused at registration
    required: ClassVar[tuple[str, ...]] = ()

    name: str
    description: str = ""
    override: bool = False
    validate: Callable[[Any, Any], None] | None = None


# ----------------------------------------------------------------------------
# precision
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision(Record):
    """How linear weights are represented in training and converted for rollout.

    ``prepare_train_model(model, config)`` swaps or wraps linears in the training
    model (fake-quant, FP8 GEMMs) and returns the model.
    ``prepare_rollout_model(model, config)`` does the same on the rollout side.
    ``convert_for_rollout(named_tensors, config)`` maps the trainer's
    ``(name, tensor)`` pairs to what the rollout engine loads at weight sync
    (e.g. ``weight`` -> ``weight`` + ``weight_scale_inv``).
    """

    prepare_train_model: Callable[[Any, Any], Any] | None = None
    prepare_rollout_model: Callable[[Any, Any], Any] | None = None
    convert_for_rollout: Callable[[Any, Any], Any] | None = None


# ----------------------------------------------------------------------------
# rollout
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutBackend(Record):
    """A rollout backend: ``factory(config, plugin_manager) -> backend``, an object that
    implements :class:`miles_host.protocols.RolloutBackend`.

    ``multi_process``: its engines run in processes that the host's launcher starts
    (``--rollout-backend process``), so the run goes through
    :mod:`miles_host.distributed.launcher`. ``distributed_variant``: the backend that does
    this one's work from other processes when the run needs several (``embedded`` ->
    ``process``); empty: this backend serves multi-process runs as it is.
    ``fault_tolerant``: with ``--use-fault-tolerance`` it carries on when one of its engines
    fails (restarts it, or drops an external server while another is up).
    """

    factory: Callable[..., Any] | None = None
    multi_process: bool = False
    distributed_variant: str = ""
    fault_tolerant: bool = False

    required = ("factory",)


@dataclass(frozen=True)
class DecodingStrategy(Record):
    """A decoding strategy for the embedded engine (plain, speculative, ...).

    ``factory(engine, config) -> strategy``; the engine asks the strategy to
    advance its running requests by one or more tokens per step.
    """

    factory: Callable[..., Any] | None = None


# ----------------------------------------------------------------------------
# correction
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Correction(Record):
    """An off-policy correction between training and rollout log-probs.

    ``fn(train_log_probs, rollout_log_probs, loss_mask, response_lengths, config)``
    returns a ``CorrectionResult`` (token weights, token mask, metrics).
    ``enabled(config) -> bool`` says whether the run's flags switch it on.
    """

    fn: Callable[..., Any] | None = None
    enabled: Callable[[Any], bool] = lambda config: False

    required = ("fn",)


# ----------------------------------------------------------------------------
# model family
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFamily(Record):
    """A model family adapter: which HF ``model_type``s it handles and how.

    - ``model_types``: HF ``config.model_type`` values handled.
    - ``config_from_hf(hf_config: dict) -> ModelConfig`` (native config).
    - ``hf_to_native(name) -> str | None``: native parameter name for an HF
      weight name (``None`` = drop, e.g. rotary buffers).
    - ``native_to_hf(name) -> str``: the inverse.
    - ``hf_config_from_native(config, original_hf_config) -> dict`` for saving.
    - ``convert_hf_tensor(name, tensor, config) -> list[(native_name, tensor)]``
      for weights that are not a plain rename (fused or split tensors); ``None``
      means rename only. An entry may also be ``(native_name, tensor, index)``:
      the tensor fills ``native_param[index]`` (e.g. the k rows of a fused
      ``qkv_proj``, or expert 3 of a stacked ``[E, ...]`` tensor), so the loader
      streams HF tensors into fused native ones without an extra copy.
    - ``convert_native_tensor(name, tensor, config) -> list[(hf_name, tensor)]``:
      the inverse, for saving (split fused tensors, unstack experts); ``None``
      (the field) means ``native_to_hf`` renames only.
    - ``chat_defaults``: e.g. ``{"eos_token_ids": [...], "chat_template": ...}``.
    """

    model_types: tuple[str, ...] = ()
    config_from_hf: Callable[[Mapping[str, Any]], Any] | None = None
    hf_to_native: Callable[[str], str | None] | None = None
    native_to_hf: Callable[[str], str] | None = None
    hf_config_from_native: Callable[..., dict] | None = None
    convert_hf_tensor: Callable[..., Any] | None = None
    convert_native_tensor: Callable[..., Any] | None = None
    chat_defaults: Mapping[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------
# weight sync
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightSyncTransport(Record):
    """A way to move weights from trainer to rollout: ``factory(config) -> transport``, an
    object that implements :class:`miles_host.protocols.WeightSyncTransport`
    (``push(named_tensors, backend, weight_version)``).

    ``in_process_only``: it needs trainer and engine in one process; a multi-process run
    replaces it with the host's CUDA IPC (colocated on GPUs) or broadcast transport.
    """

    factory: Callable[..., Any] | None = None
    in_process_only: bool = False

    required = ("factory",)


# ----------------------------------------------------------------------------
# the loop
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardFunction(Record):
    """A reward: ``fn(sample, config) -> float | dict`` (sync or async).

    With ``group=True`` the function takes the list of samples of one prompt and
    returns one reward per sample.
    """

    fn: Callable[..., Any] | None = None
    group: bool = False

    required = ("fn",)


@dataclass(frozen=True)
class AdvantageEstimator(Record):
    """An advantage estimator, and everything the host does around it.

    - ``fn(inputs: AdvantageInputs, config) -> list[Tensor]``: per-sample ``[L_i]``
      advantages before any whitening (:mod:`miles_host.algorithms.advantages`).
    - ``whiten``: the host always whitens them over the batch's loss-masked tokens (as
      slime requires ``--normalize-advantages`` for REINFORCE++); otherwise only with
      ``--normalize-advantages``.
    - ``needs_critic``: the trainer builds a value model (PPO); value targets are the
      unwhitened advantages plus the critic's values.
    - ``policy_loss``: the policy-gradient term the loss uses with these advantages,
      ``fn(log_probs, old_log_probs, advantages, loss_mask, response_lengths, config) ->
      PolicyLossTerms`` (:mod:`miles_host.algorithms.losses`); ``None``: PPO's clipped surrogate.
    """

    fn: Callable[..., Any] | None = None
    needs_critic: bool = False
    whiten: bool = False
    policy_loss: Callable[..., Any] | None = None

    required = ("fn",)


@dataclass(frozen=True)
class LossTerm(Record):
    """An extra loss term added to the policy loss (e.g. the MTP draft loss).

    ``fn(model_outputs, batch, config) -> (loss_tensor, metrics)``;
    ``enabled(config) -> bool``.
    """

    fn: Callable[..., Any] | None = None
    enabled: Callable[[Any], bool] = lambda config: True

    required = ("fn",)


@dataclass(frozen=True)
class TrainBackend(Record):
    """A training backend: ``factory(config, plugin_manager) -> trainer``, an object that
    implements :class:`miles_host.protocols.Trainer`.

    ``trainer_class``: optional ``() -> class``, the class each rank of the host's
    trainer group builds as ``cls(config, manager, group, rank, world)``
    (:mod:`miles_host.distributed.trainer_group`). ``multi_process``: its trainers run in
    processes that the host's launcher starts (``native_dp``, ``fsdp``).
    ``distributed_variant``: the backend that does this one's work over processes when the
    run needs several (``native`` -> ``native_dp``); empty: it serves such runs as it is.
    ``honoured_flags``: fields of the accepted-and-ignored list that this backend reads
    (no warning when it is the one chosen). ``lora``: it trains LoRA adapters (``--lora-rank``).
    """

    factory: Callable[..., Any] | None = None
    trainer_class: Callable[[], type] | None = None
    multi_process: bool = False
    distributed_variant: str = ""
    honoured_flags: tuple[str, ...] = ()
    lora: bool = False

    required = ("factory",)


@dataclass(frozen=True)
class Logger(Record):
    """A metrics logger: ``factory(config) -> obj`` with ``log(metrics, step)``
    and ``close()`` (:class:`miles_host.protocols.MetricsLogger`). ``enabled(config) -> bool``."""

    factory: Callable[..., Any] | None = None
    enabled: Callable[[Any], bool] = lambda config: True

    required = ("factory",)


@dataclass(frozen=True)
class Command(Record):
    """A ``miles`` sub-command: ``add_arguments(parser)`` and ``run(args) -> int``."""

    add_arguments: Callable[[Any], None] | None = None
    run: Callable[[Any], int] | None = None

    required = ("run",)


@dataclass(frozen=True)
class CheckpointConverter(Record):
    """A checkpoint format for ``miles convert --to NAME SRC DST``.

    ``add_arguments(parser)`` adds the format's own flags (e.g. ``--group-size``);
    ``convert(src, dst, args) -> None`` writes the converted HF checkpoint.
    """

    add_arguments: Callable[[Any], None] | None = None
    convert: Callable[[str, str, Any], None] | None = None

    required = ("convert",)


#: record type -> registration hook name; the plugin manager builds one registry each.
REGISTRATION_HOOKS: Mapping[str, type[Record]] = {
    "miles_register_precisions": Precision,
    "miles_register_rollout_backends": RolloutBackend,
    "miles_register_decoding_strategies": DecodingStrategy,
    "miles_register_corrections": Correction,
    "miles_register_model_families": ModelFamily,
    "miles_register_weight_sync_transports": WeightSyncTransport,
    "miles_register_reward_functions": RewardFunction,
    "miles_register_advantage_estimators": AdvantageEstimator,
    "miles_register_loss_terms": LossTerm,
    "miles_register_train_backends": TrainBackend,
    "miles_register_loggers": Logger,
    "miles_register_commands": Command,
    "miles_register_checkpoint_converters": CheckpointConverter,
}

__all__: Sequence[str] = [name for name in dir() if name[0].isupper()]
