"""miles-fp8 (entry point ``fp8``): unified block-scaled FP8 for rollout and training.

Selecting the plugin makes ``fp8`` the run's precision recipe: training linears run
their forward and backward GEMMs in block-scaled FP8 E4M3 (1x128 activation
groups, 128x128 weight blocks, float32 scales) on the master weights, the rollout
engine holds FP8 weights + ``weight_scale_inv``, and weight sync quantizes the
master weights with the same code, so both sides multiply the same numbers.
It also offers ``miles convert --to fp8 SRC DST`` (see :mod:`miles_fp8.convert`).
"""

from __future__ import annotations

from miles_fp8 import kernel_switches
from miles_host.kernels import switches
from miles_host.records import CheckpointConverter, Precision


def miles_add_arguments(parser):
    """FP8 flags (Megatron / slime spellings)."""
    group = parser.add_argument_group("fp8 (plugin)")
    group.add_argument("--fp8-format", default="e4m3", choices=["e4m3", "hybrid"], help="FP8 format")
    group.add_argument("--fp8-recipe", default="blockwise", choices=["blockwise"], help="FP8 scaling recipe")
    group.add_argument(
        "--fp8-power-of-two-scales", action="store_true", help="round FP8 scales to powers of two"
    )
    switches.add_flags(group, kernel_switches.SWITCHES)


def miles_process_start(config):
    """The FP8 kernel switches (``--fp8-gemm``, ...) from the config, in every process of the run."""
    switches.apply_config(config, kernel_switches.SWITCHES)


def miles_configure(config):
    """An active fp8 plugin selects the ``fp8`` precision recipe."""
    config.precision = "fp8"


def check_fp8_run(config, registries):
    """``Precision.validate``: the FP8 flags are ones the recipe implements, and the run's device
    has FP8 tensor cores (CPU: float32 emulation)."""
    from miles_fp8.device import check_fp8_device
    from miles_fp8.recipe import Fp8Recipe
    from miles_host.rollout_backend import resolve_device

    Fp8Recipe.from_config(config)
    check_fp8_device(resolve_device(config))


def miles_register_precisions():
    """The ``fp8`` recipe (imports torch-heavy modules only when a run builds models)."""
    from miles_fp8 import recipe

    return [
        Precision(
            "fp8",
            "block-scaled FP8 E4M3 (1x128 activations, 128x128 weights) in training and rollout",
            prepare_train_model=recipe.prepare_train_model,
            prepare_rollout_model=recipe.prepare_rollout_model,
            convert_for_rollout=recipe.convert_for_rollout,
            validate=check_fp8_run,
        )
    ]


def miles_register_checkpoint_converters():
    """``miles convert --to fp8 SRC DST``."""
    from miles_fp8 import convert

    return [
        CheckpointConverter(
            "fp8",
            "block-scaled FP8 HF checkpoint (weight + weight_scale_inv, quantization_config)",
            add_arguments=convert.add_convert_arguments,
            convert=lambda src, dst, args: convert.run_convert(args),
        )
    ]
