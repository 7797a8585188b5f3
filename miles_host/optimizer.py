"""The trainer's optimizer: ``--optimizer`` adam or sgd, Megatron's weight-decay groups,
and ``--optimizer-cpu-offload``.

Weight decay follows Megatron-LM (``megatron/core/optimizer``): biases and every
one-dimensional parameter (norm weights) take none; matrices and embeddings take
``--weight-decay``.

With ``--optimizer-cpu-offload`` the optimizer keeps float32 master copies of the
parameters and its state on the CPU: each step copies the gradients there, steps, and
copies the parameters back to the device (Megatron's CPU optimizer does the same, so the
device holds no optimizer state).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Callable, Iterable, Iterator

import torch


def no_weight_decay(name: str, parameter: torch.Tensor) -> bool:
    """Megatron's rule: biases and 1-D parameters (norm weights) are not decayed."""
    return name.endswith(".bias") or parameter.dim() <= 1


def parameter_groups(named_parameters: Iterable[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict]:
    """Two groups, decayed and not (an empty one is left out), over the trainable parameters;
    one group without weight decay (the layout of checkpoints written before the split)."""
    decayed, plain = [], []
    for name, parameter in named_parameters:
        if parameter.requires_grad:
            (plain if no_weight_decay(name, parameter) and weight_decay else decayed).append(parameter)
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def _adam(groups: list[dict], config: Any, lr: float, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                             fused=fused)


def _sgd(groups: list[dict], config: Any, lr: float, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=lr, momentum=config.sgd_momentum)


#: ``--optimizer`` name -> the torch optimizer over parameter groups
OPTIMIZER_BUILDERS: dict[str, Callable[[list[dict], Any, float, bool], torch.optim.Optimizer]] = {
    "adam": _adam,
    "sgd": _sgd,
}


def build_optimizer(named_parameters: Iterable[tuple[str, torch.Tensor]], config: Any, *, lr: float | None = None,
                    fused: bool = False, cpu_offload: bool = False) -> torch.optim.Optimizer:
    """The ``--optimizer`` over Megatron's weight-decay groups (on CPU with ``cpu_offload``)."""
    lr = config.lr if lr is None else lr
    groups = parameter_groups(named_parameters, config.weight_decay)
    if cpu_offload:
        return CpuOffloadOptimizer(groups, lambda cpu_groups: OPTIMIZER_BUILDERS[config.optimizer](
            cpu_groups, config, lr, False), lr)
    return OPTIMIZER_BUILDERS[config.optimizer](groups, config, lr, fused)


class _MasterStateView(MutableMapping):
    """``optimizer.state`` of a :class:`CpuOffloadOptimizer`, keyed by the device parameters as
    a torch optimizer's is: reading one gives its CPU state copied to the parameter's device (what
    a backend that gathers the state across ranks needs), writing one stores it on the CPU.
    Iteration lists nothing: code that moves every optimizer tensor between devices
    (``--offload-train``) leaves the CPU state where it is."""

    def __init__(self, owner: "CpuOffloadOptimizer"):
        self.owner = owner

    def _master(self, parameter: torch.Tensor) -> torch.Tensor:
        master = self.owner.master_of.get(id(parameter))
        if master is None:
            raise KeyError("not a parameter of this optimizer")
        return master

    def __getitem__(self, parameter: torch.Tensor) -> dict:
        master = self._master(parameter)
        if master not in self.owner.inner.state:
            raise KeyError("no state yet")
        return {key: value.to(parameter.device) if torch.is_tensor(value) and key != "step" else value
                for key, value in self.owner.inner.state[master].items()}

    def __setitem__(self, parameter: torch.Tensor, state: dict) -> None:
        self.owner.inner.state[self._master(parameter)] = {
            key: value.detach().to("cpu", torch.float32) if torch.is_tensor(value) else value
            for key, value in state.items()}

    def __delitem__(self, parameter: torch.Tensor) -> None:
        del self.owner.inner.state[self._master(parameter)]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(())

    def __len__(self) -> int:
        return 0


class CpuOffloadOptimizer(torch.optim.Optimizer):
    """An optimizer whose state and step live on the CPU.

    Its own ``param_groups`` hold the device parameters (the learning-rate schedule sets
    ``lr`` there; ``zero_grad`` clears their gradients); ``state`` is a view of the CPU
    state by device parameter (:class:`_MasterStateView`). The inner optimizer steps float32
    CPU copies; :meth:`step` copies gradients in and parameters out. ``state_dict`` is the
    inner optimizer's."""

    def __init__(self, groups: list[dict], make_inner: Callable[[list[dict]], torch.optim.Optimizer], lr: float):
        super().__init__(groups, {"lr": lr})
        self.masters = [[p.detach().to("cpu", torch.float32, copy=True) for p in group["params"]]
                        for group in self.param_groups]
        cpu_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": masters}
                      for group, masters in zip(self.param_groups, self.masters)]
        self.inner = make_inner(cpu_groups)
        self.master_of = {id(p): m for group, masters in zip(self.param_groups, self.masters)
                          for p, m in zip(group["params"], masters)}
        self.state = _MasterStateView(self)
        #: the masters are copied again from the parameters before the first step: whatever set the
        #: parameters after construction (a data-parallel broadcast, a checkpoint) is what trains
        self._masters_current = False

    @torch.no_grad()
    def _copy_parameters_to_masters(self) -> None:
        for group, masters in zip(self.param_groups, self.masters):
            for parameter, master in zip(group["params"], masters):
                master.copy_(parameter.detach().to("cpu", torch.float32))
        self._masters_current = True

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        if closure is not None:
            raise ValueError("--optimizer-cpu-offload: a closure cannot be re-evaluated on the CPU copies")
        if not self._masters_current:
            self._copy_parameters_to_masters()
        for group, inner_group, masters in zip(self.param_groups, self.inner.param_groups, self.masters):
            inner_group["lr"] = group["lr"]
            for parameter, master in zip(group["params"], masters):
                master.grad = None if parameter.grad is None else parameter.grad.detach().to("cpu", torch.float32)
        self.inner.step()
        for group, masters in zip(self.param_groups, self.masters):
            for parameter, master in zip(group["params"], masters):
                if master.grad is not None:
                    parameter.copy_(master.to(parameter.device, parameter.dtype), non_blocking=True)
                master.grad = None

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)
        self._copy_parameters_to_masters()  # the masters follow the parameters (loaded with the model)
