"""Sharded checkpoints of the megatron trainer: ``megatron.core.dist_checkpointing``, torch_dist format.

Every rank writes and reads only its own shards; nothing is gathered. The sharded
state dict is Megatron's own, so the files are a Megatron checkpoint:

- ``model``: ``GPTModel.sharded_state_dict()`` (Megatron's keys, e.g.
  ``decoder.layers.self_attention.linear_qkv.weight`` with the global layer as the
  first axis, TP shards as offsets, the SwiGLU ``linear_fc1`` as Megatron's factory,
  the tied output layer of the last pipeline stage as a replica of the embedding);
- ``optimizer``: the host's torch optimizer (AdamW) in Megatron's ``FP32Optimizer``
  layout: each parameter's moments a ShardedTensor keyed
  ``optimizer.state.<moment>.<the parameter's key>`` with the parameter's sharding,
  the step shared by all parameters (``state.common_step``), the parameter groups'
  hyper-parameters common state (with ``--optimizer-cpu-offload`` the moments of the
  CPU masters, in the same order). A run resumed on the same layout continues exactly;
  on another TP / PP layout dist_checkpointing reads each rank's new shards from the
  same files (the last stage's tied embedding moments are the first stage's: the
  gradients of both copies are summed, so their moments agree).

Where the files go: ``<iteration folder>/`` :data:`SUBDIR` (``save_shards``), next to
the host's ``state.pt`` (scheduler, data position, RNG). ``save_model_shards`` /
``load_model_shards`` write and read the model alone, in Megatron's own ``iter_*`` layout
(``--load`` / ``--ref-load`` of a slime / Megatron torch_dist checkpoint,
:mod:`miles_megatron.megatron_load`). Writing happens in this process (see
:func:`_in_process_strategy`): only the save plans and metadata meet on rank 0.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

#: the subfolder of a host checkpoint's ``iter_*`` folder holding the torch_dist files
SUBDIR = "torch_dist"
#: the files of a torch_dist checkpoint that rank 0 writes (the host's manifest checksums them)
RANK0_FILES = ("metadata.json", "common.pt", ".metadata")
#: Megatron's name of the optimizer step shared by every parameter
COMMON_STEP = "common_step"


def _chunks(trainer: Any) -> list[torch.nn.Module]:
    """The trainer's GPTModel (under virtual pipeline stages its model chunks, in order)."""
    return [getattr(chunk, "module", chunk) for chunk in trainer.model.chunks]  # (not Megatron's DDP wrapper)


def _chunk_key(index: int) -> str:
    return f"chunk{index}"


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return list(itertools.chain.from_iterable(group["params"] for group in optimizer.param_groups))


def model_sharded_state(trainer: Any) -> dict:
    """This rank's ShardedTensors / ShardedObjects of the GPTModel (Megatron's keys; under virtual
    pipeline stages one dict per model chunk, the keys in the files being the same global ones,
    so the checkpoint loads on a layout with or without virtual stages)."""
    from miles_megatron.runtime import on_device

    with on_device(trainer.device):
        states = [chunk.sharded_state_dict() for chunk in _chunks(trainer)]
    return states[0] if len(states) == 1 else {_chunk_key(i): state for i, state in enumerate(states)}


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Zero moments for parameters without state (a fresh optimizer about to be loaded):
    the sharded state dict needs a tensor to read each moment into."""
    for param in _optimizer_params(optimizer):
        state = optimizer.state[param]
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def optimizer_sharded_state(trainer: Any, model_state: dict, is_loading: bool = False) -> dict:
    """The optimizer's state dict with each moment a ShardedTensor shaped as its parameter
    (see module doc). A Megatron optimizer gives its own (``sharded_state_dict``)."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    optimizer = trainer.optimizer
    if hasattr(optimizer, "sharded_state_dict"):
        return optimizer.sharded_state_dict(model_state, is_loading=is_loading)
    # --optimizer-cpu-offload: the AdamW over CPU masters, whose state_dict is the wrapper's
    adamw = getattr(optimizer, "inner", optimizer)
    if type(adamw) is not torch.optim.AdamW:
        raise ValueError(f"--ckpt-format torch_dist saves AdamW's moments; this trainer's optimizer is a "
                         f"{type(adamw).__name__} (use --optimizer adam, or --ckpt-format torch)")
    if is_loading:
        _init_optimizer_state(adamw)
    params = _optimizer_params(optimizer)
    id_to_sharded = get_param_id_to_sharded_param_map(model_state, params)
    missing = [index for index in range(len(params)) if index not in id_to_sharded]
    if missing:
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        listed = ", ".join(names.get(id(params[i]), f"#{i}") for i in missing[:5])
        raise ValueError(f"--ckpt-format torch_dist: optimizer parameters outside the GPTModel's sharded state "
                         f"({listed}) cannot be saved as shards; use --ckpt-format torch")
    state = optimizer.state_dict()
    steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"--ckpt-format torch_dist keeps one optimizer step for all parameters (Megatron's "
                         f"layout); this optimizer's parameters have taken {sorted(steps)} steps")
    optim_state_to_sharding_state(state, id_to_sharded, exclude_keys=("step",))
    if steps:
        state["state"][COMMON_STEP] = torch.tensor(steps.pop(), dtype=torch.float32)
    return state


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
    """Load what :func:`optimizer_sharded_state` read back (the step shared again per parameter)."""
    if hasattr(optimizer, "sharded_state_dict"):
        optimizer.load_state_dict(loaded)
        return
    step = loaded["state"].pop(COMMON_STEP, None)
    for param_state in loaded["state"].values():
        param_state["step"] = torch.tensor(float(step) if step is not None else 0.0, dtype=torch.float32)
    optimizer.load_state_dict(loaded)  # (the groups' parameter ids are this optimizer's: never saved)


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
