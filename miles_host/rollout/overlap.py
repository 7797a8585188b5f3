"""Overlapped decode (``overlap_schedule``): the host schedules and launches step N+1
before it reads step N's sampled tokens, so its bookkeeping runs while the GPU works.

At launch every sequence of the step gets a placeholder token (and logprob), so
lengths, block allocation, positions and the seeded sampling position are exact; the
next step takes those sequences' input tokens straight from the previous step's
sampled tensor on the device. When the results arrive the placeholders are filled
in and finishes are checked at the filled position. A sequence that stopped (EOS,
stop token or string) at step N was already launched in step N+1: that row's work is
wasted and its placeholder dropped, which is the price of the overlap (one extra
token of compute per stopping sequence). Only plain decode steps overlap; prefill,
speculative decoding and batch-invariant mode run as before.

Route capture (R3) overlaps too: the step's routes leave the device with its tokens
(the same event, queued before the next step reuses the decode graph's output buffer),
and when the step is resolved they are written at the step's cache slots
(:class:`~miles_host.rollout.route_store.RouteStore`) in one vectorized write. Rows of
sequences that no longer own those slots are left out: the discarded rows of sequences
that stopped a step earlier, and those of sequences preempted since the launch, which
keep their row with their other routes (``Sequence.routed_expert_chunks``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from miles_host.devices import host_to_device
from miles_host.rollout.scheduler import ScheduledBatch
from miles_host.rollout.sequence import Sequence, SequenceStatus

PLACEHOLDER = -1


@dataclass
class PendingDecode:
    """A launched decode step whose results have not been read."""

    batch: ScheduledBatch
    tokens_B: torch.Tensor
    logprobs_B: torch.Tensor
    readback: Any = None  # the results' copy to the host (model_runner.Readback)
    positions: list[int] = field(default_factory=list)  # index of each sequence's placeholder
    slots: np.ndarray | None = None  # the cache slot of each row (when routes are captured)
    #: sequences that gave up their blocks (preemption) before this step was read
    released: list[Sequence] = field(default_factory=list)


def launch(runner, batch: ScheduledBatch, previous: PendingDecode | None, device: torch.device) -> PendingDecode:
    """Launch ``batch``; rows whose last token is ``previous``'s pending sample read it on the device."""
    ids_override = None
    if previous is not None:
        source = {id(seq): j for j, seq in enumerate(previous.batch.sequences)}
        rows, src = [], []
        for row, seq in enumerate(batch.sequences):
            j = source.get(id(seq))
            if j is not None and seq.token_ids[-1] == PLACEHOLDER:
                rows.append(row)
                src.append(j)
        if rows:  # pinned copies: a pageable one would wait for the step in flight
            src_index = host_to_device(torch.tensor(src, dtype=torch.long), device)
            ids_override = (host_to_device(torch.tensor(rows, dtype=torch.long), device),
                            previous.tokens_B.index_select(0, src_index))
    want_routes = any(seq.want_routed_experts for seq in batch.sequences)
    tokens_B, logprobs_B, captured = runner.launch_decode(batch, ids_override, want_routes)
    slots_B, routes_BLK = captured if captured is not None else (None, None)
    pending = PendingDecode(batch, tokens_B, logprobs_B, runner.start_readback(tokens_B, logprobs_B, routes_BLK),
                            slots=slots_B)
    for seq in batch.sequences:
        pending.positions.append(len(seq.token_ids))
        seq.token_ids.append(PLACEHOLDER)
        seq.output_logprobs.append(math.nan)
    return pending


def resolve_step(pending: PendingDecode, result, block_manager, finish_reason,
                 route_store=None) -> list[tuple[Sequence, dict]]:
    """Fill ``pending``'s placeholders with ``result`` (a read :class:`StepResult`) and store
    its routes in ``route_store``; return the ``(sequence, finish reason)`` pairs that
    stopped, their later placeholders dropped."""
    stopped, discarded = [], []
    for row, (seq, position, token, logprob) in enumerate(zip(pending.batch.sequences, pending.positions,
                                                              result.token_ids, result.logprobs)):
        if seq.status == SequenceStatus.FINISHED:
            discarded.append(row)
            continue  # stopped at an earlier step; this row's work is discarded
        seq.token_ids[position] = token
        seq.output_logprobs[position - seq.num_prompt_tokens] = logprob
        if seq.status == SequenceStatus.RUNNING:  # (a preempted one holds no cache now)
            seq.num_cached_tokens = position  # the launched step writes this token's K/V
            block_manager.register_full_blocks(seq, position)
        reason = finish_reason(seq, position)
        if reason is not None:
            del seq.token_ids[position + 1:]
            del seq.output_logprobs[position + 1 - seq.num_prompt_tokens:]
            stopped.append((seq, reason))
    if result.routes is not None and route_store is not None:
        store_routes(pending, result.routes, discarded, route_store)
    return stopped


def store_routes(pending: PendingDecode, routes_BLK: np.ndarray, discarded: list[int], route_store) -> None:
    """Write a resolved step's routes at its cache slots, but for rows whose sequence no
    longer owns its slot: ``discarded`` rows, and the rows of ``pending.released``
    sequences, which keep theirs (``(position, [1, L, K])``) with their other routes."""
    skip = list(discarded)
    if pending.released:
        released = {id(seq) for seq in pending.released}
        for row, seq in enumerate(pending.batch.sequences):
            if id(seq) in released:
                skip.append(row)
                seq.routed_expert_chunks.append((pending.positions[row] - 1, routes_BLK[row:row + 1].copy()))
    route_store.write(pending.slots, routes_BLK, skip)
