"""LoRA on the routed experts' stacked weights, in PEFT's ``target_parameters`` format.

The native :class:`~miles_host.models.mlp.Experts` holds every expert in two 3-D parameters,
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, as transformers' fused MoE experts
do (``Qwen3MoeExperts``). PEFT adapts such a parameter with ``target_parameters``
(``lora.ParamWrapper``): one rank-``r`` pair per expert, and the expert's weight becomes
``W_e + scaling * B_e @ A_e``. :class:`LoraExperts` computes the same: ``lora_A.<param>``
``[E, R, in]`` and ``lora_B.<param>`` ``[E, out, R]``, and each forward runs the experts' own
path (fused kernels at inference, the per-expert loop elsewhere;
:meth:`~miles_host.models.mlp.Experts.routed_with`) over the merged stacks, so gradients
reach ``A`` and ``B`` through whichever path the batch takes. The training path of grouped
GEMMs adds the low-rank update as grouped GEMMs of its own instead
(:class:`~miles_host.kernels.moe_train.StackAdapter`: no merged stacks kept for backward, no
full-size weight gradient), where ``_grouped_mm``'s alignment allows the rank (bf16: a
multiple of 8; else merged stacks). Like PEFT's wrapper, the update is a weight delta: no
dropout on the adapters' input.

PEFT's file layout (:func:`peft_layout`): ``lora_A.weight`` ``[E * R, in]`` (expert-major
rows: ``A.reshape(E, R, in)``) and ``lora_B.weight`` ``[out, R * E]`` (rank-major columns:
``B.reshape(out, R, E)``). Several adapted parameters of one module are nested wrappers, the
first in the module's parameter order innermost, so its keys carry one ``base_layer.`` per
wrapper around it (``experts.base_layer.lora_A.weight`` is ``gate_up_proj``'s when both
stacks are adapted, ``experts.lora_A.weight`` is ``down_proj``'s).

With ``--lora-sync adapter`` the engine keeps the merged stacks in buffers
(:meth:`LoraExperts.fuse_adapters`), re-merged in place after each sync of the adapters: a
second copy of the adapted expert weights on the engine, no merge per decode step.
Tensor legend: E experts, O out features, I in features, R rank.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from miles_host.kernels import moe_train
from miles_host.lora.layers import LoraPart
from miles_host.models.mlp import Experts

#: the stacked parameters of :class:`Experts`, in registration order (PEFT nests its wrappers in this order)
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
_PER_EXPERT = re.compile(r"(?P<module>.+)\.(?P<e>\d+)\.[^.]+\.weight")


class LoraExperts(Experts):
    """:class:`Experts` (same parameter names, frozen) plus one LoRA pair per adapted stack
    (``parts``: :class:`LoraPart` with the stack's name as ``key`` and its HF parameter path as
    ``hf_module``): ``lora_A.<key>`` ``[E, R, in]``, ``lora_B.<key>`` ``[E, out, R]``."""

    def _init_lora(self, parts: list[LoraPart], rank: int, alpha: float,
                   stack_shapes: dict[str, tuple[int, float]] | None = None) -> None:
        """``rank`` and ``alpha`` for every stack, except those ``stack_shapes`` (key -> (rank, alpha))
        names: a PEFT adapter's ``rank_pattern`` / ``alpha_pattern`` (PEFT >= 0.22 fuses transformers
        v4's ``gate_proj`` and ``up_proj`` adapters into one ``gate_up_proj`` adapter of twice the rank)."""
        self.parts = sorted(parts, key=lambda p: EXPERT_PARAMETERS.index(p.key))
        self.rank, self.alpha = rank, alpha
        shapes = {part.key: (stack_shapes or {}).get(part.key, (rank, alpha)) for part in self.parts}
        self.ranks = {key: r for key, (r, _) in shapes.items()}
        self.alphas = {key: a for key, (_, a) in shapes.items()}
        self.scalings = {key: a / r for key, (r, a) in shapes.items()}
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for part in self.parts:
            weight_EOI = getattr(self, part.key)
            experts, out_features, in_features = weight_EOI.shape
            kwargs = dict(device=weight_EOI.device, dtype=weight_EOI.dtype)
            r = self.ranks[part.key]
            self.lora_A[part.key] = torch.nn.Parameter(torch.empty(experts, r, in_features, **kwargs))
            self.lora_B[part.key] = torch.nn.Parameter(torch.zeros(experts, out_features, r, **kwargs))
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        """PEFT's default: each expert's ``A`` as ``torch.nn.Linear(in, R)`` draws it
        (Kaiming-uniform, a = sqrt(5): ``U(-1/sqrt(in), 1/sqrt(in))``), ``B`` zero."""
        with torch.no_grad():
            for a in self.lora_A.values():
                if a.device.type != "meta":
                    bound = 1.0 / math.sqrt(a.shape[-1])
                    a.uniform_(-bound, bound)
            for b in self.lora_B.values():
                b.zero_()

    def merged(self, key: str) -> torch.Tensor:
        """``W + scaling * B @ A`` of stack ``key`` (differentiable in ``A`` and ``B``; the base
        stack itself when ``key`` carries no adapter)."""
        weight_EOI = getattr(self, key)
        if key not in self.lora_A:
            return weight_EOI
        return torch.baddbmm(weight_EOI, self.lora_B[key], self.lora_A[key], alpha=self.scalings[key])

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                routing: Any = None) -> torch.Tensor:
        fused = {key: self._buffers.get(f"lora_merged_{key}") for key in EXPERT_PARAMETERS}
        if all(buffer is None for buffer in fused.values()) and self.takes_grouped(x_TH) and \
                all(moe_train.low_rank_fits(r, moe_train.compute_dtype(x_TH)) for r in self.ranks.values()):
            adapters = tuple(
                moe_train.StackAdapter(self.lora_A[key], self.lora_B[key], self.scalings[key]) if key in self.lora_A
                else None
                for key in EXPERT_PARAMETERS
            )
            return moe_train.grouped_experts(x_TH, ids_TK, weights_TK, self.gate_up_proj, self.down_proj, self.act,
                                             adapters=adapters)
        stacks = [fused[key] if fused[key] is not None else self.merged(key) for key in EXPERT_PARAMETERS]
        return self.routed_with(x_TH, ids_TK, weights_TK, routing, *stacks)

    def fuse_adapters(self) -> None:
        """Inference layout (the engine's ``--lora-sync adapter`` model): the merged stacks in
        buffers, refreshed in place after every weight update (:meth:`miles_weights_updated`),
        so a decode step merges nothing and captured CUDA graphs stay valid."""
        for part in self.parts:
            self.register_buffer(f"lora_merged_{part.key}", torch.empty_like(getattr(self, part.key)),
                                 persistent=False)
        self.miles_weights_updated()

    @torch.no_grad()
    def miles_weights_updated(self) -> None:
        """After an engine weight update: re-merge the :meth:`fuse_adapters` buffers."""
        for part in self.parts:
            buffer = self._buffers.get(f"lora_merged_{part.key}")
            if buffer is not None:
                buffer.copy_(self.merged(part.key))

    def merged_weights(self, name: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The merged stacks of module ``name`` from a native ``state`` (float32 arithmetic, cast
        back to the stack's dtype), under the stacks' native names."""
        out = {}
        for part in self.parts:
            weight = state[f"{name}.{part.key}"]
            compute = torch.promote_types(weight.dtype, torch.float32)
            a, b = (state[f"{name}.lora_{m}.{part.key}"].detach().to(compute) for m in ("A", "B"))
            out[f"{name}.{part.key}"] = torch.baddbmm(weight.detach().to(compute), b, a,
                                                      alpha=self.scalings[part.key]).to(weight.dtype)
        return out

    def extra_repr(self) -> str:
        keys = ", ".join(f"{p.key}: r={self.ranks[p.key]}, alpha={self.alphas[p.key]:g}" for p in self.parts)
        return f"lora_rank={self.rank}, lora_alpha={self.alpha:g}, parts=({keys})"


def adapt_experts(module: Experts, parts: list[LoraPart], rank: int, alpha: float,
                  stack_shapes: dict[str, tuple[int, float]] | None = None) -> LoraExperts:
    """Give the routed experts ``module`` adapters on the stacks ``parts`` name (in place: its
    class becomes :class:`LoraExperts`, its own parameters frozen); ``stack_shapes``: the stacks
    whose (rank, alpha) are not ``rank`` and ``alpha``."""
    if type(module) is not Experts:
        raise ValueError(f"LoRA on routed experts: {type(module).__name__} experts (a precision recipe's or a "
                         "model variant's) are not adaptable, only the plain bf16/fp32 stacks; exclude the experts "
                         "(--exclude-modules experts) or drop --precision")
    module.requires_grad_(False)
    module.__class__ = LoraExperts
    module._init_lora(parts, rank, alpha, stack_shapes)
    return module


def is_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` is the routed experts whose stacks can carry adapters."""
    return type(module) in (Experts, LoraExperts)


def experts_parts(family: Any, native_module: str, module: torch.nn.Module, config: Any) -> list[LoraPart]:
    """The adaptable stacks of routed-experts ``module`` (native name ``native_module``) under
    their HF parameter paths: those whose per-expert HF tensors are, in order, the row slices of
    each expert's native matrix (transformers' fused in-memory stack then has the native
    layout). Empty when the family maps them otherwise (a transposed stack, say)."""
    parts = []
    for key in EXPERT_PARAMETERS:
        weight = getattr(module, key)
        probe = torch.arange(weight.numel(), dtype=torch.float64).view(weight.shape)
        try:
            pieces = family.convert_native_tensor(f"{native_module}.{key}", probe, config)
        except (ValueError, RuntimeError, TypeError, AttributeError):
            continue
        hf_module = _stack_module(pieces, probe)
        if hf_module is not None:
            parts.append(LoraPart(key, f"{hf_module}.{key}", 0, weight.shape[1]))
    return parts


def _stack_module(pieces: list[tuple[str, torch.Tensor]], probe_EOI: torch.Tensor) -> str | None:
    """The HF experts module of per-expert ``pieces`` (``<module>.<e>.<proj>.weight``) when, per
    expert, they concatenate along the rows to that expert's slice of ``probe``; else None."""
    modules, by_expert = set(), {}
    for name, tensor in pieces:
        match = _PER_EXPERT.fullmatch(name)
        if match is None or tensor.dim() != 2:
            return None
        modules.add(match["module"])
        by_expert.setdefault(int(match["e"]), []).append(tensor)
    if len(modules) != 1 or sorted(by_expert) != list(range(probe_EOI.shape[0])):
        return None
    if not all(torch.equal(torch.cat(by_expert[e]), probe_EOI[e]) for e in by_expert):
        return None
    return modules.pop()


@dataclass(frozen=True)
class PeftLayout:
    """One adapter matrix in a PEFT file: its key and the conversions between the native
    tensor and PEFT's."""

    key: str
    to_peft: Callable[[torch.Tensor], torch.Tensor]
    from_peft: Callable[[torch.Tensor], torch.Tensor]


def _a_to_peft(a_ERI: torch.Tensor) -> torch.Tensor:
    return a_ERI.reshape(-1, a_ERI.shape[-1])


def _b_to_peft(b_EOR: torch.Tensor) -> torch.Tensor:
    return b_EOR.permute(1, 2, 0).reshape(b_EOR.shape[1], -1)


def peft_layout(module: LoraExperts, prefix: str) -> dict[str, PeftLayout]:
    """Native adapter name (``lora_A.<key>``) -> :class:`PeftLayout` for each matrix of
    ``module``; ``prefix`` goes before the HF module path (PEFT's ``base_model.model.``)."""
    out = {}
    for depth, part in enumerate(module.parts):
        hf_module = part.hf_module.rsplit(".", 1)[0]
        wrappers = "base_layer." * (len(module.parts) - 1 - depth)
        experts = getattr(module, part.key).shape[0]
        a_shape, b_shape = module.lora_A[part.key].shape, module.lora_B[part.key].shape
        out[f"lora_A.{part.key}"] = PeftLayout(
            f"{prefix}{hf_module}.{wrappers}lora_A.weight", _a_to_peft, lambda t, s=a_shape: t.reshape(s))
        out[f"lora_B.{part.key}"] = PeftLayout(
            f"{prefix}{hf_module}.{wrappers}lora_B.weight", _b_to_peft,
            lambda t, s=b_shape, e=experts: t.reshape(s[1], s[2], e).permute(2, 0, 1))
    return out
