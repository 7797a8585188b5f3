"""``--train-backend megatron``: the native trainer's RL step on a Megatron-Core GPTModel.

:class:`MegatronTrainer` is a :class:`~miles_host.trainer.NativeTrainer` whose policy
(and reference) model is a :class:`~miles_megatron.policy.MegatronPolicy`: advantages,
old/reference log-probs, micro-batching, the policy loss of
:mod:`miles_host.algorithms`, corrections, AdamW with the same settings, clipping,
the LR schedule, metrics, weight export and checkpoints are the host's code; only
the forward is Megatron's. One process, TP = PP = EP = CP = 1 (Megatron's
``parallel_state`` over a one-rank group); larger sizes are refused with the reason.
On CPU or one GPU (``--device cuda`` / ``cuda:N``), with the native trainer's
precision: float32 masters, bf16 autocast on GPU (see :mod:`miles_megatron.policy`).
"""

from __future__ import annotations

from typing import Any

import torch

from miles_host.rollout_backend import resolve_device
from miles_host.trainer import NativeTrainer
from miles_megatron.runtime import check_parallel_sizes, init_model_parallel, on_device, seed_rng

#: flags whose native implementation needs the native model's modules
_NATIVE_ONLY = {
    "true_on_policy": "--true-on-policy (the batch-invariant forward is the native model's)",
    "train_compile": "--train-compile (compiles the native decoder layers)",
    "enable_mtp_training": "--enable-mtp-training (Megatron's MTP block is not wired yet)",
}


def check_supported(config: Any) -> None:
    """What the megatron backend cannot do yet, named (ValueError)."""
    check_parallel_sizes(config)
    problems = [what for flag, what in _NATIVE_ONLY.items() if getattr(config, flag, False)]
    if config.precision != "bf16":
        problems.append(f"--precision {config.precision} (FP8/INT4 training through TransformerEngine is not wired yet)")
    if problems:
        raise ValueError(f"--train-backend megatron does not support {'; '.join(problems)}; use --train-backend native")


class MegatronTrainer(NativeTrainer):
    """The native trainer over a Megatron-Core GPTModel (see module doc)."""

    backend = "megatron"

    def __init__(self, config: Any, manager: Any):
        check_supported(config)
        device = resolve_device(config)
        init_model_parallel(device)
        seed_rng(config.seed, device)
        super().__init__(config, manager)

    def load_model(self, path: str, routing) -> torch.nn.Module:
        from miles_megatron.policy import MegatronPolicy

        recompute = self.config.recompute_granularity == "full"
        return MegatronPolicy.from_pretrained(path, self.device, routing, recompute=recompute)

    def train(self, samples):
        with on_device(self.device):
            return super().train(samples)

    def response_log_probs(self, model, batch, with_entropy: bool = False):
        with on_device(self.device):
            return super().response_log_probs(model, batch, with_entropy)

    def state_dict(self) -> dict:
        """The native trainer's checkpoint (model under native names), tagged with the
        backend: the optimizer state is indexed in Megatron's parameter order."""
        return {**super().state_dict(), "train_backend": self.backend}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("train_backend", "native")
        if saved != self.backend:
            raise ValueError(
                f"--load: this checkpoint was written by --train-backend {saved}; its optimizer state does not "
                f"map onto --train-backend {self.backend} (start from its HF weights with --hf-checkpoint instead)"
            )
        super().load_state_dict(state)
