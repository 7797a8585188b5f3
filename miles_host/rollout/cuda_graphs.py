"""CUDA graphs of the decode forward, and their inputs staged in one host-to-device copy.

A graph is captured per padded batch size of a ladder (1, 2, 4, 8, 16, 32, ...),
once without and, on first use, once with MoE route capture (R3): the captured
expert ids are then outputs of the graph. Every step writes the token ids,
positions, cache slots and context lengths of the batch, plus the block-table
entries that changed since the previous step, into one pinned int64 staging
vector and copies it to the device with a single ``copy_``; the graph reads
its inputs from that device vector. Padded rows write to the reserved block 0
and attend to one slot.

Block tables live on the device, one row per batch position. A row is
rewritten only when the sequence in that position changed (its table is
another list object) and otherwise gets its new entries plus its last entry
(the one a copy-on-write can replace), so a steady decode batch sends a few
numbers per step instead of the whole table.
"""

from __future__ import annotations

import numpy as np
import torch

from miles_host.models.context import ForwardContext, RoutingContext
from miles_host.rollout.attention import AttentionMetadata, PagedAttention
from miles_host.rollout.kv_cache import PagedKVCache
from miles_host.rollout.sequence import Sequence

IDS, POSITIONS, SLOTS, CONTEXT = range(4)


def stack_routes(captured: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """Per-layer ``[T, K]`` expert ids -> ``[T, layers, K]`` int32 in layer order (None if empty)."""
    if not captured:
        return None
    return torch.stack([captured[layer].to(torch.int32) for layer in sorted(captured)], dim=1)


def graph_batch_sizes(max_num_seqs: int, batch_sizes: list[int] | None = None) -> list[int]:
    """The padded batch sizes graphs are captured for: ``batch_sizes`` up to ``max_num_seqs``
    (SGLang's ``--cuda-graph-bs``), or by default 1, 2, 4, 8, then every 16th and ``max_num_seqs``."""
    if batch_sizes is not None:
        return sorted({s for s in batch_sizes if 1 <= s <= max_num_seqs})
    ladder = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({s for s in ladder if s <= max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """Captured decode graphs over a model and a paged KV cache (see the module doc).

    Subclasses reuse the ladder, the staging and the block tables for other fixed-shape
    steps (speculative decoding): they set :attr:`num_fields`, capture in
    :meth:`_capture_ladder` with :meth:`_record`, and replay with :meth:`_next_host`,
    :meth:`_stage_tables` and :meth:`_upload`.
    """

    #: int64 fields of ``max_bs`` numbers each staged before the block-table pairs
    num_fields = 4

    def __init__(
        self, model: torch.nn.Module, kv_cache: PagedKVCache, *, device: torch.device, attention_backend: str,
        max_num_seqs: int, max_blocks_per_seq: int, fused_kernels: bool, batch_sizes: list[int] | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        self.attention_backend = attention_backend
        self.fused_kernels = fused_kernels
        self.max_bs = max_num_seqs
        self.max_blocks = max_blocks_per_seq
        self.sizes = graph_batch_sizes(max_num_seqs, batch_sizes)  # larger decode batches run eagerly
        bs = self.max_bs
        # [num_fields * max_bs] fixed fields, then up to max_bs * max_blocks (flat index, block) pairs
        self.fields_end = self.num_fields * bs
        capacity = self.fields_end + 2 * bs * self.max_blocks
        # two pinned staging vectors, used in turn: with overlapped decode the next step is
        # staged while the previous step's copy may still be queued
        self.hosts = [torch.zeros(capacity, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self._turn = 0
        self.host = self.hosts[0]
        self.host_np = self.host.numpy()
        self.staged = torch.zeros(capacity, dtype=torch.long, device=device)
        self.context_lens = torch.ones(bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(bs, self.max_blocks, dtype=torch.int32, device=device)
        self.cu_seqlens = torch.arange(bs + 1, dtype=torch.int32, device=device)
        self.tile_seq = torch.arange(bs, dtype=torch.int32, device=device)
        self._row_tables: list[list[int] | None] = [None] * bs
        self._row_written: list[int] = [0] * bs
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.pool = None
        self.num_replays = 0
        cache_rotary_tables = getattr(model, "cache_rotary_tables", None)
        if cache_rotary_tables is not None:  # a step's positions have cache slots: below max_blocks * block_size
            cache_rotary_tables(self.max_blocks * self.block_size, device)
        self._capture_ladder()

    def _capture_ladder(self) -> None:
        """The graphs captured up front: decode without route capture, largest size first."""
        for size in reversed(self.sizes):
            self._capture(size, capture_routes=False)

    # ------------------------------------------------------------------ capture

    def _field(self, index: int, size: int) -> torch.Tensor:
        start = index * self.max_bs
        return self.staged[start:start + size]

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping_T=self._field(SLOTS, size),
            cu_seqlens_q=self.cu_seqlens[: size + 1],
            context_lens_B=self.context_lens[:size],
            block_tables_BM=self.block_tables[:size],
            max_q_len=1,
            max_context_len=self.max_blocks * self.block_size,
            is_decode=True,
            tile_seq=self.tile_seq[:size],
            tile_q_start=self.cu_seqlens[:size],
        )

    def _attention(self, size: int):
        """The attention context the graph of ``size`` rows captures (subclasses add state to it)."""
        return PagedAttention(self.kv_cache, self._metadata(size), self.attention_backend)

    def _graph_body(self, size: int, capture_routes: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.context_lens[:size].copy_(self._field(CONTEXT, size))
        routing = RoutingContext(phase="rollout")
        routing.extra["capture"] = capture_routes
        context = ForwardContext(
            attention=self._attention(size),
            routing=routing, fused_kernels=self.fused_kernels,
            batch_invariant=self.attention_backend == "triton_invariant",  # --true-on-policy
        )
        hidden = self.model.forward_hidden(self._field(IDS, size), self._field(POSITIONS, size), context)
        return hidden, stack_routes(routing.captured)

    def _capture(self, size: int, capture_routes: bool) -> None:
        self.host_np[: self.fields_end] = 0
        self.host_np[CONTEXT * self.max_bs:(CONTEXT + 1) * self.max_bs] = 1
        self.staged[: self.fields_end].copy_(self.host[: self.fields_end])
        self._record((size, capture_routes), lambda: self._graph_body(size, capture_routes))

    @torch.no_grad()
    def _record(self, key, body) -> None:
        """Capture ``body()`` (all in the shared pool) as the graph of ``key``; its result is ``outputs[key]``.

        Without autograd, as the eager steps run (``inference_mode``): the model's inference
        paths (the fused MoE kernels) check ``torch.is_grad_enabled()``."""
        body()  # warm-up: Triton compilation, allocator
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool):
            self.outputs[key] = body()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = graph
        torch.cuda.synchronize()

    # ------------------------------------------------------------------ replay

    def padded_size(self, batch_size: int) -> int | None:
        for size in self.sizes:
            if size >= batch_size:
                return size
        return None

    def _stage(self, seqs: list[Sequence], size: int) -> int:
        """Write the step's inputs into the pinned staging vector; return how many block-table pairs."""
        host, bs, block_size = self.host_np, self.max_bs, self.block_size
        n = len(seqs)
        ids, positions, slots, contexts = [], [], [], []
        for seq in seqs:
            table = seq.block_table
            position = len(seq) - 1
            ids.append(seq.token_ids[-1])
            positions.append(position)
            slots.append(table[position // block_size] * block_size + position % block_size)
            contexts.append(position + 1)
        host[IDS * bs:IDS * bs + n] = ids
        host[POSITIONS * bs:POSITIONS * bs + n] = positions
        host[SLOTS * bs:SLOTS * bs + n] = slots
        host[CONTEXT * bs:CONTEXT * bs + n] = contexts
        for field_index, fill in ((IDS, 0), (POSITIONS, 0), (SLOTS, 0), (CONTEXT, 1)):
            host[field_index * bs + n:field_index * bs + size] = fill
        return self._stage_tables([seq.block_table for seq in seqs], size)

    def _stage_tables(self, tables: list[list[int]], size: int) -> int:
        """Stage the block-table entries of rows ``0 .. len(tables) - 1`` that changed since
        they were last sent (padding rows up to ``size``: block 0) as ``(flat index, block)``
        pairs after the fixed fields; return how many pairs."""
        pairs: list[int] = []
        row_tables, row_written = self._row_tables, self._row_written
        n = len(tables)
        for row, table in enumerate(tables):
            first = 0 if row_tables[row] is not table else max(row_written[row] - 1, 0)
            base = row * self.max_blocks
            for index in range(first, len(table)):
                pairs.append(base + index)
                pairs.append(table[index])
            row_tables[row] = table
            row_written[row] = len(table)
        for row in range(n, size):  # padding rows: block 0, one slot of context
            if row_tables[row] is not None or row_written[row] != 1:
                pairs.extend((row * self.max_blocks, 0))
                row_tables[row] = None
                row_written[row] = 1
        self.host_np[self.fields_end:self.fields_end + len(pairs)] = pairs
        return len(pairs) // 2

    def _next_host(self) -> None:
        """Stage into the other pinned vector (the previous step's copy may still be queued)."""
        self._turn ^= 1
        self.host = self.hosts[self._turn]
        self.host_np = self.host.numpy()

    def _upload(self, num_pairs: int) -> None:
        """Copy the staged fields and ``num_pairs`` block-table pairs to the device (one
        ``copy_``) and write the pairs into the device block tables."""
        used = self.fields_end + 2 * num_pairs
        self.staged[:used].copy_(self.host[:used], non_blocking=True)
        if num_pairs:
            pairs = self.staged[self.fields_end:used].view(num_pairs, 2)
            self.block_tables.view(-1).index_copy_(0, pairs[:, 0], pairs[:, 1].to(torch.int32))

    def replay(
        self, seqs: list[Sequence], capture_routes: bool, ids_override: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states ``[len(seqs), H]`` of one decode step, and the captured routes
        ``[len(seqs), moe_layers, K]`` int32 (None without capture or MoE layers).
        ``ids_override``: ``(rows, token ids)`` on the device replacing those rows' input tokens."""
        size = self.padded_size(len(seqs))
        assert size is not None
        key = (size, capture_routes)
        if key not in self.graphs:
            self._row_tables = [None] * self.max_bs  # capture runs the forward: forget cached rows
            self._capture(size, capture_routes)
        self._next_host()
        self._upload(self._stage(seqs, size))
        if ids_override is not None:  # input tokens still on the device (the previous step's samples)
            rows, values = ids_override
            self._field(IDS, size).index_copy_(0, rows, values)
        self.graphs[key].replay()
        self.num_replays += 1
        hidden, routes_TLK = self.outputs[key]
        n = len(seqs)
        return hidden[:n], (routes_TLK[:n] if routes_TLK is not None else None)

    def staged_slots(self, n: int) -> np.ndarray:
        """The cache slots of the last replay's ``n`` rows (a host copy: the staging vector is reused)."""
        start = SLOTS * self.max_bs
        return self.host_np[start:start + n].copy()

    def forget_rows(self) -> None:
        """Resend every block-table row at the next replay (after the table was written elsewhere)."""
        self._row_tables = [None] * self.max_bs
