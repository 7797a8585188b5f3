"""The native PyTorch trainer over the shared model code.

One :meth:`NativeTrainer.train` call per rollout: advantages, old (and reference)
log-probs, then the optimizer steps of :func:`~miles_host.lr_schedule.step_sizes` over micro-batches of
packed sequences, with the policy loss of :mod:`miles_host.algorithms.losses` and
the corrections the run enabled. Parameters are fp32 masters; on GPU the forward
runs under bf16 autocast.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from miles_host.algorithms.advantages import AdvantageInputs, compute_advantages
from miles_host.algorithms.corrections import mismatch_metrics
from miles_host.algorithms.kl import compute_approx_kl
from miles_host.algorithms.losses import PolicyLossBatch, micro_batch_share
from miles_host.lr_schedule import lr_lambda, step_sizes
from miles_host.loss_types import micro_batch_loss
from miles_host.lora import apply_lora
from miles_host.lora.layers import store_frozen_bases_in
from miles_host.lora.sync import rollout_state
from miles_host import offload, profiling
from miles_host.dashboard.samples import record_train_log_probs
from miles_host.debug_rollout import keeps_train_log_probs
from miles_host.devices import host_to_device, resolve_device
from miles_host.models.context import ForwardContext, RoutingContext
from miles_host.protocols import TrainerBase
from miles_host.routing import RoutingHooks
from miles_host.sample import Sample, Status

logger = logging.getLogger(__name__)


#: the dtype the training forward computes in on CUDA (autocast over float32 master weights)
CUDA_AUTOCAST_DTYPE = torch.bfloat16


@dataclass
class PackedBatch:
    """Samples packed into one flat sequence for the training forward.

    ``response_index_R`` selects, from the per-position log-probs ``[T]``, the
    positions that predict response tokens (R = all response tokens, in order).
    """

    samples: list[Sample]
    input_ids_T: torch.Tensor
    positions_T: torch.Tensor
    cu_seqlens: torch.Tensor
    target_ids_T: torch.Tensor
    response_index_R: torch.Tensor
    response_lengths: list[int]
    routing: RoutingContext = field(default_factory=RoutingContext)
    model_config: Any = None

    @classmethod
    def from_samples(cls, samples: list[Sample], device: torch.device) -> "PackedBatch":
        ids, positions, targets, response_index, lengths = [], [], [], [], []
        cu = [0]
        for sample in samples:
            tokens = sample.tokens
            start = cu[-1]
            ids.extend(tokens)
            positions.extend(range(len(tokens)))
            targets.extend(tokens[1:] + [0])
            first = len(tokens) - sample.response_length - 1  # position predicting the first response token
            response_index.extend(range(start + first, start + len(tokens) - 1))
            lengths.append(sample.response_length)
            cu.append(start + len(tokens))
        # built on the host, copied without waiting for the GPU (host_values reads them back for free)
        as_long = lambda values: host_to_device(torch.tensor(values, dtype=torch.long), device)  # noqa: E731
        return cls(
            samples,
            as_long(ids),
            host_to_device(torch.tensor(positions, dtype=torch.long), device, keep_host=True),
            host_to_device(torch.tensor(cu, dtype=torch.int32), device, keep_host=True),
            as_long(targets),
            as_long(response_index),
            lengths,
        )

    def per_token(self, values: Iterable[Iterable[float]], device: torch.device) -> torch.Tensor:
        """Concatenate per-sample response values (e.g. rollout log-probs) into ``[R]``."""
        flat = [float(v) for row in values for v in row]
        return host_to_device(torch.tensor(flat, dtype=torch.float32), device)


def trainable(sample: Sample) -> bool:
    """Samples that take part in training: generated something and were scored."""
    return sample.status in (Status.COMPLETED, Status.TRUNCATED) and sample.response_length > 0 and sample.reward is not None


def micro_batches(samples: list[Sample], config: Any) -> list[list[Sample]]:
    """``--micro-batch-size`` samples, or packs of at most ``--max-tokens-per-gpu`` tokens."""
    if not config.use_dynamic_batch_size:
        size = config.micro_batch_size
        return [samples[i : i + size] for i in range(0, len(samples), size)]
    batches: list[list[Sample]] = []
    current: list[Sample] = []
    tokens = 0
    for sample in samples:
        if current and tokens + len(sample.tokens) > config.max_tokens_per_gpu:
            batches.append(current)
            current, tokens = [], 0
        current.append(sample)
        tokens += len(sample.tokens)
    if current:
        batches.append(current)
    return batches


def scalar_reward(reward: Any, config: Any) -> float:
    """A sample's reward as one number (``--reward-key`` of a dict reward, default ``score``)."""
    if isinstance(reward, dict):
        return float(reward[config.reward_key or "score"])
    return float(reward)


def advantage_inputs(samples: list[Sample], ref_log_probs, old_log_probs, values, config: Any) -> AdvantageInputs:
    """The advantage estimator's inputs for ``samples``: rewards, groups, loss masks, critic
    ``values`` (or None) and, with ``--kl-coef`` and reference log-probs, the per-token KL
    of the old policy to the reference by the ``--kl-loss-type`` estimator (as slime shapes
    rewards)."""
    token_kl = None
    if config.kl_coef and ref_log_probs is not None:
        token_kl = [compute_approx_kl(o, r, config.kl_loss_type).cpu() for o, r in zip(old_log_probs, ref_log_probs)]
    return AdvantageInputs(
        rewards=torch.tensor([scalar_reward(s.reward, config) for s in samples], dtype=torch.float32),
        group_index=torch.tensor([s.group_index for s in samples], dtype=torch.long),
        response_lengths=[s.response_length for s in samples],
        token_kl=token_kl,
        loss_masks=[torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples],
        values=[v.cpu() for v in values] if values is not None else None,
    )


def compile_decoder_layers(model: torch.nn.Module) -> None:
    """``torch.compile`` each decoder layer in place (dynamic token count, so packed
    batches of any size reuse one graph); the log-prob head stays chunked eager."""
    for layer in model.layers:
        layer.compile(dynamic=True)


class _PackedLogProbs(torch.nn.Module):
    """``model.packed_log_probs`` as a forward (for ``torch.func.functional_call``)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model.packed_log_probs(*args, **kwargs)


def as_float64(value):
    """A metric as float64: a detached device tensor stays on the device, a number stays a number."""
    return value.detach().double() if isinstance(value, torch.Tensor) else float(value)


def _local(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor: a DTensor (FSDP2's grad norm) becomes its full value."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def read_floats(values: dict) -> dict[str, float]:
    """``values`` with every tensor read to a Python float, all tensors in one host transfer."""
    tensors = {
        key: _local(v).detach().double().reshape(()) for key, v in values.items() if isinstance(v, torch.Tensor)
    }
    read = {}
    if tensors:
        devices = {t.device for t in tensors.values()}
        target = next(iter(devices))
        read = dict(zip(tensors, torch.stack([t.to(target) for t in tensors.values()]).tolist()))
    return {key: read[key] if key in read else float(v) for key, v in values.items()}


class NativeTrainer(TrainerBase):
    """Trains the policy in this process (CPU or one GPU)."""

    #: ``--offload-train``: the policy, reference model, critic and optimizers move to CPU
    can_offload_train_state = True
    #: the state is on the CPU now (between ``offload_train_state`` and ``onload_train_state``)
    train_state_offloaded = False
    #: why ``--optimizer-cpu-offload`` cannot work with this trainer (None: it can)
    cpu_offload_refusal: str | None = None
    #: LoRA: the frozen base linears are stored in the forward's autocast dtype (a trainer whose
    #: sharding wants one parameter dtype per module turns this off)
    stores_frozen_lora_bases_cast = True
    #: the ``--optimizer`` values this trainer builds
    optimizer_names: tuple[str, ...] = ("adam", "sgd")
    #: metrics of the last rollout's advantages (``opd/*`` with ``--use-opd``)
    advantage_metrics: dict[str, float] = {}

    def __init__(self, config: Any, manager: Any):
        self.config = config
        self.manager = manager
        self.device = resolve_device(config)
        routing = RoutingHooks(manager.hook)
        self.model = self.load_model(config.hf_checkpoint, routing)
        precision = manager.registries.precisions.get(config.precision)
        self.model = self.apply_precision(self.model, precision)
        self.convert_for_rollout = precision.convert_for_rollout
        # --lora-rank: adapters on the chosen linears, everything else frozen (before the optimizer is built)
        self.lora = apply_lora(self.model, config)
        if self.lora is not None and self.stores_frozen_lora_bases_cast:
            self._store_frozen_lora_bases_cast()
        if config.train_compile and config.true_on_policy:
            # compiled kernels would not compute what the engine's batch-invariant kernels do
            logger.warning("--train-compile is ignored with --true-on-policy (batch-invariant eager path)")
        elif config.train_compile:
            compile_decoder_layers(self.model)
        self.ref_model = None
        if config.use_kl_loss or config.kl_coef:
            self.ref_model = self.load_model(config.ref_load or config.hf_checkpoint, routing)
            self.ref_model.requires_grad_(False)
            manager.hook.miles_prepare_model(model=self.ref_model, role="ref", config=config)
        estimator = manager.registries.advantage_estimators.get(config.advantage_estimator)
        self.critic = None
        if estimator.needs_critic:
            from miles_host.critic import Critic

            self.critic = Critic(config, manager, self.device)
        self.estimator = estimator
        self.corrections = [c.fn for c in manager.registries.corrections if c.enabled(config)]
        self.loss_terms = [t for t in manager.registries.loss_terms if t.enabled(config)]
        # activation checkpointing: each decoder layer's activations are recomputed in backward
        self.model.gradient_checkpointing = config.recompute_granularity == "full"
        # plugins may attach modules (e.g. a draft head) before the optimizer sees the parameters
        manager.hook.miles_prepare_model(model=self.model, role="train", config=config)
        self._make_optimizer()
        self.consecutive_nan_steps = 0

    def _store_frozen_lora_bases_cast(self) -> None:
        """Under bf16 autocast (CUDA), LoRA's frozen base linears in bf16
        (:func:`miles_host.lora.layers.store_frozen_bases_in`: the same forward, no per-forward casts,
        half their memory)."""
        if self.device.type != "cuda":
            return
        store_frozen_bases_in(self.model, CUDA_AUTOCAST_DTYPE)

    def _make_optimizer(self, fused: bool | None = None) -> None:
        """The ``--optimizer`` over the model's parameters (no weight decay on biases and norms, as
        Megatron) and its learning-rate schedule (:mod:`miles_host.optimizer`)."""
        from miles_host.optimizer import build_optimizer

        config = self.config
        if config.optimizer not in self.optimizer_names:
            raise ValueError(f"--optimizer {config.optimizer}: the {type(self).__name__} builds "
                             f"{', '.join(self.optimizer_names)} only; give one of them")
        if config.optimizer_cpu_offload and self.cpu_offload_refusal:
            raise ValueError(f"--optimizer-cpu-offload: {self.cpu_offload_refusal}; drop the flag")
        self.optimizer = build_optimizer(
            self.model.named_parameters(), config,
            fused=self.device.type == "cuda" if fused is None else fused,
            cpu_offload=config.optimizer_cpu_offload,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))
        self.last_step_lr: float | None = None  # the learning rate of the last optimizer step taken

    def load_model(self, path: str, routing: RoutingHooks) -> torch.nn.Module:
        """The policy (and reference) model of an HF checkpoint directory, fp32 on
        the trainer's device. Other training backends override this: the rest of
        the trainer needs ``packed_log_probs``, ``config`` (native), ``parameters``
        and a native-named ``state_dict`` / ``load_state_dict`` from the model."""
        from miles_host.models import load_pretrained

        return load_pretrained(path, dtype=torch.float32, device=str(self.device), routing_hooks=routing)

    # -- forward passes -----------------------------------------------------

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=CUDA_AUTOCAST_DTYPE)
        return torch.autocast("cpu", enabled=False)

    def pack(self, samples: list[Sample], phase: str) -> PackedBatch:
        """Pack ``samples`` for a forward of ``phase`` (``old_logprob``, ``ref``,
        ``train``) and let plugins attach per-token data (``miles_train_batch_prepared``)."""
        batch = PackedBatch.from_samples(samples, self.device)
        batch.routing = RoutingContext(phase=phase)
        batch.model_config = self.model.config
        self.manager.hook.miles_train_batch_prepared(batch=batch, samples=samples, config=self.config)
        return batch

    def apply_precision(self, model: torch.nn.Module, precision: Any) -> torch.nn.Module:
        """The training model under the run's precision recipe (a backend with its own
        modules overrides this)."""
        if precision.prepare_train_model is None:
            return model
        return precision.prepare_train_model(model, self.config) or model

    def response_log_probs(self, model: torch.nn.Module, batch: PackedBatch, with_entropy: bool = False):
        """Log-probs ``[R]`` (and entropy) of the response tokens under ``model``."""
        from miles_host.models import PackedAttention

        ctx = ForwardContext(
            attention=PackedAttention(batch.cu_seqlens), routing=batch.routing,
            batch_invariant=bool(self.config.true_on_policy),
        )
        args = (batch.input_ids_T, batch.positions_T, batch.cu_seqlens, batch.target_ids_T)
        kwargs = dict(temperature=self.config.rollout_temperature or 1.0, ctx=ctx, return_entropy=with_entropy)
        if self.config.log_probs_chunk_size > 0:  # tokens per lm-head chunk (-1: the model's default)
            kwargs["chunk_size"] = self.config.log_probs_chunk_size
        engine_dtype = self._true_on_policy_dtype(model)
        if engine_dtype is not None:
            log_probs_T, entropy_T = self._forward_in_engine_dtype(model, engine_dtype, args, kwargs)
        else:
            with self._autocast():
                log_probs_T, entropy_T = model.packed_log_probs(*args, **kwargs)
        entropy = entropy_T[batch.response_index_R] if entropy_T is not None else None
        return log_probs_T[batch.response_index_R], entropy

    def _true_on_policy_dtype(self, model: torch.nn.Module) -> torch.dtype | None:
        """``--true-on-policy`` with an engine dtype other than the master weights' (bf16
        rollout, float32 master): the dtype the trainer's forward must compute in."""
        if not self.config.true_on_policy:
            return None
        from miles_host.devices import resolve_dtype

        dtype = resolve_dtype(self.config, self.device)
        master = next(model.parameters()).dtype
        return dtype if dtype != master else None

    @staticmethod
    def _forward_in_engine_dtype(model: torch.nn.Module, dtype: torch.dtype, args, kwargs):
        """The engine's dtype flow: weights cast as the engine loads them (router kept in
        float32 where the family says so), no autocast; gradients reach the master weights
        through the casts."""
        from miles_host.models.loading import cast_like_loaded

        wrapper = _PackedLogProbs(model)
        tensors = {f"model.{name}": tensor for name, tensor in cast_like_loaded(model, dtype).items()}
        with torch.autocast(next(model.parameters()).device.type, enabled=False):
            return torch.func.functional_call(wrapper, tensors, args, kwargs, tie_weights=True, strict=False)

    @torch.no_grad()
    def _log_probs_without_grad(self, model, samples: list[Sample], phase: str) -> list[torch.Tensor]:
        out = []
        with profiling.region("train_log_probs"):  # --profile-target train_log_probs
            for micro in self._forward_micro_batches(model, samples):
                if micro is None:
                    self._placeholder_pass(phase)
                    continue
                batch = self.pack(micro, phase)
                log_probs, _ = self.response_log_probs(model, batch)
                out.extend(torch.split(log_probs.float(), batch.response_lengths))
        return out

    def _forward_micro_batches(self, model, samples: list[Sample]) -> list:
        """The micro-batches of a pass of ``model`` over ``samples``. A sharded trainer pads
        them with ``None`` (a pass that only joins the collectives) to the longest rank's."""
        return micro_batches(samples, self.config) if samples else []

    def _placeholder_pass(self, phase: str) -> None:
        raise NotImplementedError  # only sharded trainers pad their micro-batches

    # -- one rollout's training ------------------------------------------------

    def advantages(self, samples: list[Sample], ref_log_probs, old_log_probs, values=None):
        """Per-token advantages (and value targets) from the registry's estimator."""
        if self.config.disable_compute_advantages_and_returns or self.config.loss_type == "sft_loss":  # not read: zero
            return [torch.zeros(s.response_length) for s in samples], None
        inputs = advantage_inputs(samples, ref_log_probs, old_log_probs, values, self.config)
        penalties = None
        if self.config.use_opd:  # on-policy distillation: the teacher's reverse KL leaves the advantages
            from miles_host.opd.penalty import opd_penalties

            penalties, self.advantage_metrics = opd_penalties(samples, old_log_probs, self.config)
        outputs = compute_advantages(self.estimator, inputs, self.config,  # whitening, value targets: the record's
                                     token_penalties=penalties)
        return outputs.advantages, outputs.returns

    def rank_counters(self) -> dict[str, float]:
        """This process's plugin counters of the step (:func:`~miles_host.hookspecs.miles_rank_counters`)."""
        return self.manager.rank_counters(self.config)

    # -- phases (--offload-train, --colocate) --------------------------------------

    def offload_train_state(self) -> None:
        """Parameters, gradients and optimizer state to CPU for the rollout phase."""
        offload.offload_train_state(self)

    def onload_train_state(self) -> None:
        """Back on the trainer's device before training (no-op unless offloaded)."""
        offload.onload_train_state(self)

    def empty_device_cache(self) -> None:
        """Hand the allocator's free blocks back to the device (a colocated engine resumes)."""
        offload.empty_device_cache(self.device)

    def optimizer_steps(self) -> int:
        """Optimizer steps taken (the learning-rate schedule counts each one)."""
        return int(self.scheduler.last_epoch)

    def train(self, samples: list[Sample]) -> dict[str, float]:
        """Train on one rollout's samples; returns ``train/*`` metrics."""
        if self.config.true_on_policy and self.device.type != "cuda":
            # the per-token graph's backward too: tiny ops, one CPU thread is faster
            from miles_host.models.batch_invariant import single_threaded

            with single_threaded():
                return self._train(samples)
        return self._train(samples)

    def _train(self, samples: list[Sample]) -> dict[str, float]:
        samples = [s for s in samples if trainable(s)]
        if not samples:
            return {"train/skipped_no_samples": 1.0}
        sizes = step_sizes(len(samples), self.config)
        self.model.eval()
        old = None  # None: the training forward's own log-probs, detached, are the old policy's
        if self._needs_old_logprob_pass(len(sizes) == 1):
            old = self._log_probs_without_grad(self.model, samples, "old_logprob")
        ref = self._log_probs_without_grad(self.ref_model, samples, "ref") if self.ref_model is not None else None
        values = self._critic_values(samples) if self.critic is not None else None
        advantages, returns = self.advantages(samples, ref, old, values)
        for i, sample in enumerate(samples):
            sample.metadata["_train_index"] = i
        self.model.train()
        metrics: dict[str, list[float]] = {}
        start = 0
        for size in sizes:
            chunk = samples[start : start + size]
            start += size
            step_metrics = self._optimizer_step(chunk, old, ref, advantages)
            if self.critic is not None:
                step_metrics.update(self._critic_step(chunk, values, returns))
            for key, value in step_metrics.items():
                metrics.setdefault(key, []).append(value)
        return self._rollout_metrics(samples, metrics)

    def _needs_old_logprob_pass(self, one_optimizer_step: bool) -> bool:
        """Whether old log-probs must be computed before training. With one optimizer step
        per rollout the weights do not change before every sample's loss is taken, so the
        old policy's log-probs are the training forward's own (detached; TRL does the same),
        unless a KL-shaped reward needs them for the advantages or ``--old-logprob-pass
        always`` (plugins that record routes in that pass, R2, set it)."""
        if self.config.old_logprob_pass == "always" or not one_optimizer_step:
            return True
        if self.config.use_opd and not self.config.use_rollout_logprobs:  # the OPD penalty reads them
            return True
        return bool(self.config.kl_coef and self.ref_model is not None)

    def _rollout_metrics(self, samples: list[Sample], metrics: dict[str, list[float]]) -> dict[str, float]:
        """Mean of each metric over the rollout's optimizer steps (and drop the batch indices)."""
        for sample in samples:
            sample.metadata.pop("_train_index", None)
        out = {key: sum(values) / len(values) for key, values in metrics.items()}
        if self.lora is not None:
            out.update(self.lora.metrics())
        out.update(self.advantage_metrics)
        if self.last_step_lr is not None:
            out["train/lr"] = self.last_step_lr
        return out

    def _optimizer_step(self, samples, old, ref, advantages) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        step_masks = [s.loss_mask for s in samples]
        # sums stay on the device (float64, the same arithmetic as Python floats): the host
        # reads them once per step, so it keeps queueing micro-batches instead of waiting
        metrics: dict[str, torch.Tensor | float] = {}
        loss_sum: torch.Tensor | float = 0.0
        for micro in micro_batches(samples, self.config):
            loss, micro_metrics = self._micro_loss(micro, old, ref, advantages)
            micro_masks = [s.loss_mask for s in micro]
            share = micro_batch_share(self.config, micro_masks, step_masks)
            (loss * share).backward()
            loss_sum = loss_sum + as_float64(loss) * share
            metric_share = micro_batch_share(self.config, micro_masks, step_masks, for_metrics=True)
            for key, value in micro_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + as_float64(value) * metric_share
        return self._clip_and_step({f"train/{key}": value for key, value in metrics.items()}, loss_sum)

    def _clip_grads(self) -> torch.Tensor:
        """Clip the gradients to ``--clip-grad``; the norm before clipping (a backend with its
        own gradient reductions overrides this)."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad)

    def _clip_and_step(self, out: dict, loss_sum) -> dict[str, float]:
        """Clip gradients and step, or skip the step (and count it) on a NaN/Inf loss or norm.
        ``out`` and ``loss_sum`` may hold device tensors: they are read here, in one sync."""
        grad_norm = self._clip_grads()
        out = read_floats({**out, "train/loss": loss_sum, "train/grad_norm": grad_norm})
        loss_sum = out["train/loss"]
        if not (math.isfinite(loss_sum) and math.isfinite(out["train/grad_norm"])):
            self.optimizer.zero_grad(set_to_none=True)
            self.consecutive_nan_steps += 1
            out["train/nan_step_skipped"] = 1.0
            return out
        self.consecutive_nan_steps = 0
        self.last_step_lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        return out

    @torch.no_grad()
    def _critic_values(self, samples: list[Sample]) -> list[torch.Tensor]:
        """``V_old`` per sample (``[L_i]``) before this rollout's updates."""
        self.critic.eval()
        out = []
        for micro in micro_batches(samples, self.config):
            batch = PackedBatch.from_samples(micro, self.device)
            out.extend(torch.split(self.critic.values(batch), batch.response_lengths))
        return out

    def _critic_step(self, samples, values, returns) -> dict[str, float]:
        """One critic optimizer step on the clipped value loss."""
        self.critic.train()
        self.critic.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        for micro in micro_batches(samples, self.config):
            batch = PackedBatch.from_samples(micro, self.device)
            indices = [s.metadata["_train_index"] for s in micro]
            cat = lambda parts: torch.cat([parts[i] for i in indices]).to(self.device).float()  # noqa: E731
            loss_mask = batch.per_token((s.loss_mask for s in micro), self.device)
            loss, micro_metrics = self.critic.loss(batch, cat(values), cat(returns), loss_mask)
            micro_masks, step_masks = [s.loss_mask for s in micro], [s.loss_mask for s in samples]
            share = micro_batch_share(self.config, micro_masks, step_masks)
            (loss * share).backward()
            metric_share = micro_batch_share(self.config, micro_masks, step_masks, for_metrics=True)
            for key, value in micro_metrics.items():
                share_of = share if key == "value_loss" else metric_share  # the loss sums as the loss does
                metrics[f"critic/{key}"] = metrics.get(f"critic/{key}", 0.0) + value * share_of
        grad_norm = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.config.clip_grad)
        metrics["critic/grad_norm"] = float(grad_norm)
        if math.isfinite(float(grad_norm)):
            self.critic.optimizer.step()
        return metrics

    def _micro_loss(self, micro, old, ref, advantages):
        batch = self.pack(micro, "train")
        indices = [s.metadata["_train_index"] for s in micro]
        log_probs, entropy = self.response_log_probs(self.model, batch, with_entropy=bool(self.config.entropy_coef))
        cat = lambda parts: host_to_device(torch.cat([parts[i] for i in indices]), self.device)  # noqa: E731
        loss_batch = PolicyLossBatch(
            log_probs=log_probs.float(),
            advantages=cat(advantages).float(),
            loss_mask=batch.per_token((s.loss_mask for s in micro), self.device),
            response_lengths=batch.response_lengths,
            old_log_probs=cat(old) if old is not None else None,
            rollout_log_probs=(batch.per_token((s.rollout_log_probs for s in micro), self.device)
                               if all(s.rollout_log_probs is not None for s in micro) else None),  # SFT data: none
            ref_log_probs=cat(ref) if ref is not None else None,
            entropy=entropy.float() if entropy is not None else None,
        )
        loss, metrics = micro_batch_loss(self, batch, loss_batch)  # --loss-type
        metrics = dict(metrics)
        old_B = cat(old) if old is not None else log_probs.detach().float()
        if loss_batch.rollout_log_probs is not None:
            metrics.update(mismatch_metrics(old_B, loss_batch.rollout_log_probs, loss_batch.loss_mask))
        if keeps_train_log_probs(self.config):  # the dashboard's heat map, --save-debug-train-data
            record_train_log_probs(micro, old_B, batch.response_lengths)
        for term in self.loss_terms:
            outputs = {"batch": batch, "log_probs": log_probs, "model": self.model}
            extra, term_metrics = term.fn(outputs, loss_batch, self.config)
            loss = loss + extra
            metrics.update({f"{term.name}/{k}": v for k, v in term_metrics.items()})
        metrics.pop("loss", None)
        return loss, metrics

    # -- weights and state ----------------------------------------------------

    def named_weights_for_rollout(self):
        """``(name, tensor)`` pairs the rollout engine loads (LoRA as ``--lora-sync`` says: merged, or base
        and adapters), after the precision's conversion."""
        named = [(name, tensor.detach()) for name, tensor in rollout_state(self.model, None, self.config).items()]
        return self.convert_for_rollout(named, self.config) if self.convert_for_rollout else named

    def state_dict(self) -> dict:
        """Model, optimizer and scheduler state for checkpoints."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "consecutive_nan_steps": self.consecutive_nan_steps,
            "critic": self.critic.checkpoint_state() if self.critic is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.consecutive_nan_steps = state.get("consecutive_nan_steps", 0)
        if self.critic is not None and state.get("critic") is not None:
            self.critic.load_checkpoint_state(state["critic"])
