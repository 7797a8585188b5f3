"""Runs one scheduled batch through the model: inputs, forward, logits, sampling.

Decode batches on CUDA replay the CUDA graphs of :mod:`.cuda_graphs`. In batch-invariant mode
nothing about a request's numerics depends on its neighbours: on CPU every sequence is
forwarded and sampled on its own, token by token (:mod:`miles_host.models.batch_invariant`);
on CUDA batches run batch-invariant kernels (:mod:`miles_host.models.invariant_gpu`), graphs
included, and each sampled token's logprob is computed by the trainer's formula.

Tensor legend: T = tokens of the step, B = sequences, M = blocks per sequence,
V = vocabulary, L = MoE layers, K = experts per token.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from miles_host.kernels.small_m_gemm import swept_matmul
from miles_host.models.context import ForwardContext, RoutingContext
from miles_host.rollout.attention import AttentionMetadata, PagedAttention
from miles_host.rollout.cuda_graphs import DecodeGraphs, stack_routes
from miles_host.rollout.recurrent_graphs import RecurrentDecodeGraphs
from miles_host.rollout.grammar import allowed_tokens
from miles_host.rollout.kv_cache import PagedKVCache
from miles_host.rollout.logprobs import PositionExtras, position_extras
from miles_host.rollout.penalties import LogitsProcessing
from miles_host.devices import host_to_device
from miles_host.rollout.sampler import SamplingBatch, sample_with_distribution, seeded_uniforms
from miles_host.rollout.sampling_graphs import SamplingGraphs
from miles_host.rollout.scheduler import ScheduledBatch
from miles_host.rollout.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class Readback:
    """A decode step's ``[token ids..., logprobs...]`` (float64) on their way to the host,
    and the step's captured routes ``[B, moe_layers, K]`` int32 when it captured them (on
    CUDA in one of two reused pinned buffers: read it before the step after next is launched)."""

    values: torch.Tensor
    ready: "torch.cuda.Event | None"
    n: int
    routes: torch.Tensor | None = None


@dataclass
class StepResult:
    """Sampled tokens (host lists, aligned with ``batch.samplers``) and, for samplers that
    asked, their positions' top / requested-id logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    extras: list[PositionExtras | None] | None = None
    #: a launched decode step's captured routes, ``[B, moe_layers, K]`` int32 (None: not captured;
    #: on CUDA a view of a reused pinned buffer)
    routes: np.ndarray | None = None


def paged_metadata(
    block_tables: list[list[int]],
    context_lens: list[int],
    num_new: list[int],
    block_size: int,
    device: torch.device,
    is_decode: bool,
    attention_backend: str = "torch",
    head_counts=None,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions ``[T]`` and attention metadata of a step over the paged cache.

    Sequence ``b`` has ``context_lens[b]`` tokens of which the last ``num_new[b]``
    are forwarded now (their K/V are written at their slots). Also used by
    decoding strategies that forward tokens not yet in ``Sequence.token_ids``
    (speculative verification) or into a cache of their own (a draft).
    """
    bs = block_size
    width = max(len(table) for table in block_tables)
    tables = np.zeros((len(block_tables), width), dtype=np.int32)
    cu_seqlens = [0]
    for b, (table, n) in enumerate(zip(block_tables, num_new)):
        tables[b, : len(table)] = table
        cu_seqlens.append(cu_seqlens[-1] + n)
    context_lens = [int(c) for c in context_lens]
    # positions and slots of every new token, vectorised over the step
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    seq_of_token = np.repeat(np.arange(len(block_tables)), np.diff(cu))
    positions = ctx[seq_of_token] - (cu[1:][seq_of_token] - np.arange(cu[-1]))
    slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs

    def to_dev(values, dtype):
        tensor = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
        return host_to_device(tensor.to(dtype), device)

    meta = AttentionMetadata(
        slot_mapping_T=to_dev(slots, torch.long),
        cu_seqlens_q=to_dev(cu_seqlens, torch.int32),
        context_lens_B=to_dev(context_lens, torch.int32),
        block_tables_BM=to_dev(tables, torch.int32),
        max_q_len=max(num_new),
        max_context_len=max(context_lens),
        is_decode=is_decode,
        cu_seqlens_q_host=cu_seqlens,
        context_lens_host=context_lens,
        slot_mapping_host=slots,
    )
    if attention_backend in ("triton", "triton_invariant"):
        from miles_host.kernels.paged_attention import build_tiles, tokens_per_tile

        per_tile = tokens_per_tile(*head_counts(), is_decode, invariant=attention_backend == "triton_invariant")
        meta.tile_seq, meta.tile_q_start = build_tiles(cu_seqlens, per_tile, device)
    return to_dev(positions, torch.long), meta


class ModelRunner:
    """Owns the model, the KV cache and (on CUDA) the decode graphs."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: PagedKVCache,
        *,
        device: torch.device,
        attention_backend: str,
        max_num_seqs: int,
        max_model_len: int,
        batch_invariant: bool = False,
        use_cuda_graph: bool = False,
        fused_kernels: bool = False,
        cuda_graph_batch_sizes: list[int] | None = None,
        recurrent_states=None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        self.attention_backend = attention_backend
        self.batch_invariant = batch_invariant
        #: the CPU construction: one sequence, one token at a time
        self.token_by_token = batch_invariant and device.type != "cuda"
        self.fused_kernels = fused_kernels and not self.token_by_token
        self.max_num_seqs = max_num_seqs
        self.cuda_graph_batch_sizes = cuda_graph_batch_sizes
        self.max_blocks_per_seq = (max_model_len + self.block_size - 1) // self.block_size
        #: the captured decode graphs (None: decode runs eagerly)
        self.graphs: DecodeGraphs | None = None
        #: the captured sampling of small decode batches (None: sampling runs eagerly)
        self.sampling_graphs: SamplingGraphs | None = None
        self.prefill_forwards = 0
        self._last_sampling: tuple[list, list, SamplingBatch] | None = None
        self._routes_host: torch.Tensor | None = None  # pinned staging of captured routes
        self._routes_used = 0
        self._readback_routes: list[torch.Tensor | None] = [None, None]  # pinned, used in turn
        self._readback_turn = 0
        #: per-sequence states of linear-attention layers (:mod:`.recurrent_state`; None: no such layers)
        self.recurrent_states = recurrent_states
        if use_cuda_graph:
            self.capture_graphs()

    def capture_graphs(self, reason: str = "") -> None:
        """Capture the decode graphs (and set up the sampling graphs over their pool); on
        failure decode eagerly and say why."""
        try:
            graphs_class = DecodeGraphs
            if self.recurrent_states is not None:  # the recurrent state's gather/scatter inside the graphs
                graphs_class = functools.partial(RecurrentDecodeGraphs, pool=self.recurrent_states)
            self.graphs = graphs_class(
                self.model, self.kv_cache, device=self.device, attention_backend=self.attention_backend,
                max_num_seqs=self.max_num_seqs, max_blocks_per_seq=self.max_blocks_per_seq,
                fused_kernels=self.fused_kernels, batch_sizes=self.cuda_graph_batch_sizes,
            )
        except Exception as error:  # noqa: BLE001 - fall back to eager, say why
            logger.warning("CUDA graph capture%s failed (%s); decoding eagerly", reason, error)
            self.graphs = None
        self.sampling_graphs = None
        if self.graphs is not None and not self.batch_invariant:
            hidden = next(iter(self.graphs.outputs.values()))[0]  # the forward graphs' hidden states
            self.sampling_graphs = SamplingGraphs(
                self._logits, sizes=self.graphs.sizes, hidden_size=hidden.shape[-1], dtype=hidden.dtype,
                device=self.device, pool=self.graphs.pool,
            )

    def release_graphs(self) -> None:
        """Drop every captured graph (they read the KV cache's and the weights' addresses)."""
        self.graphs = self.sampling_graphs = None
        self._last_sampling = None

    # ------------------------------------------------------------------ inputs

    def _metadata(
        self, seqs: list[Sequence], num_new: list[int], is_decode: bool
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids: list[int] = []
        for seq, n in zip(seqs, num_new):
            input_ids.extend(seq.token_ids[len(seq) - n:])
        positions, meta = paged_metadata(
            [seq.block_table for seq in seqs], [len(seq) for seq in seqs], num_new, self.block_size,
            self.device, is_decode, self.attention_backend, self.head_counts,
        )
        return host_to_device(torch.tensor(input_ids, dtype=torch.long), self.device), positions, meta

    def head_counts(self) -> tuple[int, int]:
        """``(query heads, KV heads)`` of the model's attention (what the paged kernels tile by)."""
        layout = next((entry for entry in self.kv_cache.layout if entry[0]), self.kv_cache.layout[0])  # skip linear attention
        num_q_heads = getattr(self.model.config, "num_heads", None) or self.model.config.num_attention_heads
        return num_q_heads, layout[0]

    # ------------------------------------------------------------------ forward

    def _forward(
        self, seqs: list[Sequence], num_new: list[int], is_decode: bool, routing: RoutingContext,
        ids_override: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[int], torch.Tensor, tuple[np.ndarray, torch.Tensor] | None]:
        """Hidden states of each sequence's last token ``[B, hidden]``, the step's cu_seqlens,
        the hidden states of every forwarded token ``[T, hidden]`` and, when routes are
        captured, ``(cache slots [T] int64 on the host, expert ids [T, moe_layers, K] int32
        on the device)`` of those tokens."""
        capture = bool(routing.extra.get("capture"))
        if is_decode and self.graphs is not None and not self.token_by_token:
            if self.graphs.padded_size(len(seqs)) is not None:
                hidden_BH, routes_TLK = self.graphs.replay(seqs, capture_routes=capture, ids_override=ids_override)
                captured = None if routes_TLK is None else (self.graphs.staged_slots(len(seqs)), routes_TLK)
                return hidden_BH, list(range(len(seqs) + 1)), hidden_BH, captured
        input_ids, positions, meta = self._metadata(seqs, num_new, is_decode)
        if ids_override is not None:  # decode: one token per sequence, rows are token indices
            input_ids.index_copy_(0, *ids_override)
        if not is_decode:
            self.prefill_forwards += 1
        if self.token_by_token:
            hidden_TH = self._invariant_forward(seqs, num_new, input_ids, positions, routing)
        else:
            attention = PagedAttention(self.kv_cache, meta, self.attention_backend)
            if self.recurrent_states is not None:
                attention = self.recurrent_states.attach(attention, seqs, num_new)
            context = ForwardContext(
                attention=attention, routing=routing, fused_kernels=self.fused_kernels,
                batch_invariant=self.batch_invariant,
            )
            hidden_TH = self.model.forward_hidden(input_ids, positions, context)
        routes_TLK = stack_routes(routing.captured) if capture else None
        captured = None if routes_TLK is None else (meta.slot_mapping_host, routes_TLK)
        if is_decode:
            return hidden_TH, meta.cu_seqlens_q_host, hidden_TH, captured
        last_T = torch.tensor(meta.cu_seqlens_q_host[1:], dtype=torch.long) - 1
        return hidden_TH[host_to_device(last_T, hidden_TH.device)], meta.cu_seqlens_q_host, hidden_TH, captured

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, want_routes: bool, on_hidden=None
    ) -> tuple[StepResult, list[tuple[np.ndarray, np.ndarray]]]:
        """Forward ``batch``, sample every sampler's next token.

        ``on_hidden(group, hidden_TH, cu_seqlens)``, when given, receives the hidden
        states of every forwarded token of each forward (a draft model reads them).
        Returns the sampled tokens and, when ``want_routes``, per forward
        ``(cache slots [T] int64, expert ids [T, moe_layers, K] int32)`` (numpy; on CUDA
        views of a reused pinned buffer, valid until the next step).
        """
        if batch.pending_copies:
            self.kv_cache.copy_blocks(batch.pending_copies)
        seqs = batch.sequences
        num_new = [len(s) - s.num_cached_tokens for s in seqs] if batch.is_prefill else [1] * len(seqs)
        groups = [[i] for i in range(len(seqs))] if self.token_by_token else [list(range(len(seqs)))]
        tokens: list[int] = [0] * len(batch.samplers)
        logprobs: list[float] = [0.0] * len(batch.samplers)
        extras: list[PositionExtras | None] | None = None
        if any(s.wants_position_extras for s in batch.samplers):
            extras = [None] * len(batch.samplers)
        routes: list[tuple[np.ndarray, torch.Tensor]] = []
        self._routes_used = 0
        for group in groups:
            routing = RoutingContext(phase="rollout")
            routing.extra["capture"] = want_routes
            hidden_BH, cu_seqlens, hidden_TH, captured = self._forward(
                [seqs[i] for i in group], [num_new[i] for i in group], not batch.is_prefill, routing
            )
            if on_hidden is not None:
                on_hidden(group, hidden_TH, cu_seqlens)
            if captured is not None:
                # copied while the step's sampling runs; read after the step's one sync
                routes.append((captured[0], self._routes_to_host(captured[1])))
            logits_BV = self._logits(hidden_BH)
            first = group[0]
            rows = [r for r, source in enumerate(batch.sample_from) if first <= source <= group[-1]]
            sub_groups = [[r] for r in rows] if self.token_by_token else [rows]
            for sub in sub_groups:
                if not sub:
                    continue
                rows_of = [batch.sample_from[r] - first for r in sub]
                index = torch.tensor(rows_of, dtype=torch.long)
                samplers = [batch.samplers[r] for r in sub]
                if rows_of == list(range(logits_BV.shape[0])):  # every row once, in order (decode)
                    rows_BV = logits_BV
                else:
                    rows_BV = logits_BV.index_select(0, host_to_device(index, logits_BV.device))
                token_B, logprob_B, logprobs_BV = self._sample(rows_BV, samplers)
                # One device-to-host copy per sampling group: the only sync of the step.
                for r, t, lp in zip(sub, token_B.tolist(), logprob_B.tolist()):
                    tokens[r] = t
                    logprobs[r] = lp
                if extras is not None:
                    for r, extra in zip(sub, position_extras(logprobs_BV, [s.logprob_options for s in samplers])):
                        extras[r] = extra
                if self.token_by_token:
                    logprobs[sub[0]] = self._invariant_logprob(hidden_BH, index, tokens[sub[0]], samplers[0])
        return StepResult(tokens, logprobs, extras), [(slots, host.numpy()) for slots, host in routes]

    @torch.inference_mode()
    def launch_decode(
        self, batch: ScheduledBatch, ids_override: tuple[torch.Tensor, torch.Tensor] | None = None,
        want_routes: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[np.ndarray, torch.Tensor] | None]:
        """Forward and sample a plain decode batch (one sampler per sequence) without waiting:
        returns the device tensors ``token ids [B]`` and ``logprobs [B]`` and, when
        ``want_routes``, ``(cache slots [B] on the host, routes [B, moe_layers, K] on the
        device)`` (else None); :meth:`start_readback` copies them to the host."""
        if batch.pending_copies:
            self.kv_cache.copy_blocks(batch.pending_copies)
        seqs = batch.sequences
        routing = RoutingContext(phase="rollout")
        routing.extra["capture"] = want_routes
        hidden_BH, _, _, captured = self._forward(seqs, [1] * len(seqs), True, routing, ids_override)
        if self.sampling_graphs is not None:
            sampled = self._sample_graphed(hidden_BH, seqs)
            if sampled is not None:
                return (*sampled, captured)
        return (*self._sample(self._logits(hidden_BH), seqs)[:2], captured)

    def _sample_graphed(self, hidden_BH: torch.Tensor, samplers: list[Sequence]):
        """:meth:`_sample`'s token ids and logprobs by a replayed sampling graph, or None when
        the batch samples eagerly (:mod:`miles_host.rollout.sampling_graphs`)."""
        graphs = self.sampling_graphs
        if graphs.padded_size(len(samplers)) is None or any(s.needs_processed_logits for s in samplers):
            return None
        sampling = self._sampling_batch(samplers, hidden_BH)
        if not graphs.accepts(sampling):
            return None
        uniforms_B = None if sampling.all_greedy else self._uniforms(samplers, hidden_BH.device)
        return graphs.sample(hidden_BH, sampling, uniforms_B)

    def _sample(
        self, logits_BV: torch.Tensor, samplers: list[Sequence]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's next token, its logprob and the rows' logprobs ``[B, V]`` (device tensors),
        sampled with its sequence's settings."""
        sampling = self._sampling_batch(samplers, logits_BV)
        uniforms_B = None if sampling.all_greedy else self._uniforms(samplers, logits_BV.device)
        token_B, logprobs_BV = sample_with_distribution(logits_BV, sampling, uniforms_B)
        logprob_B = logprobs_BV.gather(1, token_B[:, None]).squeeze(1)
        if self.batch_invariant and not self.token_by_token:
            from miles_host.models.invariant_gpu import sampled_log_probs

            logprob_B = sampled_log_probs(logits_BV, token_B, [seq.params.temperature for seq in samplers])
        return token_B, logprob_B, logprobs_BV

    def logits(self, hidden_TH: torch.Tensor) -> torch.Tensor:
        """The logits of hidden states as the sampler gets them (prompt logprobs read them too)."""
        return self._logits(hidden_TH)

    def _logits(self, hidden_BH: torch.Tensor) -> torch.Tensor:
        """The logits sampled from (on CUDA in batch-invariant mode: by the invariant kernels; else the
        small-M GEMM where a sweep put the LM head's shape in its table)."""
        if not self.batch_invariant or self.token_by_token:
            return self.model.compute_logits(hidden_BH, swept_matmul)
        from miles_host.kernels.invariant_ops import batch_invariant_aten

        with batch_invariant_aten():
            return self.model.compute_logits(hidden_BH)

    def start_readback(self, tokens_B: torch.Tensor, logprobs_B: torch.Tensor,
                       routes_BLK: torch.Tensor | None = None) -> Readback:
        """Start copying a launched step's results (and captured routes) to the host (pinned,
        asynchronous) and mark when they are there: reading them later waits for this step
        alone, not for the steps launched after it (a plain ``tolist`` would wait for the whole
        stream). The copies are queued before the next step, which reuses the decode graph's
        output buffers. The routes land in one of two pinned buffers used in turn (at most
        two launched steps are unread)."""
        values = torch.cat([tokens_B.double(), logprobs_B.double()])
        if not values.is_cuda:
            return Readback(values, None, tokens_B.shape[0], routes_BLK)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        routes_host = None
        if routes_BLK is not None:
            routes_host = self._readback_buffer(routes_BLK)
            routes_host.copy_(routes_BLK, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return Readback(host, ready, tokens_B.shape[0], routes_host)

    def _readback_buffer(self, routes_BLK: torch.Tensor) -> torch.Tensor:
        """The next of the two pinned route buffers, as a view shaped like ``routes_BLK``."""
        self._readback_turn ^= 1
        buffer = self._readback_routes[self._readback_turn]
        if buffer is None or buffer.numel() < routes_BLK.numel():
            buffer = torch.empty(max(routes_BLK.numel(), self.max_num_seqs * routes_BLK[0].numel()),
                                 dtype=routes_BLK.dtype, pin_memory=True)
            self._readback_routes[self._readback_turn] = buffer
        return buffer[:routes_BLK.numel()].view(routes_BLK.shape)

    @staticmethod
    def finish_decode(readback: Readback) -> StepResult:
        """Wait for a launched decode step's results (:meth:`start_readback`)."""
        if readback.ready is not None:
            readback.ready.synchronize()
        values, n = readback.values.tolist(), readback.n
        routes = None if readback.routes is None else readback.routes.numpy()
        return StepResult([int(t) for t in values[:n]], values[n:], routes=routes)

    def _routes_to_host(self, routes_TLK: torch.Tensor) -> torch.Tensor:
        """Start an asynchronous copy of the routes into a reused pinned buffer.

        Forwards of one step take consecutive parts of the buffer; a larger buffer
        replaces it when needed (earlier parts keep the old one alive).
        """
        if routes_TLK.device.type != "cuda":
            return routes_TLK
        numel, start = routes_TLK.numel(), self._routes_used
        if self._routes_host is None or self._routes_host.numel() < start + numel:
            size = max(2 * (start + numel), 1 << 16)
            self._routes_host, start = torch.empty(size, dtype=torch.int32, pin_memory=True), 0
        self._routes_used = start + numel
        host = self._routes_host[start:start + numel].view(routes_TLK.shape)
        host.copy_(routes_TLK, non_blocking=True)
        return host

    @staticmethod
    def _uniforms(samplers: list[Sequence], device: torch.device) -> torch.Tensor:
        """One ``U[0, 1)`` number per row: from (sampling_seed, sample index, output position)
        for seeded requests, from torch's global CPU generator otherwise; one small copy."""
        seeded = [row for row, seq in enumerate(samplers) if seq.params.sampling_seed is not None]
        chosen = [samplers[row] for row in seeded]
        values_S = torch.from_numpy(seeded_uniforms(
            [seq.params.sampling_seed for seq in chosen], [seq.sample_index for seq in chosen],
            [seq.num_output_tokens for seq in chosen],
        ))
        if len(seeded) == len(samplers):  # the RL case: every sample carries a seed
            return host_to_device(values_S, device)
        unseeded = [row for row, seq in enumerate(samplers) if seq.params.sampling_seed is None]
        uniforms_B = torch.empty(len(samplers))
        uniforms_B[unseeded] = torch.rand(len(unseeded))
        uniforms_B[seeded] = values_S
        return host_to_device(uniforms_B, device)

    def _sampling_batch(self, samplers: list[Sequence], logits_BV: torch.Tensor) -> SamplingBatch:
        """The rows' sampling settings; reused while the same requests decode together
        (not when some row's logits change with its output: penalties, a grammar)."""
        params = [s.params for s in samplers]
        generators = [s.generator for s in samplers]
        banned = [s.banned_tokens() for s in samplers]
        device = logits_BV.device
        if any(s.needs_processed_logits for s in samplers):
            vocab = logits_BV.shape[-1]
            processing = LogitsProcessing.build(
                params, [s.output_ids for s in samplers], vocab, device,
                allowed_BV=allowed_tokens([s.grammar for s in samplers], vocab, device),
            )
            self._last_sampling = None
            return SamplingBatch.build(params, generators, banned, device, processing=processing)
        cached = self._last_sampling
        if (
            cached is not None and not any(banned) and len(cached[0]) == len(params)
            and all(a is b for a, b in zip(cached[0], params))
            and all(a is b for a, b in zip(cached[1], generators))
        ):
            return cached[2]
        sampling = SamplingBatch.build(params, generators, banned, device)
        # holding the params keeps their ids from being reused by new objects
        self._last_sampling = None if any(banned) else (params, generators, sampling)
        return sampling

    # ------------------------------------------------------------------ batch-invariant mode

    def _invariant_forward(self, seqs, num_new, input_ids, positions, routing) -> torch.Tensor:
        """One sequence, one token at a time over the paged cache (``models.batch_invariant``)."""
        from miles_host.models.batch_invariant import PagedTokenAttention

        (seq,) = seqs
        attention = PagedTokenAttention(
            self.kv_cache.k_NSHD, self.kv_cache.v_NSHD, seq.block_table, self.block_size, len(seq) - num_new[0]
        )
        context = ForwardContext(attention=attention, routing=routing, batch_invariant=True)
        return self.model.forward_hidden(input_ids, positions, context)

    def _invariant_logprob(self, hidden_BH, index, token: int, sampler) -> float:
        """The sampled token's logprob by the function the trainer's log-prob head uses."""
        from miles_host.models.batch_invariant import sampled_token_log_prob

        hidden_1H = hidden_BH.index_select(0, index.to(hidden_BH.device))
        return sampled_token_log_prob(self.model, hidden_1H, token, sampler.params.temperature)
