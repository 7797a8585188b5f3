"""Quantization-aware training: the selected weights are fake-quantized in every forward.

A name-preserving parametrization: the module's class is swapped for a subclass
whose ``weight`` (or ``gate_up_proj`` / ``down_proj``) attribute is the INT4
fake-quantized master weight *inside* the module's forward, computed once per
forward and shared by every read (the experts loop indexes it per expert). The
master parameter stays where it was (``module._parameters[name]``), so
``state_dict`` names, the optimizer, checkpoints, FSDP and weight sync see the
float master weights unchanged; outside forward the attribute is the master too.
The gradient passes straight through the quantizer (STE).
"""

from __future__ import annotations

from typing import Any

import torch

from miles_int4.quant import check_groupable, fake_quantize
from miles_int4.targets import target_parameters

_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


class Int4FakeQuantMixin:
    """Forward with the ``int4_params`` replaced by their fake-quantized values."""

    int4_params: tuple[str, ...] = ()
    int4_group_size: int = 128

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_int4_active") is not None:  # re-entrant call: reuse
            return super().forward(*args, **kwargs)
        self.__dict__["_int4_active"] = {
            name: fake_quantize(self._parameters[name], self.int4_group_size) for name in self.int4_params
        }
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.__dict__["_int4_active"] = None

    def int4_effective_weight(self, name: str) -> torch.Tensor:
        """The fake-quantized value of parameter ``name`` (what forward multiplies by)."""
        return fake_quantize(self._parameters[name], self.int4_group_size)


def _quantized_attribute(name: str) -> property:
    def get(self):
        active = self.__dict__.get("_int4_active")
        return active[name] if active is not None else self._parameters[name]

    return property(get, doc=f"``{name}``: fake-quantized inside forward, the master parameter outside")


def _qat_class(cls: type, names: tuple[str, ...]) -> type:
    key = (cls, names)
    if key not in _CLASSES:
        attributes = {name: _quantized_attribute(name) for name in names}
        attributes["int4_params"] = names
        _CLASSES[key] = type(f"Int4QAT{cls.__name__}", (Int4FakeQuantMixin, cls), attributes)
    return _CLASSES[key]


def apply_fake_quant(model: torch.nn.Module, group_size: int, target: str) -> int:
    """Fake-quantize the ``target`` weights of ``model`` in place; return how many weights.

    Checks every selected weight first (ValueError naming the layer and shape when
    ``group_size`` does not divide its input dim), then swaps classes.
    """
    selected: dict[torch.nn.Module, list[str]] = {}
    for module_name, module, param_name in target_parameters(model, target):
        check_groupable(f"{module_name}.{param_name}", module._parameters[param_name].shape, group_size)
        selected.setdefault(module, []).append(param_name)
    for module, names in selected.items():
        if isinstance(module, Int4FakeQuantMixin):
            names = sorted(set(names) | set(module.int4_params))
            base = type(module).__mro__[2]
        else:
            base = type(module)
        module.__class__ = _qat_class(base, tuple(names))
        module.int4_group_size = group_size
        module.__dict__["_int4_active"] = None
    return sum(len(names) for names in selected.values())
