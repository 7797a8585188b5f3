"""Continuous batching: which sequences run in the next step.

Prefill has priority: waiting sequences are admitted while the token budget,
the sequence limit and free KV blocks allow; otherwise every running sequence
decodes one token. When a decode cannot get a block, the most recently admitted
sequence is preempted (its blocks freed, recomputed later from its tokens).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from miles_host.rollout.block_manager import BlockManager
from miles_host.rollout.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work.

    ``sequences`` are forwarded (new tokens of a prefill, or one token each in
    decode). ``sample_from[i]`` is the index in ``sequences`` whose last logits
    row ``samplers[i]`` samples from: the ``n > 1`` samples forked in a prefill
    sample from their parent's row. ``failed`` sequences could never fit.
    """

    sequences: list[Sequence]
    is_prefill: bool
    samplers: list[Sequence] = field(default_factory=list)
    sample_from: list[int] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)
    pending_copies: list[tuple[int, int]] = field(default_factory=list)


class Scheduler:
    """Queues of waiting and running sequences over one :class:`BlockManager`."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        #: slots past the last token each decode step writes (speculative decoding's drafts)
        self.num_lookahead_tokens = 0
        #: called with an unfinished sequence about to lose its blocks (preempted, or failed)
        self.on_release: Callable[[Sequence], None] | None = None

    def add(self, seq: Sequence) -> None:
        """Queue a request's sample 0; its other samples ride along in ``seq.children``."""
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _fits_alone(self, seq: Sequence) -> bool:
        needed = self.block_manager.blocks_needed(len(seq) + self.num_lookahead_tokens)
        return needed <= self.block_manager.num_usable_blocks

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's batch, or None when nothing can run."""
        batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        if batch is not None:
            batch.pending_copies = self.block_manager.pending_copies
            self.block_manager.pending_copies = []
        return batch

    def _schedule_prefill(self) -> ScheduledBatch | None:
        batch = ScheduledBatch(sequences=[], is_prefill=True)
        num_tokens = 0
        num_seqs = len(self.running)
        while self.waiting:
            seq = self.waiting[0]
            new_children = [c for c in seq.children if c.status == SequenceStatus.WAITING and not c.block_table
                            and c.num_output_tokens == 0]
            if num_seqs + 1 + len(new_children) > self.max_num_seqs and num_seqs > 0:
                break
            if not self._fits_alone(seq):
                self.waiting.popleft()
                batch.failed.append(seq)
                continue
            # routed experts and input logprobs need every prompt token forwarded
            use_cache = not seq.want_routed_experts and not seq.wants_input_logprobs
            if not self.block_manager.can_allocate(seq, use_cache):
                break
            estimate = len(seq) - self.block_manager.num_cached_estimate(seq, use_cache)
            if batch.sequences and num_tokens + estimate > self.max_num_batched_tokens:
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, use_cache)
            num_tokens += len(seq) - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            row = len(batch.sequences)
            batch.sequences.append(seq)
            batch.samplers.append(seq)
            batch.sample_from.append(row)
            self.running.append(seq)
            for child in new_children:
                self.block_manager.fork(seq, child)
                child.status = SequenceStatus.RUNNING
                batch.samplers.append(child)
                batch.sample_from.append(row)
                self.running.append(child)
            num_seqs += 1 + len(new_children)
        if batch.sequences or batch.failed:
            return batch
        return None

    def _schedule_decode(self) -> ScheduledBatch | None:
        batch = ScheduledBatch(sequences=[], is_prefill=False)
        kept: list[Sequence] = []
        manager = self.block_manager
        block_size, ref_counts = manager.block_size, manager.ref_counts
        plain = self.num_lookahead_tokens == 0
        while self.running and len(kept) < self.max_num_seqs:
            seq = self.running.popleft()
            if plain:  # fast path: the new token's slot is in a block this sequence owns alone
                index = (len(seq.token_ids) - 1) // block_size
                table = seq.block_table
                if index < len(table) and ref_counts[table[index]] == 1:
                    kept.append(seq)
                    continue
            while not self.block_manager.can_append(seq, self.num_lookahead_tokens):
                if self.running:
                    self.preempt(self.running.pop())
                elif self._fits_alone(seq):
                    self.preempt(seq)
                    break
                else:
                    self._release(seq)
                    batch.failed.append(seq)
                    break
            else:
                self.block_manager.prepare_append(seq, self.num_lookahead_tokens)
                kept.append(seq)
        self.running.extendleft(reversed(kept))
        batch.sequences = kept
        batch.samplers = list(kept)
        batch.sample_from = list(range(len(kept)))
        if batch.sequences or batch.failed:
            return batch
        return None

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and put it first in line; it is recomputed from its tokens."""
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._release(seq)
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        if self.on_release is not None:
            self.on_release(seq)
        self.block_manager.free(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
