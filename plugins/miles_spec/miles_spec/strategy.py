"""The ``eagle`` decoding strategy: chain drafting, one-forward verification, speculative sampling.

One decode step for a batch of running sequences, each of length ``n``
(tokens ``x_0 .. x_{n-1}``, K/V cached for ``x_0 .. x_{n-2}``):

1. draft *extend*: the draft runs over its pending entries (the pairs
   ``(h_t, x_{t+1})`` whose policy hidden states arrived since the last step),
   writing its own KV cache; the last entry's features give ``q_1`` and ``d_1``.
   After a verify the pending entries are that verify's kept ones: a fixed
   ``J = k + 1`` entries per sequence are forwarded (:mod:`miles_spec.plan`);
   after a prefill they are the prompt's (any number, eagerly);
2. ``k - 1`` single-token draft steps (the draft's own feature stands in for the
   policy's hidden state) give ``d_2 .. d_k``;
3. verify: ONE policy forward over ``[x_{n-1}, d_1 .. d_k]`` on the paged KV
   cache (slots made writable by the scheduler's lookahead);
4. accept by speculative sampling (:mod:`miles_spec.sampling`); K/V of
   rejected drafts stay in slots past the new ``len - 1`` and are overwritten
   later (the engine only trusts slots below ``num_cached_tokens``), and their
   routed-expert rows are dropped.

Steps 1 (fixed part) to 4 are device code without host synchronisation
(:mod:`miles_spec.step`); the step's inputs go to the device in a few copies
(eager) or one (CUDA graphs, :mod:`miles_spec.graphs`, on CUDA unless
``enforce_eager``), and its result comes back in one device-to-host read. The
verify's hidden states stay on the device in a slab (two halves used in turn)
until the next step's extend reads them.

The draft's KV cache is a second :class:`PagedKVCache` with the same blocks as
the policy's (slot ``s`` of a sequence in both), so the block manager, prefix
sharing of the ``n`` samples and copy-on-write serve both.

Tensor legend: B sequences, K draft tokens, J = K + 1, T tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from miles_host import offload
from miles_host.rollout.attention import PagedAttention
from miles_host.rollout.kv_cache import PagedKVCache
from miles_host.rollout.model_runner import paged_metadata
from miles_host.devices import host_to_device
from miles_host.rollout.strategy import DecodeTokens

from miles_spec.draft import ModelDraft
from miles_spec.plan import StepPlan, build_plan
from miles_spec.sampling import RowSettings
from miles_spec.step import Forward, StepInputs, StepOutputs, draft_and_verify, extend_features

logger = logging.getLogger(__name__)

#: live strategies, for the per-step metrics (``miles_step_end``)
LIVE: "weakref.WeakSet[EagleStrategy]" = weakref.WeakSet()


@dataclass
class DraftState:
    """A sequence's pending draft entries ``first .. len - 2``: after a prefill with their
    policy hidden states ``hidden_TH``; after the verify of step ``step`` (``row`` set) with
    theirs in slab rows ``row ..`` (valid for the next step only)."""

    first: int
    hidden_TH: torch.Tensor | None
    row: int | None = None
    step: int = -1


@dataclass
class SpecCounters:
    """Acceptance statistics since the last :meth:`EagleStrategy.pop_counters`."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


class EagleStrategy:
    """Speculative decoding with a chain (top-k 1) draft of ``num_steps`` tokens."""

    def __init__(self, engine, draft, num_steps: int = 3, cpu_backup: bool = False):
        if num_steps < 1:
            raise ValueError(f"--sglang-speculative-num-steps must be >= 1, got {num_steps}")
        self.engine = engine
        self.draft = draft
        self.num_steps = num_steps
        self.num_lookahead_tokens = num_steps
        self.cpu_backup = cpu_backup
        self.draft_weights_cpu: dict[str, torch.Tensor] = {}
        kv = engine.kv_cache
        self.feature_dtype = next(iter(_draft_parameters(draft)), torch.empty((), dtype=kv.dtype)).dtype
        self.draft_cache = PagedKVCache(draft.layout(), kv.num_blocks, kv.block_size, self.feature_dtype, engine.device)
        # the verify's hidden states [2 halves x max_num_seqs x J, H]: step s writes half s % 2
        self.slab_rows = engine.config.max_num_seqs * (num_steps + 1)
        embedding = engine.model.embed_tokens.weight  # the dtype of the policy's hidden states
        self.slab = torch.zeros(2 * self.slab_rows if draft.uses_hidden else 1, embedding.shape[1],
                                dtype=embedding.dtype, device=engine.device)
        self.steps = 0
        self.counters = SpecCounters()
        self._pinned: dict[str, torch.Tensor] = {}
        #: the captured steps (None: eager)
        self.graphs = None
        self._graphs_released = False
        config = engine.config
        if config.use_cuda_graph and not config.batch_invariant:
            self._build_graphs()
        LIVE.add(self)

    def _build_graphs(self) -> None:
        """Capture the speculative step's CUDA graphs; decode eagerly (and say why) if that fails."""
        if self.engine.runner.attention_backend == "torch":
            logger.info("speculative step: the torch attention backend reads host metadata; no CUDA graphs")
            return
        from miles_spec.graphs import SpecGraphs

        try:
            with torch.no_grad():
                self.graphs = SpecGraphs(self)
            logger.info("speculative step: CUDA graphs for batch sizes %s", self.graphs.sizes)
        except Exception as error:  # noqa: BLE001 - fall back to eager, say why
            logger.warning("CUDA graph capture of the speculative step failed (%s); running it eagerly", error)
            self.graphs = None

    # ------------------------------------------------------------------ engine protocol

    def copy_blocks(self, pairs):
        self.draft_cache.copy_blocks(pairs)
        if self.graphs is not None:  # a copy-on-write replaced table entries: resend whole rows
            self.graphs.forget_rows()

    def on_weights_updated(self) -> None:
        if self.draft.hot is not None:  # the token map's head rows follow the new weights
            self.draft.hot.refresh()
        if self.cpu_backup:
            self.draft_weights_cpu = {
                name: tensor.detach().to("cpu", copy=True) for name, tensor in _draft_named_parameters(self.draft)
            }

    def release_memory_occupation(self, tags) -> None:
        """The engine frees its memory (``--colocate``): the draft's KV cache goes with
        ``kv_cache``, a separate draft model's weights with ``weights`` (an MTP head is
        part of the policy and moves with it); the graphs (over both) go with either."""
        if self.graphs is not None:
            self.graphs = None
            self._graphs_released = True
        if "kv_cache" in tags:
            self.draft_cache.release()
        if "weights" in tags and isinstance(self.draft, ModelDraft):
            offload.move_modules([self.draft.model], "cpu")

    def resume_memory_occupation(self, tags) -> None:
        if "weights" in tags and isinstance(self.draft, ModelDraft):
            offload.move_modules([self.draft.model], self.engine.device)
        if "kv_cache" in tags:
            self.draft_cache.allocate()
        if self._graphs_released and not self.engine.released_tags:
            self._graphs_released = False
            self._build_graphs()

    def on_prefill(self, batch, group, hidden_TH, cu_seqlens) -> None:
        """Every sampler of a prefilled sequence gets the prefill's hidden states as pending entries."""
        for position, index in enumerate(group):
            rows_TH = hidden_TH[cu_seqlens[position]:cu_seqlens[position + 1]]
            parent = batch.sequences[index]
            first = len(parent) - rows_TH.shape[0] - self.draft.offset
            kept = rows_TH.clone() if self.draft.uses_hidden else None
            for seq, source in zip(batch.samplers, batch.sample_from):
                if source == index:
                    seq.draft_state = DraftState(first, kept)

    @torch.inference_mode()
    def decode(self, sequences, want_routes: bool) -> list[DecodeTokens]:
        step, self.steps = self.steps, self.steps + 1
        groups = [[i] for i in range(len(sequences))] if self.engine.config.batch_invariant else [list(range(len(sequences)))]
        out: list[DecodeTokens | None] = [None] * len(sequences)
        for group in groups:
            for i, tokens in zip(group, self._decode([sequences[i] for i in group], want_routes, step, group[0])):
                out[i] = tokens
        return out

    # ------------------------------------------------------------------ one step

    def _decode(self, seqs: list, want_routes: bool, step: int, row_base: int) -> list[DecodeTokens]:
        """One step of ``seqs``; their verify rows go to slab rows ``row_base * J ..`` of this step's half."""
        count = self.num_steps + 1
        fixed_state = [self._fixed_state(seq, step) for seq in seqs]
        plan = build_plan(seqs, fixed_state, self.num_steps, self.draft.offset, self.engine.kv_cache.block_size)
        banned_BJV = self._banned(seqs, self.engine.model.config.vocab_size)
        outputs = None
        graphs = self.graphs
        if graphs is not None and row_base == 0 and banned_BJV is None and graphs.padded_size(len(seqs)):
            outputs = self._graph_step(seqs, plan, want_routes)
        if outputs is None:
            outputs = self._eager_step(seqs, plan, banned_BJV, want_routes)
        first_row = (step % 2) * self.slab_rows + row_base * count
        if self.draft.uses_hidden:
            self.slab[first_row:first_row + len(seqs) * count].copy_(outputs.hidden_TH)
        rows, routes_TLE = self._read(outputs)
        return self._emit(seqs, rows, routes_TLE, step, first_row)

    def _fixed_state(self, seq, step: int) -> tuple[int, int] | None:
        """``(first, slab row)`` when ``seq``'s pending entries are the previous step's kept ones."""
        state = seq.draft_state
        if not isinstance(state, DraftState) or state.row is None or state.step != step - 1:
            return None
        kept = len(seq) - 1 - state.first
        return (state.first, state.row) if 1 <= kept <= self.num_steps + 1 else None

    def _attention(self, cache, seqs, context_lens, num_new, is_decode) -> Forward:
        runner = self.engine.runner
        positions_T, meta = paged_metadata(
            [s.block_table for s in seqs], context_lens, num_new, cache.block_size, self.engine.device,
            is_decode, runner.attention_backend, runner.head_counts,
        )
        return Forward(positions_T, PagedAttention(cache, meta, runner.attention_backend))

    def _to_device(self, values: np.ndarray | list) -> torch.Tensor:
        return host_to_device(torch.as_tensor(np.asarray(values)), self.engine.device)

    def _prompt_features(self, seqs: list, rows: list[int]) -> torch.Tensor:
        """Start features ``[len(rows), H']`` of prompt rows: the draft over their pending entries (eager)."""
        chosen = [seqs[b] for b in rows]
        states = [self._prompt_state(seq) for seq in chosen]
        counts = [len(seq) - 1 - state.first for seq, state in zip(chosen, states)]
        ids = [t for seq, state in zip(chosen, states) for t in seq.token_ids[state.first + 1:]]
        hidden_TH = torch.cat([state.hidden_TH for state in states]) if self.draft.uses_hidden else None
        forward = self._attention(
            self.draft_cache, chosen, [len(seq) - 1 + self.draft.offset for seq in chosen], counts, is_decode=False
        )
        last = self._to_device(np.cumsum(counts) - 1)
        return extend_features(self.draft, hidden_TH, self._to_device(ids), forward, last)

    def _prompt_state(self, seq) -> DraftState:
        state = seq.draft_state
        if isinstance(state, DraftState) and state.row is None:
            return state
        return self._fallback_state(seq)

    def _fallback_state(self, seq) -> DraftState:
        """A sequence without usable pending entries (not expected): only its last one, with a zero feature."""
        hidden = None
        if self.draft.uses_hidden:
            hidden = torch.zeros(1, self.slab.shape[1], device=self.engine.device, dtype=self.slab.dtype)
        return DraftState(len(seq) - 2, hidden)

    def _start_features(self, seqs: list, plan: StepPlan) -> torch.Tensor:
        """``[B, H']`` draft features of every sequence's last pending entry (eager)."""
        count = self.num_steps + 1
        parts = []
        if plan.fixed:
            fixed = plan.fixed
            forward = self._attention(self.draft_cache, [seqs[b] for b in fixed], plan.ext_context_B[fixed].tolist(),
                                      [count] * len(fixed), is_decode=True)
            hidden_TH = None
            if self.draft.uses_hidden:
                hidden_TH = self.slab.index_select(0, self._to_device(plan.ext_sources_BJ[fixed].reshape(-1)))
            last = self._to_device(np.arange(len(fixed)) * count + plan.kept_B[fixed] - 1)
            ids = self._to_device(plan.ext_ids_BJ[fixed].reshape(-1))
            parts.append((fixed, extend_features(self.draft, hidden_TH, ids, forward, last)))
        if plan.prompt:
            parts.append((plan.prompt, self._prompt_features(seqs, plan.prompt)))
        if len(parts) == 1:
            return parts[0][1]  # rows in order: all fixed or all prompt
        feature_BH = parts[0][1].new_empty(len(seqs), parts[0][1].shape[1])
        for rows, features in parts:
            feature_BH.index_copy_(0, self._to_device(rows), features)
        return feature_BH

    def _eager_step(self, seqs: list, plan: StepPlan, banned_BJV, want_routes: bool) -> StepOutputs:
        count = self.num_steps + 1
        runner = self.engine.runner
        chain = [
            self._attention(self.draft_cache, seqs, plan.chain_context_BC[:, i].tolist(), [1] * len(seqs), True)
            for i in range(self.num_steps - 1)
        ]
        inputs = StepInputs(
            chain=chain,
            verify=self._attention(self.engine.kv_cache, seqs, plan.ver_context_B.tolist(), [count] * len(seqs), True),
            last_ids_B=self._to_device(plan.last_ids_B),
            rows=RowSettings.build([s.params for s in seqs], [None] * len(seqs), self.engine.device),
            uniforms_BR=self._to_device(plan.uniforms_BR).float(), banned_BJV=banned_BJV, capture_routes=want_routes,
        )
        return draft_and_verify(runner.model, self.draft, self._start_features(seqs, plan), inputs, runner.fused_kernels)

    def _graph_step(self, seqs: list, plan: StepPlan, want_routes: bool) -> StepOutputs | None:
        """The step in a CUDA graph (None, and no graphs from now on, when capturing a new variant failed)."""
        from miles_spec.graphs import CaptureError, Variant

        if plan.prompt:
            features = self._prompt_features(seqs, plan.prompt)
            self.graphs.prompt_feature.index_copy_(0, self._to_device(plan.prompt), features)
        try:
            return self.graphs.replay_step(seqs, plan, Variant.of([s.params for s in seqs], want_routes))
        except CaptureError as error:
            logger.warning("%s; running the speculative step eagerly from now on", error)
            self.graphs = None
            return None

    def _read(self, outputs: StepOutputs) -> tuple[list[list[float]], np.ndarray | None]:
        """The step's one device-to-host read: packed rows, and the routes (numpy) if captured."""
        packed, routes = outputs.packed_BP, outputs.routes_TLE
        if not packed.is_cuda:
            return packed.tolist(), (routes.numpy() if routes is not None else None)
        packed = self._host_copy("packed", packed)
        if routes is not None:
            routes = self._host_copy("routes", routes)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return packed.tolist(), (routes.numpy() if routes is not None else None)

    def _host_copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Start copying ``tensor`` into a reused pinned buffer; the view (valid until the next step)."""
        buffer = self._pinned.get(name)
        if buffer is None or buffer.dtype != tensor.dtype or buffer.numel() < tensor.numel():
            buffer = torch.empty(max(tensor.numel(), 1 << 12), dtype=tensor.dtype, pin_memory=True)
            self._pinned[name] = buffer
        host = buffer[:tensor.numel()].view(tensor.shape)
        host.copy_(tensor, non_blocking=True)
        return host

    def _emit(self, seqs: list, rows: list, routes_TLE, step: int, first_row: int) -> list[DecodeTokens]:
        """Each sequence's kept tokens; its next pending entries are this verify's kept rows."""
        count = self.num_steps + 1
        out = []
        for b, (seq, values) in enumerate(zip(seqs, rows)):
            accepted = int(values[2 * count])
            kept = accepted + 1
            start = len(seq) - 1
            seq.draft_state = DraftState(start, None, row=first_row + b * count, step=step)
            routes = None
            if routes_TLE is not None:
                routes = (start, routes_TLE[b * count:b * count + kept].copy())
            out.append(DecodeTokens([int(t) for t in values[:kept]], values[count:count + kept], routes))
            self._count(seq, accepted)
        return out

    def _banned(self, seqs, vocab: int) -> torch.Tensor | None:
        """``[B, J, V]`` tokens a position may not take (``min_new_tokens`` not reached), or None."""
        k = self.num_steps
        if all(s.num_output_tokens >= s.params.min_new_tokens for s in seqs):
            return None
        banned = torch.zeros(len(seqs), k + 1, vocab, dtype=torch.bool)
        for b, seq in enumerate(seqs):
            ids = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else list(seq.eos_token_ids))
            for j in range(k + 1):
                if seq.num_output_tokens + j < seq.params.min_new_tokens and ids:
                    banned[b, j, ids] = True
        return host_to_device(banned, self.engine.device)

    # ------------------------------------------------------------------ statistics

    def _count(self, seq, accepted: int) -> None:
        k = self.num_steps
        info = seq.spec_info
        info["spec_verify_ct"] = info.get("spec_verify_ct", 0) + 1
        info["spec_draft_tokens"] = info.get("spec_draft_tokens", 0) + k
        info["spec_accepted_tokens"] = info.get("spec_accepted_tokens", 0) + accepted
        # tokens emitted per verify forward (SGLang's accept length): accepted drafts + 1
        info["spec_accept_length"] = 1.0 + info["spec_accepted_tokens"] / info["spec_verify_ct"]
        self.counters.verify_steps += 1
        self.counters.draft_tokens += k
        self.counters.accepted_tokens += accepted

    def pop_counters(self) -> SpecCounters:
        """The statistics since the last call (and reset them)."""
        counters, self.counters = self.counters, SpecCounters()
        return counters


def _draft_named_parameters(draft):
    if hasattr(draft, "layer"):
        return [(f"mtp.0.{name}", p) for name, p in draft.layer.named_parameters()]
    return list(draft.model.named_parameters())


def _draft_parameters(draft):
    return [p for _, p in _draft_named_parameters(draft)]
