"""miles-megatron (entry point ``megatron``): Megatron-Core as the training backend.

Chosen with ``--train-backend megatron`` (which also activates the plugin).
Weight maps and the ``TransformerConfig``/``GPTModel`` arguments
(:mod:`miles_megatron.weights`) are tested on CPU against a real Megatron-Core
``GPTModel`` (same logits as the native model for Qwen3, Llama and Qwen3-MoE);
the backend itself needs CUDA and megatron-core (Python >= 3.12), and says so
clearly when either is missing. The training loop on Megatron-Core (TP/PP/EP,
RouterReplay for R3, MTP) is issue [12/13] and not written yet.
"""

from __future__ import annotations

from miles_host.records import TrainBackend


def megatron_available() -> tuple[bool, str]:
    """Whether this machine can run the backend, and why not."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "Megatron-Core needs a CUDA GPU and none is available"
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False, "megatron-core is not installed (pip install 'miles-megatron[megatron]', Python >= 3.12)"
    return True, ""


def _megatron_trainer(config, manager):
    ok, why = megatron_available()
    if not ok:
        raise ValueError(f"--train-backend megatron: {why}; use --train-backend native")
    raise ValueError(
        "--train-backend megatron: the Megatron-Core training loop is not implemented in this version "
        "(only the weight maps are); use --train-backend native"
    )


def miles_activate(args):
    """``--train-backend megatron`` switches the plugin on."""
    return getattr(args, "train_backend", None) == "megatron"


def miles_register_train_backends():
    """The ``megatron`` training backend."""
    return [TrainBackend("megatron", "Megatron-Core GPTModel (TP/PP/EP); needs CUDA", factory=_megatron_trainer)]
