"""The LoRA linear layer: a frozen base linear plus low-rank adapters on row slices.

One native linear may hold several HF linears fused along its output rows (``qkv_proj`` =
``q_proj``, ``k_proj``, ``v_proj``; ``gate_up_proj`` = ``gate_proj``, ``up_proj``). PEFT
adapts each HF linear on its own, so :class:`LoraLinear` keeps one ``(A, B)`` pair per
adapted HF part and adds its update to that part's rows only: the fused layer computes
exactly what the separate PEFT-wrapped linears compute.

For each part ``p`` with rows ``[start, stop)``::

    y[:, start:stop] += scaling * B_p @ A_p @ dropout(x)      scaling = alpha / r

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


class LoraLinear(torch.nn.Linear):
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
        self.parts = sorted(parts, key=lambda p: p.start)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.lora_dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        device, dtype = base.weight.device, base.weight.dtype
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

    def forward(self, x_TI: torch.Tensor) -> torch.Tensor:
        y_TO = F.linear(x_TI, self.weight, self.bias)
        h_TI = self.lora_dropout(x_TI)
        rank = self.rank
        a_list = [self.lora_A[part.key] for part in self.parts]
        # every part's A in one GEMM ([T, parts * R]), then each part's B on its R columns
        low_TR = F.linear(h_TI, a_list[0] if len(a_list) == 1 else torch.cat(a_list))
        pieces, position = [], 0
        for i, part in enumerate(self.parts):
            if part.start > position:  # rows of an HF part that carries no adapter
                pieces.append(y_TO.new_zeros(*y_TO.shape[:-1], part.start - position))
            pieces.append(F.linear(low_TR[..., i * rank : (i + 1) * rank], self.lora_B[part.key]))
            position = part.stop
        if position < self.out_features:
            pieces.append(y_TO.new_zeros(*y_TO.shape[:-1], self.out_features - position))
        delta_TO = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
        return y_TO + delta_TO * self.scaling

    def extra_repr(self) -> str:
        keys = ", ".join(p.key for p in self.parts)
        return f"{super().extra_repr()}, lora_rank={self.rank}, lora_alpha={self.alpha:g}, parts=({keys})"


def merged_weight(
    weight_OI: torch.Tensor, parts: list[LoraPart], a_by_key: dict, b_by_key: dict, scaling: float
) -> torch.Tensor:
    """``W + scaling * B @ A`` on each part's rows, computed in float32 (or W's dtype when wider)
    and cast back to W's dtype."""
    compute = torch.promote_types(weight_OI.dtype, torch.float32)
    merged = weight_OI.detach().to(compute, copy=True)
    for part in parts:
        delta = b_by_key[part.key].detach().to(compute) @ a_by_key[part.key].detach().to(compute)
        merged[part.start : part.stop] += scaling * delta
    return merged.to(weight_OI.dtype)


def lora_modules(model: torch.nn.Module) -> dict[str, LoraLinear]:
    """The model's LoRA layers by module name (empty: the model carries no adapters)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLinear)}
