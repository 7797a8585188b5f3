"""miles-megatron (entry point ``megatron``): Megatron-Core as the training backend.

Chosen with ``--train-backend megatron`` (which also activates the plugin). The
trainer (:mod:`miles_megatron.trainer`) runs the native trainer's RL step on a
Megatron-Core ``GPTModel`` (local layer spec, no TransformerEngine) built from the
family adapter's native config and loaded through the weight maps
(:mod:`miles_megatron.weights`); R3 goes through Megatron's ``RouterReplay``.
Runs on CPU or one GPU with TP = PP = EP = CP = 1; larger sizes, MTP and FP8 are
refused with the reason. Needs megatron-core (``pip install megatron-core``).
"""

from __future__ import annotations

from miles_host.records import TrainBackend

INSTALL_HINT = "pip install megatron-core (or pip install 'miles-megatron[megatron]')"


def megatron_available() -> tuple[bool, str]:
    """Whether megatron-core can be imported here, and why not."""
    from miles_megatron.runtime import quiet_imports

    try:
        with quiet_imports():
            import megatron.core  # noqa: F401
            import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    except ImportError as error:
        return False, f"megatron-core is not installed ({error}); {INSTALL_HINT}"
    return True, ""


def _megatron_trainer(config, manager):
    ok, why = megatron_available()
    if not ok:
        raise ValueError(f"--train-backend megatron: {why}")
    from miles_megatron.trainer import MegatronTrainer

    return MegatronTrainer(config, manager)


def miles_activate(args):
    """``--train-backend megatron`` switches the plugin on."""
    return getattr(args, "train_backend", None) == "megatron"


def miles_configure(config):
    """Refuse placements the one-process backend cannot honour before any work."""
    if config.train_backend != "megatron":
        return
    from miles_host.distributed.launcher import wants_distributed

    from miles_megatron.runtime import check_parallel_sizes

    check_parallel_sizes(config)
    if wants_distributed(config):
        raise ValueError(
            "--train-backend megatron runs its trainer in this process for now: multi-process placement "
            "(--use-ray, several trainers or engines, --rollout-backend process) is not wired to it yet"
        )


def miles_register_train_backends():
    """The ``megatron`` training backend."""
    return [TrainBackend("megatron", "Megatron-Core GPTModel (local spec; TP/PP/EP = 1 for now)", factory=_megatron_trainer)]
