"""Megatron-Core's process state for the one-process backend.

- :func:`check_parallel_sizes`: what ``--tensor/pipeline/expert/context-model-parallel-size``
  this version can honour (TP, EP, PP and CP in any combination, CP with dense models:
  :mod:`miles_megatron.context_parallel`).
- :func:`init_model_parallel`: Megatron's ``parallel_state`` over the default group:
  a one-rank group created here (NCCL for a CUDA trainer, gloo on CPU; in-process
  store) at sizes 1, else the ``TP * PP * CP * DP`` trainer ranks' group. The expert
  tensor-parallel size is 1 (:data:`EXPERT_TP`): experts are never TP-split; the
  expert-parallel groups are carved out of each stage's ``TP x DP`` ranks, as
  Megatron's ``initialize_model_parallel`` does, with Megatron's data-parallel size DP
  the trainers over ``TP x PP``, a multiple of the smallest that EP divides into: at
  TP = EP = 2 two ranks, the EP group of a rank its TP group; at TP 1, EP 2 two ranks
  (DP 2), see :class:`miles_megatron.parallel.Sizes`.
- :func:`seed_rng`: Megatron's RNG tracker (the CUDA one on GPU, without moving the
  process's own CUDA generator).
- :func:`on_device`: what Megatron code of the trainer runs under. On GPU, ``cuda:N``
  as the current device (Megatron allocates its scratch buffers and rope frequencies
  on ``torch.cuda.current_device()``). On CPU, Megatron-Core 0.16 still asks
  ``torch.cuda.current_device()`` for a few buffers (rotary frequencies,
  attention/MoE scratch) even when built with ``use_cpu_initialization``, and its
  activation recomputation saves the CUDA RNG state: those calls are answered with
  ``"cpu"`` and an empty state, and tensor factories asked for ``device="cuda"`` (its
  pipeline schedules' token count) build on the CPU, while the trainer runs Megatron
  code, and nowhere else.
  Either way, scratch buffers Megatron cached on another device are dropped first.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
import weakref
from typing import Any, Iterator

import torch

from miles_megatron.multi_tensor import use_foreach_ops

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


#: Megatron's expert tensor-parallel size: experts are whole on the rank that owns them
EXPERT_TP = 1


def check_parallel_sizes(config: Any) -> None:
    """What this version runs: TP, EP, PP and CP in any combination (one trainer process per
    rank of ``TP x PP x CP x DP``, DP a multiple of the smallest that EP divides into); the
    sizes must be positive."""
    bad = [f"{flag} {getattr(config, dest)}" for flag, dest in PARALLEL_FLAGS.items() if int(getattr(config, dest)) < 1]
    if bad:
        raise ValueError(f"--train-backend megatron: {', '.join(bad)}: model-parallel sizes are at least 1")


def config_sizes(config: Any):
    """The :class:`~miles_megatron.parallel.Sizes` a config asks for: DP from the trainer
    processes (``--actor-num-nodes x --actor-num-gpus-per-node`` = TP x PP x CP x DP) when they
    divide so (DP a multiple of the smallest EP allows), else that smallest DP (the
    placement check then names the processes wanted)."""
    from miles_host.distributed.placement import num_trainers

    from miles_megatron.parallel import Sizes

    smallest = Sizes(int(config.tensor_model_parallel_size), int(config.expert_model_parallel_size),
                     int(config.pipeline_model_parallel_size), cp=int(config.context_parallel_size))
    trainers, model_parallel = num_trainers(config), smallest.tp * smallest.pp * smallest.cp
    if trainers % model_parallel == 0 and (trainers // model_parallel) % smallest.dp == 0:
        return Sizes(smallest.tp, smallest.ep, smallest.pp, trainers // model_parallel, smallest.cp)
    return smallest


def model_parallel_world(config: Any) -> int:
    """Trainer processes of the run: ``TP * PP * CP * DP`` (:func:`config_sizes`)."""
    return config_sizes(config).world


def init_model_parallel(device: torch.device, tp: int = 1, ep: int = 1, pp: int = 1,
                        timeout_s: float | None = None, dp: int = 0, cp: int = 1, vpp: int = 1) -> None:
    """Megatron ``parallel_state`` with TP = ``tp``, EP = ``ep``, PP = ``pp``, CP = ``cp``
    (expert TP = :data:`EXPERT_TP`; DP ``dp``, 0: the smallest EP allows), ``vpp`` model
    chunks (virtual pipeline stages) per pipeline rank.

    Sizes 1: a one-rank default group (created here if none exists). Above 1: the
    default group must already hold the ``tp * pp * dp`` trainer ranks (the launcher's
    trainer group, see :mod:`miles_host.distributed.launcher`). ``timeout_s``
    (``--worker-timeout``): the timeout of Megatron's subgroups, whole minutes rounded up
    (Megatron's default is 30 minutes: a rank whose peer failed mid-step would wait that
    long in a TP/EP/PP collective before the run could stop)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from miles_megatron.parallel import Sizes

    sizes = Sizes(tp, ep, pp, dp, cp)
    world, what = sizes.world, sizes.describe()
    if not dist.is_initialized():
        if world != 1:
            raise ValueError(
                f"--train-backend megatron with {what} needs {world} trainer processes in a default "
                "process group (started by the trainer launcher); none exists here"
            )
        backend = "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        global _OWNS_ONE_RANK_GROUP
        _OWNS_ONE_RANK_GROUP = True
    elif dist.get_world_size() != world:
        raise ValueError(
            f"--train-backend megatron with {what} runs {world} trainer process(es), but "
            f"torch.distributed has {dist.get_world_size()} ranks here"
        )
    global _STATE_ON
    default = dist.distributed_c10d._get_default_group()
    if parallel_state.model_parallel_is_initialized() and _STATE_ON is not None and _STATE_ON() is not default:
        # left by an earlier run whose default group is gone (the launcher destroys it)
        parallel_state.destroy_model_parallel()
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_world_size(),
                parallel_state.get_context_parallel_world_size())
        if have != (tp, ep, pp, EXPERT_TP, cp):
            raise ValueError(f"Megatron's parallel state already has TP x EP x PP (expert TP) x CP = {have}, not "
                             f"{(tp, ep, pp, EXPERT_TP, cp)}")
    else:
        minutes = {} if timeout_s is None else {"distributed_timeout_minutes": max(1, math.ceil(timeout_s / 60))}
        parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=EXPERT_TP, **minutes)
        _STATE_ON = weakref.ref(default)
    # (what initialize_model_parallel's virtual size sets; set here for a reused state too)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    parallel_state.set_virtual_pipeline_model_parallel_rank(0 if vpp > 1 else None)
    _fix_megatron_without_te()


#: the default group Megatron's parallel state was built on (weak: it may be destroyed)
_STATE_ON: "weakref.ref | None" = None
#: :func:`init_model_parallel` created the one-rank default group (it destroys it on leave)
_OWNS_ONE_RANK_GROUP = False


def leave_model_parallel() -> None:
    """Undo :func:`init_model_parallel`: Megatron's parallel state, and the one-rank
    default group if it created one (a process may run another trainer, or build its own
    parallel state, afterwards)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    global _STATE_ON, _OWNS_ONE_RANK_GROUP
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _STATE_ON = None
    if _OWNS_ONE_RANK_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWNS_ONE_RANK_GROUP = False


def seed_rng(seed: int, device: torch.device) -> None:
    """Megatron's RNG tracker: on GPU the CUDA one (``model_parallel_cuda_manual_seed``,
    which also reseeds the device's default generator: its state is put back, so the
    rollout's sampling stream does not depend on the training backend); on CPU a
    tracker whose forks do nothing (Megatron's own inference tracker; dropout is off
    in this backend)."""
    from megatron.core.tensor_parallel import random as megatron_random

    if device.type != "cuda":
        megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        return
    with torch.cuda.device(device):
        state = torch.cuda.get_rng_state()
        megatron_random.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        torch.cuda.set_rng_state(state)


def _fix_megatron_without_te() -> None:
    """megatron-core 0.16 tests ``te_general_gemm is not None`` in the router GEMM but
    only defines the name when TransformerEngine imports; and its MLA module believes
    TransformerEngine present when Megatron's TE extension imports (with mock classes in
    place of TE's, which its ``isinstance`` checks then reject): told the truth. Its
    optimizers' gradient norm and scaling without Apex or TransformerEngine run on
    :mod:`miles_megatron.multi_tensor`'s ops."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False
    use_foreach_ops()


_lock = threading.RLock()
_depth = 0
_saved: list[tuple[Any, str, Any]] = []


def _cpu_stand_ins() -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, replacement)`` of the CUDA calls Megatron makes on CPU."""
    from megatron.core.tensor_parallel import random as megatron_random

    return [
        (torch.cuda, "current_device", lambda: "cpu"),
        # the pipeline schedules' shape exchange synchronises the device (nothing to wait for)
        (torch.cuda, "synchronize", lambda *args, **kwargs: None),
        # activation recomputation saves and restores the CUDA RNG (there is none; dropout is off)
        (megatron_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)),
        (megatron_random, "_set_cuda_rng_state", lambda *args, **kwargs: None),
    ]


class _CudaFactoriesOnCpu(torch.overrides.TorchFunctionMode):
    """Tensor factories asked for ``device="cuda"`` (Megatron's pipeline schedules count
    tokens in such a tensor) build on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """While Megatron code runs for a trainer on ``device`` (see module doc; re-entrant)."""
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            _drop_foreign_scratch(torch.device("cuda", torch.cuda.current_device()))
            yield
        return
    with _cpu_stand_ins_held(), _CudaFactoriesOnCpu():
        _drop_foreign_scratch(torch.device("cpu"))
        yield


def _drop_foreign_scratch(device: torch.device) -> None:
    """Megatron's global scratch buffers (attention scores) are cached per name and dtype
    whatever their device: drop those another device's trainer left (a CPU and a GPU
    trainer in one process, or two GPUs)."""
    from megatron.core import parallel_state

    memory = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if memory is None:
        return
    for key in [key for key, tensor in memory.buffer.items() if tensor.device != device]:
        del memory.buffer[key]


@contextlib.contextmanager
def _cpu_stand_ins_held() -> Iterator[None]:
    global _depth
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
