"""The sharded megatron trainer's weights, bucket by bucket, without the whole model on one rank.

:func:`weight_buckets` is a collective of every trainer rank (every rank iterates it to the
end); on rank 0 it yields the model in buckets of native-named full tensors (the names and
layouts weight sync, ``--save-hf`` and the native trainer use), each bucket at most
``bucket_bytes`` (``--update-weight-buffer-size``; a tensor larger than that gets a bucket of
its own), the others yield nothing. What any rank holds at once is its own shard plus one
bucket (the idea of slime's ``update_weight_from_distributed``):

- **Plan.** Each pipeline stage lists its parameters under Megatron's names (model chunk
  by model chunk under virtual pipeline stages; the tied
  output copy of a last stage dropped: the first stage's embedding is the weight), in
  units that become whole native tensors (one parameter, or all of a layer's routed
  experts of one projection: native names stack them), sized as full (TP- and
  EP-gathered) tensors, and cuts them into buckets. The ranks of a stage hold the same
  names and shapes, so they cut alike.
- **Gather.** Stage by stage, every rank of the stage gathers each bucket's tensors over
  its TP and EP groups (:func:`miles_megatron.parallel.gather_state`); the stage's source
  rank (TP, CP and DP rank 0) renames the layers to global indices and sends the bucket to
  rank 0 (nothing to send on the first stage's own source, rank 0), one flat tensor per
  dtype after a small header of names and shapes.
- **Convert.** Rank 0 maps the bucket to native names
  (:func:`~miles_megatron.weights.megatron_to_native`) and yields it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

_LOCAL_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..+)$")


@dataclass
class Unit:
    """Megatron names of this rank that become whole native tensors together, and their
    full (gathered) size in bytes."""

    names: list[str]
    nbytes: int


def _local_state(gpt: torch.nn.Module) -> dict[str, torch.Tensor]:
    from miles_megatron.pipeline import TIED_COPY, tied_output_copy

    tied = tied_output_copy(gpt) is not None
    return {name: tensor.detach() for name, tensor in gpt.state_dict().items()
            if not name.endswith("_extra_state") and not (tied and name == TIED_COPY)}


def plan_units(gpt: torch.nn.Module, local: dict[str, torch.Tensor]) -> list[Unit]:
    """This stage's units (see module doc), in name order."""
    from miles_megatron.parallel import _partition_dims, current_sizes

    sizes = current_sizes()
    dims = _partition_dims(gpt)
    units: dict[str, Unit] = {}
    for name in sorted(local):
        tensor = local[name]
        nbytes = tensor.numel() * tensor.element_size()
        expert = _LOCAL_EXPERT.match(name)
        if expert is not None:
            key, nbytes = f"{expert.group(1)}*{expert.group(3)}", nbytes * sizes.ep
        else:
            key = name
            if name in dims:
                nbytes *= sizes.tp
        unit = units.setdefault(key, Unit([], 0))
        unit.names.append(name)
        unit.nbytes += nbytes
    return list(units.values())


def cut_buckets(units: list[Unit], bucket_bytes: int) -> list[list[str]]:
    """Consecutive units, at most ``bucket_bytes`` a bucket (a larger unit alone)."""
    buckets: list[list[str]] = []
    size = 0
    for unit in units:
        if not buckets or (buckets[-1] and size + unit.nbytes > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].extend(unit.names)
        size += unit.nbytes
    return buckets


def _is_source() -> bool:
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0)


def _send_bucket(state: dict[str, torch.Tensor] | None, device: torch.device) -> None:
    """To rank 0: a header ``[(name, shape, dtype)]`` (None: this stage is done), then one flat
    tensor per dtype."""
    header = None if state is None else [(name, tuple(t.shape), t.dtype) for name, t in state.items()]
    dist.send_object_list([header], dst=0, device=device if device.type == "cuda" else None)
    for dtype in _dtypes(header or []):
        dist.send(torch.cat([t.reshape(-1) for t in state.values() if t.dtype == dtype]).contiguous(), dst=0)


def _recv_bucket(src: int, device: torch.device) -> dict[str, torch.Tensor] | None:
    holder: list[Any] = [None]
    dist.recv_object_list(holder, src=src, device=device if device.type == "cuda" else None)
    header = holder[0]
    if header is None:
        return None
    out: dict[str, torch.Tensor] = {}
    for dtype in _dtypes(header):
        entries = [(name, shape) for name, shape, d in header if d == dtype]
        flat = torch.empty(sum(_numel(shape) for _, shape in entries), dtype=dtype, device=device)
        dist.recv(flat, src=src)
        for (name, shape), part in zip(entries, flat.split([_numel(shape) for _, shape in entries])):
            out[name] = part.view(shape)
    return {name: out[name] for name, _, _ in header}


def _dtypes(header: list) -> list[torch.dtype]:
    return sorted({dtype for _, _, dtype in header}, key=str)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _stage_sources() -> list[int]:
    """Global rank of each pipeline stage's source (TP, CP and DP rank 0): every rank's
    ``_is_source`` flag, gathered."""
    from megatron.core import parallel_state as ps

    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, (ps.get_pipeline_model_parallel_rank(), _is_source()))
    sources: dict[int, int] = {}
    for rank, (stage, source) in enumerate(flags):
        if source:
            sources.setdefault(stage, rank)
    return [sources[stage] for stage in sorted(sources)]


def megatron_buckets(chunks: list[torch.nn.Module], vocab_size: int, bucket_bytes: int,
                     device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """Every rank calls it with its model chunks (one GPTModel, or one per virtual pipeline
    stage; see module doc); rank 0 gets each bucket of full, Megatron-named tensors (global
    layer indices), the others nothing."""
    from miles_megatron.parallel import current_sizes, gather_state
    from miles_megatron.pipeline import _renumber, current_stage, global_layer_ids

    sizes = current_sizes()
    # (chunk, its local state, one bucket's names), chunk by chunk
    buckets = []
    for gpt in chunks:
        local = _local_state(gpt)
        buckets += [(gpt, local, names) for names in cut_buckets(plan_units(gpt, local), bucket_bytes)]
    if not sizes.parallel:
        for _, local, names in buckets:
            yield {name: local[name] for name in names}
        return
    stage = current_stage()
    sources = _stage_sources()
    rank = dist.get_rank()
    for index in range(stage.size):
        if index == stage.index:
            for gpt, local, names in buckets:
                full = gather_state({name: local[name] for name in names}, gpt, vocab_size)
                to_global = global_layer_ids(gpt)
                full = {_renumber(name, to_global): tensor for name, tensor in full.items()}
                if rank == 0:
                    yield full
                elif rank == sources[index]:
                    _send_bucket(full, device)
                del full
            if rank == sources[index] and rank != 0:
                _send_bucket(None, device)
        elif rank == 0:
            while (full := _recv_bucket(sources[index], device)) is not None:
                yield full


def native_buckets(policy: Any, bucket_bytes: int, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """:func:`megatron_buckets` under native names (rank 0; see module doc)."""
    from miles_megatron.runtime import on_device
    from miles_megatron.weights import megatron_to_native

    chunks = getattr(policy, "chunks", None) or [policy.gpt]  # virtual pipeline stages: one GPTModel each
    buckets = megatron_buckets(chunks, policy.config.vocab_size, bucket_bytes, device)
    while True:
        with on_device(device):  # around the gathering only: the caller's code between buckets runs outside it
            bucket = next(buckets, None)
        if bucket is None:
            return
        yield megatron_to_native(bucket, policy.config)
