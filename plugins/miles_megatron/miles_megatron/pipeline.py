"""Pipeline parallelism (PP) of the megatron backend (``--pipeline-model-parallel-size N``).

``N`` trainer processes, one pipeline stage each, or ``N * TP * DP`` with each
stage sharded as :mod:`miles_megatron.parallel` describes (Megatron's DP replicas, if
EP needs them, on the same batch: every rank sees the whole batch), started as the host's trainer group like TP/EP. A rank
talks to its own pipeline group (the same TP/EP rank of every stage); under sequence
parallelism the stages pass on this TP rank's sequence shard.

Stages. Megatron's ``parallel_state`` gets the pipeline size; each rank builds
``GPTModel(pre_process=first stage, post_process=last stage)``, whose decoder holds a
contiguous slice of ``num_layers / N`` layers (Megatron's layer offset; the module
names are local, ``decoder.layers.{i}``, each layer's ``layer_number`` global, so the
MoE routers and R3's replayed ids are keyed by global layer index,
:func:`miles_megatron.replay.moe_routers`). The embedding lives on the first stage,
the final norm and output layer on the last. With tied embeddings the last stage
holds a copy of the word embedding as its output weight (Megatron's layout).

Weights (:func:`stage_state`, :func:`gather_stages`): a rank loads its stage's layers
from the full Megatron-named state, renumbered to local indices (the tied copy from
the embedding), then its TP/EP shard of them (:func:`miles_megatron.parallel.rank_state`);
the inverse renumbers back to global indices and all-gathers over the
pipeline group, the tied copy dropped (the first stage's embedding is the weight), so
every rank, rank 0 among them, gets the complete model for export and checkpoints.

Training step (:func:`pipelined_log_probs`). Every stage runs the host trainer's loop
in lockstep over the same micro-batches; a forward is, per micro-batch:

- the first stage embeds, a later stage receives the previous stage's output
  (:class:`_FromPreviousStage`; its backward sends the gradient back);
- a non-last stage sends its output on (:class:`_ToNextStage`, whose backward receives
  the next stage's gradient of it) and gets back an empty token tied to its graph;
- the last stage computes the log-probs (and entropy) with the host's
  ``chunked_log_probs`` and broadcasts them over the pipeline group; the other stages
  receive them through :class:`_FromLastStage`, attached to their token.

So every stage computes the same loss and metrics, and ``loss.backward()`` on a
non-last stage reaches, through the token, the receive of the next stage's gradient,
which drives its own layers' backward. The schedule is the simplest correct one: each
micro-batch's whole forward, then its whole backward, no interleaving (a stage idles
while the others compute).

Gradients (:func:`reduce_tied_embedding_grads`): the tied embedding's two copies get
the sum of their gradients over the embedding group (first and last stage), as
Megatron's ``finalize_model_grads`` does, so AdamW keeps them equal; the clipping norm
sums every stage's gradients, the tied copy counted once
(:func:`miles_megatron.parallel.clip_grad_norm`).

Routes observed in a forward (R2's recording, ``RoutingContext.captured``) exist on
the stage that owns the layer: :func:`share_captured_routes` all-gathers them, so every
rank's routing plugin sees every MoE layer's ids.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
#: names that exist on the first stage only / on the last stage only
_FIRST_ONLY = ("embedding.",)
_LAST_ONLY = ("decoder.final_layernorm.", "output_layer.")
TIED_COPY = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class Stage:
    """This rank's place in the pipeline (ranks are global ranks)."""

    index: int
    size: int
    group: Any
    ranks: tuple[int, ...]

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    @property
    def previous_rank(self) -> int:
        return self.ranks[self.index - 1]

    @property
    def next_rank(self) -> int:
        return self.ranks[self.index + 1]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]


def current_stage() -> Stage:
    """This rank's stage, from Megatron's ``parallel_state``."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    return Stage(ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(), group,
                 tuple(dist.get_process_group_ranks(group)))


def check_layers(num_layers: int, pp: int) -> None:
    """Each stage owns ``num_layers / pp`` layers: refuse sizes that do not divide."""
    if num_layers % pp:
        raise ValueError(
            f"--pipeline-model-parallel-size {pp}: the model's {num_layers} decoder layers do not split evenly "
            f"over {pp} stages; use a pipeline size that divides {num_layers}"
        )


# -- weights ------------------------------------------------------------------------


def global_layer_ids(gpt: torch.nn.Module) -> dict[int, int]:
    """``{local index: global index}`` of this stage's decoder layers (0-based)."""
    return {local: int(layer.layer_number) - 1 for local, layer in enumerate(gpt.decoder.layers)}


def tied_output_copy(gpt: torch.nn.Module) -> torch.nn.Parameter | None:
    """The last stage's copy of a tied word embedding (None where the stage has none)."""
    if gpt.share_embeddings_and_output_weights and gpt.post_process and not gpt.pre_process:
        return gpt.output_layer.weight
    return None


def _renumber(name: str, ids: Mapping[int, int]) -> str | None:
    """``name`` with its decoder-layer index mapped through ``ids`` (None: not in ``ids``)."""
    match = _LAYER.match(name)
    if match is None:
        return name
    index = ids.get(int(match.group(1)))
    return None if index is None else f"decoder.layers.{index}.{match.group(2)}"


def stage_state(full: Mapping[str, torch.Tensor], gpt: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This stage's part of a full Megatron-named state, layers renumbered to local indices."""
    to_local = {g: local for local, g in global_layer_ids(gpt).items()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        if (name.startswith(_FIRST_ONLY) and not gpt.pre_process) or (
                name.startswith(_LAST_ONLY) and not gpt.post_process):
            continue
        local = _renumber(name, to_local)
        if local is not None:
            out[local] = tensor
    if tied_output_copy(gpt) is not None:
        out[TIED_COPY] = full[EMBEDDING]
    return out


def gather_stages(local: Mapping[str, torch.Tensor], gpt: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full Megatron-named state from every stage's part (a collective of the pipeline
    group; every rank gets the whole state)."""
    stage = current_stage()
    to_global = global_layer_ids(gpt)
    mine = {_renumber(name, to_global): tensor.detach() for name, tensor in local.items()
            if not (name == TIED_COPY and tied_output_copy(gpt) is not None)}
    layouts: list[Any] = [None] * stage.size
    dist.all_gather_object(layouts, [(name, tuple(t.shape), t.dtype) for name, t in mine.items()], group=stage.group)
    device = next(iter(mine.values())).device if mine else torch.device("cpu")
    out: dict[str, torch.Tensor] = {}
    for index, layout in enumerate(layouts):
        for dtype in sorted({dtype for _, _, dtype in layout}, key=str):
            entries = [(name, shape) for name, shape, d in layout if d == dtype]
            if index == stage.index:
                flat = torch.cat([mine[name].reshape(-1) for name, _ in entries])
            else:
                flat = torch.empty(sum(_numel(shape) for _, shape in entries), dtype=dtype, device=device)
            dist.broadcast(flat, stage.ranks[index], group=stage.group)
            for (name, shape), part in zip(entries, flat.split([_numel(shape) for _, shape in entries])):
                out[name] = part.view(shape)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


# -- gradients ------------------------------------------------------------------------


def reduce_tied_embedding_grads(gpt: torch.nn.Module) -> None:
    """Sum the tied embedding's gradient over its first- and last-stage copies (ranks of
    the embedding group call it; the others return)."""
    from megatron.core import parallel_state as ps

    if not gpt.share_embeddings_and_output_weights or not (gpt.pre_process or gpt.post_process):
        return
    weight = gpt.shared_embedding_or_output_weight()
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=ps.get_embedding_group())


# -- the training step ------------------------------------------------------------------


class _FromPreviousStage(torch.autograd.Function):
    """Forward: the previous stage's output; backward: its gradient sent back there.
    ``anchor`` (an empty tensor that requires grad when autograd is on) makes the
    received tensor part of the graph."""

    @staticmethod
    def forward(ctx, anchor, shape, dtype, stage):
        received = torch.empty(shape, dtype=dtype, device=anchor.device)
        dist.recv(received, stage.previous_rank, group=stage.group)
        ctx.stage = stage
        return received

    @staticmethod
    def backward(ctx, grad):
        dist.send(grad.contiguous(), ctx.stage.previous_rank, group=ctx.stage.group)
        return None, None, None, None


class _ToNextStage(torch.autograd.Function):
    """Forward: send this stage's output to the next stage, return an empty token;
    backward (reached from the loss through the token): the next stage's gradient of the output."""

    @staticmethod
    def forward(ctx, hidden, stage):
        dist.send(hidden.detach().contiguous(), stage.next_rank, group=stage.group)
        ctx.stage, ctx.shape, ctx.dtype = stage, hidden.shape, hidden.dtype
        return hidden.new_zeros(0)

    @staticmethod
    def backward(ctx, grad_token):
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=grad_token.device)
        dist.recv(grad, ctx.stage.next_rank, group=ctx.stage.group)
        return grad, None


class _FromLastStage(torch.autograd.Function):
    """Forward: the last stage's broadcast outputs; backward: nothing for the last stage
    (it computes the same loss itself), a zero for the token, which starts this stage's
    backward."""

    @staticmethod
    def forward(ctx, token, shape, stage):
        values = torch.empty(shape, dtype=torch.float32, device=token.device)
        dist.broadcast(values, stage.last_rank, group=stage.group)
        return values

    @staticmethod
    def backward(ctx, grad):
        return grad.new_zeros(0), None, None


def pipelined_log_probs(policy: Any, input_ids_T: torch.Tensor, positions_T: torch.Tensor, cu_seqlens: torch.Tensor,
                        target_ids_T: torch.Tensor, routing: Any, temperature: float, chunk_size: int,
                        return_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``packed_log_probs`` of this stage (see module doc): every stage returns the same
    values, the last stage's."""
    from miles_host.models.logprobs import chunked_log_probs

    stage = current_stage()
    device = input_ids_T.device
    config = policy.gpt.config

    def receive(layout) -> torch.Tensor:
        anchor = torch.empty(0, device=device, requires_grad=torch.is_grad_enabled())
        # under sequence parallelism the stages exchange this TP rank's sequence shard
        seq_len = layout.seq_len // policy.sizes.tp if config.sequence_parallel else layout.seq_len
        shape = (seq_len, layout.batch, config.hidden_size)
        return _FromPreviousStage.apply(anchor, shape, config.params_dtype, stage)

    run = policy.decoder_pass(input_ids_T, positions_T, cu_seqlens, routing,
                              stage_input=None if stage.first else receive)
    if stage.last:
        log_probs_T, entropy_T = chunked_log_probs(
            run.layout.from_sb(run.hidden_SBH), policy.lm_head_weight, target_ids_T,
            temperature=temperature, chunk_size=chunk_size, return_entropy=return_entropy,
        )
        values = torch.stack([log_probs_T, entropy_T]) if return_entropy else log_probs_T[None]
        dist.broadcast(values.detach().float().contiguous(), stage.last_rank, group=stage.group)
    else:
        token = _ToNextStage.apply(run.hidden_SBH.to(config.params_dtype), stage)
        values = _FromLastStage.apply(token, (2 if return_entropy else 1, input_ids_T.shape[0]), stage)
        log_probs_T, entropy_T = values[0], (values[1] if return_entropy else None)
    if routing is not None and policy.replay.routing_hooks.active:  # once the whole pipeline ran
        share_captured_routes(routing, stage, device)
    return log_probs_T, entropy_T


def share_captured_routes(routing: Any, stage: Stage, device: torch.device) -> None:
    """Every stage's captured expert ids (``routing.captured``, by global layer) on every rank."""
    mine = {layer: ids.cpu() for layer, ids in routing.captured.items()}
    everyone: list[Any] = [None] * stage.size
    dist.all_gather_object(everyone, mine, group=stage.group)
    for index, captured in enumerate(everyone):
        if index != stage.index:
            routing.captured.update({layer: ids.to(device) for layer, ids in captured.items()})
