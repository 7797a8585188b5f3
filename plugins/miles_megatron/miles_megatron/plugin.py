"""miles-megatron (entry point ``megatron``): Megatron-Core as the training backend.

Chosen with ``--train-backend megatron`` (which also activates the plugin). The
trainer (:mod:`miles_megatron.trainer`) runs the native trainer's RL step on a
Megatron-Core ``GPTModel`` (local layer spec, no TransformerEngine) built from the
family adapter's native config and loaded through the weight maps
(:mod:`miles_megatron.weights`); R3 goes through Megatron's ``RouterReplay``.
DeepSeek-V3/R1 runs on Megatron-Core's MLA and yarn rope (:mod:`miles_megatron.mla`) with
DeepSeek's sigmoid, expert-bias, group-limited routing (:mod:`miles_megatron.moe_routing`);
GLM-4.5's partial rotary (and interleaved rope pairs) on Megatron's rope (:mod:`miles_megatron.rope`).
Runs in one process (CPU or one GPU) at TP = EP = PP = 1, or as TP * PP * DP trainer
processes (TP, EP and PP alone or combined, EP carved out of TP x DP as Megatron-Core's
grids do, each DP rank on its share of the samples; Megatron's schedules (1F1B), DDP and
``finalize_model_grads``, :mod:`miles_megatron.schedule`; gloo on CPU, NCCL on GPU;
:mod:`miles_megatron.parallel`, :mod:`miles_megatron.pipeline`); CP is refused with
the reason; ``--sequence-parallel`` runs
with TP (:mod:`miles_megatron.sequence_parallel`). ``--plugins spec
--enable-mtp-training`` trains the draft on Megatron-Core's MTP layer at TP = EP = 1
(:mod:`miles_megatron.mtp`). ``--plugins fp8`` runs
Megatron's linears through miles-fp8's block-scaled FP8 GEMMs at TP = 1
(:mod:`miles_megatron.fp8`). Needs megatron-core (``pip install megatron-core``).
"""

from __future__ import annotations

from miles_host.config_megatron import MEGATRON_BACKEND_FIELDS
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


def _trainer_class():
    ok, why = megatron_available()
    if not ok:
        raise ValueError(f"--train-backend megatron: {why}")
    from miles_megatron.trainer import MegatronTrainer

    return MegatronTrainer


def _megatron_trainer(config, manager):
    """One process at TP = EP = PP = 1; else the host's trainer group of TP * PP * DP ranks."""
    from miles_megatron.runtime import model_parallel_world

    trainer_class = _trainer_class()
    if model_parallel_world(config) == 1:
        return trainer_class(config, manager)
    from miles_host.distributed.launcher import make_trainer

    return make_trainer(config, manager)


def miles_activate(args):
    """``--train-backend megatron`` switches the plugin on."""
    return getattr(args, "train_backend", None) == "megatron"


def check_megatron_backend(config, registries):
    """``TrainBackend.validate``: megatron-core is importable, the flags are ones this backend
    runs (:func:`miles_megatron.trainer.check_supported`), and the placement is one trainer
    process per rank of ``TP x PP x DP`` (``--actor-num-gpus-per-node`` that many; DP a
    multiple of the smallest data-parallel size that EP divides into)."""
    from miles_host.distributed.placement import num_trainers, uses_ray, wants_distributed

    from miles_megatron.runtime import config_sizes
    from miles_megatron.trainer import check_supported

    ok, why = megatron_available()
    if not ok:
        raise ValueError(f"--train-backend megatron: {why}")
    check_supported(config)
    check_model(config)
    sizes = config_sizes(config)
    world = sizes.world
    if world > 1:
        if num_trainers(config) != world or uses_ray(config):
            raise ValueError(
                f"--train-backend megatron with {sizes.describe()} runs {world} trainer processes on one node "
                f"(TP x PP x DP, DP a multiple of {sizes.smallest_dp}, the smallest that EP divides into): pass "
                f"--actor-num-gpus-per-node {world} or a multiple of {sizes.tp * sizes.pp * sizes.smallest_dp} "
                f"(got {num_trainers(config)} trainer(s)"
                f"{', --use-ray' if uses_ray(config) else ''})"
            )
        return
    if wants_distributed(config, registries):
        raise ValueError(
            "--train-backend megatron runs its trainer in this process at TP = EP = PP = 1: multi-process "
            "placement (--use-ray, several trainers or engines, --rollout-backend process) is wired only for "
            "TP/EP/PP > 1"
        )


def check_model(config):
    """The checkpoint's model is one this backend builds (the features Megatron's GPT layer spec
    cannot express are named), its layers split over the pipeline stages (and virtual stages), and (TP > 1) its heads over
    the tensor-parallel ranks: refused by the validation stage, not when the trainer starts."""
    from miles_host.validation.host_checks import model_config

    from miles_megatron.mla import tensor_parallel_problems
    from miles_megatron.pipeline import PipelineLayout
    from miles_megatron.weights import megatron_transformer_config_kwargs

    native = model_config(config)
    megatron_transformer_config_kwargs(native)
    PipelineLayout.from_config(config, native.num_layers)  # pipeline, virtual and uneven stages
    tp = config.tensor_model_parallel_size
    if native.num_heads % tp or native.num_kv_heads % tp:
        raise ValueError(
            f"--tensor-model-parallel-size {tp}: the model's {native.num_heads} attention heads and "
            f"{native.num_kv_heads} KV heads must each divide evenly over the tensor-parallel ranks"
        )
    if config.precision == "fp8" and tp > 1:
        check_fp8_shards(native, tp)
    uneven = tensor_parallel_problems(native, tp)
    if uneven:
        raise ValueError(f"--tensor-model-parallel-size {tp}: the model's MLA down projections are split over the "
                         f"tensor-parallel ranks; {', '.join(uneven)} must divide by {tp}")


def check_fp8_shards(native, tp: int) -> None:
    """FP8 at TP > 1: every tensor-parallel shard of a dense linear holds whole 128 x 128 blocks
    (the rollout quantizes the whole weight), so the per-rank MLP width and attention width are
    multiples of 128 (the heads themselves: ``apply_fp8``'s head_dim check)."""
    widths = {"intermediate_size": native.intermediate_size, "num_heads x head_dim": native.num_heads * native.head_dim}
    if native.moe is not None and native.moe.shared_intermediate_size:
        widths["shared_intermediate_size"] = native.moe.shared_intermediate_size
    cut = [f"{name} {width} / {tp} = {width / tp:g}" for name, width in widths.items() if (width // tp) % 128 or width % tp]
    if cut:
        raise ValueError(
            f"--plugins fp8 with --tensor-model-parallel-size {tp}: the tensor-parallel shards would cut the 128 x 128 "
            f"FP8 blocks the rollout quantizes ({'; '.join(cut)}, not multiples of 128); use a smaller "
            "--tensor-model-parallel-size, or 1")


def miles_register_train_backends():
    """The ``megatron`` training backend."""
    return [TrainBackend(
        "megatron", "Megatron-Core GPTModel (local spec; TP, EP, PP and their products over processes)",
        factory=_megatron_trainer, trainer_class=_trainer_class, validate=check_megatron_backend,
        honoured_flags=(*MEGATRON_BACKEND_FIELDS, "overlap_grad_reduce", "use_distributed_optimizer",
                        "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"),
    )]
