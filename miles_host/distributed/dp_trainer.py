"""Data-parallel native trainer: the same model on every rank, samples split across the
ranks (balanced by tokens with ``--balance-data``, else dealt out in turn:
:mod:`miles_host.distributed.balance`), gradients summed over the trainers' process group.

Replicated: every rank holds the whole model and optimizer, and one fp32 gradient
all-reduce gives bit-level agreement with one process. ``--train-backend fsdp``
(:mod:`miles_host.distributed.fsdp_trainer`) shards them with FSDP2 instead.

Loss normalisation: the one-process trainer weights each micro-batch's loss by its
share of the step (:func:`~miles_host.algorithms.losses.micro_batch_share`:
``micro_tokens / step_tokens`` for ``token-mean``, ``micro_samples / step_samples`` for
the ``seq-mean-*`` modes, 1 for ``token-sum``). Here the denominators are the *global* counts of
the step (every rank sees all the step's samples), each rank back-propagates its
own micro-batches with those shares, and the gradient all-reduce is a plain SUM, so
N ranks compute the gradient of one process (up to fp32 summation order).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from miles_host.distributed.balance import split_samples
from miles_host.distributed.comm import allreduce_sum_
from miles_host.algorithms.losses import micro_batch_share
from miles_host.lr_schedule import step_sizes
from miles_host.trainer import NativeTrainer, read_floats, trainable


class DataParallelTrainer(NativeTrainer):
    """:class:`NativeTrainer` on rank ``rank`` of ``world`` trainers over ``group``."""

    #: whether ``state_dict`` must be called on every rank (sharded trainers)
    collective_state_dict = False
    #: factor on each rank's backward (a sharded trainer's gradient reduction averages)
    loss_scale = 1.0

    def __init__(self, config: Any, manager: Any, group: Any = None, rank: int = 0, world: int = 1):
        super().__init__(config, manager)
        self.group = group
        self.rank = rank
        self.world = world
        if world > 1 and self.critic is not None:
            raise ValueError(
                f"--advantage-estimator {config.advantage_estimator} trains a critic, which the data-parallel trainer "
                "does not all-reduce yet; use one trainer process or a critic-free estimator (grpo, gspo, rloo, ...)"
            )
        if world > 1:
            self._broadcast_parameters()

    # -- collectives ------------------------------------------------------------

    def _broadcast_parameters(self) -> None:
        """Everyone starts from rank 0's weights (they load the same checkpoint,
        this guards against a precision plugin's random init)."""
        from miles_host.distributed.comm import broadcast_

        with torch.no_grad():
            for tensor in self.model.state_dict().values():
                broadcast_(self.group, tensor, 0)

    def _allreduce_grads(self) -> None:
        """One flat fp32 SUM of every gradient (missing grads count as zero)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            return
        flat = torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params
        ])
        allreduce_sum_(self.group, flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype).clone()
            offset += n

    def _agree_on_keys(self, keys: list[str], source: int) -> list[str]:
        """The metric names of rank ``source`` (a rank without samples has none)."""
        import json

        from miles_host.distributed.comm import broadcast_

        data = json.dumps(keys).encode() if self.rank == source else b""
        size = broadcast_(self.group, torch.tensor([len(data)], dtype=torch.long), source)
        buffer = torch.zeros(int(size.item()), dtype=torch.uint8)
        if self.rank == source:
            buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        broadcast_(self.group, buffer, source)
        return json.loads(bytes(buffer.tolist()).decode())

    def _allreduce_floats(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        allreduce_sum_(self.group, tensor)
        return tensor.tolist()

    # -- training ---------------------------------------------------------------

    def _train(self, samples):
        self.onload_train_state()  # no-op unless offloaded
        if self.world == 1:
            return super()._train(samples)
        return self._train_dp(samples)

    def _train_dp(self, samples) -> dict[str, float]:
        samples = [s for s in samples if trainable(s)]
        if not samples:
            return {"train/skipped_no_samples": 1.0}
        sizes = step_sizes(len(samples), self.config)
        chunks = [samples[end - size : end] for end, size in zip(itertools.accumulate(sizes), sizes)]
        mine: list[int] = []  # global indices of this rank's samples, step by step
        per_step: list[list[int]] = []
        offset = 0
        sources: list[int] = []  # per step, the lowest rank that has samples (it names the metrics)
        for chunk in chunks:
            split = split_samples(chunk, self.world, self.config.balance_data)
            sources.append(min(r for r in range(self.world) if split[r]))
            local = [offset + i for i in split[self.rank]]
            per_step.append(local)
            mine.extend(local)
            offset += len(chunk)
        # old / ref log-probs of this rank's samples only
        self.model.eval()
        mine_samples = [samples[i] for i in mine]
        old_local = self._log_probs_without_grad(self.model, mine_samples, "old_logprob")
        ref_local = None
        if self.ref_model is not None:
            ref_local = self._log_probs_without_grad(self.ref_model, mine_samples, "ref")
        old: list = [None] * len(samples)
        ref: list | None = [None] * len(samples) if self.ref_model is not None else None
        for j, i in enumerate(mine):
            old[i] = old_local[j]
            if ref is not None:
                ref[i] = ref_local[j]
        if self.config.kl_coef and ref is not None:
            old = self._gather_per_sample(old, samples)  # the estimator's token KL needs every sample
            ref = self._gather_per_sample(ref, samples)
        elif self.config.use_opd:
            old = self._gather_per_sample(old, samples)  # so does the OPD penalty
        advantages = self.advantages(samples, ref, self._fill(old, samples))
        if isinstance(advantages, tuple):  # newer NativeTrainer: (advantages, value targets)
            advantages = advantages[0]
        for i, sample in enumerate(samples):
            sample.metadata["_train_index"] = i
        self.model.train()
        metrics: dict[str, list[float]] = {}
        for chunk_indices, chunk, source in zip(per_step, chunks, sources):
            local = [samples[i] for i in chunk_indices]
            step_metrics = self._optimizer_step_dp(local, chunk, old, ref, advantages, source)
            for key, value in step_metrics.items():
                metrics.setdefault(key, []).append(value)
        return self._rollout_metrics(samples, metrics)

    @staticmethod
    def _fill(values: list, samples) -> list[torch.Tensor]:
        """Placeholders (zeros) where another rank holds the log-probs; only the
        estimator's token KL reads them, and then they were gathered."""
        return [v if v is not None else torch.zeros(s.response_length) for v, s in zip(values, samples)]

    def _gather_per_sample(self, values: list, samples) -> list[torch.Tensor]:
        """Every rank's per-sample tensors, summed into place (each slot is held by one rank)."""
        lengths = [s.response_length for s in samples]
        flat = torch.zeros(sum(lengths), dtype=torch.float64)
        offset = 0
        for v, n in zip(values, lengths):
            if v is not None:
                flat[offset : offset + n] = v.double().cpu()
            offset += n
        allreduce_sum_(self.group, flat)
        return [t.float().to(self.device) for t in torch.split(flat, lengths)]

    def _optimizer_step_dp(self, local, step_samples, old, ref, advantages, source: int = 0) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        step_masks = [s.loss_mask for s in step_samples]
        sums: dict[str, float] = {}
        loss_sum = 0.0
        for micro in self._forward_micro_batches(self.model, local):
            if micro is None:  # a sharded model's placeholder pass (see _forward_micro_batches)
                self._placeholder_pass("train")
                continue
            loss, micro_metrics = self._micro_loss(micro, old, ref, advantages)
            micro_masks = [s.loss_mask for s in micro]
            share = micro_batch_share(self.config, micro_masks, step_masks)
            (loss * (share * self.loss_scale)).backward()
            micro_floats = read_floats({**micro_metrics, "__loss__": loss})  # one host sync per micro-batch
            loss_sum += micro_floats.pop("__loss__") * share
            metric_share = micro_batch_share(self.config, micro_masks, step_masks, for_metrics=True)
            for key, value in micro_floats.items():
                sums[key] = sums.get(key, 0.0) + value * metric_share
        self._allreduce_grads()
        keys = self._agree_on_keys(sorted(sums), source)
        reduced = self._allreduce_floats([loss_sum, *[sums.get(k, 0.0) for k in keys]])
        return self._clip_and_step({f"train/{key}": value for key, value in zip(keys, reduced[1:])}, reduced[0])
