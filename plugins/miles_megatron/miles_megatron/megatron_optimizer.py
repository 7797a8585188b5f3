"""Megatron-Core's optimizer for the megatron backend.

``get_megatron_optimizer`` over the trainer's DDP-wrapped model chunks. The parameters are
float32 (this backend's masters) and Megatron is told so (``bf16=False``), so it builds:

- without ``--use-distributed-optimizer``, its ``FP32Optimizer`` (one per parameter kind:
  dense, experts): a torch optimizer over the model's own parameters, its state keyed by
  them (no separate master copies); the DDP all-reduces the gradients;
- with ``--use-distributed-optimizer``, its distributed optimizer (ZeRO-1: each data-parallel
  rank keeps the Adam moments and the float32 master weights of its slice of the contiguous
  gradient buffer, the parameters' own slices here; the DDP reduce-scatters the gradients
  and, after the step, all-gathers the parameters).

The moments stay float32 (no precision-aware optimizer). The optimizer's settings are the
host's (:mod:`miles_host.optimizer`): ``--optimizer`` adam (AdamW), ``--lr``,
``--weight-decay`` (Megatron's groups: biases and 1-D parameters take none, as the host's;
Megatron leaves the group's ``wd_mult`` to its own scheduler, so it is applied here once),
``--adam-beta1/2``, ``--adam-eps``, ``--clip-grad``. With ``--optimizer-cpu-offload`` (not
with the distributed optimizer) each ``FP32Optimizer``'s torch optimizer is the host's
:class:`~miles_host.optimizer.CpuOffloadOptimizer` over the same groups: state and step on
the CPU, the parameters copied back to the device.

:class:`MegatronOptimizerStep` puts it where the host trainer keeps its torch optimizer:

- the learning rate: its one parameter group's ``lr`` is what the host's ``LambdaLR``
  (``--lr-decay-style`` and warm-up, :func:`~miles_host.lr_schedule.lr_lambda`) sets; each
  step copies it into every group of Megatron's optimizers (dense and expert);
- :meth:`~MegatronOptimizerStep.clip`: Megatron's gradient preparation (the DDP's reduced
  ``main_grad`` as the gradients of the parameters, or of this rank's master slice), its
  gradient norm over the whole model (each gradient counted once over TP / PP / DP / EP,
  the tied embedding's copy not at all) and its clipping to ``--clip-grad``; the host reads
  the norm and skips a step whose loss or norm is not finite (as it does for its own
  optimizer);
- :meth:`~MegatronOptimizerStep.step`: Megatron's step on the prepared gradients (the inner
  optimizer; with the distributed optimizer the masters back to the parameters and the DP
  all-gather);
- ``state``: the ``FP32Optimizer``'s per-parameter state, keyed by the model's parameters
  (:class:`InnerState`), read and written by the torch-format checkpoint
  (:mod:`miles_megatron.optimizer_state`) and moved by ``--offload-train``
  (:mod:`miles_host.offload`); empty for the distributed optimizer, whose state is keyed by
  its master slices;
- ``sharded_state_dict`` / ``load_state_dict``: Megatron's own (``torch_dist`` checkpoints,
  :mod:`miles_megatron.dist_ckpt`).

On CPU, Megatron-Core 0.16's optimizers want CUDA: the distributed optimizer accepts only
parameters whose ``Tensor.type()`` names a CUDA type (its clipping asserts the same of the
gradients), and its checkpoint state is gathered after ``Tensor.cuda()``: while they run,
CPU tensors answer their CUDA type's name and stay where they are for ``cuda()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import MutableMapping
from typing import Any, Iterator

import torch


def optimizer_config(config: Any):
    """Megatron's ``OptimizerConfig`` from the host's flags (see module doc)."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer=config.optimizer, lr=config.lr, min_lr=config.min_lr, weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
        sgd_momentum=config.sgd_momentum, clip_grad=config.clip_grad,
        use_distributed_optimizer=config.use_distributed_optimizer,
        params_dtype=torch.float32, bf16=False, fp16=False, use_precision_aware_optimizer=False,
    )


#: the distributed optimizer's checkpoint layout: its moments as the model's tensors (each
#: parameter's moments keyed and sharded as the parameter), so a checkpoint loads on another
#: TP / PP / DP layout (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``)
SHARDING = "fully_reshardable"


class _CpuAsCuda(torch.overrides.TorchFunctionMode):
    """``Tensor.type()`` of a CPU tensor answers its CUDA type name, and ``Tensor.cuda()``
    (the checkpoint's state gathering copies to the device before its collective) is the
    tensor itself (see module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda and args[0].device.type == "cpu":
            return args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def _on(device: torch.device) -> Iterator[None]:
    """Megatron's device context (:func:`~miles_megatron.runtime.on_device`), on CPU with
    :class:`_CpuAsCuda`."""
    from miles_megatron.runtime import on_device

    with on_device(device), (_CpuAsCuda() if torch.device(device).type == "cpu" else contextlib.nullcontext()):
        yield


class MegatronOptimizerStep(torch.optim.Optimizer):
    """Megatron's optimizer behind the torch optimizer interface the host trainer uses
    (see module doc). ``megatron``: what ``get_megatron_optimizer`` built."""

    def __init__(self, megatron: Any, params: list[torch.nn.Parameter], lr: float, device: torch.device):
        super().__init__([{"params": params}], {"lr": lr})
        self.megatron = megatron
        self.device = torch.device(device)
        self.state = InnerState(megatron)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.megatron.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def clip(self) -> torch.Tensor:
        """Megatron's gradient preparation, norm and clipping (see module doc): the norm
        before clipping, every rank the same."""
        with _on(self.device):
            self.megatron.prepare_grads()
            norm = float(self.megatron.get_grad_norm())
            clip_grad = self.megatron.config.clip_grad
            # Megatron's clip scales only below this coefficient; its per-parameter list
            # building (after the norm's host read, with the GPU idle) is skipped otherwise
            clips = clip_grad > 0 and clip_grad / (norm + 1.0e-6) < 1.0
            for optimizer in getattr(self.megatron, "chained_optimizers", [self.megatron]) if clips else []:
                parameters = optimizer.get_parameters()
                if parameters:
                    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

                    clip_grad_by_total_norm_fp32(parameters, max_norm=clip_grad, total_norm=norm)
        return torch.tensor(norm, dtype=torch.float64)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Megatron's step on the gradients :meth:`clip` prepared, at this group's ``lr``."""
        if closure is not None:
            raise ValueError("the megatron backend's optimizer takes no closure")
        self._share_lr()
        with _on(self.device):
            self.megatron.step_with_ready_grads()

    def _share_lr(self) -> None:
        """This group's ``lr`` (the schedule's) into every group of Megatron's optimizers."""
        for group in self.megatron.param_groups:
            group["lr"] = self.param_groups[0]["lr"]

    def sharded_state_dict(self, model_state: dict, is_loading: bool = False) -> dict:
        """Megatron's sharded optimizer state, :data:`SHARDING` (see there), with the
        schedule's next learning rate."""
        self._share_lr()
        if is_loading:
            for optimizer in self.megatron.chained_optimizers:
                _allocate_state(getattr(optimizer.optimizer, "inner", optimizer.optimizer))
        with _on(self.device):
            return self.megatron.sharded_state_dict(model_state, is_loading=is_loading,
                                                    metadata={"distrib_optim_sharding_type": SHARDING})

    def state_dict(self) -> dict:
        raise ValueError("the megatron trainer's optimizer state is saved per parameter (--ckpt-format torch: "
                         "miles_megatron.optimizer_state) or as Megatron's shards (--ckpt-format torch_dist), "
                         "not as one torch state_dict")

    def load_state_dict(self, state_dict: dict) -> None:
        """What :meth:`sharded_state_dict` read back from a torch_dist checkpoint (the learning
        rate the schedule had set comes back with Megatron's parameter groups)."""
        with _on(self.device):
            self.megatron.load_state_dict(state_dict)
        self.param_groups[0]["lr"] = self.megatron.param_groups[0]["lr"]


def build_megatron_optimizer(chunks: list[torch.nn.Module], config: Any, device: torch.device) -> MegatronOptimizerStep:
    """Megatron's optimizer over the rank's model ``chunks`` (each a ``DistributedDataParallel``,
    built with ``use_distributed_optimizer`` as ``--use-distributed-optimizer`` says) with the
    host's settings (see module doc)."""
    from megatron.core.optimizer import get_megatron_optimizer

    from miles_megatron.runtime import quiet_imports

    with quiet_imports(), _on(device):
        megatron = get_megatron_optimizer(optimizer_config(config), list(chunks))
    for optimizer in megatron.chained_optimizers:
        if optimizer.optimizer is None:  # (a rank without parameters of this kind)
            continue
        for group in optimizer.optimizer.param_groups:
            group["weight_decay"] = config.weight_decay * group["wd_mult"]  # (Megatron's scheduler does this)
        if config.use_distributed_optimizer:
            _load_keeps_the_step(optimizer)
        elif config.optimizer_cpu_offload:
            optimizer.optimizer = _on_cpu(optimizer.optimizer, config)
        elif torch.device(device).type == "cuda":
            use_fused_kernel(optimizer.optimizer)
    params = [param for ddp in chunks for param in ddp.module.parameters() if param.requires_grad]
    return MegatronOptimizerStep(megatron, params, config.lr, device)


def use_fused_kernel(inner: torch.optim.Optimizer) -> None:
    """Megatron's torch Adam / AdamW (its optimizer without TransformerEngine or Apex: foreach,
    a host loop over the parameters for the bias corrections and about ten passes over the
    state) on torch's fused kernel, as the native trainer's AdamW on CUDA (Megatron with
    TransformerEngine runs TE's FusedAdam). Before the first step: the per-parameter ``step``
    counters are then created on the parameters' device (:func:`step_counter`)."""
    if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or inner.state:
        return
    for group in (inner.defaults, *inner.param_groups):
        group["fused"], group["foreach"] = True, False


def step_counter(optimizer: torch.optim.Optimizer, param: torch.Tensor, value: float) -> torch.Tensor:
    """A ``step`` state entry for ``param`` in ``optimizer`` (torch's rule: on the parameter's
    device where the optimizer runs fused or capturable, else a CPU scalar)."""
    on_device = any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)
    return torch.tensor(float(value), dtype=torch.float32, device=param.device if on_device else "cpu")


def _on_cpu(optimizer: torch.optim.Optimizer, config: Any) -> torch.optim.Optimizer:
    """``optimizer`` (a torch optimizer over the device parameters) as the host's
    :class:`~miles_host.optimizer.CpuOffloadOptimizer` of the ``--optimizer`` over the same
    groups (see module doc)."""
    from miles_host.optimizer import OPTIMIZER_BUILDERS, CpuOffloadOptimizer

    make = OPTIMIZER_BUILDERS[config.optimizer]
    return CpuOffloadOptimizer(optimizer.param_groups, lambda groups: make(groups, config, config.lr, False), config.lr)


class InnerState(MutableMapping):
    """The per-parameter state of Megatron's ``FP32Optimizer`` torch optimizers, keyed by the
    model's parameters as a torch optimizer's ``state`` is (see module doc): each parameter's
    entry lives in the optimizer that holds it. Iteration lists the parameters with state."""

    def __init__(self, megatron: Any):
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        self.optimizers = [optimizer.optimizer for optimizer in megatron.chained_optimizers
                           if not isinstance(optimizer, DistributedOptimizer) and optimizer.optimizer is not None]
        self.owner = {id(param): inner for inner in self.optimizers
                      for group in inner.param_groups for param in group["params"]}

    def step_counter(self, param: torch.Tensor, value: float) -> torch.Tensor:
        """A ``step`` entry for ``param``'s state, where its optimizer keeps one (:func:`step_counter`)."""
        return step_counter(self._inner(param), param, value)

    def _inner(self, param: torch.Tensor) -> torch.optim.Optimizer:
        inner = self.owner.get(id(param))
        if inner is None:
            raise KeyError("not a parameter of Megatron's FP32Optimizer")
        return inner

    def __getitem__(self, param: torch.Tensor) -> dict:
        inner = self._inner(param)
        if param not in inner.state:
            raise KeyError("no state yet")
        return inner.state[param]

    def __setitem__(self, param: torch.Tensor, state: dict) -> None:
        self._inner(param).state[param] = state

    def __delitem__(self, param: torch.Tensor) -> None:
        del self._inner(param).state[param]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for inner in self.optimizers:
            yield from list(inner.state)

    def __len__(self) -> int:
        return sum(len(inner.state) for inner in self.optimizers)


def _load_keeps_the_step(optimizer: Any) -> None:
    """Two things Megatron-Core 0.16's distributed optimizer gets wrong when it loads into
    ``torch.optim.AdamW`` (its Adam without TransformerEngine or Apex), which keeps a ``step``
    tensor per parameter: it gives every parameter the same ``step`` tensor (restored from the
    parameter groups), which AdamW then increments in place once per parameter; and it loads a
    ``fully_reshardable`` state key by key, expecting a per-parameter ``step`` that format does
    not hold. Each parameter here gets its own copy of the restored step, and the loaded
    tensors that step."""
    original = optimizer._set_main_param_and_optimizer_states

    def set_states(model_param: torch.nn.Parameter, tensors: dict) -> None:
        group, order = optimizer.model_param_group_index_map[model_param]
        state = optimizer.optimizer.state[optimizer.optimizer.param_groups[group]["params"][order]]
        if "step" in state:
            state["step"] = state["step"].detach().clone()
            if "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
        original(model_param, tensors)

    optimizer._set_main_param_and_optimizer_states = set_states


def _allocate_state(adam: torch.optim.Optimizer) -> None:
    """Zero moments and step for the parameters of a ``torch.optim.AdamW`` that has taken no step
    yet: Megatron-Core 0.16 reads the step from the inner state when it builds the sharded state
    to load into (TransformerEngine's and Apex's Adam keep it in the parameter groups), and the
    loaded moments are copied into these tensors. (Another Adam keeps its own state layout.)"""
    if type(adam) not in (torch.optim.AdamW, torch.optim.Adam):
        return
    for group in adam.param_groups:
        for param in group["params"]:
            state = adam.state[param]
            if "exp_avg" not in state:
                state.update(step=step_counter(adam, param, 0.0), exp_avg=torch.zeros_like(param),
                             exp_avg_sq=torch.zeros_like(param))
