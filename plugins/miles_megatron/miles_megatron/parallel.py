"""Tensor (TP) and expert (EP) model parallelism of the megatron backend.

The ranks follow Megatron-Core's two grids (``parallel_state.initialize_model_parallel``):
the dense layers run on ``TP x PP x DP`` ranks, the MoE layers on ``ETP x EP x PP x EDP``
of the same ranks, expert TP (ETP) 1 (:data:`~miles_megatron.runtime.EXPERT_TP`: experts
are whole). Expert parallelism is carved out of each stage's ``TP x DP`` ranks, so EP
needs no ranks of its own where it divides TP: TP 2 x EP 2 is two trainer processes,
each holding half the heads and half the experts. Megatron's data-parallel size DP is
``--actor-num-gpus-per-node / (TP x PP)``, a multiple of the smallest that lets EP divide
``TP x DP`` (:attr:`Sizes.smallest_dp`: 1 where EP divides TP, ``EP`` at TP 1); each DP
rank trains on its share of the step's samples (:mod:`miles_megatron.schedule`). At TP 2 x EP 2 the EP group of a
rank is its TP group; at TP 1 x EP 2 (DP 2) the EP group is the DP group. Pipeline
parallelism, the third size, is :mod:`miles_megatron.pipeline` (:func:`rank_state` /
:func:`full_state` combine the stage and shard maps). Each rank builds its shard of the
GPTModel and:

- :func:`shard_state`: takes its shard of the full Megatron-named state (what
  :func:`~miles_megatron.weights.native_to_megatron` gives), following Megatron's
  layouts: column-parallel weights (``linear_qkv``, already interleaved per query
  group, MLA's down and up projections, and ``output_layer``) and the vocab-parallel
  embedding by rows, row-parallel
  weights (``linear_proj``, ``linear_fc2``) by columns, SwiGLU ``linear_fc1`` (the MLP's
  and the shared experts') as ``[gate_r; up_r]`` (each half split by rows, as Megatron's gated column-parallel
  layout), routed experts as ``ep_rank * local + e`` (SequentialMLP numbering, whole
  experts: ETP 1, never split by TP); norms and routers are replicated; the vocabulary
  is padded to a multiple of TP with zero rows (:func:`padded_vocab`).
- :func:`gather_state`: the inverse, a collective of every rank (the full state on
  each, rank 0 keeps it).
- :func:`vocab_parallel_head`: the full ``[V, H]`` output weight, gathered with
  Megatron's ``gather_from_tensor_model_parallel_region`` (forward all-gather,
  backward this rank's slice): every rank computes the exact float32 log-probs and
  entropy over the whole vocabulary with the host's ``chunked_log_probs``, so the
  loss is the one-process loss.
- :func:`expert_batch_copies`: MoE layers dispatch with the all-gather dispatcher over
  the EP group: each TP rank's tokens (its sequence shard under sequence parallelism, else
  the same tokens as its TP peers) reach every expert, so an expert's gradient, summed
  over its expert-data-parallel group by Megatron's DDP, counts each token that many
  times (:mod:`miles_megatron.schedule` divides them out).

The gradient norm and clipping over all ranks are Megatron-Core's optimizer's
(:mod:`miles_megatron.megatron_optimizer`), which counts a gradient on every TP rank where
its parameter is TP-split (:func:`mark_tensor_parallel`), on TP rank 0 where it is replicated.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from miles_megatron.runtime import EXPERT_TP

_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..+)$")


@dataclass(frozen=True)
class Sizes:
    """Model-parallel sizes of the trainer group: ``tp * pp * cp * dp`` ranks (see module doc;
    ``cp``: context parallelism, :mod:`miles_megatron.context_parallel`); ``dp`` 0: the
    smallest data-parallel size EP allows."""

    tp: int = 1
    ep: int = 1
    pp: int = 1
    dp: int = 0
    cp: int = 1

    def __post_init__(self):
        if self.dp == 0:
            object.__setattr__(self, "dp", self.smallest_dp)
        if self.dp % self.smallest_dp:
            raise ValueError(f"data-parallel size {self.dp} with TP {self.tp} x CP {self.cp} x EP {self.ep}: EP must "
                             f"divide TP x CP x DP, so DP must be a multiple of {self.smallest_dp}")

    @property
    def smallest_dp(self) -> int:
        """The smallest data-parallel size with ``ETP * EP`` dividing ``TP * CP * DP``."""
        experts = EXPERT_TP * self.ep
        return experts // math.gcd(self.tp * self.cp, experts)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def describe(self) -> str:
        """``TP 2 x PP 1 x DP 1 (EP 2, expert TP 1)``: the sizes and Megatron's data-parallel size
        (``x CP n`` after PP where context parallelism is on)."""
        cp = f" x CP {self.cp}" if self.cp > 1 else ""
        return f"TP {self.tp} x PP {self.pp}{cp} x DP {self.dp} (EP {self.ep}, expert TP {EXPERT_TP})"

    @property
    def parallel(self) -> bool:
        return self.world > 1


def current_sizes() -> Sizes:
    from megatron.core import parallel_state as ps

    return Sizes(ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                 ps.get_pipeline_model_parallel_world_size(), ps.get_data_parallel_world_size(),
                 ps.get_context_parallel_world_size())


def _partition_dims(gpt: torch.nn.Module) -> dict[str, int]:
    """``{parameter name: dim}`` of the TP-split parameters, from the module types
    (Megatron sets ``partition_dim`` only when it initialises the weights itself):
    column-parallel weights and biases and the vocab-parallel embedding by rows,
    row-parallel weights by columns (their bias is replicated)."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    dims: dict[str, int] = {}
    for module_name, module in gpt.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dims.update({prefix + name: 0 for name, _ in module.named_parameters(recurse=False)})
        elif isinstance(module, RowParallelLinear):
            dims[prefix + "weight"] = 1
    return dims


def mark_tensor_parallel(gpt: torch.nn.Module) -> None:
    """Give each TP-split parameter Megatron's ``tensor_model_parallel`` / ``partition_dim``
    attributes (built without Megatron's initialisation, the weights lack them): Megatron's
    optimizer counts a gradient without them in the norm on TP rank 0 only, as a replica."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, dim in _partition_dims(gpt).items():
        param = gpt.get_parameter(name)
        if not getattr(param, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(param, True, dim, 1)


#: the vocabulary rows of the model (padded to a multiple of TP, see :func:`padded_vocab`)
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary Megatron is built with: a multiple of TP (its vocab-parallel
    layers split it evenly). The padding rows are zeros, never looked up, and cut off
    the gathered output weight, so the log-probs are over the real vocabulary."""
    return -(-vocab_size // tp) * tp


def _layout(name: str, dims: Mapping[str, int], gated: bool = True) -> tuple[str, int]:
    """``(kind, dim)``: kind ``replicated``, ``expert``, ``tp`` or ``gated`` (fc1 halves)."""
    if _EXPERT.match(name):
        return "expert", 0
    if name not in dims:
        return "replicated", 0
    # the MLP's and the shared experts' (``mlp.shared_experts.linear_fc1``) SwiGLU fc1
    if gated and name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return "gated", dims[name]
    return "tp", dims[name]


def shard_state(full: Mapping[str, torch.Tensor], gpt: torch.nn.Module, vocab_size: int) -> dict[str, torch.Tensor]:
    """This rank's shard of a full Megatron-named state dict (see module doc)."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    dims = _partition_dims(gpt)
    local_experts = _local_expert_count(gpt)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        expert = _EXPERT.match(name)
        if expert is not None:
            prefix, index, suffix = expert.groups()
            owner, local = divmod(int(index), local_experts)
            if owner == ep_rank:
                out[f"{prefix}{local}{suffix}"] = tensor
            continue
        kind, dim = _layout(name, dims)
        if name in VOCAB_ROWS and tp > 1:
            tensor = torch.cat([tensor, tensor.new_zeros(padded_vocab(vocab_size, tp) - vocab_size, *tensor.shape[1:])])
        if kind == "replicated" or tp == 1:
            out[name] = tensor
        elif kind == "tp":
            out[name] = tensor.chunk(tp, dim)[tp_rank].contiguous()
        else:  # gated: [gate; up] -> [gate_r; up_r]
            gate, up = tensor.chunk(2, dim)
            out[name] = torch.cat([gate.chunk(tp, dim)[tp_rank], up.chunk(tp, dim)[tp_rank]], dim).contiguous()
    return out


def _local_expert_count(gpt: torch.nn.Module) -> int:
    for layer in gpt.decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            return int(experts.num_local_experts)
    return 1


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def gather_state(local: Mapping[str, torch.Tensor], gpt: torch.nn.Module, vocab_size: int) -> dict[str, torch.Tensor]:
    """The full Megatron-named state from every rank's shard (a collective: every rank
    calls it with its own shard, in the same name order)."""
    from megatron.core import parallel_state as ps

    tp_group, ep_group = ps.get_tensor_model_parallel_group(), ps.get_expert_model_parallel_group()
    tp, ep = dist.get_world_size(tp_group), dist.get_world_size(ep_group)
    dims = _partition_dims(gpt)
    local_experts = _local_expert_count(gpt)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(local):
        tensor = local[name].detach()
        expert = _EXPERT.match(name)
        if expert is not None:
            prefix, index, suffix = expert.groups()
            parts = _all_gather(tensor, ep_group) if ep > 1 else [tensor]
            for owner, part in enumerate(parts):
                out[f"{prefix}{owner * local_experts + int(index)}{suffix}"] = part
            continue
        kind, dim = _layout(name, dims)
        if kind == "replicated" or tp == 1:
            out[name] = tensor
            continue
        parts = _all_gather(tensor, tp_group)
        if kind == "tp":
            out[name] = torch.cat(parts, dim)
            if name in VOCAB_ROWS:
                out[name] = out[name][:vocab_size]
        else:
            halves = [part.chunk(2, dim) for part in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
    return out


def rank_state(full: Mapping[str, torch.Tensor], gpt: torch.nn.Module, vocab_size: int) -> dict[str, torch.Tensor]:
    """This rank's part of a full Megatron-named state: its pipeline stage's layers
    (:func:`~miles_megatron.pipeline.stage_state`), then its TP/EP shard of them."""
    from miles_megatron.pipeline import stage_state

    if current_sizes().pp > 1:
        full = stage_state(full, gpt)
    return shard_state(full, gpt, vocab_size)


def full_state(local: Mapping[str, torch.Tensor], gpt: torch.nn.Module, vocab_size: int) -> dict[str, torch.Tensor]:
    """Inverse of :func:`rank_state` (a collective of every rank; each gets the full state)."""
    return full_state_of_chunks([local], [gpt], vocab_size)


def full_state_of_chunks(locals_: list[Mapping[str, torch.Tensor]], chunks: list[torch.nn.Module],
                         vocab_size: int) -> dict[str, torch.Tensor]:
    """:func:`full_state` of a rank's model chunks (virtual pipeline stages; ``locals_[i]`` the
    state of ``chunks[i]``; every rank has as many)."""
    from miles_megatron.pipeline import gather_stages

    states = [gather_state(local, chunk, vocab_size) for local, chunk in zip(locals_, chunks, strict=True)]
    return gather_stages(states, chunks) if current_sizes().pp > 1 else states[0]


def vocab_parallel_head(weight_VrH: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The full ``[V, H]`` output weight from this rank's vocabulary rows, padding rows
    cut off (autograd: the backward keeps this rank's rows of the full gradient)."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(weight_VrH.t().contiguous()).t()[:vocab_size]


def expert_batch_copies(sizes: Sizes, sequence_parallel: bool) -> int:
    """Times each token of a stage's batch reaches its experts (see module doc): the TP ranks
    hold the same tokens (each DP rank its own share), all-gathered over the EP group, or
    ``1 / TP`` of them each under sequence parallelism."""
    return 1 if sequence_parallel else sizes.tp
