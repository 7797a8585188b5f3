"""FR-Spec: the draft proposes only a fixed set of frequent tokens (SGLang's ``--speculative-token-map``).

A draft step's cost on a large vocabulary is mostly its output head: a ``[V, H]`` weight read for
every draft token (151,936 x 2,560 bf16 = 0.78 GB on a Qwen3-4B shape, three times per step at
``--sglang-speculative-num-steps 3``). With a token map of ``N`` ids the draft's logits are
computed over those rows only (``N / V`` of the bytes and FLOPs); every other token gets
``-inf``, so the draft's distribution ``q`` is zero there. Speculative sampling stays exact for
any ``q`` (the residual ``max(0, p - q)`` covers the tokens the draft cannot propose), so the
output still follows the policy; only the acceptance rate can drop, by the policy's mass outside
the map.

The map's rows are a copy of the head's (one gather per weight sync, :meth:`HotVocabHead.refresh`,
into the same buffer, so captured CUDA graphs keep reading it); the draft's training is unchanged
(full vocabulary, as FR-Spec does).

Token maps load as SGLang's do (``torch.load`` of a 1-D integer tensor, e.g. ``hot_token_id.pt``),
or from a JSON list of ids. :func:`frequent_tokens` makes one from rollouts.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

import torch

from miles_host.models.logprobs import compute_logits


def load_token_map(path: str, vocab: int) -> torch.Tensor:
    """The sorted unique int64 token ids of a token map file; a clear error for a bad one."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"--sglang-speculative-token-map {path}: no such file (a torch.save'd 1-D tensor of token ids, "
            "e.g. SGLang's hot_token_id.pt, or a JSON list of ids)"
        )
    if file.suffix == ".json":
        ids = torch.tensor(json.loads(file.read_text()), dtype=torch.int64)
    else:
        ids = torch.as_tensor(torch.load(file, map_location="cpu", weights_only=True))
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"--sglang-speculative-token-map {path}: expected a non-empty 1-D list of integer token "
                         f"ids, got shape {tuple(ids.shape)} of {ids.dtype}")
    ids = torch.unique(ids.long())
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab:
        raise ValueError(f"--sglang-speculative-token-map {path}: token ids must lie in [0, {vocab}) (the policy's "
                         f"vocabulary); found {int(ids[0])} .. {int(ids[-1])}")
    return ids


def frequent_tokens(token_lists: Iterable[Iterable[int]], size: int) -> torch.Tensor:
    """The ``size`` most frequent ids of these token lists (ties: smaller id first), sorted."""
    counts = Counter(token for tokens in token_lists for token in tokens)
    chosen = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:size]
    return torch.tensor(sorted(token for token, _ in chosen), dtype=torch.int64)


class HotVocabHead:
    """The draft's output head restricted to ``ids_N``: full-width ``[T, V]`` logits, ``-inf``
    outside the map, equal to the full head's logits inside it (same soft-capping)."""

    def __init__(self, ids_N: torch.Tensor, head_weight: Callable[[], torch.Tensor], softcap: float | None):
        self._head_weight = head_weight
        weight_VH = head_weight()
        self.vocab = weight_VH.shape[0]
        self.ids_N = ids_N.to(weight_VH.device)
        self.softcap = softcap
        self.weight_NH = weight_VH.detach().index_select(0, self.ids_N)

    def refresh(self) -> None:
        """Re-gather the rows after a weight update (in place: captured graphs read this buffer)."""
        with torch.no_grad():
            weight_VH = self._head_weight()
            if weight_VH.device != self.weight_NH.device or weight_VH.dtype != self.weight_NH.dtype:
                self.ids_N = self.ids_N.to(weight_VH.device)
                self.weight_NH = weight_VH.detach().index_select(0, self.ids_N)
            else:
                torch.index_select(weight_VH.detach(), 0, self.ids_N, out=self.weight_NH)

    def logits(self, normed_TH: torch.Tensor) -> torch.Tensor:
        hot_TN = compute_logits(normed_TH, self.weight_NH, self.softcap)
        full_TV = hot_TN.new_full((hot_TN.shape[0], self.vocab), float("-inf"))
        return full_TV.index_copy_(1, self.ids_N, hot_TN)
