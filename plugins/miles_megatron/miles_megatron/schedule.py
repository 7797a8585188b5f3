"""The megatron trainer's passes on Megatron-Core's schedules, DDP and gradient finalisation.

Training step (:func:`train_step`), one optimizer step of the host trainer:

- **Data parallelism.** The step's samples are dealt to the DP ranks (the rollout's sample
  ``i`` to rank ``i mod DP``); each rank makes its own micro-batches of them (``--micro-batch-size``, or
  ``--max-tokens-per-gpu`` with the dynamic batch size: the limit is per rank). Every DP
  rank runs as many micro-batches as the one with most (the others repeat one with a
  zero share: collectives of MoE layers span DP ranks), and where EP > 1 every micro-batch
  index has one padded ``[S, B]`` shape on all DP ranks (Megatron's all-gather token
  dispatcher gathers equal shapes; the padding is extra positions and all-padding
  sequences, which no real token attends to and no loss reads).
- **Schedule.** ``megatron.core.pipeline_parallel.get_forward_backward_func()``: no
  pipelining at PP 1, 1F1B at PP > 1, interleaved 1F1B over the rank's model chunks with
  virtual pipeline stages (each chunk reads every micro-batch from its own iterator; the
  micro-batches padded with zero-share copies to a multiple of PP, the schedule's group, and
  all given the step's largest ``[S, B]``: its shape exchange pairs messages by order, which
  at PP 2, where the previous and the next rank are one peer, can cross the two directions'
  shapes, harmless when they are equal), with ``forward_step`` running the chunk it is given
  (:meth:`~miles_megatron.policy.MegatronPolicy.running_chunk`; the first stage embeds, a
  later one reads what the schedule received) and, on the last stage, the host's micro-batch loss (:meth:`~miles_host.trainer.NativeTrainer._micro_loss`)
  times the host's share of it in the step
  (:func:`~miles_host.algorithms.losses.micro_batch_share`, over the whole step's samples,
  every DP rank's). So the shares sum to the step's loss whatever the layout, and
  Megatron is told to neither divide by the micro-batch count nor average over DP
  (``calculate_per_token_loss``: its schedules keep the loss as given, its DDP sums).
  Variable-length micro-batches: ``variable_seq_lengths`` (the stages exchange shapes;
  Megatron refuses it for the all-gather dispatcher at construction because ranks of the
  EP group could hold different token counts, which the shared padded shape rules out).
- **Gradients.** The model is wrapped in Megatron's ``DistributedDataParallel``
  (contiguous fp32 gradient buffers; reduced once after the last micro-batch's backward,
  or with ``--overlap-grad-reduce`` bucket by bucket during it, as the buckets' gradients
  are complete: Megatron's ``no_sync`` / ``start_grad_sync`` given to the schedule), then
  ``finalize_model_grads`` (which waits for those reductions): the DP
  (dense) and expert-DP (experts, marked ``allreduce=False``) sums, the TP sums of the
  per-head q/k norms and of sequence-parallel norms and routers, the tied embedding's
  first/last-stage sum. Two layout facts Megatron's local (non-TransformerEngine) spec
  leaves to the caller: each expert receives every token of its EP group from each TP
  rank holding it (:func:`~miles_megatron.parallel.expert_batch_copies`; divided out),
  and MLA's latent query norm sees the whole latent on every TP rank without sequence
  parallelism (marked ``average_gradients_across_tp_domain``: averaged, not summed).
  The reduced gradients become the parameters' ``.grad`` for the host's clipping and
  optimizer.
- **Metrics.** Computed where the loss is (last stage); summed over DP ranks (TP and CP ranks
  of the last stage hold the same values, one counts) and returned on every rank.
- **Context parallelism** (:mod:`miles_megatron.context_parallel`): the CP ranks of a DP rank
  run the same micro-batches, each on its rows of every sequence; the last stage gathers
  the rows, so each CP rank computes the whole loss and backpropagates ``1 / CP`` of it
  (DDP sums the dense gradients over DP x CP).

Forward-only passes (:func:`log_probs_without_grad`: old and reference log-probs) run the
same schedule with ``forward_only``, each DP rank on its samples (dealt by their index in
the rollout, as the training steps deal them, so R2's routes are recorded on the rank
that trains the sample); the last stage broadcasts the log-probs over the pipeline group
(and each stage's captured routes are shared,
:func:`~miles_megatron.pipeline.share_captured_routes`), then the DP ranks all-gather them.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

_EXPERT = re.compile(r"\.local_experts\.\d+\.")


@dataclass
class MicroBatch:
    """One micro-batch of a step: its samples, their share of the step's loss and metrics,
    and the smallest padded ``(S, B)`` of its forward."""

    samples: list
    share: float
    metric_share: float
    pad_to: tuple[int, int] = (0, 0)
    #: a copy run only to keep the DP ranks' collectives in step (its outputs are dropped)
    filler: bool = False


# -- the model ----------------------------------------------------------------------


def configure_schedule(config: Any) -> None:
    """The ``TransformerConfig`` settings the schedules read (see module doc): shapes sent
    between stages per micro-batch, plain send/recv (gloo has no batched p2p), the loss as
    the host gives it."""
    config.variable_seq_lengths = True
    config.batch_p2p_comm = False
    config.calculate_per_token_loss = True
    config.deallocate_pipeline_outputs = False
    config.finalize_model_grads_func = None


def wrap_ddp(gpt: torch.nn.Module, overlap_grad_reduce: bool = False,
             distributed_optimizer: bool = False) -> torch.nn.Module:
    """``gpt`` in Megatron's ``DistributedDataParallel`` (see module doc); ``overlap_grad_reduce``:
    the reduction overlaps the last micro-batch's backward (``--overlap-grad-reduce``);
    ``distributed_optimizer``: the buffers laid out for Megatron's distributed optimizer
    (gradients reduce-scattered over DP, parameters all-gathered after its step;
    :mod:`miles_megatron.megatron_optimizer`)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from miles_megatron.grouped_experts import GroupedSequentialMLP

    for name, param in gpt.named_parameters():
        if _EXPERT.search(f".{name}"):
            param.allreduce = False  # reduced over the expert-data-parallel group
        if gpt.config.multi_latent_attention and not gpt.config.sequence_parallel and "q_layernorm" in name:
            param.average_gradients_across_tp_domain = True
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=distributed_optimizer,
        average_in_collective=False,
    )
    for module in gpt.modules():  # (the DDP's hooks count every parameter only when the reduction overlaps)
        if isinstance(module, GroupedSequentialMLP):
            module.weight_grads_into_main_grad = not overlap_grad_reduce
    return DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)


def wrap_ddp_chunks(chunks: list[torch.nn.Module], overlap_grad_reduce: bool = False,
                    distributed_optimizer: bool = False) -> list[torch.nn.Module]:
    """Each model chunk of a rank (one without virtual pipeline stages) in :func:`wrap_ddp`;
    with ``overlap_grad_reduce`` the schedule holds each chunk's reduction back until its last
    micro-batch (Megatron's ``no_sync`` / ``start_grad_sync``, one per chunk under virtual stages)."""
    wrapped = [wrap_ddp(chunk, overlap_grad_reduce, distributed_optimizer) for chunk in chunks]
    if overlap_grad_reduce:
        config = chunks[0].config  # the schedules read the first chunk's
        if len(wrapped) == 1:
            config.no_sync_func, config.grad_sync_func = wrapped[0].no_sync, wrapped[0].start_grad_sync
        else:
            config.no_sync_func = [ddp.no_sync for ddp in wrapped]
            config.grad_sync_func = [ddp.start_grad_sync for ddp in wrapped]
    return wrapped


# -- micro-batches ----------------------------------------------------------------------


def _is_last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage()


def _dp_share(samples: list, sizes: Any, index_of: Callable[[int, Any], int]) -> list:
    """The samples of this DP rank: those whose index (``index_of(position, sample)``) is
    this rank's modulo DP."""
    if sizes.dp == 1:
        return samples
    from megatron.core import parallel_state as ps

    rank = ps.get_data_parallel_rank()
    return [sample for i, sample in enumerate(samples) if index_of(i, sample) % sizes.dp == rank]


def _in_step(micros: list[MicroBatch], samples: list, sizes: Any, chunks: int = 1) -> list[MicroBatch]:
    """``micros`` padded to the DP ranks' longest count with zero-share fillers (``filler``),
    and where EP > 1 given each index's largest shape over the DP ranks (see module doc); with
    ``chunks`` > 1 (virtual pipeline stages) to a multiple of the pipeline size, as the
    interleaved schedule runs micro-batches in groups of that many, each padded to the step's
    largest shape."""
    count = len(micros)
    if sizes.dp > 1:
        from megatron.core import parallel_state as ps

        largest = torch.tensor([count], dtype=torch.long)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        count = int(largest)
    if chunks > 1:
        count = max(sizes.pp, -(-count // sizes.pp) * sizes.pp)
    filler = micros[0].samples if micros else samples[:1]
    micros = micros + [MicroBatch(filler, 0.0, 0.0, filler=True) for _ in range(count - len(micros))]
    if sizes.dp > 1 and sizes.ep > 1:
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group()  # the MoE token exchange spans DP ranks: one shape per micro-batch index
        shapes = torch.tensor([[max(len(s.tokens) for s in m.samples), len(m.samples)] for m in micros],
                              dtype=torch.long)
        dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=group)
        for micro, shape in zip(micros, shapes.tolist()):
            micro.pad_to = (shape[0], shape[1])
    if chunks > 1:  # one shape for the step (see module doc)
        shape = (max(max(len(s.tokens) for s in m.samples) for m in micros), max(len(m.samples) for m in micros))
        for micro in micros:
            micro.pad_to = (max(micro.pad_to[0], shape[0]), max(micro.pad_to[1], shape[1]))
    return micros


def batching_config(config: Any, sizes: Any) -> Any:
    """The config the host's micro-batching reads: under context parallelism a micro-batch's
    sequences are split over the CP group, so ``--max-tokens-per-gpu`` (per GPU) allows
    ``max_tokens_per_gpu * CP`` tokens a micro-batch (slime's budget)."""
    if sizes.cp == 1 or not config.max_tokens_per_gpu:
        return config
    scaled = copy.copy(config)
    scaled.max_tokens_per_gpu = config.max_tokens_per_gpu * sizes.cp
    return scaled


def data_parallel_micro_batches(samples: list, config: Any, sizes: Any, chunks: int = 1) -> list[MicroBatch]:
    """This DP rank's micro-batches of one optimizer step (see module doc): its samples by
    their index in the rollout (``_train_index``, as the forward-only passes deal them);
    ``chunks``: the model chunks of each rank (see :func:`_in_step`)."""
    from miles_host.algorithms.losses import micro_batch_share
    from miles_host.trainer import micro_batches

    step_masks = [s.loss_mask for s in samples]
    mine = _dp_share(samples, sizes, lambda i, sample: sample.metadata["_train_index"])
    micros = [
        MicroBatch(micro, micro_batch_share(config, [s.loss_mask for s in micro], step_masks),
                   micro_batch_share(config, [s.loss_mask for s in micro], step_masks, for_metrics=True))
        for micro in (micro_batches(mine, batching_config(config, sizes)) if mine else [])
    ]
    return _in_step(micros, samples, sizes, chunks)


def _run(chunks: list[torch.nn.Module], forward_step: Callable, micros: list[MicroBatch], tp: int,
         forward_only: bool) -> None:
    """Megatron's schedule over the rank's model chunks (the interleaved one where there are
    several: each chunk reads every micro-batch from its own iterator)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = iter(micros) if len(chunks) == 1 else [iter(micros) for _ in chunks]
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=list(chunks),
        num_microbatches=len(micros), seq_length=tp, micro_batch_size=1, forward_only=forward_only,
    )


def _keep(output: torch.Tensor):
    """A last stage's ``loss_func``: the output as the loss, unscaled (see module doc)."""
    return output, torch.ones((), dtype=torch.int), {}


def _not_last_stage(output: torch.Tensor):
    raise RuntimeError("loss_func runs on the last pipeline stage only")


# -- the passes ---------------------------------------------------------------------


def train_step(trainer: Any, samples: list, old, ref, advantages) -> tuple[dict[str, float], float]:
    """One optimizer step's forward and backward (see module doc); the gradients are reduced
    and on ``.grad``. Returns the step's ``train/*`` metric sums and loss (every rank)."""
    from megatron.core.distributed import finalize_model_grads

    from miles_host.trainer import as_float64, read_floats
    from miles_megatron.grouped_experts import expert_stacks_reused
    from miles_megatron.parallel import expert_batch_copies
    from miles_megatron.runtime import on_device

    policy, chunks, sizes = trainer.model, trainer.ddp_chunks, trainer.sizes
    trainer.optimizer.zero_grad(set_to_none=True)
    for ddp in chunks:
        ddp.zero_grad_buffer()
    micros = data_parallel_micro_batches(samples, trainer.config, sizes, len(chunks))
    last = _is_last_stage()
    sums: dict[str, Any] = {}

    def forward_step(data_iterator, model):
        micro = next(data_iterator)
        policy.pad_to = micro.pad_to
        policy.running_chunk(model)
        if not policy.chunk.post_process:
            batch = trainer.pack(micro.samples, "train")
            with trainer._autocast():
                return policy.stage_forward(batch), _not_last_stage
        loss, metrics = trainer._micro_loss(micro.samples, old, ref, advantages)
        sums["train/loss"] = sums.get("train/loss", 0.0) + as_float64(loss) * micro.share
        for key, value in metrics.items():
            key = f"train/{key}"
            sums[key] = sums.get(key, 0.0) + as_float64(value) * micro.metric_share
        # (every CP rank computes the loss over whole sequences: each backpropagates 1 / CP of it)
        return loss * (micro.share / sizes.cp), _keep

    recompute = policy.gpt.config.recompute_granularity is not None
    policy.replay.keep_for_recompute(policy.gpt.config.recompute_granularity == "full")
    with on_device(trainer.device), expert_stacks_reused(enabled=not recompute):
        try:
            _run(chunks, forward_step, micros, sizes.tp, forward_only=False)
        finally:
            policy.pad_to = (0, 0)
            policy.running = 0
            policy.replay.keep_for_recompute(False)
        finalize_model_grads(chunks)
    copies = expert_batch_copies(sizes, bool(policy.gpt.config.sequence_parallel))
    for chunk in policy.chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if copies > 1 and _EXPERT.search(f".{name}"):
                param.main_grad.div_(copies)
            param.grad = param.main_grad
    from megatron.core import parallel_state as ps

    contributes = last and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    totals = _sum_over_ranks(read_floats(sums) if contributes else None, sizes)
    loss_sum = totals.pop("train/loss", 0.0)
    return totals, loss_sum


def _sum_over_ranks(values: dict[str, float] | None, sizes: Any) -> dict[str, float]:
    """The sum of every contributing rank's ``values`` (None: not contributing), on every rank."""
    if not sizes.parallel:
        return values or {}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    total: dict[str, float] = {}
    for part in gathered:
        for key, value in (part or {}).items():
            total[key] = total.get(key, 0.0) + value
    return total


@torch.no_grad()
def log_probs_without_grad(trainer: Any, policy: Any, samples: list, phase: str) -> list[torch.Tensor]:
    """Per-sample response log-probs under ``policy`` (the trainer's or the reference model),
    on every rank (see module doc)."""
    from miles_host.trainer import micro_batches
    from miles_megatron.grouped_experts import expert_stacks_reused
    from miles_megatron.pipeline import current_stage, share_captured_routes
    from miles_megatron.runtime import on_device

    sizes = trainer.sizes
    if not samples:
        return []
    mine = list(range(len(samples)))
    mine = _dp_share(mine, sizes, lambda i, index: index)  # positions: the rollout's sample indices
    micros = [MicroBatch(micro, 0.0, 0.0)
              for micro in micro_batches([samples[i] for i in mine], batching_config(trainer.config, sizes))]
    micros = _in_step(micros, samples, sizes, len(policy.chunks))
    last = _is_last_stage()
    out: list[torch.Tensor] = []
    batches = []
    packed: dict[int, Any] = {}

    def forward_step(data_iterator, model):
        micro = next(data_iterator)
        policy.pad_to = micro.pad_to
        policy.running_chunk(model)
        batch = packed.get(id(micro))
        if batch is None:  # packed once: the rank's chunks capture their routes into one routing context
            batch = packed[id(micro)] = trainer.pack(micro.samples, phase)
            batches.append(batch)
        if not policy.chunk.post_process:
            with trainer._autocast():
                return policy.stage_forward(batch), _not_last_stage
        log_probs, _ = trainer.response_log_probs(policy, batch)
        if not micro.filler:
            out.extend(torch.split(log_probs.float(), batch.response_lengths))
        return log_probs.new_zeros(()), lambda output: (output, {})

    recompute = policy.gpt.config.recompute_granularity is not None  # (then only each layer's stacks are held at once)
    with on_device(trainer.device), expert_stacks_reused(enabled=not recompute):
        try:
            _run(policy.chunks, forward_step, micros, sizes.tp, forward_only=True)
        finally:
            policy.pad_to = (0, 0)
            policy.running = 0
    if sizes.pp > 1:  # the last stage's values on every stage
        stage = current_stage()
        carried = [[t.cpu() for t in out] if last else None]
        dist.broadcast_object_list(carried, src=stage.last_rank, group=stage.group)
        out = carried[0]
        if policy.replay.routing_hooks.active:  # every stage's captured routes on every rank
            for batch in batches:
                share_captured_routes(batch.routing, stage, trainer.device)
    if sizes.dp == 1:
        return out
    from megatron.core import parallel_state as ps

    shares: list[Any] = [None] * sizes.dp
    dist.all_gather_object(shares, (mine, [t.cpu() for t in out]), group=ps.get_data_parallel_group())
    full: list[Any] = [None] * len(samples)
    for indices, values in shares:
        for index, value in zip(indices, values):
            full[index] = value.to(trainer.device)
    return full
