"""miles-int4 (entry point ``int4``): INT4 quantization-aware training with INT4 rollout weights.

Selecting the plugin makes ``int4`` the run's precision recipe:

- training: the selected weights (``--int4-target experts``: MoE routed experts;
  ``all``: every linear but heads and routers) are fake-quantized group-wise
  (``--int4-group-size``) in every forward, straight-through gradient
  (:mod:`miles_int4.qat`);
- weight sync: those weights travel as compressed-tensors INT4
  (``weight_packed`` / ``weight_scale`` / ``weight_shape``) and the rollout model
  runs weight-only INT4 GEMMs (:mod:`miles_int4.rollout`), dequantizing exactly as
  the QAT forward does.

Sub-commands: ``miles convert-int4 SRC DST`` (compressed-tensors checkpoint for
SGLang/vLLM) and ``miles memory`` (BF16 vs INT4 weight memory of a config).
"""

from __future__ import annotations

from miles_host.kernels import switches
from miles_host.records import CheckpointConverter, Command, Precision
from miles_int4 import kernel_switches
from miles_int4.convert import add_convert_arguments, run_convert
from miles_int4.memory import add_memory_arguments, run_memory
from miles_int4.qat import apply_fake_quant
from miles_int4.rollout import convert_for_rollout, prepare_rollout_model
from miles_int4.settings import ROLLOUT_GEMMS, int4_settings


def miles_add_arguments(parser):
    """INT4 flags."""
    group = parser.add_argument_group("int4 (plugin)")
    group.add_argument("--int4-group-size", type=int, default=128, choices=[32, 64, 128], help="weights per scale group")
    group.add_argument(
        "--int4-target", default="experts", choices=["experts", "all"], help="which linears are quantised"
    )
    group.add_argument(
        "--int4-rollout-gemm", default="auto", choices=list(ROLLOUT_GEMMS),
        help="rollout INT4 GEMM: packed (weights held in a kernel layout only; CUDA: a Triton kernel at decode, "
        "dequantize + matmul at prefill; CPU: torch's int4 kernel), dequant (bit-identical to the QAT forward), "
        "auto (packed on CUDA unless --true-on-policy)",
    )
    switches.add_flags(group, kernel_switches.SWITCHES)


def miles_process_start(config):
    """The INT4 kernel switches (``--int4-cuda-layout``, ...) from the config, in every process of the run."""
    switches.apply_config(config, kernel_switches.SWITCHES)


def miles_configure(config):
    """An active int4 plugin selects the ``int4`` precision recipe."""
    config.precision = "int4"


def prepare_train_model(model, config):
    """Fake-quantize the selected weights of the training model (QAT)."""
    settings = int4_settings(config)
    apply_fake_quant(model, settings.group_size, settings.target)
    return model


def miles_register_precisions():
    """The ``int4`` recipe."""
    return [
        Precision(
            "int4",
            "group-wise symmetric INT4 fake quantization in training (STE), INT4 weight-only GEMMs in rollout",
            prepare_train_model=prepare_train_model,
            prepare_rollout_model=prepare_rollout_model,
            convert_for_rollout=convert_for_rollout,
            validate=lambda config, registries: int4_settings(config),  # --int4-* values a run can use
        )
    ]


def miles_register_checkpoint_converters():
    """``miles convert --to int4 SRC DST [--group-size N] [--target experts|all]``."""
    return [
        CheckpointConverter(
            "int4",
            "compressed-tensors pack-quantized INT4 (SGLang/vLLM W4A16)",
            add_arguments=add_convert_arguments,
            convert=lambda src, dst, args: run_convert(args),
        )
    ]


def miles_register_commands():
    """``miles memory``."""
    return [
        Command(
            "memory",
            "BF16 vs INT4 weight memory of a model, from its config.json",
            add_arguments=add_memory_arguments,
            run=run_memory,
        ),
    ]
