"""Split one optimizer step's samples across data-parallel ranks, balanced by tokens."""

from __future__ import annotations

from typing import Any, Sequence


def split_by_tokens(samples: Sequence[Any], world: int) -> list[list[int]]:
    """Indices of ``samples`` for each of ``world`` ranks.

    Greedy longest-first onto the rank with fewest tokens (ties: lower rank), then
    each rank's indices in their original order, so packing inside a rank keeps the
    sample order of the one-process trainer. Deterministic: every rank computes the
    same split from the same samples."""
    loads = [0] * world
    counts = [0] * world
    owner = [0] * len(samples)
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i].tokens), i))
    for i in order:
        rank = min(range(world), key=lambda r: (loads[r], counts[r], r))
        owner[i] = rank
        loads[rank] += len(samples[i].tokens)
        counts[rank] += 1
    return [[i for i in range(len(samples)) if owner[i] == rank] for rank in range(world)]
