"""The ``eagle`` decoding strategy: chain drafting, one-forward verification, speculative sampling.

One decode step for a batch of running sequences, each of length ``n``
(tokens ``x_0 .. x_{n-1}``, K/V cached for ``x_0 .. x_{n-2}``):

1. draft *extend*: the draft runs over its pending entries (the pairs
   ``(h_t, x_{t+1})`` whose policy hidden states arrived since the last step:
   the prompt after prefill, the kept tokens after a verify), writing its own
   KV cache; the last entry's logits give ``q_1`` and the first draft ``d_1``;
2. ``k - 1`` single-token draft steps (the draft's own feature stands in for the
   policy's hidden state) give ``d_2 .. d_k``;
3. verify: ONE policy forward over ``[x_{n-1}, d_1 .. d_k]`` on the paged KV
   cache (slots made writable by the scheduler's lookahead);
4. accept by speculative sampling (:mod:`miles_spec.sampling`); K/V of
   rejected drafts stay in slots past the new ``len - 1`` and are overwritten
   later (the engine only trusts slots below ``num_cached_tokens``), and their
   routed-expert rows are dropped.

The draft's KV cache is a second :class:`PagedKVCache` with the same blocks as
the policy's (slot ``s`` of a sequence in both), so the block manager, prefix
sharing of the ``n`` samples and copy-on-write serve both.

Tensor legend: B sequences, K draft tokens, J = K + 1, T tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from miles_host import offload
from miles_host.models.context import ForwardContext, RoutingContext
from miles_host.rollout.attention import PagedAttention
from miles_host.rollout.kv_cache import PagedKVCache
from miles_host.rollout.model_runner import paged_metadata
from miles_host.rollout.strategy import DecodeTokens

from miles_spec.draft import ModelDraft
from miles_spec.sampling import RowSettings, accept, distributions, sample_from

#: live strategies, for the per-step metrics (``miles_step_end``)
LIVE: "weakref.WeakSet[EagleStrategy]" = weakref.WeakSet()


@dataclass
class DraftState:
    """A sequence's pending draft entries ``first .. len - 2`` and their policy hidden states."""

    first: int
    hidden_TH: torch.Tensor | None


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
        dtype = next(iter(_draft_parameters(draft)), torch.empty((), dtype=kv.dtype)).dtype
        self.draft_cache = PagedKVCache(draft.layout(), kv.num_blocks, kv.block_size, dtype, engine.device)
        self.counters = SpecCounters()
        LIVE.add(self)

    # ------------------------------------------------------------------ engine protocol

    def copy_blocks(self, pairs):
        self.draft_cache.copy_blocks(pairs)

    def on_weights_updated(self) -> None:
        if self.cpu_backup:
            self.draft_weights_cpu = {
                name: tensor.detach().to("cpu", copy=True) for name, tensor in _draft_named_parameters(self.draft)
            }

    def release_memory_occupation(self, tags) -> None:
        """The engine frees its memory (``--colocate``): the draft's KV cache goes with
        ``kv_cache``, a separate draft model's weights with ``weights`` (an MTP head is
        part of the policy and moves with it)."""
        if "kv_cache" in tags:
            self.draft_cache.release()
        if "weights" in tags and isinstance(self.draft, ModelDraft):
            offload.move_modules([self.draft.model], "cpu")

    def resume_memory_occupation(self, tags) -> None:
        if "weights" in tags and isinstance(self.draft, ModelDraft):
            offload.move_modules([self.draft.model], self.engine.device)
        if "kv_cache" in tags:
            self.draft_cache.allocate()

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
        groups = [[i] for i in range(len(sequences))] if self.engine.config.batch_invariant else [list(range(len(sequences)))]
        out: list[DecodeTokens | None] = [None] * len(sequences)
        for group in groups:
            for i, tokens in zip(group, self._decode([sequences[i] for i in group], want_routes)):
                out[i] = tokens
        return out

    # ------------------------------------------------------------------ one step

    def _attention(self, cache, seqs, context_lens, num_new, is_decode):
        runner = self.engine.runner
        positions_T, meta = paged_metadata(
            [s.block_table for s in seqs], context_lens, num_new, cache.block_size, self.engine.device,
            is_decode, runner.attention_backend, runner._head_counts,
        )
        return positions_T, PagedAttention(cache, meta, runner.attention_backend)

    def _draft(self, seqs: list, rows: RowSettings, banned_BJV) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens ``[B, K]`` and the draft's distributions ``[B, K, V]``."""
        device, offset, k = self.engine.device, self.draft.offset, self.num_steps
        lengths = [len(s) for s in seqs]
        states = [s.draft_state or self._fallback_state(s) for s in seqs]
        counts = [n - 1 - st.first for n, st in zip(lengths, states)]
        token_ids = [t for s, st in zip(seqs, states) for t in s.token_ids[st.first + 1:]]
        hidden_TH = torch.cat([st.hidden_TH for st in states]) if self.draft.uses_hidden else None
        positions_T, attention = self._attention(
            self.draft_cache, seqs, [n - 1 + offset for n in lengths], counts, is_decode=False
        )
        feature_TH, logits_TV = self.draft.forward(
            hidden_TH, torch.tensor(token_ids, dtype=torch.long).to(device), positions_T, attention
        )
        last_B = torch.tensor(attention.metadata.cu_seqlens_q_host[1:], dtype=torch.long, device=device) - 1
        feature_BH, logits_BV = feature_TH[last_B], logits_TV[last_B]
        tokens, probs = [], []
        for j in range(k):
            probs_BV, _ = distributions(logits_BV[:, None], rows, None if banned_BJV is None else banned_BJV[:, j:j + 1])
            probs_BV = probs_BV[:, 0]
            token_B = sample_from(probs_BV, rows.generators)
            tokens.append(token_B)
            probs.append(probs_BV)
            if j == k - 1:
                break
            positions_T, attention = self._attention(
                self.draft_cache, seqs, [n + j + offset for n in lengths], [1] * len(seqs), is_decode=True
            )
            feature_BH, logits_BV = self.draft.forward(feature_BH, token_B, positions_T, attention)
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)

    def _fallback_state(self, seq) -> DraftState:
        """A sequence that reached decode without prefill hidden states (not expected): a zero feature."""
        hidden = None
        if self.draft.uses_hidden:
            hidden = torch.zeros(1, self.engine.model.config.hidden_size, device=self.engine.device,
                                 dtype=self.engine.kv_cache.dtype)
        return DraftState(len(seq) - 2, hidden)

    def _decode(self, seqs: list, want_routes: bool) -> list[DecodeTokens]:
        device, k = self.engine.device, self.num_steps
        model = self.engine.runner.model
        rows = RowSettings.build([s.params for s in seqs], [s.generator for s in seqs], device)
        banned_BJV = self._banned(seqs, model.config.vocab_size)
        drafts_BK, draft_probs_BKV = self._draft(seqs, rows, banned_BJV)
        lengths = [len(s) for s in seqs]
        last_B1 = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.long).to(device)[:, None]
        input_ids_T = torch.cat([last_B1, drafts_BK], dim=1).reshape(-1)
        positions_T, attention = self._attention(
            self.engine.kv_cache, seqs, [n + k for n in lengths], [k + 1] * len(seqs), is_decode=False
        )
        routing = RoutingContext(phase="rollout")
        routing.extra["capture"] = want_routes
        context = ForwardContext(attention=attention, routing=routing, fused_kernels=self.engine.runner.fused_kernels)
        hidden_TH = model.forward_hidden(input_ids_T, positions_T, context)
        logits_BJV = model.compute_logits(hidden_TH).view(len(seqs), k + 1, -1)
        target_probs_BJV, target_logprobs_BJV = distributions(logits_BJV, rows, banned_BJV)
        verdict = accept(target_probs_BJV, target_logprobs_BJV, draft_probs_BKV, drafts_BK, rows.generators)
        # the step's one device-to-host copy
        num_accepted = verdict.num_accepted_B.tolist()
        tokens = verdict.tokens_BJ.tolist()
        logprobs = verdict.logprobs_BJ.tolist()
        routes_TLK = None
        if want_routes and routing.captured:
            layers = sorted(routing.captured)
            routes_TLK = torch.stack([routing.captured[layer].to(torch.int32) for layer in layers], dim=1)
        hidden_BJH = hidden_TH.view(len(seqs), k + 1, -1)
        out = []
        for b, (seq, a) in enumerate(zip(seqs, num_accepted)):
            kept = a + 1
            # next step's pending entries: x_{n-1} and the kept drafts, with their verified hidden states
            seq.draft_state = DraftState(lengths[b] - 1, hidden_BJH[b, :kept].clone() if self.draft.uses_hidden else None)
            routes = None
            if routes_TLK is not None:
                routes = (lengths[b] - 1, routes_TLK[b * (k + 1): b * (k + 1) + kept])
            out.append(DecodeTokens(tokens[b][:kept], logprobs[b][:kept], routes))
            self._count(seq, a)
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
        return banned.to(self.engine.device)

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
