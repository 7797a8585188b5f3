"""``--train-backend megatron``: the native trainer's RL step on a Megatron-Core GPTModel.

:class:`MegatronTrainer` is a :class:`~miles_host.trainer.NativeTrainer` whose policy
(and reference) model is a :class:`~miles_megatron.policy.MegatronPolicy`: advantages,
old/reference log-probs, micro-batching, the policy loss of
:mod:`miles_host.algorithms`, corrections, the LR schedule, the NaN/Inf step skipping,
metrics, weight export and checkpoints are the host's code; the forward and backward run on
Megatron-Core's pipeline schedules, its ``DistributedDataParallel`` and
``finalize_model_grads`` (:mod:`miles_megatron.schedule`); the step is Megatron-Core's
optimizer (AdamW with the host's settings, its gradient norm and clipping; distributed with
``--use-distributed-optimizer``) under the host's schedule
(:mod:`miles_megatron.megatron_optimizer`). ``--ckpt-format torch`` checkpoints hold the
weights and Adam moments under native names, loadable on any layout
(:mod:`miles_megatron.optimizer_state`); ``torch_dist`` ones Megatron's shards
(:mod:`miles_megatron.dist_ckpt`).
One process at TP = PP = EP = CP = DP = 1 (Megatron's ``parallel_state`` over a one-rank
group), or ``TP * PP * CP * DP`` processes, one rank each (``--actor-num-gpus-per-node``; any
combination of TP, EP, PP and CP, DP a multiple of the smallest that EP divides into, each DP
rank training on its share of the samples; :mod:`miles_megatron.parallel`,
:mod:`miles_megatron.pipeline`, with virtual and uneven pipeline stages, started as the trainer group of
:mod:`miles_host.distributed.launcher`); context parallelism for dense models
(:mod:`miles_megatron.context_parallel`);
``--sequence-parallel`` at TP > 1 (:mod:`miles_megatron.sequence_parallel`).
On CPU or one GPU (``--device cuda`` / ``cuda:N``), with the native trainer's
precision: float32 masters, bf16 autocast on GPU (see :mod:`miles_megatron.policy`).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from miles_host.rollout_backend import resolve_device
from miles_host.trainer import NativeTrainer
from miles_megatron.runtime import (
    PARALLEL_FLAGS,
    check_parallel_sizes,
    init_model_parallel,
    leave_model_parallel,
    on_device,
    seed_rng,
)

logger = logging.getLogger(__name__)

#: flags whose native implementation needs the native model's modules
_NATIVE_ONLY = {
    "true_on_policy": "--true-on-policy (the batch-invariant forward is the native model's)",
    "train_compile": "--train-compile (compiles the native decoder layers)",
}


def check_supported(config: Any) -> None:
    """What the megatron backend cannot do yet, named (ValueError)."""
    check_parallel_sizes(config)
    problems = [what for flag, what in _NATIVE_ONLY.items() if getattr(config, flag)]
    if config.precision not in ("bf16", "fp8"):
        problems.append(f"--precision {config.precision} (only bf16 and fp8 are wired for Megatron)")
    if config.use_distributed_optimizer and config.save and getattr(config, "ckpt_format", "torch_dist") == "torch":
        problems.append("--use-distributed-optimizer with --save in --ckpt-format torch (the optimizer state is "
                        "sharded over the data-parallel ranks: save with --ckpt-format torch_dist)")
    if config.use_distributed_optimizer and config.optimizer_cpu_offload:
        problems.append("--use-distributed-optimizer with --optimizer-cpu-offload (Megatron's distributed optimizer "
                        "keeps its state on the trainer's device)")
    if problems:
        raise ValueError(f"--train-backend megatron does not support {'; '.join(problems)}; use --train-backend native")


class MegatronTrainer(NativeTrainer):
    """The native trainer over a Megatron-Core GPTModel (see module doc).

    ``(config, manager)`` in one process; ``(config, manager, group, rank, world)`` as
    a rank of the host's trainer group (``world`` = TP * PP * DP, the group the default one)."""

    backend = "megatron"
    #: under TP/EP/PP/DP ``state_dict`` gathers the optimizer state: every rank must call it
    #: (and the trainer group's process group is the default one, which Megatron needs)
    collective_state_dict = True
    #: checkpoints hold Adam's moments per parameter (optimizer_state.py)
    optimizer_names = ("adam",)
    #: --load / --ref-load of a Megatron torch_dist checkpoint (megatron_load.py)
    reads_megatron_checkpoints = True
    #: weight sync gathers and sends the weights bucket by bucket (:meth:`weight_buckets`)
    streams_weights = True

    def __init__(self, config: Any, manager: Any, group: Any = None, rank: int = 0, world: int = 1):
        from miles_megatron.runtime import config_sizes

        check_supported(config)
        self.sizes = config_sizes(config)
        if world != self.sizes.world:
            raise ValueError(
                f"--train-backend megatron with {self.sizes.describe()} needs {self.sizes.world} trainer processes, "
                f"got {world}"
            )
        self.group, self.rank, self.world = group, rank, world
        from miles_host.validation.host_checks import model_config
        from miles_megatron.pipeline import PipelineLayout

        #: the decoder layers over pipeline ranks and virtual stages (model chunks)
        self.layout = PipelineLayout.from_config(config, model_config(config).num_layers)
        device = resolve_device(config)
        init_model_parallel(device, self.sizes.tp, self.sizes.ep, self.sizes.pp, timeout_s=config.worker_timeout,
                            dp=self.sizes.dp, cp=self.sizes.cp, vpp=self.layout.vpp)
        seed_rng(config.seed, device)
        # the native trainer refuses model-parallel sizes (it has none): it is given sizes 1
        single = copy.copy(config)
        for dest in PARALLEL_FLAGS.values():
            setattr(single, dest, 1)
        super().__init__(single, manager)
        self.config = config
        from miles_megatron.megatron_load import load_start_weights

        load_start_weights(self)  # --ref-load / --load of Megatron torch_dist checkpoints
        if self.sizes.parallel and self.critic is not None:
            raise ValueError(
                f"--advantage-estimator {config.advantage_estimator} trains a critic, which the TP/EP/PP megatron "
                "trainer does not shard yet; use a critic-free estimator (grpo, gspo, rloo, ...)"
            )

    def _make_optimizer(self, fused: bool | None = None) -> None:
        """Each model chunk in Megatron's DDP (:func:`miles_megatron.schedule.wrap_ddp_chunks`), then
        Megatron's optimizer (distributed with ``--use-distributed-optimizer``) under the host's
        learning-rate schedule (:mod:`miles_megatron.megatron_optimizer`)."""
        from miles_host.lr_schedule import lr_lambda
        from miles_megatron.megatron_optimizer import build_megatron_optimizer
        from miles_megatron.parallel import mark_tensor_parallel
        from miles_megatron.schedule import wrap_ddp_chunks

        config = self.config
        if config.optimizer not in self.optimizer_names:
            raise ValueError(f"--optimizer {config.optimizer}: the {type(self).__name__} builds "
                             f"{', '.join(self.optimizer_names)} only; give one of them")
        distributed = config.use_distributed_optimizer
        for chunk in self.model.chunks:
            mark_tensor_parallel(chunk)  # (the norm counts each TP shard's gradient)
        with on_device(self.device):
            #: the DDP-wrapped model chunks (one without virtual pipeline stages)
            self.ddp_chunks = wrap_ddp_chunks(self.model.chunks, overlap_grad_reduce=config.overlap_grad_reduce,
                                              distributed_optimizer=distributed)
        self.ddp = self.ddp_chunks[0]
        _check_all_parameters_in_chunks(self.model, self.ddp_chunks)
        # (with the distributed optimizer the parameters are views of the DDP parameter buffer it gathers
        # into: moving them to the host and back would detach them from it; --offload-train / --colocate
        # are refused)
        self.can_offload_train_state = not distributed
        self.optimizer = build_megatron_optimizer(self.ddp_chunks, config, self.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))
        self.last_step_lr = None

    def offload_train_state(self) -> None:
        """The host's ``--offload-train`` move, the gradients dropped first: each is its parameter's
        ``main_grad``, a view of the DDP's gradient buffer, which moving it would detach from that
        buffer (the next step would then add to a stale gradient). (The buffer stays put.)"""
        self.optimizer.zero_grad(set_to_none=True)
        super().offload_train_state()

    def close(self) -> None:
        """Leave Megatron's parallel state, and the default group the trainer created (the
        one-rank group, or under TP/EP/PP the trainers' group)."""
        from miles_host.distributed.comm import leave_default_group

        leave_model_parallel()
        if self.sizes.parallel:
            leave_default_group()

    def apply_precision(self, model: torch.nn.Module, precision: Any) -> torch.nn.Module:
        """fp8: Megatron's linears through miles-fp8's FP8 GEMMs (:mod:`miles_megatron.fp8`)."""
        if precision.name == "fp8":
            from miles_megatron.fp8 import apply_fp8

            apply_fp8(model.gpt, model.config, self.config)
        return model

    def load_model(self, path: str, routing) -> torch.nn.Module:
        from miles_megatron.megatron_load import architecture_source
        from miles_megatron.policy import MegatronPolicy

        path = architecture_source(self.config, path)  # a torch_dist --ref-load: its weights come later

        recompute = self.config.recompute_granularity == "full"
        sequence_parallel = self.config.sequence_parallel
        if sequence_parallel and self.sizes.tp == 1:
            logger.warning("--sequence-parallel is ignored at --tensor-model-parallel-size 1 (it splits the "
                           "sequence over the tensor-parallel ranks)")
        from miles_megatron.perf_flags import log_dispatcher_note, transformer_config_overrides

        log_dispatcher_note(self.config, self.device, self.sizes.parallel)
        overrides = transformer_config_overrides(self.config, self.device, self.sizes.parallel)
        overrides.update(self.layout.transformer_kwargs())  # virtual and uneven pipeline stages
        from miles_megatron.schedule import configure_schedule

        policy = MegatronPolicy.from_pretrained(path, self.device, routing, recompute=recompute,
                                                sequence_parallel=sequence_parallel and self.sizes.tp > 1,
                                                overrides=overrides)
        for chunk in policy.chunks:
            configure_schedule(chunk.config)
        return policy

    def train(self, samples):
        with on_device(self.device):
            return super().train(samples)

    def response_log_probs(self, model, batch, with_entropy: bool = False):
        with on_device(self.device):
            return super().response_log_probs(model, batch, with_entropy)

    def _optimizer_step(self, samples, old, ref, advantages) -> dict[str, float]:
        """Forward and backward on Megatron's schedule, its DDP and gradient finalisation
        (:func:`miles_megatron.schedule.train_step`), then the host's clip-and-step (Megatron's
        clipping and step, skipped on a NaN/Inf loss or norm)."""
        from miles_megatron.schedule import train_step

        metrics, loss_sum = train_step(self, samples, old, ref, advantages)
        return self._clip_and_step(metrics, loss_sum)

    def _log_probs_without_grad(self, model, samples, phase: str) -> list[torch.Tensor]:
        from miles_megatron.schedule import log_probs_without_grad

        return log_probs_without_grad(self, model, samples, phase)

    def _clip_grads(self) -> torch.Tensor:
        """Megatron's gradient norm over the whole model (each gradient counted once over
        TP / EP / PP / DP) and its clipping to ``--clip-grad`` (:meth:`MegatronOptimizerStep.clip
        <miles_megatron.megatron_optimizer.MegatronOptimizerStep.clip>`)."""
        return self.optimizer.clip()

    # -- weights and state ------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Native-named weights; under TP/EP/PP/CP gathered whole on every rank (a collective,
        for the torch-format checkpoint: weight sync and ``--save-hf`` stream them instead,
        :meth:`weight_buckets`, and so does the trainer group for its callers)."""
        with on_device(self.device):
            return self.model.state_dict()

    def named_weights_for_rollout(self):
        """The engine's weights whole (a collective under TP/EP/PP/CP, see :meth:`full_state_dict`)."""
        named = list(self.full_state_dict().items())
        return self.convert_for_rollout(named, self.config) if self.convert_for_rollout else named

    def weight_buckets(self, bucket_bytes: int, for_rollout: bool = True):
        """The weights in native names, in buckets of at most ``bucket_bytes``, gathered across
        TP/EP/PP one bucket at a time (:mod:`miles_megatron.weight_buckets`; a collective:
        every rank iterates it to the end, rank 0 gets the buckets); ``for_rollout``: after the
        precision's conversion for the engine (else the trainer's weights, for ``--save-hf``)."""
        from miles_megatron.weight_buckets import native_buckets

        for bucket in native_buckets(self.model, bucket_bytes, self.device):
            named = list(bucket.items())
            if for_rollout and self.convert_for_rollout:
                named = self.convert_for_rollout(named, self.config)
            yield named

    def save_shards(self, folder: str) -> list[str]:
        """``--ckpt-format torch_dist``: this rank's model and optimizer shards into ``folder``
        (:mod:`miles_megatron.dist_ckpt`; every rank calls it)."""
        from miles_megatron.dist_ckpt import save_trainer_shards, uses_torch_dist

        return save_trainer_shards(self, folder) if uses_torch_dist(self.config) else []

    def state_dict(self) -> dict:
        """``--ckpt-format torch_dist``: the schedule's state, the model and optimizer being
        :meth:`save_shards`' files. ``torch``: the model under native names and the optimizer's
        moments gathered whole under native names (:mod:`miles_megatron.optimizer_state`; a
        collective under TP/EP/PP/CP/DP), which load on any layout."""
        from miles_megatron.dist_ckpt import trainer_state, uses_torch_dist

        if uses_torch_dist(self.config):
            return trainer_state(self)
        if self.config.use_distributed_optimizer:
            raise ValueError("--use-distributed-optimizer shards the optimizer state over the data-parallel ranks: "
                             "checkpoints need --ckpt-format torch_dist")
        from miles_megatron.optimizer_state import gather_optimizer_state

        return {
            "model": self.full_state_dict(),
            "optimizer": gather_optimizer_state(self),
            "scheduler": self.scheduler.state_dict(),
            "consecutive_nan_steps": self.consecutive_nan_steps,
            "critic": self.critic.checkpoint_state() if self.critic is not None else None,
            "train_backend": self.backend,
            "model_parallel": {"tp": self.sizes.tp, "ep": self.sizes.ep, "pp": self.sizes.pp},
        }

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("train_backend", "native")
        if saved != self.backend:
            raise ValueError(
                f"--load: this checkpoint was written by --train-backend {saved}; its optimizer state does not "
                f"map onto --train-backend {self.backend} (start from its HF weights with --hf-checkpoint instead)"
            )
        if state.get("format") == "torch_dist":  # shards, on whatever layout this trainer has
            from miles_megatron.dist_ckpt import load_trainer_state

            load_trainer_state(self, state)
            return
        with_optimizer = not getattr(self.config, "no_load_optim", False)
        if "model_parallel" not in state and with_optimizer:
            raise ValueError(
                "--load: this checkpoint of a one-process megatron trainer holds the state of the host's AdamW "
                "(the megatron trainer now steps Megatron-Core's optimizer, whose state it saves per parameter); "
                "give --no-load-optim to resume with fresh optimizer moments"
            )
        from miles_megatron.optimizer_state import load_optimizer_state

        with on_device(self.device):
            self.model.load_state_dict(state["model"])
        if with_optimizer:
            load_optimizer_state(self, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.consecutive_nan_steps = state.get("consecutive_nan_steps", 0)
        if self.critic is not None and state.get("critic") is not None:
            self.critic.load_checkpoint_state(state["critic"])


def _check_all_parameters_in_chunks(model: torch.nn.Module, chunks: list[torch.nn.Module]) -> None:
    """Megatron's optimizer steps the parameters of the DDP-wrapped chunks: a trainable parameter
    attached to the policy outside them (by a plugin) would never train, so it is refused."""
    inside = {id(param) for chunk in chunks for param in chunk.parameters()}
    outside = [name for name, param in model.named_parameters() if param.requires_grad and id(param) not in inside]
    if outside:
        raise ValueError(f"--train-backend megatron trains the parameters of Megatron's model chunks; "
                         f"{', '.join(outside[:5])} were attached outside them (a plugin's module): use --train-backend "
                         "native")
