"""Split one optimizer step's samples across data-parallel ranks.

``--balance-data`` (slime's flag) balances the ranks' tokens (:func:`split_by_tokens`);
without it the samples are dealt out in turn, sample ``i`` to rank ``i % world``
(:func:`split_in_turn`, slime's split without the flag). Either split gives every rank
the indices of its samples in their original order, and every rank computes the same
split from the same samples."""

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


def split_in_turn(samples: Sequence[Any], world: int) -> list[list[int]]:
    """Sample ``i`` to rank ``i % world`` (no regard to lengths)."""
    return [list(range(rank, len(samples), world)) for rank in range(world)]


#: ``--balance-data`` -> the split
SPLITS = {True: split_by_tokens, False: split_in_turn}


def split_samples(samples: Sequence[Any], world: int, balance: bool) -> list[list[int]]:
    """The split ``--balance-data`` asks for."""
    return SPLITS[bool(balance)](samples, world)
