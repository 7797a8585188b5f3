"""INT4 weights on the rollout side: weight-only INT4 modules and the weight-sync conversion.

:func:`prepare_rollout_model` replaces each selected ``torch.nn.Linear`` by an
:class:`Int4Linear` and each MoE :class:`~miles_host.models.mlp.Experts` by an
:class:`Int4Experts`. Their state is compressed-tensors' triple per weight,
``<name>_packed`` (int32, 8 nibbles each), ``<name>_scale`` (bf16) and
``<name>_shape`` (int64), exactly what :func:`convert_for_rollout` emits at weight
sync, so the engine's ordinary ``update_weights`` (by name) loads it.

Two GEMMs, chosen by ``--int4-rollout-gemm``:

- ``dequant``: dequantize (the QAT forward's own formula) then ``F.linear``. The
  rollout logits equal the QAT training forward's bit for bit.
- ``packed``: INT4 GEMM kernels (:mod:`miles_int4.kernels`) on the weights in the
  kernel's layout only: on CUDA the ``halves`` layout, multiplied by the Triton
  small-M kernel at decode (:mod:`miles_int4.decode_gemm`) and dequantized for
  ``F.linear`` at prefill; on CPU torch's int4 kernel. The module claims the
  compressed-tensors names as weight sinks and repacks what a sync sends in place
  (CUDA-graph safe). Layers whose shape the kernel does not take fall back to ``dequant``.

``auto`` (default) is ``packed`` on CUDA unless ``--true-on-policy``, else ``dequant``.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterable

import torch
import torch.nn.functional as F

from miles_host.kernels.moe_grouped import FUSED_ACTIVATIONS, Routing, fused_moe
from miles_host.models.mlp import Experts, routed_forward, uses_fused_moe
from miles_host.rollout.weights import WeightSink
from miles_int4.kernels import PackedInt4, int4_mm, kernel_supports, pack_for_kernel
from miles_int4.moe_fused import Int4ExpertGemms
from miles_int4.quant import check_groupable, compress, dequantize_packed, pack_int32, quantize, unpack_int32
from miles_int4.settings import int4_settings
from miles_int4.targets import is_target, target_parameters


class _Int4Weights(torch.nn.Module):
    """INT4 weights held one of two ways.

    ``dequant``: compressed-tensors buffers (``<name>_packed``, ``_scale``, ``_shape``),
    updated by ``copy_`` at weight sync. ``packed``: only the int4 kernel's layout;
    the module claims the three names as weight sinks (:mod:`miles_host.rollout.weights`),
    stages what a sync sends and repacks it in place (addresses kept: captured CUDA
    graphs read them), so the weights are held once.
    """

    def _setup_int4(self, device: torch.device) -> None:
        self._device = device
        self._staged: dict[str, dict[str, torch.Tensor]] = {}
        self._sink_specs: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
        self._expected_shape: dict[str, list[int]] = {}
        self._kernel_copies: dict[str, list[PackedInt4]] = {}
        self._act_dtype: torch.dtype | None = None

    @property
    def weight_device(self) -> torch.device:
        """The device of the weights (in the packed layout they are held outside ``state_dict``)."""
        return self._device

    def _register_int4(self, name: str, weight: torch.Tensor, group_size: int) -> None:
        q, scale = quantize(weight, group_size)
        packed = pack_int32(q)
        shape = torch.tensor(list(weight.shape), dtype=torch.int64, device=weight.device)
        if not self.use_kernel:
            self.register_buffer(f"{name}_packed", packed)
            self.register_buffer(f"{name}_scale", scale)
            self.register_buffer(f"{name}_shape", shape)
            return
        self._sink_specs[name] = {
            part: (tuple(t.shape), t.dtype) for part, t in (("packed", packed), ("scale", scale), ("shape", shape))
        }
        self._expected_shape[name] = list(weight.shape)
        self._staged[name] = {"packed": packed, "scale": scale}

    def _dequantized(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_packed(getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale"), dtype)

    def _kernels(self, act_dtype: torch.dtype) -> dict[str, list[PackedInt4]]:
        if self._staged:
            self.refresh(act_dtype)
        return self._kernel_copies

    # -- weight sync (packed path) ---------------------------------------------------

    def miles_weight_sinks(self) -> dict[str, WeightSink]:
        """The compressed-tensors names this module loads itself (packed path only)."""
        if not self.use_kernel:
            return {}
        sinks = {}
        for name, parts in self._sink_specs.items():
            for part, (shape, dtype) in parts.items():
                sinks[f"{name}_{part}"] = WeightSink(shape, dtype, self._device, partial(self._receive, name, part))
        return sinks

    def _receive(self, name: str, part: str, tensor: torch.Tensor) -> None:
        if part == "shape":
            if tensor.tolist() != self._expected_shape[name]:
                raise ValueError(f"INT4 weight {name}: synced shape {tensor.tolist()}, expected {self._expected_shape[name]}")
            return
        # a copy: the sender may reuse its buffer before the other half of the pair arrives
        self._staged.setdefault(name, {})[part] = tensor.clone()

    @torch.no_grad()
    def refresh(self, act_dtype: torch.dtype | None = None) -> None:
        """Repack every staged ``(packed, scale)`` pair into the kernel copies (in place when they exist)."""
        if not self.use_kernel:
            return
        self._act_dtype = act_dtype or self._act_dtype or torch.float32
        for name in [n for n, parts in self._staged.items() if {"packed", "scale"} <= parts.keys()]:
            parts = self._staged.pop(name)
            q = unpack_int32(parts["packed"])
            q = q.reshape(-1, *q.shape[-2:])  # [E or 1, N, K]
            scale = parts["scale"].reshape(-1, *parts["scale"].shape[-2:])
            fresh = [pack_for_kernel(q[i], scale[i], self._act_dtype) for i in range(q.shape[0])]
            old = self._kernel_copies.get(name)
            if old is not None and old[0].weight.device == fresh[0].weight.device:
                for mine, new in zip(old, fresh):  # keep addresses: captured CUDA graphs read these
                    mine.weight.copy_(new.weight)
                    mine.scales.copy_(new.scales)
            else:
                self._kernel_copies[name] = fresh

    def miles_weights_updated(self) -> None:
        """Called by the host after a weight update (see :func:`refresh_int4_weights`)."""
        self.refresh()


class Int4Linear(_Int4Weights):
    """``F.linear`` with a weight-only INT4 weight (``weight_packed``, ``weight_scale``, ``weight_shape``)."""

    int4_names = ("weight",)

    def __init__(self, linear: torch.nn.Linear, group_size: int, use_kernel: bool):
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.group_size = group_size
        self.use_kernel = use_kernel and kernel_supports(self.out_features, self.in_features, linear.weight.device)
        self._setup_int4(linear.weight.device)
        self._register_int4("weight", linear.weight.detach(), group_size)
        self.bias = linear.bias

    @property
    def can_dequantize(self) -> bool:
        """Whether :meth:`dequantized_weight` can answer: the compressed-tensors buffers are held
        (the packed path keeps only the kernel's layout)."""
        return not self.use_kernel

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as ``dtype`` (MLA's latent path reads ``kv_b_proj`` so)."""
        if self.use_kernel:
            raise ValueError("Int4Linear: the packed path holds only the kernel's layout; build it with use_kernel=False")
        return self._dequantized("weight", dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            y = int4_mm(x, self._kernels(x.dtype)["weight"][0])
            return y if self.bias is None else y + self.bias
        return F.linear(x, self._dequantized("weight", x.dtype), self.bias)

    def extra_repr(self) -> str:
        kernel = "packed" if self.use_kernel else "dequant"
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, gemm={kernel}"


class Int4Experts(_Int4Weights):
    """Routed experts with INT4 ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``.

    Rollout default (``--moe-kernel fused``, where Triton runs): the host's fused MoE
    with the grouped INT4 GEMMs of :mod:`miles_int4.moe_fused`, which read the
    compressed-tensors form (``packed``, ``scale``) directly: the buffers on the
    ``dequant`` path, on the ``packed`` path a copy kept next to the kernel layout and
    updated in place at each weight sync (CUDA-graph safe). ``--moe-kernel loop`` (and
    CPU) runs :meth:`Experts.forward`'s token loop, op for op (the rollout/QAT equality
    test guards that), with each expert's matmul done in INT4.
    """

    int4_names = ("gate_up_proj", "down_proj")
    #: ``forward`` takes the ``routing`` layout of the host's fused router
    takes_routing = True

    def __init__(self, experts: Experts, group_size: int, use_kernel: bool):
        super().__init__()
        self.num_experts = experts.num_experts
        self.act = experts.act
        self.act_name = getattr(experts, "act_name", None)
        #: inference path (``--moe-kernel``): the fused kernels or the per-expert loop
        self.moe_kernel = "fused"
        self.group_size = group_size
        device = experts.gate_up_proj.device
        self.use_kernel = use_kernel and all(
            kernel_supports(*getattr(experts, name).shape[1:], device) for name in self.int4_names
        )
        #: packed path: the compressed-tensors ``(packed, scale)`` per weight name, read by the fused kernel
        self._compressed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._setup_int4(device)
        for name in self.int4_names:
            self._register_int4(name, getattr(experts, name).detach(), group_size)

    @torch.no_grad()
    def refresh(self, act_dtype: torch.dtype | None = None) -> None:
        """Keep the staged compressed-tensors pairs (in place once they exist), then repack them."""
        for name, parts in self._staged.items() if self.use_kernel else ():
            if {"packed", "scale"} <= parts.keys():
                held = self._compressed.get(name)
                if held is not None and held[0].shape == parts["packed"].shape:
                    held[0].copy_(parts["packed"])
                    held[1].copy_(parts["scale"])
                else:
                    self._compressed[name] = (parts["packed"].to(self._device, copy=True),
                                              parts["scale"].to(self._device, copy=True))
        super().refresh(act_dtype)

    @property
    def weight_format(self) -> str:
        """The tile table's name of these weights (as ``Int4ExpertGemms`` names them)."""
        return f"int4_g{self.group_size}"

    def _fused_operands(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_kernel:
            if self._staged:
                self.refresh(self._act_dtype)
            return self._compressed[name]
        return getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")

    def _expert_linear(self, x: torch.Tensor, name: str, expert: int, cache: dict) -> torch.Tensor:
        if self.use_kernel:
            return int4_mm(x, cache[name][expert])
        packed = getattr(self, f"{name}_packed")[expert]
        scale = getattr(self, f"{name}_scale")[expert]
        return F.linear(x, dequantize_packed(packed, scale, x.dtype))

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                routing: Routing | None = None) -> torch.Tensor:
        """The routed experts' output; ``routing``: the layout of a fused router (the fused path reuses it)."""
        if uses_fused_moe(self, x_TH) and self.act_name in FUSED_ACTIVATIONS:
            gemms = Int4ExpertGemms(*self._fused_operands("gate_up_proj"), *self._fused_operands("down_proj"),
                                    self.act_name)
            return fused_moe(x_TH, ids_TK, weights_TK, gemms, routing=routing)
        cache = self._kernels(x_TH.dtype) if self.use_kernel else {}

        def expert_mlp(x_e: torch.Tensor, expert: int) -> torch.Tensor:
            gate, up = self._expert_linear(x_e, "gate_up_proj", expert, cache).chunk(2, dim=-1)
            return self._expert_linear(self.act(gate) * up, "down_proj", expert, cache)

        return routed_forward(x_TH, ids_TK, weights_TK, self.num_experts, expert_mlp)

    def extra_repr(self) -> str:
        kernel = "packed" if self.use_kernel else "dequant"
        return f"num_experts={self.num_experts}, group_size={self.group_size}, gemm={kernel}"


def _use_kernel(config: Any, device: torch.device) -> bool:
    gemm = int4_settings(config).rollout_gemm
    if gemm == "auto":
        return device.type == "cuda" and not getattr(config, "true_on_policy", False)
    return gemm == "packed"


def quantize_rollout_model(model: torch.nn.Module, group_size: int, target: str, use_kernel: bool) -> int:
    """Swap the ``target`` linears/experts of ``model`` for INT4 modules; return how many modules.

    Linears a parent reads in float (its ``absorbed_weight_names``: MLA's ``kv_b_proj`` over a
    latent cache) keep the compressed-tensors buffers, which dequantize, instead of a kernel layout."""
    selected: dict[str, torch.nn.Module] = {}
    for module_name, module, param_name in target_parameters(model, target):
        check_groupable(f"{module_name}.{param_name}", module._parameters[param_name].shape, group_size)
        selected[module_name] = module
    for module_name, module in selected.items():
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        kind = Int4Experts if isinstance(module, Experts) else Int4Linear
        dtype = next(module.parameters()).dtype
        absorbed = child in getattr(parent, "absorbed_weight_names", ())
        replacement = kind(module, group_size, use_kernel and not absorbed)
        replacement.refresh(dtype)  # kernel copies exist before any CUDA graph is captured
        setattr(parent, child, replacement)
    return len(selected)


def prepare_rollout_model(model: torch.nn.Module, config: Any) -> torch.nn.Module:
    """The ``int4`` recipe's rollout side: INT4 modules in place of the selected weights."""
    settings = int4_settings(config)
    device = next(model.parameters()).device
    quantize_rollout_model(model, settings.group_size, settings.target, _use_kernel(config, device))
    return model


def convert_for_rollout(named_tensors: Iterable[tuple[str, torch.Tensor]], config: Any) -> list[tuple[str, torch.Tensor]]:
    """Weight sync: each selected ``(name, w)`` -> ``name_packed``, ``name_scale``, ``name_shape``."""
    settings = int4_settings(config)
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named_tensors:
        if is_target(name, tensor.dim(), settings.target):
            out.extend(compress(name, tensor, settings.group_size))
        else:
            out.append((name, tensor))
    return out


def refresh_int4_weights(model: torch.nn.Module) -> int:
    """Re-pack every INT4 module's kernel copy after an in-place weight update; return how many."""
    modules = [m for m in model.modules() if isinstance(m, _Int4Weights) and m.use_kernel]
    for module in modules:
        module.refresh()
    return len(modules)
