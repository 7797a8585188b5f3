"""FSDP2 trainer (``--train-backend fsdp``): parameters, gradients and optimizer state
sharded over the trainer processes with ``fully_shard`` (each decoder layer, then
the root), the rest as in :class:`~miles_host.distributed.dp_trainer.DataParallelTrainer`.

Same arithmetic as one process: every rank weights its micro-batch losses by the
step's *global* token (or sample) counts and the gradient reduce-scatter is a SUM
(FSDP's average times a loss scale of the world size). FSDP runs a collective in every layer's
forward and backward, so all ranks must run the same number of passes: a rank with
fewer micro-batches pads with placeholder passes (a real sample of the step, its
loss times zero) that only join the collectives.

The trainers' group is each trainer process's default process group (FSDP2's
device mesh needs one); the weight-sync group stays private. After each
``train`` the full weights are gathered (a collective of all ranks) and rank 0
keeps them for weight sync, ``--save-hf`` and checkpoints; the optimizer state of
a checkpoint is gathered when it is written (``TrainerGroup.state_dict`` asks
every rank).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from miles_host import offload
from miles_host.distributed.comm import allreduce_sum_
from miles_host.distributed.dp_trainer import DataParallelTrainer
from miles_host.lora.sync import rollout_state
from miles_host.trainer import trainable


class Fsdp2Trainer(DataParallelTrainer):
    """:class:`DataParallelTrainer` with the model and optimizer sharded by FSDP2."""

    #: ``state_dict`` is a collective: the trainer group must call it on every rank
    collective_state_dict = True
    #: FSDP2 all-gathers a module's parameters in one dtype
    stores_frozen_lora_bases_cast = False
    cpu_offload_refusal = ("the FSDP2 trainer steps sharded parameters (DTensors), which have no CPU master copies "
                           "here; --train-backend native_dp (replicated) runs the optimizer step on CPU")

    def __init__(self, config: Any, manager: Any, group: Any, rank: int = 0, world: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("the FSDP2 trainer needs the trainers' default process group (comm.new_group(as_default=True))")
        super().__init__(config, manager, group, rank, world)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the mesh and FSDP's streams use the current device
        mesh = init_device_mesh(self.device.type, (world,))
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        # the trainer's entry point is packed_log_probs, not forward: it gathers the root's
        # parameters (embedding, final norm, tied head) around it
        register_fsdp_forward_method(self.model, "packed_log_probs")
        # FSDP averages gradients over the ranks (gloo has no pre-scaled sum): each rank's
        # loss is scaled by the world size so the result is the SUM the shares assume
        self.loss_scale = float(world)
        self._make_optimizer(fused=False)  # over the sharded parameters (DTensors)
        self._dummy_sample = None
        self._full_state: dict[str, torch.Tensor] | None = None
        self._gather_full_state()

    def _allreduce_grads(self) -> None:
        """Nothing to do: FSDP reduce-scattered each layer's gradients in backward."""

    # -- equal numbers of passes on every rank ------------------------------------

    def _max_over_ranks(self, value: int) -> int:
        slots = torch.zeros(self.world, dtype=torch.long)
        slots[self.rank] = value
        allreduce_sum_(self.group, slots)
        return int(slots.max())

    def _padded(self, micros: list) -> list:
        return micros + [None] * (self._max_over_ranks(len(micros)) - len(micros))

    def _forward_micro_batches(self, model, samples) -> list:
        micros = super()._forward_micro_batches(model, samples)
        return self._padded(micros) if model is self.model else micros  # the reference model is not sharded

    def _placeholder_pass(self, phase: str) -> None:
        batch = self.pack([self._dummy_sample], phase)
        if phase == "train":
            log_probs, _ = self.response_log_probs(self.model, batch)
            (log_probs.sum() * 0.0).backward()
        else:
            with torch.no_grad():
                self.response_log_probs(self.model, batch)

    def _train(self, samples):
        # every rank holds all the step's samples: the first trainable one serves placeholders
        self._dummy_sample = next((s for s in samples if trainable(s)), None)
        metrics = super()._train(samples)
        self._gather_full_state()
        return metrics

    # -- weights and state ----------------------------------------------------------

    def _gather_full_state(self) -> None:
        """All ranks: all-gather the full weights; rank 0 keeps them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        self._full_state = {k: v.detach() for k, v in full.items()} if self.rank == 0 else None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights under native names, as of the last ``train`` (rank 0)."""
        assert self._full_state is not None, "full weights are kept on rank 0 only"
        return self._full_state

    def named_weights_for_rollout(self):
        named = list(rollout_state(self.model, self.full_state_dict(), self.config).items())
        return self.convert_for_rollout(named, self.config) if self.convert_for_rollout else named

    # -- phases (--offload-train) ---------------------------------------------------

    def offload_train_state(self) -> None:
        """The shards, their gradients and optimizer state to CPU, and rank 0's gathered weights."""
        super().offload_train_state()
        if self._full_state is not None and any(t.device.type != "cpu" for t in self._full_state.values()):
            self._full_state = {name: offload.to_host(t) for name, t in self._full_state.items()}
            offload.settle(self.device)

    @contextlib.contextmanager
    def _resident(self):
        """The sharded state on the device for a collective (NCCL needs device tensors)."""
        offloaded = self.train_state_offloaded
        self.onload_train_state()
        try:
            yield
        finally:
            if offloaded:
                self.offload_train_state()

    def state_dict(self) -> dict:
        """A collective: every rank calls it; rank 0's result is the checkpoint."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        with self._resident():
            optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=True))
        return {
            "model": self._full_state,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "consecutive_nan_steps": self.consecutive_nan_steps,
            "critic": None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Every rank gets the full state and keeps its shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        with self._resident():
            set_model_state_dict(self.model, state["model"], options=options)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
            self._gather_full_state()
        self.scheduler.load_state_dict(state["scheduler"])
        self.consecutive_nan_steps = state.get("consecutive_nan_steps", 0)

    def close(self) -> None:
        """Leave the trainers' default process group."""
        from miles_host.distributed.comm import leave_default_group

        leave_default_group()
