"""--balance-data: the data-parallel split of a step's samples."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from miles_host.distributed.balance import split_in_turn, split_samples


def _samples(lengths):
    return [SimpleNamespace(tokens=[0] * n) for n in lengths]


LENGTHS = [90, 10, 10, 10, 80, 5, 5, 70]


def _loads(samples, split):
    return [sum(len(samples[i].tokens) for i in part) for part in split]


@pytest.mark.parametrize("world", [2, 3])
def test_balanced_split_is_as_even_as_the_best_partition(world):
    samples = _samples(LENGTHS)
    split = split_samples(samples, world, balance=True)
    assert sorted(i for part in split for i in part) == list(range(len(samples)))
    assert all(part == sorted(part) for part in split)  # original order inside a rank
    best = min(max(_loads(samples, [[i for i, r in enumerate(owners) if r == k] for k in range(world)]))
               for owners in itertools.product(range(world), repeat=len(samples)))
    # greedy longest-first is within 4/3 of the optimum (Graham's bound); here it reaches it
    assert max(_loads(samples, split)) <= best * 4 / 3
    assert max(_loads(samples, split)) < max(_loads(samples, split_in_turn(samples, world)))


def test_without_the_flag_samples_are_dealt_in_turn():
    samples = _samples(LENGTHS)
    assert split_samples(samples, 3, balance=False) == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert split_samples(samples[:1], 2, balance=False) == [[0], []]
