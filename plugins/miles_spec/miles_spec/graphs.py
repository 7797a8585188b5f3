"""CUDA graphs of the speculative step, on :class:`~miles_host.rollout.cuda_graphs.DecodeGraphs`' machinery.

One graph per padded batch size (the same ladder as plain decode) and sampling variant
(:class:`Variant`) covers the whole fixed-shape part of a step: the fixed draft extend
over ``J`` entries per sequence, the ``K - 1`` single-token draft steps, the policy's
verify forward over ``J`` tokens per sequence, speculative sampling and the packed
result (:mod:`miles_spec.step`, the code the eager path runs). Only two things stay
outside: the variable-length draft extend of sequences fresh from a prefill (eager;
its features enter through :attr:`SpecGraphs.prompt_feature`), and copying the verify's
hidden states into the strategy's slab after the replay.

Inputs follow ``DecodeGraphs``: the host plan (:mod:`miles_spec.plan`), sampling settings
and uniform numbers are written into one pinned int64 vector (floats as float64 bits),
together with the block-table entries that changed, and reach the device in one
``copy_``; padding rows write to slot 0 of the reserved block 0 and see one slot of
context per token. The block tables (shared by the policy's and the draft's caches)
are wider than plain decode's by the lookahead. The graphs for plain sampling at
temperature 1 are captured up front; other variants (greedy, truncation, route
capture) on first use.

Tensor legend: B sequences (padded: ``size``), J = K + 1, T tokens, H' draft features.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from miles_host.rollout.attention import AttentionMetadata, PagedAttention
from miles_host.rollout.cuda_graphs import DecodeGraphs

from miles_spec.plan import StepPlan
from miles_spec.sampling import RowSettings
from miles_spec.step import Forward, StepInputs, StepOutputs, draft_and_verify, extend_features

#: names of the per-sequence fields after the extend and draft-step ones, and their widths (x J or x 1)
_EXT = (("ext_ids", "J"), ("ext_positions", "J"), ("ext_slots", "J"), ("ext_sources", "J"),
        ("ext_context", 1), ("ext_last", 1), ("is_prompt", 1))
_VERIFY = (("last_ids", 1), ("ver_positions", "J"), ("ver_slots", "J"), ("ver_context", 1),
           ("greedy", 1), ("top_k", 1), ("temperature", 1), ("top_p", 1), ("min_p", 1), ("uniforms", "R"))
_FLOATS = ("temperature", "top_p", "min_p", "uniforms")


class CaptureError(RuntimeError):
    """Capturing a graph failed (the caller runs the step eagerly instead)."""


@dataclass(frozen=True)
class Variant:
    """What a step's sampling needs besides tensors: the host flags of ``SamplingBatch``."""

    capture_routes: bool = False
    all_greedy: bool = False
    any_greedy: bool = False
    unit_temperature: bool = True
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False

    @classmethod
    def of(cls, params: list, capture_routes: bool) -> "Variant":
        """The variant of a batch (the same conditions as ``SamplingBatch.build``)."""
        return cls(
            capture_routes=capture_routes, all_greedy=all(p.greedy for p in params),
            any_greedy=any(p.greedy for p in params),
            unit_temperature=all(p.greedy or p.temperature == 1.0 for p in params),
            top_k=any(p.top_k > 0 for p in params), top_p=any(p.top_p < 1 for p in params),
            min_p=any(p.min_p > 0 for p in params),
        )


def field_layout(num_steps: int) -> dict[str, tuple[int, int]]:
    """Field name -> (first field, width): a field of width ``w`` holds ``[max_bs, w]`` row-major,
    so the first ``size * w`` numbers are the rows of a padded batch of ``size``."""
    widths = {"J": num_steps + 1, "R": 2 * num_steps + 1}
    names = list(_EXT)
    for i in range(num_steps - 1):
        names += [(f"chain_positions_{i}", 1), (f"chain_slots_{i}", 1), (f"chain_context_{i}", 1)]
    names += list(_VERIFY)
    layout, start = {}, 0
    for name, width in names:
        width = widths.get(width, width)
        layout[name] = (start, width)
        start += width
    return layout


def padding_values(num_steps: int) -> dict[str, float]:
    """Padding values of the fields that are not 0: neutral sampling settings, and a context
    of ``J`` slots for the ``J``-token forwards (no query is left without a key)."""
    values = {"ext_context": num_steps + 1, "ver_context": num_steps + 1, "temperature": 1.0, "top_p": 1.0}
    values.update({f"chain_context_{i}": 1 for i in range(num_steps - 1)})
    return values


def plan_fields(plan: StepPlan, params: list) -> dict[str, np.ndarray]:
    """The staged fields of a step (``[B]`` or ``[B, width]``), by :func:`field_layout` name."""
    is_prompt_B = np.zeros(len(params), dtype=np.int64)
    is_prompt_B[plan.prompt] = 1
    fields = {
        "ext_ids": plan.ext_ids_BJ, "ext_positions": plan.ext_positions_BJ, "ext_slots": plan.ext_slots_BJ,
        "ext_sources": plan.ext_sources_BJ, "ext_context": plan.ext_context_B, "ext_last": plan.ext_last_B,
        "is_prompt": is_prompt_B, "last_ids": plan.last_ids_B, "ver_positions": plan.ver_positions_BJ,
        "ver_slots": plan.ver_slots_BJ, "ver_context": plan.ver_context_B, "uniforms": plan.uniforms_BR,
        "greedy": np.array([p.greedy for p in params], dtype=np.int64),
        "top_k": np.array([max(p.top_k, 0) for p in params], dtype=np.int64),
        "temperature": np.array([p.temperature if p.temperature > 0 else 1.0 for p in params]),
        "top_p": np.array([p.top_p for p in params], dtype=np.float64),
        "min_p": np.array([p.min_p for p in params], dtype=np.float64),
    }
    for i in range(plan.chain_positions_BC.shape[1]):
        fields[f"chain_positions_{i}"] = plan.chain_positions_BC[:, i]
        fields[f"chain_slots_{i}"] = plan.chain_slots_BC[:, i]
        fields[f"chain_context_{i}"] = plan.chain_context_BC[:, i]
    return fields


def write_fields(host_np: np.ndarray, layout: dict, max_bs: int, fields: dict, size: int, padding: dict) -> None:
    """Write ``fields`` into the int64 staging vector ``host_np`` (floats as float64 bits),
    padding rows up to ``size`` with ``padding`` (default 0)."""
    floats_np = host_np.view(np.float64)
    for name, (start, width) in layout.items():
        target = floats_np if name in _FLOATS else host_np
        values = fields[name].reshape(-1)
        base = start * max_bs
        target[base:base + values.shape[0]] = values
        target[base + values.shape[0]:base + size * width] = padding.get(name, 0)


class SpecGraphs(DecodeGraphs):
    """Captured speculative steps of an :class:`~miles_spec.strategy.EagleStrategy` (see the module doc)."""

    def __init__(self, strategy):
        engine = strategy.engine
        runner, config = engine.runner, engine.config
        self.draft = strategy.draft
        self.draft_cache = strategy.draft_cache
        self.slab = strategy.slab
        self.num_steps = strategy.num_steps
        self.num_tokens = strategy.num_steps + 1  # J
        self.layout = field_layout(strategy.num_steps)
        self.padding = padding_values(strategy.num_steps)
        self.num_fields = sum(width for _, width in self.layout.values())
        self.head_counts = runner.head_counts
        #: start features of prompt rows ``[max_bs, H']``, written before each replay
        self.prompt_feature = torch.zeros(
            config.max_num_seqs, self.draft.feature_size, dtype=strategy.feature_dtype, device=engine.device
        )
        block_size = engine.kv_cache.block_size
        # every slot a step touches is below len + K: room for the lookahead past max_model_len
        max_blocks = (config.max_model_len + 2 * self.num_tokens + block_size - 1) // block_size
        super().__init__(
            engine.model, engine.kv_cache, device=engine.device, attention_backend=runner.attention_backend,
            max_num_seqs=config.max_num_seqs, max_blocks_per_seq=max_blocks, fused_kernels=runner.fused_kernels,
        )

    # ------------------------------------------------------------------ capture

    def _capture_ladder(self) -> None:
        """Static multi-token metadata, then the temperature-1 graphs of every size, largest first."""
        bs, count = self.max_bs, self.num_tokens
        self.cu_seqlens_j = torch.arange(bs + 1, dtype=torch.int32, device=self.device) * count
        self.tiles_j = None
        if self.attention_backend == "triton":
            from miles_host.kernels.paged_attention import build_tiles, tokens_per_tile

            per_tile = tokens_per_tile(*self.head_counts(), True)
            self.tiles_j = build_tiles(list(range(0, (bs + 1) * count, count)), per_tile, self.device)
            self.tiles_per_seq = -(-count // per_tile)
        for size in reversed(self.sizes):
            self._capture_variant(size, Variant())

    def _capture_variant(self, size: int, variant: Variant) -> None:
        self._row_tables = [None] * self.max_bs  # capture runs the step: resend every row afterwards
        fields = {name: np.zeros(0) for name in self.layout}
        write_fields(self.host_np, self.layout, self.max_bs, fields, self.max_bs, self.padding)
        self.staged[:self.fields_end].copy_(self.host[:self.fields_end])
        self._record((size, variant), lambda: self._step_body(size, variant))

    def _ints(self, name: str, size: int) -> torch.Tensor:
        start, width = self.layout[name]
        return self.staged[start * self.max_bs:start * self.max_bs + size * width]

    def _floats(self, name: str, size: int) -> torch.Tensor:
        return self._ints(name, size).view(torch.float64).float()

    def _forward(self, cache, size: int, count: int, stem: str, suffix: str = "") -> Forward:
        """The forward over ``cache`` of ``count`` tokens per row, from the fields
        ``{stem}_positions{suffix}``, ``{stem}_slots{suffix}`` and ``{stem}_context{suffix}``."""
        positions, slots, context = (
            self._ints(f"{stem}_{field}{suffix}", size) for field in ("positions", "slots", "context")
        )
        if count == 1:
            cu_seqlens, tiles = self.cu_seqlens[:size + 1], (self.tile_seq[:size], self.cu_seqlens[:size])
        else:
            cu_seqlens, tiles = self.cu_seqlens_j[:size + 1], (None, None)
            if self.tiles_j is not None:
                tiles = tuple(t[:size * self.tiles_per_seq] for t in self.tiles_j)
        metadata = AttentionMetadata(
            slot_mapping_T=slots, cu_seqlens_q=cu_seqlens, context_lens_B=context.to(torch.int32),
            block_tables_BM=self.block_tables[:size], max_q_len=count,
            max_context_len=self.max_blocks * self.block_size, is_decode=True, tile_seq=tiles[0], tile_q_start=tiles[1],
        )
        return Forward(positions, PagedAttention(cache, metadata, self.attention_backend))

    def _row_settings(self, size: int, variant: Variant) -> RowSettings:
        return RowSettings(
            temperature_B=self._floats("temperature", size), greedy_B=self._ints("greedy", size) != 0,
            top_k_B=self._ints("top_k", size) if variant.top_k else None,
            top_p_B=self._floats("top_p", size) if variant.top_p else None,
            min_p_B=self._floats("min_p", size) if variant.min_p else None,
            generators=[], all_greedy=variant.all_greedy, banned=[], any_greedy=variant.any_greedy,
            all_unit_temperature=variant.unit_temperature,
        )

    def _step_body(self, size: int, variant: Variant) -> StepOutputs:
        count = self.num_tokens
        hidden_TH = self.slab.index_select(0, self._ints("ext_sources", size)) if self.draft.uses_hidden else None
        extended_BH = extend_features(
            self.draft, hidden_TH, self._ints("ext_ids", size), self._forward(self.draft_cache, size, count, "ext"),
            self._ints("ext_last", size),
        )
        is_prompt_B1 = (self._ints("is_prompt", size) != 0)[:, None]
        feature_BH = torch.where(is_prompt_B1, self.prompt_feature[:size], extended_BH)
        inputs = StepInputs(
            chain=[self._forward(self.draft_cache, size, 1, "chain", f"_{i}") for i in range(self.num_steps - 1)],
            verify=self._forward(self.kv_cache, size, count, "ver"),
            last_ids_B=self._ints("last_ids", size), rows=self._row_settings(size, variant),
            uniforms_BR=self._floats("uniforms", size).view(size, -1), banned_BJV=None,
            capture_routes=variant.capture_routes,
        )
        return draft_and_verify(self.model, self.draft, feature_BH, inputs, self.fused_kernels)

    # ------------------------------------------------------------------ replay

    def replay_step(self, seqs: list, plan: StepPlan, variant: Variant) -> StepOutputs:
        """One step of ``seqs`` (the prompt rows' start features already in :attr:`prompt_feature`);
        the outputs are views of the graph's static tensors, valid until the next replay."""
        size = self.padded_size(len(seqs))
        assert size is not None
        key = (size, variant)
        if key not in self.graphs:
            try:
                self._capture_variant(size, variant)
            except Exception as error:  # noqa: BLE001 - reported to the caller as what it is
                raise CaptureError(f"capturing the speculative step for {key} failed: {error}") from error
        self._next_host()
        fields = plan_fields(plan, [s.params for s in seqs])
        write_fields(self.host_np, self.layout, self.max_bs, fields, size, self.padding)
        self._upload(self._stage_tables([seq.block_table for seq in seqs], size))
        self.graphs[key].replay()
        self.num_replays += 1
        out, n, count = self.outputs[key], len(seqs), self.num_tokens
        routes = out.routes_TLE[:n * count] if out.routes_TLE is not None else None
        return StepOutputs(out.packed_BP[:n], out.hidden_TH[:n * count], routes)
