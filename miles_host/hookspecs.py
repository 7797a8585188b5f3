"""Hook specifications of miles.

Every hook is prefixed ``miles_``. Plugins implement them as plain module-level
functions or methods with the same name (the ``@hookimpl`` marker is optional:
any attribute whose name starts with ``miles_`` is taken as an implementation,
and one that matches no spec is an error, so a misspelled hook never goes unseen).

Registration hooks (``miles_register_*``) return an iterable of records from
:mod:`miles_host.records`; each record has a ``name``. The plugin manager collects
them into one registry per kind and rejects duplicates, naming both distributions.
All other hooks say below whether the first non-None answer wins.

The six concerns of the design (precision, routing, rollout, correction,
model-family, weight-sync) come first, then what keeps the loop open.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Iterable

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from miles_host import records
    from miles_host.config import MilesConfig
    from miles_host.sample import Sample

PROJECT = "miles"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ----------------------------------------------------------------------------
# precision
# ----------------------------------------------------------------------------


@hookspec
def miles_register_precisions() -> Iterable["records.Precision"]:
    """Register precision recipes (``bf16``, ``fp8``, ``int4``, ...).

    Fires once when the plugin manager builds its registries. Returns an iterable
    of :class:`~miles_host.records.Precision`. All answers are collected; the run
    uses the one named by ``--precision`` (a plugin may set that in
    :func:`miles_configure`).
    """


# ----------------------------------------------------------------------------
# routing
# ----------------------------------------------------------------------------


@hookspec(firstresult=True)
def miles_select_experts(
    layer_index: int, scores: "torch.Tensor", topk: int, router_ids: "torch.Tensor", routing_context: Any
) -> "torch.Tensor | None":
    """Choose the experts of an MoE layer instead of the router's own top-k.

    Fires in every MoE layer's forward, in rollout and in training, with the
    scores used for expert choice (``[tokens, num_experts]``, after any
    expert-bias correction) and the ``routing_context`` of that forward pass
    (a :class:`miles_host.models.context.RoutingContext`: which pass it is and
    per-pass data such as replayed ids), and ``router_ids`` (``[tokens, topk]``,
    what the router itself chose, e.g. to measure agreement). Return a LongTensor ``[tokens, topk]``
    of expert ids to use, or None to let the router pick. Stops at the first
    non-None result. The gate weights are always recomputed from ``scores`` at
    the returned ids, so the router keeps its gradient.
    """


@hookspec
def miles_experts_selected(
    layer_index: int, expert_ids: "torch.Tensor", routing_context: Any
) -> None:
    """Observe the experts an MoE layer used (``[tokens, topk]`` LongTensor).

    Fires after the choice in every MoE layer's forward. Return value ignored;
    all implementations are called (e.g. to capture routes in rollout).
    """


# ----------------------------------------------------------------------------
# rollout
# ----------------------------------------------------------------------------


@hookspec
def miles_register_rollout_backends() -> Iterable["records.RolloutBackend"]:
    """Register rollout backends (``embedded``, ``sglang``, ...).

    Fires once when registries are built. Returns an iterable of
    :class:`~miles_host.records.RolloutBackend`; ``--rollout-backend`` picks one. Its
    ``factory`` returns an object with every member of
    :class:`miles_host.protocols.RolloutBackend` (a record without ``factory`` is refused
    here, an object missing a member when the run builds it, naming the plugin).
    """


@hookspec
def miles_register_decoding_strategies() -> Iterable["records.DecodingStrategy"]:
    """Register decoding strategies of the embedded engine (``plain``, ``eagle``).

    Fires once when registries are built. Returns an iterable of
    :class:`~miles_host.records.DecodingStrategy`; ``--sglang-speculative-algorithm``
    (or ``plain`` when unset) picks one.
    """


# ----------------------------------------------------------------------------
# correction
# ----------------------------------------------------------------------------


@hookspec
def miles_register_corrections() -> Iterable["records.Correction"]:
    """Register off-policy corrections (``tis``, ``mis``, ``icepop``, ...).

    Fires once when registries are built. Returns an iterable of
    :class:`~miles_host.records.Correction`; every correction whose ``enabled``
    is true for the run's config is applied to the policy loss.
    """


# ----------------------------------------------------------------------------
# model family
# ----------------------------------------------------------------------------


@hookspec
def miles_register_model_families() -> Iterable["records.ModelFamily"]:
    """Register model-family adapters (HF config and weights <-> native).

    Fires once when registries are built. Returns an iterable of
    :class:`~miles_host.records.ModelFamily`. Two families claiming one
    ``model_type`` is an error naming both distributions.
    """


@hookspec
def miles_register_checkpoint_converters() -> Iterable["records.CheckpointConverter"]:
    """Register checkpoint formats for ``miles convert --to NAME SRC DST`` (``fp8``, ``int4``).

    Fires when ``miles convert`` runs, for every importable plugin (selected or
    not: converting needs no run). Returns
    :class:`~miles_host.records.CheckpointConverter` records.
    """


# ----------------------------------------------------------------------------
# weight sync
# ----------------------------------------------------------------------------


@hookspec
def miles_register_weight_sync_transports() -> Iterable["records.WeightSyncTransport"]:
    """Register trainer -> rollout weight transports (``inprocess``, ``disk``, ...).

    Fires once when registries are built. Returns an iterable of
    :class:`~miles_host.records.WeightSyncTransport`; ``--weight-sync`` picks one. Its
    ``factory`` returns a :class:`miles_host.protocols.WeightSyncTransport`.
    """


# ----------------------------------------------------------------------------
# the loop: rewards, advantages, losses, backends, loggers
# ----------------------------------------------------------------------------


@hookspec
def miles_prepare_model(model: Any, role: str, config: "MilesConfig") -> None:
    """Adjust a freshly loaded model in place before it is used.

    Fires once per model after loading and after the precision recipe's
    ``prepare_*_model``: ``role`` is ``"train"`` (the policy in the trainer,
    before its optimizer is built, so new parameters are optimized),
    ``"ref"`` (the frozen reference model) or ``"rollout"`` (the engine's model,
    before its KV cache is sized and CUDA graphs are captured). E.g. the spec
    plugin attaches its MTP draft head. Return value ignored; all
    implementations are called.
    """


@hookspec
def miles_register_reward_functions() -> Iterable["records.RewardFunction"]:
    """Register reward functions (``math``, ``deepscaler``, ``f1``, ``exact``, ...).

    Fires once when registries are built. ``--rm-type`` picks one.
    """


@hookspec
def miles_register_advantage_estimators() -> Iterable["records.AdvantageEstimator"]:
    """Register advantage estimators (``grpo``, ``gspo``, ``rloo``, ``ppo``, ...).

    Fires once when registries are built. ``--advantage-estimator`` picks one.
    """


@hookspec
def miles_register_loss_terms() -> Iterable["records.LossTerm"]:
    """Register extra loss terms added to the policy loss (e.g. MTP draft loss).

    Fires once when registries are built. Every term whose ``enabled(config)`` is
    true is added.
    """


@hookspec
def miles_register_train_backends() -> Iterable["records.TrainBackend"]:
    """Register training backends (``native``, ``megatron``).

    Fires once when registries are built. ``--train-backend`` picks one. Its ``factory``
    returns an object with every member of :class:`miles_host.protocols.Trainer`
    (subclass :class:`~miles_host.protocols.TrainerBase` for the optional ones).
    """


@hookspec
def miles_register_loggers() -> Iterable["records.Logger"]:
    """Register metric loggers (``jsonl``, ``tensorboard``, ``wandb``).

    Fires once when registries are built. Every logger whose ``enabled(config)``
    is true receives each step's metrics; its ``factory`` returns a
    :class:`miles_host.protocols.MetricsLogger`.
    """


@hookspec
def miles_train_batch_prepared(batch: Any, samples: "list[Sample]", config: "MilesConfig") -> None:
    """Fires after the trainer packed ``samples`` into ``batch``, before forward.

    Plugins attach per-token data the training forward needs (e.g. R3 attaches
    replayed expert ids). Return value ignored; all implementations are called.
    """


@hookspec
def miles_rank_counters(config: "MilesConfig") -> "dict[str, float] | None":
    """Summable counts this process gathered in the step's training; read them and reset them.

    Fires once per step in every trainer process (the driver's trainer and each trainer
    worker rank), after training. The host adds each key up over the processes and
    passes the sums to :func:`miles_step_end` as ``counters``: a statistic whose parts
    live on different ranks (pipeline stages hold different layers, data-parallel ranks
    different samples) is then whole. Ranks that repeat the same work (tensor- or
    expert-parallel ranks routing the same tokens) each count it, so derive ratios from
    the sums, not totals. Name keys after the plugin (``r3/agree``). Also the place to
    drop per-step state in worker processes, which see no ``miles_step_end``.
    """


@hookspec
def miles_step_end(rollout_id: int, metrics: dict, config: "MilesConfig", counters: dict) -> None:
    """Fires at the end of every RL step, before metrics are logged.

    Implementations may add entries to ``metrics`` in place. ``counters``: the
    step's :func:`miles_rank_counters`, summed over the trainer processes. Return
    value ignored.
    """


# ----------------------------------------------------------------------------
# command line and configuration
# ----------------------------------------------------------------------------


@hookspec
def miles_add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add a plugin's own flags to ``miles run``'s parser.

    Fires while the parser is built, for every importable plugin (selected or
    not), so that a script naming a plugin flag parses either way. Values land in
    ``config.plugin_args`` and as attributes of the config. Return value ignored.
    """


@hookspec
def miles_activate(args: argparse.Namespace) -> bool | None:
    """Say whether parsed flags switch this plugin on without ``--plugins``.

    Fires once per plugin after argument parsing (the manager calls each plugin's
    implementation on its own, so each plugin answers for itself). Return True
    to be activated, e.g. ``r3`` for slime's ``--use-rollout-routing-replay``.
    """


@hookspec
def miles_configure(config: "MilesConfig") -> None:
    """Adjust the resolved config after parsing, for the active plugins.

    Fires once, in registration order (built-ins first), after the config is
    built and before it is validated. Implementations edit ``config`` in place
    (e.g. ``fp8`` sets ``config.precision = "fp8"``), but only fields the user did
    not set: changing a field in ``config.user_set``, or setting a field another
    plugin set to a different value, stops the run with an error naming both
    (:mod:`miles_host.validation.plugin_settings`). Checks belong in
    :func:`miles_validate`. Return value ignored.
    """


@hookspec
def miles_validate(config: "MilesConfig", registries: Any) -> None:
    """Check this plugin's own flags and how they combine with the run's config.

    Fires once in :func:`miles_host.validation.validate`, after the host's checks
    and the selected records' ``validate``, in ``miles run``, ``--dry-run`` and the
    Python API alike. Raise a ValueError naming the flag and what to do (exit code 2);
    never change ``config``. Return value ignored; all implementations are called.
    """


@hookspec
def miles_process_start(config: "MilesConfig") -> None:
    """Set this process's plugin state from the finished config (never change ``config``).

    Fires in every process that runs plugin code: in the driver once the config is
    configured and validated, and in each worker process (trainer ranks, engine
    processes) once its plugin manager is rebuilt from the driver's config. Module-level
    state that ``miles_configure`` set in the driver does not reach a worker by itself
    (e.g. ``r3``'s R2/R3 mode): set it here.
    """


@hookspec
def miles_register_commands() -> Iterable["records.Command"]:
    """Register ``miles`` sub-commands (``convert``, ``serve``, ``memory``, ...).

    Fires when the CLI is built. Returns :class:`~miles_host.records.Command`.
    """
