"""The LoRA linear layer: a frozen base linear plus low-rank adapters on row slices.

One native linear may hold several HF linears fused along its output rows (``qkv_proj`` =
``q_proj``, ``k_proj``, ``v_proj``; ``gate_up_proj`` = ``gate_proj``, ``up_proj``). PEFT
adapts each HF linear on its own, so :class:`LoraLinear` keeps one ``(A, B)`` pair per
adapted HF part and adds its update to that part's rows only: the fused layer computes
exactly what the separate PEFT-wrapped linears compute.

For each part ``p`` with rows ``[start, stop)``::

    y[:, start:stop] += scaling * B_p @ A_p @ dropout(x)      scaling = alpha / r

A plain ``torch.nn.Linear`` becomes a :class:`LoraLinear`. A precision recipe's quantized
linear (INT4 / FP8 weights and GEMMs) keeps its own forward and state and gets the adapters
next to them (:func:`adapt_in_place`): ``quantized_base(x) + scaling * B(A x)``, ``A`` and
``B`` in the activations' dtype.

``A_p [r, in]`` starts as ``torch.nn.Linear``'s (Kaiming-uniform, PEFT's default) and
``B_p [stop - start, r]`` as zeros, so a fresh adapter leaves the model unchanged.
Tensor legend: T tokens, I in features, O out features, R rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LoraPart:
    """One adapted HF linear inside a native linear: its leaf ``key`` (``q_proj``), its
    full HF module path, and the rows ``[start, stop)`` of the native weight it owns."""

    key: str
    hf_module: str
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


class LoraAdapters:
    """The adapter half of a LoRA layer (a mixin of ``torch.nn.Module`` classes): one LoRA pair
    per :class:`LoraPart`, ``lora_A.<key>`` ``[R, I]`` and ``lora_B.<key>`` ``[rows, R]``, and
    :meth:`add_lora`, which adds the update ``scaling * B (A dropout(x))`` over all ``out_features`` rows."""

    def _init_lora(self, parts: list[LoraPart], rank: int, alpha: float, dropout: float,
                   device: torch.device, dtype: torch.dtype) -> None:
        self.parts = sorted(parts, key=lambda p: p.start)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.lora_dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.lora_A = torch.nn.ParameterDict({
            p.key: torch.nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=dtype)) for p in self.parts
        })
        self.lora_B = torch.nn.ParameterDict({
            p.key: torch.nn.Parameter(torch.zeros(p.rows, rank, device=device, dtype=dtype)) for p in self.parts
        })
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        """PEFT's default initialisation: A Kaiming-uniform (a = sqrt(5)), B zero."""
        with torch.no_grad():
            for a in self.lora_A.values():
                if a.device.type != "meta":
                    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            for b in self.lora_B.values():
                b.zero_()

    def fuse_adapters(self) -> None:
        """Inference layout (the rollout engine's layers): every part's ``A`` stacked in one
        ``[P * R, I]`` buffer and its ``B_p`` placed block-wise in one ``[O, P * R]`` buffer
        (zeros elsewhere), so the update is two GEMMs (no per-part launches, no concatenation at
        each forward). The parameters stay what weight sync writes; the buffers are refreshed in
        place after every update (:meth:`miles_weights_updated`), so captured CUDA graphs stay valid."""
        first = self.lora_A[self.parts[0].key]
        width = len(self.parts) * self.rank
        self.register_buffer("lora_fused_A", first.new_empty(width, self.in_features), persistent=False)
        self.register_buffer("lora_fused_B", first.new_zeros(self.out_features, width), persistent=False)
        self.refresh_fused_adapters()

    @torch.no_grad()
    def refresh_fused_adapters(self) -> None:
        """Copy the adapter parameters into the :meth:`fuse_adapters` buffers (in place)."""
        fused_a, fused_b = self._buffers.get("lora_fused_A"), self._buffers.get("lora_fused_B")
        if fused_a is None:
            return
        rank = self.rank
        for i, part in enumerate(self.parts):
            fused_a[i * rank : (i + 1) * rank].copy_(self.lora_A[part.key])
            fused_b[part.start : part.stop, i * rank : (i + 1) * rank].copy_(self.lora_B[part.key])

    def miles_weights_updated(self) -> None:
        """After an engine weight update: refresh the fused adapters, then what the base module refreshes."""
        self.refresh_fused_adapters()
        base_refresh = getattr(super(), "miles_weights_updated", None)
        if base_refresh is not None:
            base_refresh()

    def block_B(self) -> torch.Tensor:
        """Every part's ``B_p`` in one ``[O, P * R]`` matrix: part ``p``'s rows, columns
        ``[p * R, (p + 1) * R)``, zeros elsewhere (rows without an adapter included). Differentiable:
        the training forward's second GEMM uses it. One part over every row is its ``B`` (no block
        matrix)."""
        first = self.parts[0]
        if len(self.parts) == 1 and first.start == 0 and first.stop == self.out_features:
            return self.lora_B[first.key]
        blocks, position = [], 0
        for part in self.parts:
            if part.start > position:  # rows of an HF part that carries no adapter
                blocks.append(self.lora_B[part.key].new_zeros(part.start - position, 0))
            blocks.append(self.lora_B[part.key])
            position = part.stop
        if position < self.out_features:
            blocks.append(blocks[-1].new_zeros(self.out_features - position, 0))
        return torch.block_diag(*blocks)

    def add_lora(self, y_TO: torch.Tensor, x_TI: torch.Tensor) -> torch.Tensor:
        """``y + scaling * B_p (A_p dropout(x))`` on each part's rows: ``x`` times every part's ``A``
        in one GEMM, then one GEMM with the block matrix of the ``B``'s (:meth:`block_B`, or the
        engine's :meth:`fuse_adapters` buffer) that accumulates into ``y`` and scales by ``alpha``
        (``addmm``), so neither the update nor the scaling costs a pass or a launch of its own.
        Training and the engine's layers compute it alike."""
        fused_a = self._buffers.get("lora_fused_A")
        if fused_a is not None:
            a_RI, b_OR, h_TI = fused_a, self._buffers["lora_fused_B"], x_TI
        else:
            a_list = [self.lora_A[part.key] for part in self.parts]
            a_RI = a_list[0] if len(a_list) == 1 else torch.cat(a_list)
            b_OR, h_TI = self.block_B(), self.lora_dropout(x_TI)
        low_TR = F.linear(h_TI, a_RI).to(y_TO.dtype)
        out = torch.addmm(y_TO.reshape(-1, self.out_features), low_TR.reshape(-1, low_TR.shape[-1]),
                          b_OR.to(y_TO.dtype).t(), alpha=self.scaling)
        return out.view(y_TO.shape)

    def merged_weights(self, name: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The merged weight of this layer (native name ``name``) from a native ``state``
        (:func:`merged_weight`), under its native name."""
        a = {p.key: state[f"{name}.lora_A.{p.key}"] for p in self.parts}
        b = {p.key: state[f"{name}.lora_B.{p.key}"] for p in self.parts}
        return {f"{name}.weight": merged_weight(state[f"{name}.weight"], self.parts, a, b, self.scaling)}

    def _lora_repr(self) -> str:
        keys = ", ".join(p.key for p in self.parts)
        return f"lora_rank={self.rank}, lora_alpha={self.alpha:g}, parts=({keys})"


class LoraLinear(LoraAdapters, torch.nn.Linear):
    """``base`` (its ``weight`` and ``bias`` parameters, same names, frozen) plus one LoRA
    pair per :class:`LoraPart`: ``lora_A.<key>`` ``[R, I]`` and ``lora_B.<key>`` ``[rows, R]``."""

    def __init__(self, base: torch.nn.Linear, parts: list[LoraPart], rank: int, alpha: float, dropout: float):
        torch.nn.Module.__init__(self)  # no second weight allocation: the base's parameters are reused
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self._init_lora(parts, rank, alpha, dropout, base.weight.device, base.weight.dtype)

    def forward(self, x_TI: torch.Tensor) -> torch.Tensor:
        return self.add_lora(F.linear(x_TI, self.weight, self.bias), x_TI)

    def extra_repr(self) -> str:
        return f"{torch.nn.Linear.extra_repr(self)}, {self._lora_repr()}"


class LoraOverBase(LoraAdapters):
    """Adapters over a base linear module of another kind (a precision recipe's quantized
    linear: INT4 / FP8 weights, its own GEMM). :func:`adapt_in_place` makes the module an
    instance of ``LoraOverBase`` + its own class, so its state keeps its names (``weight_packed``,
    ``weight_scale_inv``, ...: what the recipe's weight sync sends) next to ``lora_A`` /
    ``lora_B``, and its forward is ``base(x) + scaling * B (A x)``, the base's own arithmetic
    untouched."""

    def forward(self, x_TI: torch.Tensor) -> torch.Tensor:
        return self.add_lora(super().forward(x_TI), x_TI)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self._lora_repr()}"


_OVER_BASE_CLASSES: dict[type, type] = {}


def _weights_device(module: torch.nn.Module) -> torch.device:
    """Where ``module``'s weights live: its first parameter or buffer, else its ``weight_device``
    (a module that keeps its weights outside ``state_dict``, such as INT4's packed-kernel layout)."""
    tensors = list(module.parameters()) + list(module.buffers())
    if tensors:
        return tensors[0].device
    return torch.device(getattr(module, "weight_device", "cpu"))


def adapt_in_place(module: torch.nn.Module, parts: list[LoraPart], rank: int, alpha: float, dropout: float,
                   dtype: torch.dtype) -> torch.nn.Module:
    """Give ``module`` (anything with ``in_features`` / ``out_features`` whose forward is a
    linear map) LoRA adapters in ``dtype`` (the activations' dtype), by switching its class
    to ``Lora<its class>`` (:class:`LoraOverBase` first). Its own tensors are frozen."""
    cls = type(module)
    if cls not in _OVER_BASE_CLASSES:
        _OVER_BASE_CLASSES[cls] = type(f"Lora{cls.__name__}", (LoraOverBase, cls), {})
    device = _weights_device(module)
    module.requires_grad_(False)
    module.__class__ = _OVER_BASE_CLASSES[cls]
    module._init_lora(parts, rank, alpha, dropout, device, dtype)
    return module


def store_frozen_bases_in(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Store the frozen base weight (and bias) of every :class:`LoraLinear` of ``model`` in
    ``dtype``, the dtype autocast computes its GEMM in: autocast casts a float32 weight to
    ``dtype`` at every forward (and again in a recomputed one), so a weight stored cast gives
    bit-identical outputs without those copies and at half the memory. Weights shared with
    another module (a tied ``lm_head``) keep their dtype. Returns how many weights were cast."""
    uses: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        uses[id(parameter)] = uses.get(id(parameter), 0) + 1
    cast = 0
    for module in model.modules():
        if not isinstance(module, LoraLinear):
            continue
        for name in ("weight", "bias"):
            parameter = module._parameters.get(name)
            if parameter is None or uses[id(parameter)] > 1 or parameter.dtype == dtype:
                continue
            setattr(module, name, torch.nn.Parameter(parameter.detach().to(dtype), requires_grad=False))
            cast += 1
    return cast


def merged_weight(
    weight_OI: torch.Tensor, parts: list[LoraPart], a_by_key: dict, b_by_key: dict, scaling: float
) -> torch.Tensor:
    """``W + scaling * B @ A`` on each part's rows, computed in float32 (or W's dtype when wider)
    and cast back to W's dtype: one ``addmm_`` per part into a copy of ``W`` (the product, its
    scaling and the sum in one GEMM epilogue; no ``[O, I]`` temporaries: a weight sync merges
    every adapted linear)."""
    compute = torch.promote_types(weight_OI.dtype, torch.float32)
    merged = weight_OI.detach().to(compute, copy=True)
    for part in parts:
        b, a = b_by_key[part.key].detach().to(compute), a_by_key[part.key].detach().to(compute)
        merged[part.start : part.stop].addmm_(b, a, alpha=scaling)
    return merged.to(weight_OI.dtype)
