"""Built-in plugin: the plain ``bf16`` precision (dense linears in the model dtype:
bf16 on GPU, float32 on CPU), which every other precision recipe replaces."""

from __future__ import annotations

from miles_host.kernels import switches
from miles_host.records import Precision


def _unchanged(model, config):
    return model


def _pass_through(named_tensors, config):
    return named_tensors


def miles_process_start(config):
    """The host's kernel switches (every record of :data:`miles_host.config_kernels.HOST_SWITCHES`:
    ``--pdl``, ``--moe-combine``, ``--mla-prefill``, ...) from the config, in every process."""
    switches.apply_config(config, switches.host_switches())


def miles_register_precisions():
    """The default precision recipe."""
    return [
        Precision(
            "bf16",
            "dense linears in the model dtype; weights synced as they are",
            prepare_train_model=_unchanged,
            prepare_rollout_model=_unchanged,
            convert_for_rollout=_pass_through,
        )
    ]
