"""Split-K planning and workspaces for the small-M (decode) GEMMs of the quantization plugins.

At decode a linear multiplies a few token rows by a large weight: the GEMM is a
stream of the weight through HBM, and a kernel reaches the bandwidth only with
enough programs in flight on every SM. The N dimension alone (e.g. 2048 outputs
in tiles of 64: 32 programs) does not fill an H200's 132 SMs, so the K
dimension is split too: each program multiplies ``blocks_per_split`` K-blocks
and writes an fp32 partial tile; the last program to finish a tile (an atomic
counter per tile, a "semaphore") sums the partials in split order, which makes
the result deterministic, writes the output and resets the counter to zero, so
the counters need no clearing between launches (CUDA graphs replay them as is).

:func:`plan_split_k` picks the split from the shape with a small fixed rule (no
autotuning: the same shape always runs the same code, and nothing is measured
while a CUDA graph is captured). :func:`semaphores` hands out the zeroed
counters, one buffer per (device, stream) so GEMMs on concurrent streams never
share a counter. The switch ``--split-k-reduce torch`` makes the kernels leave the
partials to a ``sum`` in PyTorch instead (a debugging fallback).
The Triton side is :mod:`miles_host.kernels._split_k_triton`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from miles_host.kernels import switches

#: counters per (device, stream) buffer; a GEMM with more output tiles grows it
SEMAPHORE_CAPACITY = 1 << 14
#: splits tried (powers of two); more than 16 partials of one tile cost more than they hide
SPLITS = (1, 2, 4, 8, 16)
#: a split gets at least this many K-blocks
MIN_BLOCKS_PER_SPLIT = 1

_SEMAPHORES: dict[tuple[int, int], torch.Tensor] = {}
#: replaced buffers stay alive: a captured CUDA graph may still point at them
_RETIRED: list[torch.Tensor] = []


@dataclass(frozen=True)
class SmallMConfig:
    """Tile shape of one small-M launch (``block_m`` >= M, a power of two >= 16)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    #: FP8 only: multiply in FP8 on the tensor cores (no float16 conversion; Hopper's FP8 MMA
    #: sums a 128-deep block at reduced precision, so not the reference's fp32 sums); benchmarks only
    fp8_mma: bool = False


def block_m_for(m: int) -> int:
    """The token tile of an ``m``-token small-M launch: 16, 32 or 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


@dataclass(frozen=True)
class SplitKPlan:
    """How one small-M GEMM is cut: ``n_tiles`` x ``split_k`` programs of ``blocks_per_split`` K-blocks."""

    n_tiles: int
    split_k: int
    blocks_per_split: int

    @property
    def num_programs(self) -> int:
        """Programs of the launch grid."""
        return self.n_tiles * self.split_k


@lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index``."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _score(programs: int, sms: int) -> float:
    """Balance (last wave as full as the others) times occupancy (>= 2 programs per SM)."""
    waves = programs / sms
    balance = waves / -(-programs // sms)
    return balance * min(1.0, waves / 2)


def plan_split_k(m: int, n_tiles: int, k_blocks: int, row_bytes: int, sms: int) -> SplitKPlan:
    """The split of a GEMM with ``m`` rows, ``n_tiles`` output tiles and ``k_blocks`` K-blocks.

    ``row_bytes``: weight bytes of one output row (what a program streams per row).
    The partials cost ``8 * m`` bytes per output and split (written, then read
    back, mostly from L2); splits are capped so that this stays under the weight
    bytes, and each split keeps :data:`MIN_BLOCKS_PER_SPLIT` blocks.
    Splits divide ``k_blocks`` (every program runs the same static loop).
    Among the allowed splits the best :func:`_score` wins; a larger split must beat
    the best so far by 5% (more partials for a marginal gain are not worth it).
    """
    cap = max(1, row_bytes // (8 * max(m, 1)))
    best, best_score = 1, _score(n_tiles, sms)
    for split in SPLITS[1:]:
        if split > cap or k_blocks < split * MIN_BLOCKS_PER_SPLIT:
            break
        if k_blocks % split:
            continue
        score = _score(n_tiles * split, sms)
        if score > best_score * 1.05:
            best, best_score = split, score
    return SplitKPlan(n_tiles, best, k_blocks // best)


def fixed_split(n_tiles: int, k_blocks: int, split: int) -> SplitKPlan:
    """A plan with ``split`` K-splits (benchmark sweeps); ValueError unless it divides ``k_blocks``."""
    if split < 1 or k_blocks % split:
        raise ValueError(f"split-K {split} does not divide the {k_blocks} K-blocks")
    return SplitKPlan(n_tiles, split, k_blocks // split)


def semaphores(device: torch.device, count: int) -> torch.Tensor:
    """``count`` (or more) zeroed int32 counters for a split-K launch on the current stream.

    The kernels leave every counter they touch at zero, so one buffer serves
    every launch on its stream, including launches inside captured CUDA graphs
    (a buffer first requested during a capture is allocated in the graph's pool
    and cleared by the graph's own memset).
    """
    if device.type != "cuda":  # Triton's CPU interpreter (tests): a fresh buffer
        return torch.zeros(count, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device)
    key = (device.index if device.index is not None else torch.cuda.current_device(), stream.cuda_stream)
    buffer = _SEMAPHORES.get(key)
    if buffer is None or buffer.numel() < count:
        if buffer is not None:
            _RETIRED.append(buffer)
        buffer = torch.zeros(max(count, SEMAPHORE_CAPACITY), dtype=torch.int32, device=device)
        _SEMAPHORES[key] = buffer
    return buffer


#: where split-K partials are summed: ``kernel`` (the last program of a tile) or ``torch`` (debugging)
REDUCE = switches.declare_host("split_k_reduce")


def reduce_in_kernel() -> bool:
    """False under ``--split-k-reduce torch`` (partials summed by PyTorch, for debugging)."""
    return switches.value(REDUCE) == "kernel"


def workspace(
    plan: SplitKPlan, m: int, n: int, device: torch.device, dummy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(partials [split, m, n] fp32, counters, reduce in kernel)`` of a launch.

    Without a split the kernel touches neither buffer: ``dummy`` (e.g. the output) stands in for both.
    """
    if plan.split_k == 1:
        return dummy, dummy, True
    in_kernel = reduce_in_kernel()
    partials = torch.empty((plan.split_k, m, n), dtype=torch.float32, device=device)
    counters = semaphores(device, plan.n_tiles) if in_kernel else dummy
    return partials, counters, in_kernel
