"""Pipeline parallelism (PP) of the megatron backend (``--pipeline-model-parallel-size N``).

``N`` trainer processes, one pipeline stage each, or ``N * TP * DP`` with each
stage sharded as :mod:`miles_megatron.parallel` describes (each DP rank's pipeline on its
share of the samples), started as the host's trainer group like TP/EP. A rank
talks to its own pipeline group (the same TP/EP rank of every stage); under sequence
parallelism the stages pass on this TP rank's sequence shard.

Stages. Megatron's ``parallel_state`` gets the pipeline size; each rank builds
``GPTModel(pre_process=first stage, post_process=last stage)``, whose decoder holds a
contiguous slice of ``num_layers / N`` layers, or of the uneven split
``--decoder-first/last-pipeline-num-layers`` ask for (:class:`PipelineLayout`; Megatron's
layer offset; the module names are local, ``decoder.layers.{i}``, each layer's
``layer_number`` global, so the MoE routers and R3's replayed ids are keyed by global layer
index, :func:`miles_megatron.replay.moe_routers`). With virtual pipeline stages
(``--virtual-pipeline-model-parallel-size V``) each rank builds ``V`` model chunks, one
GPTModel per virtual stage (``vp_stage``; chunk ``v`` of rank ``r`` is virtual stage
``v * N + r``, so a rank's layers are no longer contiguous), run by Megatron's interleaved
schedule; the functions below take a rank's chunks where the state spans them. The
embedding lives on the first stage (its first chunk), the final norm and output layer on
the last (its last chunk). With tied embeddings the last stage
holds a copy of the word embedding as its output weight (Megatron's layout).

Weights (:func:`stage_state`, :func:`gather_stages`): a rank loads its stage's layers
from the full Megatron-named state, renumbered to local indices (the tied copy from
the embedding), then its TP/EP shard of them (:func:`miles_megatron.parallel.rank_state`);
the inverse renumbers back to global indices and all-gathers over the
pipeline group, the tied copy dropped (the first stage's embedding is the weight), so
every rank, rank 0 among them, gets the complete model for export and checkpoints.

Training and forward-only passes run on Megatron-Core's schedules (1F1B), gradients
through its DDP and ``finalize_model_grads`` (the tied embedding's copies summed over the
embedding group): :mod:`miles_megatron.schedule`. Megatron's optimizer's clipping norm
sums every stage's gradients, the tied copy counted once
(:mod:`miles_megatron.megatron_optimizer`).

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


@dataclass(frozen=True)
class PipelineLayout:
    """How the decoder layers split over ``pp`` pipeline ranks of ``vpp`` model chunks each
    (virtual stages; Megatron's interleaved schedule): ``first`` / ``last``, the layers of the
    first / last rank where uneven (``--decoder-first/last-pipeline-num-layers``; None: the
    even share), the ranks between sharing the rest evenly, each rank's layers split evenly
    over its chunks (Megatron's rules, refused here by name)."""

    pp: int = 1
    vpp: int = 1
    first: int | None = None
    last: int | None = None

    @classmethod
    def from_config(cls, config: Any, num_layers: int) -> "PipelineLayout":
        """The layout a run's flags ask for (``--pipeline-model-parallel-size``, the virtual pipeline
        flags of :mod:`miles_host.config_pipeline`, the uneven stage sizes), checked against the
        model's ``num_layers``."""
        pp = int(config.pipeline_model_parallel_size)
        first = getattr(config, "decoder_first_pipeline_num_layers", None)
        last = getattr(config, "decoder_last_pipeline_num_layers", None)
        vpp = getattr(config, "virtual_pipeline_model_parallel_size", None)
        per_stage = getattr(config, "num_layers_per_virtual_pipeline_stage", None)
        if per_stage is not None:
            if first is not None or last is not None:
                raise ValueError("--num-layers-per-virtual-pipeline-stage assumes even pipeline stages; with "
                                 "--decoder-first/last-pipeline-num-layers give --virtual-pipeline-model-parallel-size")
            if per_stage <= 0 or num_layers % (pp * per_stage):
                raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_stage}: the model's {num_layers} "
                                 f"layers do not split into {pp} pipeline ranks of chunks of {per_stage} layers")
            implied = num_layers // (pp * per_stage)
            if vpp is not None and vpp != implied:
                raise ValueError(f"--virtual-pipeline-model-parallel-size {vpp} and --num-layers-per-virtual-pipeline-"
                                 f"stage {per_stage} disagree ({num_layers} layers over {pp} ranks: {implied} chunks "
                                 "each); give one of them")
            vpp = implied
        layout = cls(pp, int(vpp or 1), first, last)
        layout.rank_layers(num_layers)
        return layout

    def rank_layers(self, num_layers: int) -> list[int]:
        """The decoder layers of each pipeline rank (ValueError naming the flags where the split
        is not one Megatron can build)."""
        uneven = self.first is not None or self.last is not None
        if self.pp == 1:
            if self.vpp > 1 or uneven:
                raise ValueError("virtual pipeline stages and --decoder-first/last-pipeline-num-layers split the "
                                 "layers over pipeline ranks: they need --pipeline-model-parallel-size > 1")
            return [num_layers]
        ends = [size for size in (self.first, self.last) if size is not None]
        if any(size <= 0 for size in ends):
            raise ValueError(f"--decoder-first/last-pipeline-num-layers must be positive, got {ends}")
        middle_ranks, middle_layers = self.pp - len(ends), num_layers - sum(ends)
        if middle_layers < 0 or bool(middle_ranks) != bool(middle_layers) or (
                middle_ranks and middle_layers % middle_ranks):
            what = (f"--decoder-first-pipeline-num-layers {self.first} / --decoder-last-pipeline-num-layers "
                    f"{self.last} leave {middle_layers} layers for {middle_ranks} middle stages" if uneven else
                    f"{num_layers} decoder layers do not split evenly over {self.pp} stages")
            raise ValueError(f"--pipeline-model-parallel-size {self.pp}: the model's {what}; give stage sizes that "
                             f"sum to {num_layers} with the middle stages equal (or a pipeline size that divides it)")
        share = middle_layers // middle_ranks if middle_ranks else 0
        layers = [share] * self.pp
        if self.first is not None:
            layers[0] = self.first
        if self.last is not None:
            layers[-1] = self.last
        if any(count % self.vpp for count in layers):
            raise ValueError(f"--virtual-pipeline-model-parallel-size {self.vpp}: each pipeline rank's layers "
                             f"{layers} must split evenly into {self.vpp} model chunks")
        return layers

    def transformer_kwargs(self) -> dict[str, Any]:
        """``TransformerConfig`` fields of this layout (none at PP 1)."""
        if self.pp == 1:
            return {}
        kwargs: dict[str, Any] = {"pipeline_model_parallel_size": self.pp}
        if self.vpp > 1:
            kwargs["virtual_pipeline_model_parallel_size"] = self.vpp
        if self.first is not None:
            kwargs["num_layers_in_first_pipeline_stage"] = self.first
        if self.last is not None:
            kwargs["num_layers_in_last_pipeline_stage"] = self.last
        return kwargs


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


def gather_stages(local: Mapping[str, torch.Tensor] | list[Mapping[str, torch.Tensor]],
                  gpt: torch.nn.Module | list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The full Megatron-named state from every stage's part (a collective of the pipeline
    group; every rank gets the whole state); under virtual stages ``local`` and ``gpt`` are
    lists, one per model chunk of this rank."""
    stage = current_stage()
    parts = zip(local, gpt, strict=True) if isinstance(gpt, (list, tuple)) else [(local, gpt)]
    mine = {}
    for state, chunk in parts:
        to_global = global_layer_ids(chunk)
        mine.update({_renumber(name, to_global): tensor.detach() for name, tensor in state.items()
                     if not (name == TIED_COPY and tied_output_copy(chunk) is not None)})
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


# -- routes ---------------------------------------------------------------------------


def share_captured_routes(routing: Any, stage: Stage, device: torch.device) -> None:
    """Every stage's captured expert ids (``routing.captured``, by global layer) on every rank."""
    mine = {layer: ids.cpu() for layer, ids in routing.captured.items()}
    everyone: list[Any] = [None] * stage.size
    dist.all_gather_object(everyone, mine, group=stage.group)
    for index, captured in enumerate(everyone):
        if index != stage.index:
            routing.captured.update({layer: ids.to(device) for layer, ids in captured.items()})
