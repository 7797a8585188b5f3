"""Megatron-Core's process state for the one-process backend.

- :func:`check_parallel_sizes`: what ``--tensor/pipeline/expert/context-model-parallel-size``
  this version can honour (1 each: one trainer process).
- :func:`init_model_parallel`: a one-rank ``torch.distributed`` group (gloo, in-process
  store) and Megatron's ``parallel_state`` on it, created once and reused.
- :func:`on_cpu`: Megatron-Core 0.16 asks ``torch.cuda.current_device()`` for the
  device of a few buffers (rotary frequencies, attention/MoE scratch) even when built
  with ``use_cpu_initialization``, and its activation recomputation saves the CUDA
  RNG state; on a machine without CUDA those calls are answered with ``"cpu"`` and
  an empty state while the trainer runs Megatron code, and nowhere else.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Iterator

import torch

PARALLEL_FLAGS = {
    "--tensor-model-parallel-size": "tensor_model_parallel_size",
    "--pipeline-model-parallel-size": "pipeline_model_parallel_size",
    "--expert-model-parallel-size": "expert_model_parallel_size",
    "--context-parallel-size": "context_parallel_size",
}


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Megatron-Core warns at import that TransformerEngine and Apex are absent; this
    backend uses neither (local layer spec, torch optimizer), so those notes are dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed")
        yield


def check_parallel_sizes(config: Any) -> None:
    """Sizes > 1 need one process per model-parallel rank: not launched by this version."""
    bigger = {flag: getattr(config, dest) for flag, dest in PARALLEL_FLAGS.items() if getattr(config, dest) != 1}
    if not bigger:
        return
    named = ", ".join(f"{flag} {value}" for flag, value in bigger.items())
    if not torch.cuda.is_available():
        raise ValueError(
            f"--train-backend megatron: {named} needs CUDA GPUs (one per model-parallel rank) and none is "
            "available; on CPU only size 1 runs"
        )
    raise ValueError(
        f"--train-backend megatron: {named}: this version runs Megatron-Core in one trainer process "
        "(sizes 1); starting one process per model-parallel rank is not written yet"
    )


def init_model_parallel() -> None:
    """One-rank default group + Megatron ``parallel_state`` (TP = PP = EP = CP = 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise ValueError(
            f"--train-backend megatron runs in one process, but torch.distributed already has "
            f"{dist.get_world_size()} ranks here"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    _fix_megatron_without_te()


def seed_rng(seed: int) -> None:
    """Megatron's RNG tracker: the CUDA one on GPU; on CPU a tracker whose forks do
    nothing (Megatron's own inference tracker; dropout is off in this backend)."""
    from megatron.core.tensor_parallel import random as megatron_random

    if torch.cuda.is_available():
        megatron_random.model_parallel_cuda_manual_seed(seed)
    else:
        megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _fix_megatron_without_te() -> None:
    """megatron-core 0.16 tests ``te_general_gemm is not None`` in the router GEMM but
    only defines the name when TransformerEngine imports."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


_lock = threading.RLock()
_depth = 0
_saved: list[tuple[Any, str, Any]] = []


def _cpu_stand_ins() -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, replacement)`` of the CUDA calls Megatron makes on CPU."""
    from megatron.core.tensor_parallel import random as megatron_random

    return [
        (torch.cuda, "current_device", lambda: "cpu"),
        # activation recomputation saves and restores the CUDA RNG (there is none; dropout is off)
        (megatron_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)),
        (megatron_random, "_set_cuda_rng_state", lambda *args, **kwargs: None),
    ]


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """While Megatron code runs without CUDA: ``torch.cuda.current_device() -> "cpu"``
    and no CUDA RNG state to save (re-entrant; a no-op where CUDA is available)."""
    global _depth
    if torch.cuda.is_available():
        yield
        return
    with _lock:
        if _depth == 0:
            for owner, name, replacement in _cpu_stand_ins():
                _saved.append((owner, name, getattr(owner, name)))
                setattr(owner, name, replacement)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                while _saved:
                    owner, name, original = _saved.pop()
                    setattr(owner, name, original)
