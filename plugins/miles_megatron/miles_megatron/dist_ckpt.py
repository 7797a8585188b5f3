"""Sharded checkpoints of the megatron trainer: ``megatron.core.dist_checkpointing``, torch_dist format.

Every rank writes and reads only its own shards; nothing is gathered. The sharded
state dict is Megatron's own, so the files are a Megatron checkpoint:

- ``model``: ``GPTModel.sharded_state_dict()`` (Megatron's keys, e.g.
  ``decoder.layers.self_attention.linear_qkv.weight`` with the global layer as the
  first axis, TP shards as offsets, the SwiGLU ``linear_fc1`` as Megatron's factory,
  the tied output layer of the last pipeline stage as a replica of the embedding);
- ``optimizer``: Megatron-Core's optimizer's own ``sharded_state_dict``
  (:mod:`miles_megatron.megatron_optimizer`): without ``--use-distributed-optimizer`` its
  ``FP32Optimizer`` layout, each parameter's moments a ShardedTensor keyed
  ``optimizer.state.<moment>.<the parameter's key>`` with the parameter's sharding (MoE:
  the dense and expert optimizers' under ``chained_<i>.``), the step shared by all
  parameters (``state.common_step``), the parameter groups' hyper-parameters common state
  (with ``--optimizer-cpu-offload`` the moments of the CPU masters, in the same order); with
  it the distributed optimizer's fully reshardable layout. A run resumed on the same layout
  continues exactly; on another TP / PP layout dist_checkpointing reads each rank's new
  shards from the same files (the last stage's tied embedding moments are the first
  stage's: the gradients of both copies are summed, so their moments agree).

Where the files go: ``<iteration folder>/`` :data:`SUBDIR` (``save_shards``), next to
the host's ``state.pt`` (scheduler, data position, RNG). ``save_model_shards`` /
``load_model_shards`` write and read the model alone, in Megatron's own ``iter_*`` layout
(``--load`` / ``--ref-load`` of a slime / Megatron torch_dist checkpoint,
:mod:`miles_megatron.megatron_load`). Writing happens in this process (see
:func:`_in_process_strategy`): only the save plans and metadata meet on rank 0.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

#: the subfolder of a host checkpoint's ``iter_*`` folder holding the torch_dist files
SUBDIR = "torch_dist"
#: the files of a torch_dist checkpoint that rank 0 writes (the host's manifest checksums them)
RANK0_FILES = ("metadata.json", "common.pt", ".metadata")


def _chunks(trainer: Any) -> list[torch.nn.Module]:
    """The trainer's GPTModel (under virtual pipeline stages its model chunks, in order)."""
    return [getattr(chunk, "module", chunk) for chunk in trainer.model.chunks]  # (not Megatron's DDP wrapper)


def _chunk_key(index: int) -> str:
    return f"chunk{index}"


def model_sharded_state(trainer: Any) -> dict:
    """This rank's ShardedTensors / ShardedObjects of the GPTModel (Megatron's keys; under virtual
    pipeline stages one dict per model chunk, the keys in the files being the same global ones,
    so the checkpoint loads on a layout with or without virtual stages)."""
    from miles_megatron.runtime import on_device

    with on_device(trainer.device):
        states = [chunk.sharded_state_dict() for chunk in _chunks(trainer)]
    return states[0] if len(states) == 1 else {_chunk_key(i): state for i, state in enumerate(states)}


def optimizer_sharded_state(trainer: Any, model_state: dict, is_loading: bool = False) -> dict:
    """Megatron's optimizer's sharded state dict (see module doc)."""
    return trainer.optimizer.sharded_state_dict(model_state, is_loading=is_loading)


def sharded_state(trainer: Any, is_loading: bool = False, with_optimizer: bool = True) -> dict:
    """``{"model": ..., "optimizer": ...}`` of this rank (Megatron's checkpoint keys)."""
    model_state = model_sharded_state(trainer)
    state = {"model": model_state}
    if with_optimizer:
        state["optimizer"] = optimizer_sharded_state(trainer, model_state, is_loading)
    return state


def save_shards(trainer: Any, folder: str | Path, with_optimizer: bool = True) -> list[str]:
    """Write this rank's shards to ``folder/``:data:`SUBDIR` (a collective of every trainer
    rank); the files relative to ``folder`` that rank 0 wrote (for the host's manifest)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    directory = Path(folder) / SUBDIR
    if dist.get_rank() == 0:
        if directory.exists():  # a re-save of the same rollout: no stale shards of another layout
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
    dist.barrier()
    state = sharded_state(trainer, with_optimizer=with_optimizer)
    with _on(trainer):
        dist_checkpointing.save(state, str(directory), sharded_strategy=_in_process_strategy())
    dist.barrier()
    if dist.get_rank() != 0:
        return []
    return [f"{SUBDIR}/{name}" for name in RANK0_FILES if (directory / name).is_file()]


def save_model_shards(gpt: torch.nn.Module, directory: str | Path, device: Any) -> None:
    """Only the model's shards, straight into ``directory`` (Megatron's own layout of an
    ``iter_*`` folder: what slime's HF -> torch_dist conversion writes); a collective of
    every trainer rank. The directory must exist and be empty."""
    from megatron.core import dist_checkpointing

    from miles_megatron.runtime import on_device

    gpt = getattr(gpt, "module", gpt)
    with on_device(device), _cuda_sync_stand_in(device):
        dist_checkpointing.save({"model": gpt.sharded_state_dict()}, str(directory),
                                sharded_strategy=_in_process_strategy())


def _in_process_strategy():
    """Megatron's torch_dist save strategy, writing in this process.

    Megatron's own writer hands the tensors to a spawned queue manager and forked writer
    processes; the host's trainer ranks are daemonic processes, which may not have
    children. Same format: the tensors translated by Megatron (its keys, its
    ``MCoreSavePlanner``) and written by PyTorch DCP's ``FileSystemWriter`` (one file per
    rank), the metadata files by ``dist_checkpointing.save`` as usual."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):  # noqa: D102 - see the function's doc
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica)
            dcp_save(mcore_to_pyt_state_dict(sharded_state_dict, False),
                     storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=1),
                     planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                              flatten_state_dict=False))

    return InProcessTorchDistSave("torch_dist", 1)


def is_torch_dist(directory: str | Path) -> bool:
    """Whether ``directory`` holds a dist_checkpointing checkpoint (its ``metadata.json``)."""
    from megatron.core.dist_checkpointing.core import maybe_load_config

    path = Path(directory)
    return path.is_dir() and (path / "metadata.json").is_file() and maybe_load_config(str(path)) is not None


def _require_torch_dist(directory: str | Path) -> None:
    if not is_torch_dist(directory):
        raise FileNotFoundError(f"{directory} is not a torch_dist checkpoint (no metadata.json of "
                                "megatron.core.dist_checkpointing there)")


def load_shards(trainer: Any, directory: str | Path, with_optimizer: bool = True) -> None:
    """Read this rank's shards of model (and optimizer) from a torch_dist ``directory``
    (a collective of every trainer rank; any TP / PP layout it was saved with)."""
    from megatron.core import dist_checkpointing

    _require_torch_dist(directory)
    state = sharded_state(trainer, is_loading=True, with_optimizer=with_optimizer)
    with _on(trainer):
        loaded = dist_checkpointing.load(state, str(directory), strict="raise_unexpected")
    chunks = _chunks(trainer)
    for index, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model"] if len(chunks) == 1 else loaded["model"][_chunk_key(index)])
    if with_optimizer:
        _restore_optimizer(trainer.optimizer, loaded["optimizer"])


def load_model_shards(gpt: torch.nn.Module, directory: str | Path, device: Any) -> None:
    """Only the model's shards (a policy or reference GPTModel) from a torch_dist ``directory``
    (a collective of every trainer rank); the checkpoint's other entries are not read."""
    from megatron.core import dist_checkpointing

    from miles_megatron.runtime import on_device

    _require_torch_dist(directory)
    gpt = getattr(gpt, "module", gpt)
    with on_device(device):
        state = {"model": gpt.sharded_state_dict()}
        loaded = dist_checkpointing.load(state, str(directory), strict="raise_unexpected")
    gpt.load_state_dict(loaded["model"])


def _restore_optimizer(optimizer: Any, loaded: dict) -> None:
    """Load what :func:`optimizer_sharded_state` read back."""
    if any("wd_mult" not in group for group in _param_groups(loaded)):
        raise ValueError("--load: the optimizer state of this torch_dist checkpoint is the host AdamW's of an earlier "
                         "megatron trainer, not Megatron-Core's optimizer's; load its weights alone with "
                         "--no-load-optim")
    optimizer.load_state_dict(loaded)


def _param_groups(state: Any) -> list[dict]:
    """Every ``param_groups`` entry's groups in a (nested) optimizer state dict."""
    if not isinstance(state, dict):
        return []
    groups = [group for group in state.get("param_groups", []) if isinstance(group, dict)]
    return groups + [group for key, value in state.items() if key != "param_groups" for group in _param_groups(value)]


@contextlib.contextmanager
def _on(trainer: Any) -> Iterator[None]:
    """Megatron's device context (:func:`~miles_megatron.runtime.on_device`) with
    :func:`_cuda_sync_stand_in`."""
    from miles_megatron.runtime import on_device

    with on_device(trainer.device), _cuda_sync_stand_in(trainer.device):
        yield


@contextlib.contextmanager
def _cuda_sync_stand_in(device: Any) -> Iterator[None]:
    """On a CPU trainer without CUDA, dist_checkpointing's writer still synchronises CUDA
    before copying the tensors: nothing to wait for there, so that call does nothing while
    it runs."""
    if torch.device(device).type == "cuda" or torch.cuda.is_available():
        yield
        return
    original = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.cuda.synchronize = original


# -- the trainer's checkpoint state (what goes into the host's state.pt) ------------------


def uses_torch_dist(config: Any) -> bool:
    """``--ckpt-format torch_dist`` (Megatron's default)."""
    return getattr(config, "ckpt_format", "torch_dist") == "torch_dist"


def trainer_state(trainer: Any) -> dict:
    """The host-side part of a torch_dist checkpoint: no tensors of the model or optimizer
    (those are the shards :func:`save_shards` writes), what resumes the schedule, and
    the subfolder of the shards (``shards``; loading makes it a path)."""
    return {
        "format": "torch_dist",
        "shards": SUBDIR,
        "with_optimizer": not getattr(trainer.config, "no_save_optim", False),
        "scheduler": trainer.scheduler.state_dict(),
        "consecutive_nan_steps": trainer.consecutive_nan_steps,
        "critic": trainer.critic.checkpoint_state() if trainer.critic is not None else None,
        "train_backend": trainer.backend,
        "model_parallel": {"tp": trainer.sizes.tp, "ep": trainer.sizes.ep, "pp": trainer.sizes.pp},
    }


def save_trainer_shards(trainer: Any, folder: str | Path) -> list[str]:
    """``save_shards`` of a trainer: its model (and, unless ``--no-save-optim``, optimizer) shards."""
    return save_shards(trainer, folder, with_optimizer=not getattr(trainer.config, "no_save_optim", False))


def load_trainer_state(trainer: Any, state: dict) -> None:
    """Restore :func:`trainer_state` and its shards, on whatever TP / PP layout the trainer has
    now (the optimizer's only where saved and not ``--no-load-optim``)."""
    with_optimizer = bool(state.get("with_optimizer", True)) and not getattr(trainer.config, "no_load_optim", False)
    load_shards(trainer, state["shards"], with_optimizer=with_optimizer)
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.consecutive_nan_steps = state.get("consecutive_nan_steps", 0)
    if trainer.critic is not None and state.get("critic") is not None:
        trainer.critic.load_checkpoint_state(state["critic"])
