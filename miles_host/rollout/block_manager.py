"""Paged KV-cache bookkeeping: blocks, reference counts, prefix hashes, copy-on-write.

Block 0 is never handed out: padded rows of a CUDA-graph batch write their
keys and values there, so no kernel needs a "skip this slot" branch.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from miles_host.rollout.sequence import Sequence


def block_hash(previous_hash: int, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given the hash of everything before it."""
    return hash((previous_hash, token_ids))


class BlockManager:
    """Hands out KV blocks of ``block_size`` tokens to sequences.

    Full blocks are registered under a hash of their whole prefix, so a later
    prompt that starts the same way reuses them (prefix caching). A block held
    by several sequences (prefix hit or an ``n > 1`` fork) is copied before a
    sequence writes into it (copy-on-write); the copies to make are queued in
    ``pending_copies`` for the model runner.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks >= 2, "need at least one usable block besides the padding block"
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Free blocks without reusable content, and free blocks whose content a
        # later prompt may still hit (least recently freed first: evicted first).
        self.free_fresh: deque[int] = deque(range(1, num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.pending_copies: list[tuple[int, int]] = []  # (source block, destination block)

    # ------------------------------------------------------------------ capacity

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_fresh) + len(self.free_cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ------------------------------------------------------------------ internals

    def _take_free_block(self) -> int:
        if self.free_fresh:
            block = self.free_fresh.popleft()
        else:
            block, _ = self.free_cached.popitem(last=False)
        self._forget_hash(block)
        self.ref_counts[block] = 1
        return block

    def _forget_hash(self, block: int) -> None:
        old = self.block_hashes[block]
        if old is not None and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]
        self.block_hashes[block] = None
        self.block_tokens[block] = None

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0
        if self.ref_counts[block] == 0:
            # Cached content stays valid until the block is handed out again.
            if self.block_hashes[block] is not None:
                self.free_cached[block] = None
            else:
                self.free_fresh.appendleft(block)

    def _cached_prefix(self, seq: Sequence, use_cache: bool = True) -> list[int]:
        """Blocks already holding a prefix of ``seq`` (never covering its last token)."""
        if not (self.enable_prefix_caching and use_cache):
            return []
        hits: list[int] = []
        previous = 0
        # The last token is always recomputed: its logits are what we sample from.
        for index in range((len(seq) - 1) // self.block_size):
            tokens = tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size])
            h = block_hash(previous, tokens)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            hits.append(block)
            previous = h
        return hits

    # ------------------------------------------------------------------ prefill

    def num_cached_estimate(self, seq: Sequence, use_cache: bool = True) -> int:
        """Tokens of ``seq`` that :meth:`allocate` would find in the prefix cache."""
        return len(self._cached_prefix(seq, use_cache)) * self.block_size

    def can_allocate(self, seq: Sequence, use_cache: bool = True) -> bool:
        """Whether blocks for all of ``seq``'s tokens are available now."""
        hits = self._cached_prefix(seq, use_cache)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        needed = self.blocks_needed(len(seq)) - len(hits)
        return needed + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, use_cache: bool = True) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached prefix blocks.

        ``use_cache=False`` computes every token (e.g. when the request wants the
        routed experts of its prompt, which the cache does not keep).
        """
        assert not seq.block_table
        hits = self._cached_prefix(seq, use_cache)
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.free_cached[block]
            self.ref_counts[block] += 1
        seq.block_table = list(hits)
        seq.num_cached_tokens = len(hits) * self.block_size
        for _ in range(self.blocks_needed(len(seq)) - len(hits)):
            seq.block_table.append(self._take_free_block())

    def register_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Publish the full blocks among the first ``num_computed_tokens`` for reuse.

        Incremental: ``seq.full_block_hashes`` remembers the blocks already done.
        """
        if not self.enable_prefix_caching:
            return
        hashes = seq.full_block_hashes
        for index in range(len(hashes), num_computed_tokens // self.block_size):
            block = seq.block_table[index]
            tokens = tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size])
            h = block_hash(hashes[-1] if hashes else 0, tokens)
            hashes.append(h)
            if self.block_hashes[block] is None:
                if h not in self.hash_to_block:
                    self.hash_to_block[h] = block
                self.block_hashes[block] = h
                self.block_tokens[block] = tokens

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share every block of ``parent`` (its prompt)."""
        assert not child.block_table
        for block in parent.block_table:
            self.ref_counts[block] += 1
        child.block_table = list(parent.block_table)
        child.full_block_hashes = list(parent.full_block_hashes)

    # ------------------------------------------------------------------ decode

    def can_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Whether the slots of the last token (and ``lookahead`` more) can be made writable."""
        return self._blocks_to_write(seq, lookahead) <= self.num_free_blocks

    def _blocks_to_write(self, seq: Sequence, lookahead: int = 0) -> int:
        first = (len(seq) - 1) // self.block_size
        last = (len(seq) - 1 + lookahead) // self.block_size
        table = seq.block_table
        return sum(1 for index in range(first, last + 1) if index >= len(table) or self.ref_counts[table[index]] > 1)

    def prepare_append(self, seq: Sequence, lookahead: int = 0) -> None:
        """Make the slots of the last token and of ``lookahead`` more writable: new
        blocks, or copies of shared ones (speculative decoding writes ahead)."""
        first = (len(seq) - 1) // self.block_size
        last = (len(seq) - 1 + lookahead) // self.block_size
        for index in range(first, last + 1):
            if index >= len(seq.block_table):
                assert index == len(seq.block_table)
                seq.block_table.append(self._take_free_block())
                continue
            block = seq.block_table[index]
            if self.ref_counts[block] > 1:
                new_block = self._take_free_block()
                self.pending_copies.append((block, new_block))
                self.ref_counts[block] -= 1
                seq.block_table[index] = new_block

    # ------------------------------------------------------------------ release

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on its blocks (finish, abort or preemption)."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.full_block_hashes = []

    def reset_prefix_cache(self) -> None:
        """Forget every hash (weights changed: cached K/V are stale)."""
        self.hash_to_block.clear()
        self.free_fresh.extend(self.free_cached)
        self.free_cached.clear()
        for block in range(self.num_blocks):
            self.block_hashes[block] = None
            self.block_tokens[block] = None
