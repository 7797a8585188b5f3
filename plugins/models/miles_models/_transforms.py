"""Weight-map rules whose HF tensor is a reshaped form of the native one.

Published checkpoints of some families store fused experts in their own layouts
(gpt-oss: ``gate_up_proj [E, H, 2I]`` with gate and up columns interleaved;
Llama-4: ``gate_up_proj [E, H, 2I]`` gate columns first); the native experts are
``gate_up_proj [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]``. A
:class:`Transform` names one such pair and the two permutations between them;
permutations only, so a load-save round trip gives back the checkpoint's bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from miles_models._weights import Rule, WeightMap, _regex


@dataclass(frozen=True)
class Transform:
    """One native tensor stored under ``hf`` as ``to_hf(native)`` (``to_native`` inverts it)."""

    native: str
    hf: str
    to_native: Callable[[torch.Tensor], torch.Tensor]
    to_hf: Callable[[torch.Tensor], torch.Tensor]


class TransformWeightMap(WeightMap):
    """A :class:`WeightMap` whose :class:`Transform` entries are matched before its rules."""

    def __init__(self, rules: Iterable[Rule], transforms: Iterable[Transform], **kwargs):
        super().__init__(rules, **kwargs)
        self.transforms = [(t, _regex(t.hf), _regex(t.native)) for t in transforms]

    def _find(self, name: str, from_hf: bool):
        """``(transform, the other side's name)`` of an HF (``from_hf``) or native name; ``(None, None)``."""
        for transform, hf_regex, native_regex in self.transforms:
            match = (hf_regex if from_hf else native_regex).fullmatch(name)
            if match:
                template = transform.native if from_hf else transform.hf
                return transform, template.format(i=match.groupdict().get("i"))
        return None, None

    def _by_hf(self, name: str):
        return self._find(name, from_hf=True)

    def _by_native(self, name: str):
        return self._find(name, from_hf=False)

    def hf_to_native(self, name: str) -> str | None:
        transform, native = self._by_hf(name)
        return native if transform is not None else super().hf_to_native(name)

    def native_to_hf(self, name: str) -> str:
        transform, hf = self._by_native(name)
        return hf if transform is not None else super().native_to_hf(name)

    def convert_hf_tensor(self, name, tensor, config):
        transform, native = self._by_hf(name)
        if transform is None:
            return super().convert_hf_tensor(name, tensor, config)
        return [(native, transform.to_native(tensor), None)]

    def convert_native_tensor(self, name, tensor, config):
        transform, hf = self._by_native(name)
        if transform is None:
            return super().convert_native_tensor(name, tensor, config)
        return [(hf, transform.to_hf(tensor))]


def swap_last_two(t: torch.Tensor) -> torch.Tensor:
    """``[E, A, B] -> [E, B, A]`` (a view)."""
    return t.transpose(-1, -2)


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Even entries of ``dim`` first, then the odd ones (``g0 u0 g1 u1 .. -> g0 g1 .. u0 u1 ..``)."""
    even = t.index_select(dim, torch.arange(0, t.shape[dim], 2, device=t.device))
    odd = t.index_select(dim, torch.arange(1, t.shape[dim], 2, device=t.device))
    return torch.cat((even, odd), dim=dim)


def interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of :func:`deinterleave`."""
    first, second = t.chunk(2, dim=dim)
    return torch.stack((first, second), dim=dim + 1).flatten(dim, dim + 1)
