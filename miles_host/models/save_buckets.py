"""HF checkpoints from a sharded trainer, one safetensors shard per bucket.

:func:`save_hf_in_buckets` writes a trainer's weights as an HF checkpoint directory
without the whole model on one rank: a trainer with ``streams_weights`` (the megatron
backend, :mod:`miles_megatron.weight_buckets`) hands its weights bucket by bucket to
rank 0 (``weight_buckets(bucket_bytes, for_rollout=False)``: every rank gathers its part
of each bucket, rank 0 receives it), and rank 0 converts each bucket to HF names (the
model family's map, :func:`miles_host.models.loading.native_to_hf_tensors`) and writes it
as one ``model-XXXXX-of-YYYYY.safetensors`` shard, then the index and ``config.json``.
Rank 0 holds one bucket at a time. ``--save-hf`` takes this path for such trainers
(:func:`miles_host.lora.export.save_hf_checkpoint`).

A Megatron torch_dist checkpoint converts to HF the same way: a megatron trainer (group)
built on its shards (``--ref-load DIR``, any TP / PP / EP layout, each rank reading its own
shards) exports them with :func:`save_hf_in_buckets`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

INDEX = "model.safetensors.index.json"


def save_hf_in_buckets(trainer: Any, path: str | Path, bucket_bytes: int) -> list[str]:
    """Write ``trainer``'s weights (a trainer with ``streams_weights``, or its trainer group)
    as an HF checkpoint into ``path``, one shard per bucket of at most ``bucket_bytes`` (see
    module doc; every rank takes part). Returns the shard file names."""
    from safetensors.torch import save_file

    from miles_host.models.loading import native_to_hf_tensors, write_hf_config

    path = Path(path)
    config = trainer.model.config
    dtype = next(trainer.model.parameters()).dtype  # the trainer's (master) weights
    record = write_hf_config(config, path, dtype)
    files: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0
    for bucket in trainer.weight_buckets(bucket_bytes, for_rollout=False):
        tensors = {
            hf_name: part.detach().to("cpu").contiguous()
            for native, tensor in bucket
            for hf_name, part in native_to_hf_tensors(record, native, tensor, config)
        }
        name = f"model-{len(files) + 1:05d}.safetensors.partial"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({hf_name: name for hf_name in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors, bucket
    final = {name: f"model-{number:05d}-of-{len(files):05d}.safetensors" for number, name in enumerate(files, 1)}
    for name, renamed in final.items():
        os.replace(path / name, path / renamed)
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}
    (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return list(final.values())

