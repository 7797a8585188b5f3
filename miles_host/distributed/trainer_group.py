"""The driver's view of N data-parallel trainers: rank 0 in this process, ranks
1..N-1 spawned, each a :class:`DataParallelTrainer`; one object with the
trainer interface the loop uses (:class:`miles_host.protocols.Trainer`)."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from miles_host.distributed.comm import WorkerHandle, new_group, rebuild_manager, serve
from miles_host.distributed.errors import WorkerFailed
from miles_host.distributed.failures import failed_worker
from miles_host.distributed.sample_details import SampleDetails, put_details, take_details
from miles_host.debug_rollout import keeps_train_log_probs
from miles_host.plugin_manager import sum_counters
from miles_host.protocols import TrainerBase, writes_shards


def group_backend(config: Any) -> str:
    return "nccl" if torch.cuda.is_available() and str(config.device) != "cpu" else "gloo"


def device_for_rank(config: Any, rank: int) -> str:
    """``cuda:<rank>`` on GPU (one trainer per GPU), else the configured device."""
    if group_backend(config) == "nccl":
        return f"cuda:{rank % max(1, torch.cuda.device_count())}"
    return config.device


def trainer_class_for(config: Any, manager: Any) -> type:
    """The class each rank of ``--train-backend``'s trainer group builds: its record's
    ``trainer_class``."""
    record = manager.registries.train_backends.get(config.train_backend)
    if record.trainer_class is None:
        raise ValueError(
            f"--train-backend {config.train_backend} has no trainer_class: it cannot run as a group of "
            "trainer processes; use one trainer process or --train-backend native_dp / fsdp"
        )
    return record.trainer_class()


class _TrainerTarget:
    def __init__(self, trainer):
        self.trainer = trainer
        self.trained: list = []  # the copies of the driver's samples last trained on

    def _details(self) -> SampleDetails | None:
        """The per-sample values the driver's dashboard and dump read (None when nothing keeps them)."""
        return take_details(self.trained) if keeps_train_log_probs(self.trainer.config) else None

    def rank_counters(self):
        """This rank's counters, and the per-sample values plugins wrote while counting (R3's agreement)."""
        counters = self.trainer.rank_counters()
        details, self.trained = self._details(), []
        return counters, details

    def train(self, samples):
        """Train; the per-sample values the trainer kept (its log-probs), by position in ``samples``
        (the metrics are rank 0's)."""
        self.trained = samples
        self.trainer.train(samples)
        return self._details()

    def load_state_dict(self, state):
        # Tensors that came through the pipe live in memory shared with the sender, whose
        # own trainer loads the same state: optimizer.load_state_dict keeps the tensors it
        # is given, so without a private copy both ranks' Adam steps would update one buffer.
        self.trainer.load_state_dict(copy.deepcopy(state))
        return True

    def state_dict(self):
        return self.trainer.state_dict()

    def save_shards(self, folder):
        return self.trainer.save_shards(folder)

    def stream_weights(self, bucket_bytes, for_rollout=True):
        """Take part in streaming the weights (:meth:`TrainerGroup.weight_buckets`)."""
        for _ in self.trainer.weight_buckets(bucket_bytes, for_rollout):
            pass
        return True

    def join_state_dict(self):
        """Take part in a collective ``state_dict`` (FSDP2); rank 0 keeps the result."""
        self.trainer.state_dict()
        return True

    def offload_train_state(self):
        self.trainer.offload_train_state()
        return True

    def onload_train_state(self):
        self.trainer.onload_train_state()
        return True

    def empty_device_cache(self):
        self.trainer.empty_device_cache()
        return True

    def ping(self):
        return os.getpid()


def trainer_main(
    config: Any, rank: int, world: int, store_address: tuple[str, int], conn, num_threads: int, timeout_s: float
) -> None:
    """Entry point of trainer rank ``rank`` (> 0)."""
    import copy

    from miles_host.loop import seed_everything

    torch.set_num_threads(num_threads)
    seed_everything(config.seed)
    try:
        config = copy.copy(config)
        config.device = device_for_rank(config, rank)
        if str(config.device).startswith("cuda:"):
            torch.cuda.set_device(torch.device(config.device))  # NCCL and Triton use the current device
        manager = rebuild_manager(config)
        trainer_class = trainer_class_for(config, manager)
        address, port = store_address
        group = new_group(address, port, rank, world, group_backend(config), timeout_s,
                          as_default=trainer_class.collective_state_dict)
        trainer = trainer_class(config, manager, group, rank, world)
    except Exception:  # noqa: BLE001
        import traceback

        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", os.getpid()))
    serve(conn, _TrainerTarget(trainer))


class TrainerGroup(TrainerBase):
    """Rank 0 here, the other ranks behind pipes."""

    def __init__(self, local, handles: list[WorkerHandle]):
        self.local = local
        self.handles = handles
        self.trained: list = []  # the samples of the last train, for the ranks' per-sample values

    # -- rank 0's view -------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """Rank 0's model (a shard of it in a sharded trainer: see :meth:`full_state_dict`)."""
        return self.local.model

    @property
    def config(self) -> Any:
        return self.local.config

    @property
    def consecutive_nan_steps(self) -> int:
        """Every rank skips the same steps (the loss and norm are reduced), so rank 0's count."""
        return self.local.consecutive_nan_steps

    @property
    def can_offload_train_state(self) -> bool:
        return self.local.can_offload_train_state

    @property
    def reads_megatron_checkpoints(self) -> bool:
        return self.local.reads_megatron_checkpoints

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole weights on rank 0 (a trainer that streams them: collected from its buckets)."""
        if self.streams_weights:
            return dict(self._streamed(for_rollout=False))
        return self.local.full_state_dict()

    def named_weights_for_rollout(self):
        """Rank 0's weights, whole (a sharded trainer gathers them after each ``train``, or, if it
        streams them, they are collected from its buckets)."""
        if self.streams_weights:
            return self._streamed(for_rollout=True)
        return self.local.named_weights_for_rollout()

    def _streamed(self, for_rollout: bool) -> list:
        size = int(self.local.config.update_weight_buffer_size)
        return [pair for bucket in self.weight_buckets(size, for_rollout) for pair in bucket]

    @property
    def streams_weights(self) -> bool:
        """The trainer gathers its weights for the engine bucket by bucket (:meth:`weight_buckets`)."""
        return bool(getattr(self.local, "streams_weights", False))

    def weight_buckets(self, bucket_bytes: int, for_rollout: bool = True):
        """Rank 0's ``(name, tensor)`` buckets of the streamed weights (``for_rollout``: converted
        for the engine, else as trained), every rank taking part (the local rank's collective is
        run to its end even if the caller stops early)."""
        for handle in self.handles:
            handle.send("stream_weights", bucket_bytes, for_rollout)
        buckets = self.local.weight_buckets(bucket_bytes, for_rollout)
        try:
            yield from buckets
        finally:
            for _ in buckets:
                pass
            for handle in self.handles:
                handle.recv("'stream_weights'")

    def train(self, samples) -> dict[str, float]:
        """Every rank trains on ``samples``; the per-sample values the other ranks kept for the
        dashboard and the train-data dump go into ``samples``' metadata
        (:mod:`~miles_host.distributed.sample_details`). A rank that fails, before or under a collective,
        is named (:func:`~miles_host.distributed.failures.failed_worker`); the error says
        whether rank 0 had taken an optimizer step of this rollout yet."""
        steps_before = self.optimizer_steps()
        try:
            for handle in self.handles:
                handle.send("train", samples)
        except WorkerFailed as failed:  # nothing has trained yet
            failed.trainer_state_unchanged = steps_before is not None
            raise
        try:
            metrics = self.local.train(samples)
        except RuntimeError as error:  # a peer died, stopped or failed under a collective
            failed = failed_worker(self.handles, "'train'", error, "trainer-0")
            failed.trainer_state_unchanged = steps_before is not None and self.optimizer_steps() == steps_before
            raise failed from error
        put_details(samples, [handle.recv("'train'") for handle in self.handles])
        self.trained = samples
        return metrics

    def optimizer_steps(self) -> int | None:
        """Rank 0's (every rank steps together)."""
        return self.local.optimizer_steps()

    def rank_counters(self) -> dict[str, float]:
        """The step's :func:`~miles_host.hookspecs.miles_rank_counters`, summed over every rank (the
        per-sample values plugins wrote meanwhile, such as R3's agreement, put into the trained samples)."""
        for handle in self.handles:
            handle.send("rank_counters")
        parts = [self.local.rank_counters()]
        replies = [handle.recv("'rank_counters'") for handle in self.handles]
        put_details(self.trained, [details for _, details in replies])
        self.trained = []
        return sum_counters(parts + [counters for counters, _ in replies])

    def state_dict(self) -> dict:
        """Rank 0's checkpoint state; a sharded trainer's is gathered with every rank."""
        if not self.local.collective_state_dict:
            return self.local.state_dict()
        for handle in self.handles:
            handle.send("join_state_dict")
        state = self.local.state_dict()
        for handle in self.handles:
            handle.recv("'state_dict'")
        return state

    def save_shards(self, folder: str) -> list[str]:
        """Every rank writes its shards (a collective); rank 0's list of files. A trainer that
        writes none skips the collective, so a group with a dead rank still checkpoints."""
        if not writes_shards(self.local):
            return []
        for handle in self.handles:
            handle.send("save_shards", folder)
        files = self.local.save_shards(folder)
        for handle in self.handles:
            handle.recv("'save_shards'")
        return files

    def load_state_dict(self, state: dict) -> None:
        for handle in self.handles:
            handle.send("load_state_dict", state)
        self.local.load_state_dict(state)
        for handle in self.handles:
            handle.recv("'load_state_dict'")

    # -- phases (--offload-train, --colocate): every rank at once ---------------------

    def _on_every_rank(self, method: str) -> None:
        for handle in self.handles:
            handle.send(method)
        getattr(self.local, method)()
        for handle in self.handles:
            handle.recv(f"'{method}'")

    def offload_train_state(self) -> None:
        """Parameters, gradients and optimizer state of every rank to CPU."""
        self._on_every_rank("offload_train_state")

    def onload_train_state(self) -> None:
        self._on_every_rank("onload_train_state")

    def empty_device_cache(self) -> None:
        self._on_every_rank("empty_device_cache")

    def stop(self) -> None:
        for handle in self.handles:
            handle.stop()
        self.local.close()

    def close(self) -> None:
        self.stop()
