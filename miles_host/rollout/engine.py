"""The embedded rollout engine: continuous batching over a paged KV cache.

Synchronous use::

    engine = Engine.from_pretrained(path, dtype=torch.bfloat16, device="cuda")
    outputs = engine.generate(input_ids=[[1, 2, 3], [4, 5]], sampling_params={"temperature": 1.0, "n": 4})

Request-level use (the rollout manager): :meth:`Engine.add_request`, :meth:`Engine.step`
(returns the outputs finished in that step), :meth:`Engine.abort`, :meth:`Engine.pause` /
:meth:`Engine.resume`, and the asyncio form :meth:`Engine.async_generate`.

Logprobs: ``return_logprob`` gives each sampled token's logprob in
``meta_info["output_token_logprobs"]``; ``top_logprobs_num``, ``token_ids_logprob`` and
``logprob_start_len`` (SGLang's request fields, :mod:`.logprobs`) add ``output["logprobs"]``
(:func:`~miles_host.rollout.outputs.sglang_logprob_meta` renders it as SGLang's meta_info).

Errors: :meth:`add_request` raises ``ValueError`` for a bad request (invalid
sampling params, empty prompt, prompt not shorter than ``max_model_len`` or larger
than the KV cache, ``n`` above ``max_num_seqs``, stop strings without a tokenizer,
a feature the engine cannot run as asked: :mod:`.request_checks`).
:meth:`generate` and :meth:`async_generate` do not raise for those: the bad
request's result has ``finish_reason == {"type": "abort", "message": ...}`` and
the other requests run normally.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from miles_host.models.mlp import set_moe_kernel
from miles_host.models.self_attention import engine_caches_latents
from miles_host.rollout import overlap
from miles_host.rollout.async_api import AsyncGenerate, normalise_batch
from miles_host.rollout.block_manager import BlockManager
from miles_host.rollout.recurrent_state import HybridBlockManager, RecurrentStatePool
from miles_host.rollout.config import EngineConfig, resolve_config
from miles_host.rollout.gpu_sizing import measure_activation_peak
from miles_host.rollout.grammar import GrammarCompiler, RequestGrammar
from miles_host.rollout.kv_cache import PagedKVCache, kv_bytes_per_token, num_blocks_for_gpu
from miles_host.rollout.logprobs import LogprobOptions, input_logprobs
from miles_host.rollout.memory import MemoryOccupation
from miles_host.rollout.model_runner import ModelRunner
from miles_host.rollout.outputs import rejected_output, routed_experts_array, sequence_output
from miles_host.rollout.request_checks import check_features
from miles_host.rollout.route_store import RouteStore
from miles_host.rollout.sampling_params import SamplingParams
from miles_host.rollout.scheduler import ScheduledBatch, Scheduler
from miles_host.rollout.sequence import Sequence, SequenceStatus
from miles_host.rollout.stopping import finish_reason
from miles_host.rollout.strategy import DecodingStrategy
from miles_host.rollout.weights import copy_named_tensors

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    rid: str
    samples: list[Sequence]
    return_logprob: bool
    return_routed_experts: bool
    outputs: list[dict | None] = field(default_factory=list)
    future: "asyncio.Future | None" = None

    @property
    def done(self) -> bool:
        return all(o is not None for o in self.outputs)


class Engine(MemoryOccupation, AsyncGenerate):
    """In-process rollout engine over a :class:`miles_host.models.CausalLM`.

    See :class:`~miles_host.rollout.config.EngineConfig` for the knobs
    (``mem_fraction_static``, ``max_num_seqs``, ``batch_invariant``, ...).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any | None = None,
        decoding_strategy: Callable[["Engine"], DecodingStrategy] | None = None,
        **config_kwargs: Any,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config: EngineConfig = resolve_config(model, **config_kwargs)
        cfg = self.config
        set_moe_kernel(model, cfg.moe_kernel)
        self.device = cfg.device
        self.weight_version: Any = 0
        #: per-sequence states of linear-attention layers, allocated before the KV cache is sized
        self.recurrent_states = RecurrentStatePool.for_engine(model, cfg, decoding_strategy)
        layout = model.attention_layout(latent_mla=engine_caches_latents(cfg.batch_invariant))
        self.kv_bytes_per_token = kv_bytes_per_token(layout, cfg.kv_cache_dtype)
        if self.device.type == "cuda":
            activation_peak = measure_activation_peak(self.model, cfg, self.device, layout)
            num_blocks = num_blocks_for_gpu(
                layout, cfg.block_size, cfg.kv_cache_dtype, self.device, cfg.mem_fraction_static, activation_peak
            )
            if cfg.max_kv_cache_tokens is not None:
                num_blocks = min(num_blocks, cfg.max_kv_cache_tokens // cfg.block_size + 1)
        else:
            num_blocks = cfg.kv_cache_tokens // cfg.block_size + 1  # + the padding block
        self.kv_cache = PagedKVCache(layout, num_blocks, cfg.block_size, cfg.kv_cache_dtype, self.device)
        if self.recurrent_states is None:
            self.block_manager = BlockManager(
                num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching and not cfg.batch_invariant
            )
        else:  # prefix caching off: a cached prefix would come without its recurrent state
            self.block_manager = HybridBlockManager(num_blocks, cfg.block_size, self.recurrent_states)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        #: captured routes (R3) per cache slot, read when a sequence finishes
        self.route_store = RouteStore(num_blocks, cfg.block_size)
        self.scheduler.on_release = self._keep_routes
        self.runner = ModelRunner(
            model, self.kv_cache, device=self.device, attention_backend=cfg.attention_backend,
            max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
            batch_invariant=cfg.batch_invariant, use_cuda_graph=cfg.use_cuda_graph,
            fused_kernels=cfg.fused_kernels, cuda_graph_batch_sizes=cfg.cuda_graph_batch_sizes,
            recurrent_states=self.recurrent_states,
        )
        self.eos_token_ids = tuple(cfg.eos_token_ids)
        self.grammar_compiler = GrammarCompiler(tokenizer, model.config.vocab_size, self.eos_token_ids)
        #: None: one policy forward per token (plain). Else a plugin's strategy runs the decode steps.
        self.strategy: DecodingStrategy | None = None
        if decoding_strategy is not None:
            self.strategy = decoding_strategy(self)
            self.scheduler.num_lookahead_tokens = self.strategy.num_lookahead_tokens
        self._requests: dict[str, _Request] = {}
        self._paused = False
        self._ready_outputs: list[dict[str, Any]] = []  # finished at submission, returned by step()
        self._pending: overlap.PendingDecode | None = None  # a launched, unread decode step
        self._driver: asyncio.Task | None = None
        self._rid_counter = itertools.count()
        if self.device.type == "cuda":
            # Move the objects alive now (model, tokenizer, the caller's heap) out of the
            # collector's reach: full collections over them stalled decode steps (SGLang
            # freezes its scheduler's heap likewise). Reference counting still frees them.
            gc.collect()
            gc.freeze()
        logger.info(
            "rollout engine: %d KV blocks x %d tokens (%.2f GiB), attention=%s, cuda_graphs=%s",
            num_blocks - 1, cfg.block_size, self.kv_cache.num_bytes / 2**30, cfg.attention_backend,
            bool(self.runner.graphs),
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cuda",
        routing_hooks: Any = None,
        tokenizer: Any = "auto",
        prepare_model: Any = None,
        **config_kwargs: Any,
    ) -> "Engine":
        """Load a Hugging Face checkpoint folder through :func:`miles_host.models.load_pretrained`.

        ``tokenizer="auto"`` loads the folder's tokenizer when there is one (it is
        only needed for ``stop`` strings and ``text`` in the results).
        ``prepare_model(model) -> model`` runs before the KV cache is sized and CUDA
        graphs are captured (precision plugins swap linears there).
        """
        from miles_host.models import load_pretrained

        model = load_pretrained(path, dtype=dtype, device=device, routing_hooks=routing_hooks)
        if prepare_model is not None:
            model = prepare_model(model) or model
        if tokenizer == "auto":
            tokenizer = _try_load_tokenizer(path)
        return cls(model, tokenizer=tokenizer, **config_kwargs)

    # ------------------------------------------------------------------ capacity

    @property
    def num_kv_cache_tokens(self) -> int:
        """Tokens the KV cache holds (without the padding block)."""
        return self.block_manager.num_usable_blocks * self.config.block_size

    def block_manager_blocks(self, num_tokens: int) -> int:
        return (num_tokens + self.config.block_size - 1) // self.config.block_size

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        rid: str | None,
        input_ids: list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        top_logprobs_num: int | None = 0,
        token_ids_logprob: list[int] | None = None,
        logprob_start_len: int | None = -1,
    ) -> str:
        """Queue one request (``n`` samples); return its id. Raises ``ValueError`` if it is bad.

        ``top_logprobs_num`` / ``token_ids_logprob`` / ``logprob_start_len`` (SGLang's
        ``/generate`` fields) count only with ``return_logprob``, as in SGLang."""
        options = LogprobOptions.build(top_logprobs_num, token_ids_logprob, logprob_start_len)
        return self._add(rid, input_ids, sampling_params, return_logprob, return_routed_experts, options).rid

    def _add(self, rid, input_ids, sampling_params, return_logprob, return_routed_experts,
             options: LogprobOptions | None = None) -> _Request:
        self.check_resident()  # released memory (release_memory_occupation): a RuntimeError
        params = SamplingParams.from_any(dict(sampling_params) if isinstance(sampling_params, Mapping) else sampling_params)
        rid = str(rid) if rid is not None else f"req-{next(self._rid_counter)}-{uuid.uuid4().hex[:8]}"
        options = options if options is not None and return_logprob and options.any else None
        self._validate(rid, input_ids, params)
        check_features(
            params, options or LogprobOptions(), len(input_ids), vocab_size=self.model.config.vocab_size,
            has_tokenizer=self.tokenizer is not None, batch_invariant=self.config.batch_invariant,
            strategy=self.strategy,
        )
        compiled = self.grammar_compiler.compile(*params.grammar) if params.grammar is not None else None
        prompt = [int(t) for t in input_ids]
        samples = []
        for index in range(params.n):
            generator = None
            if params.sampling_seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.sampling_seed + index)
            samples.append(Sequence(
                rid=rid, token_ids=list(prompt), num_prompt_tokens=len(prompt), params=params,
                sample_index=index, generator=generator, want_routed_experts=return_routed_experts,
                weight_version_spans=[[0, self.weight_version]],
                eos_token_ids=self.eos_token_ids, logprob_options=options,
                grammar=RequestGrammar(compiled) if compiled is not None else None,
            ))
        parent = samples[0]
        for child in samples[1:]:
            child.parent = parent
            parent.children.append(child)
        request = _Request(rid, samples, return_logprob, return_routed_experts, outputs=[None] * params.n)
        self._requests[rid] = request
        if params.max_new_tokens == 0 and not (options is not None and options.wants_input):
            # nothing to generate: the outputs come back from the next step(), like any other
            self._ready_outputs.extend(self._finish(seq, {"type": "length", "length": 0}) for seq in samples)
        else:
            self.scheduler.add(parent)
        return request

    def _validate(self, rid: str, input_ids: Any, params: SamplingParams) -> None:
        cfg = self.config
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if not isinstance(input_ids, (list, tuple)) or not all(isinstance(t, int) for t in input_ids):
            raise ValueError("input_ids must be a list of token ids (ints)")
        if len(input_ids) == 0:
            raise ValueError("the prompt is empty: input_ids must contain at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in input_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(input_ids) >= cfg.max_model_len:
            raise ValueError(
                f"the prompt has {len(input_ids)} tokens but max_model_len is {cfg.max_model_len}: "
                "shorten the prompt or raise max_model_len"
            )
        if len(input_ids) + 1 > self.num_kv_cache_tokens:
            raise ValueError(
                f"the prompt has {len(input_ids)} tokens but the KV cache holds {self.num_kv_cache_tokens}: "
                "raise mem_fraction_static / kv_cache_tokens"
            )
        if params.n > cfg.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={cfg.max_num_seqs}")

    def has_unfinished(self) -> bool:
        """True while some request still has samples to generate (or outputs to hand back)."""
        return bool(self._ready_outputs) or self._pending is not None or self.scheduler.has_work()

    def step(self) -> list[dict[str, Any]]:
        """Run one scheduler step; return the outputs of samples that finished in it
        (with ``overlap_schedule``: in the step before, read while this one runs)."""
        finished: list[dict[str, Any]] = self._ready_outputs
        self._ready_outputs = []
        if self._paused or not self.scheduler.has_work():
            return finished + self._drain()
        batch = self.scheduler.schedule()
        if batch is None:
            return finished + self._drain()
        self.route_store.copy_blocks(batch.pending_copies)  # as the KV cache copies them
        if self._overlaps(batch):
            previous, self._pending = self._pending, overlap.launch(self.runner, batch, self._pending, self.device)
            return finished + (self._collect(previous) if previous is not None else [])
        finished += self._drain()
        for seq in batch.failed:
            finished.append(self._finish(seq, {
                "type": "abort",
                "message": f"the sequence needs {len(seq)} tokens of KV cache but only "
                           f"{self.num_kv_cache_tokens} fit: raise mem_fraction_static / kv_cache_tokens",
            }))
        if not batch.sequences:
            return finished
        want_routes = any(s.want_routed_experts for s in batch.sequences)
        if self.strategy is not None:
            if batch.pending_copies:
                self.strategy.copy_blocks(batch.pending_copies)
            if not batch.is_prefill:
                return finished + self._strategy_step(batch, want_routes)
        if batch.is_prefill:
            for seq in batch.sequences:
                if seq.num_output_tokens == 0 and seq.sample_index == 0:
                    seq.num_prompt_cached_tokens = seq.num_cached_tokens
        on_hidden = None
        if self.strategy is not None or (batch.is_prefill and any(s.wants_input_logprobs for s in batch.sequences)):
            def on_hidden(group, hidden_TH, cu_seqlens):
                if batch.is_prefill:
                    self._store_input_logprobs([batch.sequences[i] for i in group], hidden_TH, cu_seqlens)
                if self.strategy is not None:
                    self.strategy.on_prefill(batch, group, hidden_TH, cu_seqlens)
        result, routes = self.runner.run(batch, want_routes, on_hidden=on_hidden)
        for slots_T, routes_TLK in routes:
            self.route_store.write(slots_T, routes_TLK)
        extras = result.extras or [None] * len(batch.samplers)
        for seq, token, logprob, extra in zip(batch.samplers, result.token_ids, result.logprobs, extras):
            if seq.parent is not None and seq.num_output_tokens == 0:
                seq.num_prompt_cached_tokens = seq.parent.num_prompt_cached_tokens
            if seq.params.max_new_tokens == 0:  # prefilled for its prompt logprobs only
                finished.append(self._finish(seq, {"type": "length", "length": 0}))
                continue
            seq.token_ids.append(token)
            seq.output_logprobs.append(logprob)
            if seq.wants_position_extras:
                seq.output_extras.append(extra)
            if seq.grammar is not None:
                seq.grammar.accept(token)
            seq.num_cached_tokens = len(seq) - 1
            self.block_manager.register_full_blocks(seq, len(seq) - 1)
            reason = self._finish_reason(seq)
            if reason is not None:
                finished.append(self._finish(seq, reason))
        return finished

    def _store_input_logprobs(self, seqs: list[Sequence], hidden_TH: torch.Tensor, cu_seqlens: list[int]) -> None:
        """Prompt logprobs of the sequences in a prefill forward that asked (every prompt
        token was forwarded: such a sequence bypasses the prefix cache)."""
        for j, seq in enumerate(seqs):
            if seq.wants_input_logprobs:
                rows_TH = hidden_TH[cu_seqlens[j]:cu_seqlens[j + 1]]
                assert rows_TH.shape[0] == seq.num_prompt_tokens, "input logprobs need the whole prompt forwarded"
                seq.input_logprobs = input_logprobs(
                    self.runner.logits, rows_TH, seq.token_ids[:seq.num_prompt_tokens], seq.logprob_options
                )

    # ------------------------------------------------------------------ overlapped decode

    def _overlaps(self, batch: ScheduledBatch) -> bool:
        """Whether ``batch`` is a plain decode step that may run overlapped (not when a row
        needs its previous token before sampling, or per-position logprob extras)."""
        return (
            self.config.overlap_schedule and not batch.is_prefill and not batch.failed and bool(batch.sequences)
            and self.strategy is None and not self.runner.token_by_token
            and not any(s.needs_processed_logits or s.wants_position_extras for s in batch.sequences)
        )

    def _collect(self, pending: "overlap.PendingDecode") -> list[dict[str, Any]]:
        """Read a launched step's tokens; finish the sequences that stopped."""
        result = self.runner.finish_decode(pending.readback)
        stopped = overlap.resolve_step(pending, result, self.block_manager, self._finish_reason, self.route_store)
        return [self._finish(seq, reason) for seq, reason in stopped]

    def _drain(self) -> list[dict[str, Any]]:
        """Read the launched step, if any (before anything that needs final token ids)."""
        pending, self._pending = self._pending, None
        return self._collect(pending) if pending is not None else []

    def _strategy_step(self, batch: ScheduledBatch, want_routes: bool) -> list[dict[str, Any]]:
        """A decode step of the decoding strategy: possibly several tokens per sequence."""
        if batch.pending_copies:
            self.kv_cache.copy_blocks(batch.pending_copies)
        finished: list[dict[str, Any]] = []
        steps = self.strategy.decode(batch.sequences, want_routes)
        for seq, step in zip(batch.sequences, steps):
            reason = None
            for token, logprob in zip(step.token_ids, step.logprobs):
                seq.token_ids.append(token)
                seq.output_logprobs.append(logprob)
                reason = self._finish_reason(seq)
                if reason is not None:
                    break  # tokens past a stop are dropped, like a plain engine that stopped there
            if step.routes is not None and seq.want_routed_experts:
                self.route_store.write_positions(seq.block_table, *step.routes)
            seq.num_cached_tokens = len(seq) - 1
            self.block_manager.register_full_blocks(seq, len(seq) - 1)
            if reason is not None:
                finished.append(self._finish(seq, reason))
        return finished

    def _keep_routes(self, seq: Sequence) -> None:
        """Before an unfinished ``seq`` gives up its blocks (preemption, failure): keep the routes
        they hold; its row of a launched, unread step is kept when that step is read."""
        if not seq.want_routed_experts or not seq.block_table:
            return
        rows = self.route_store.gather(seq.block_table, len(seq) - 1)
        if rows is None:
            return
        seq.routed_expert_chunks = [(0, rows)]  # every row so far: earlier chunks are superseded
        if self._pending is not None:
            self._pending.released.append(seq)

    def _routes_of(self, seq: Sequence):
        """A finishing sequence's ``[len - 1, moe_layers, K]`` int32 routes (None: none captured):
        from the slots of its blocks, or, without blocks (preempted), from the rows it kept."""
        if seq.block_table:
            rows = self.route_store.gather(seq.block_table, len(seq) - 1)
            if rows is not None:
                return rows
        return routed_experts_array(seq)

    def _finish_reason(self, seq: Sequence, position: int | None = None) -> dict[str, Any] | None:
        return finish_reason(seq, self.eos_token_ids, self.config.max_model_len, self.tokenizer, position)

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> dict[str, Any]:
        seq.finish_reason = reason
        request = self._requests[seq.rid]
        routes = self._routes_of(seq) if request.return_routed_experts else None  # before its blocks go
        self.scheduler.remove(seq)
        output = sequence_output(
            seq, weight_version=self.weight_version, return_logprob=request.return_logprob,
            return_routed_experts=request.return_routed_experts, tokenizer=self.tokenizer, routed_experts=routes,
        )
        request.outputs[seq.sample_index] = output
        if request.done:
            del self._requests[seq.rid]
            if request.future is not None and not request.future.done():
                request.future.set_result(request.outputs)
        return output

    def abort(self, rid: str | None = None) -> list[dict[str, Any]]:
        """Stop request ``rid`` (every request when None); return the partial outputs.

        Each aborted sample keeps the tokens and logprobs generated so far and has
        ``finish_reason == {"type": "abort", "message": "aborted"}``.
        """
        self._ready_outputs.extend(self._drain())
        rids = list(self._requests) if rid is None else ([rid] if rid in self._requests else [])
        outputs = []
        for r in rids:
            for seq in self._requests[r].samples:
                if seq.status != SequenceStatus.FINISHED:
                    outputs.append(self._finish(seq, {"type": "abort", "message": "aborted"}))
        return outputs

    def progress(self, rid: str, return_logprob: bool = True) -> list[dict[str, Any]]:
        """Partial outputs (``finish_reason`` None) of request ``rid``'s unfinished
        samples, for streaming; empty when the request is unknown or done."""
        self._ready_outputs.extend(self._drain())
        request = self._requests.get(rid)
        if request is None:
            return []
        return [
            sequence_output(seq, weight_version=self.weight_version, return_logprob=return_logprob,
                            return_routed_experts=False, tokenizer=self.tokenizer)
            for seq in request.samples
            if seq.status != SequenceStatus.FINISHED
        ]

    def pause(self) -> None:
        """Stop stepping (requests stay queued, KV cache kept) until :meth:`resume`."""
        self._paused = True

    def resume(self) -> None:
        """Continue stepping after :meth:`pause`."""
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    # ------------------------------------------------------------------ weights

    @torch.inference_mode()
    def update_weights(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        weight_version: Any = None,
    ) -> Any:
        """Copy new weights into the model in place; return the new ``weight_version``.

        Names are the model's own parameter names (``model.state_dict()``). The
        prefix cache is flushed (its K/V came from the old weights); sequences in
        flight keep their cache and continue with the new weights, as in SGLang.
        """
        self._ready_outputs.extend(self._drain())  # the launched step used the old weights
        copy_named_tensors(self.model, named_tensors)
        if self.strategy is not None:
            self.strategy.on_weights_updated()
        self.flush_cache()
        self.weight_version = weight_version if weight_version is not None else _bump(self.weight_version)
        self._mark_version_change()
        return self.weight_version

    def _mark_version_change(self) -> None:
        """Sequences in flight generate their next tokens with the new weights: record
        where, so their outputs say which weights made each token."""
        for request in self._requests.values():
            for seq in request.samples:
                if seq.status == SequenceStatus.FINISHED:
                    continue
                spans = seq.weight_version_spans
                if spans and spans[-1][0] == seq.num_output_tokens:
                    spans[-1][1] = self.weight_version
                else:
                    spans.append([seq.num_output_tokens, self.weight_version])

    def flush_cache(self) -> bool:
        """Forget the prefix cache (blocks in use are untouched)."""
        self.block_manager.reset_prefix_cache()
        return True

    # ------------------------------------------------------------------ batch API

    def generate(
        self,
        input_ids: list[list[int]] | list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | list | None = None,
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        rid: list[str] | str | None = None,
        top_logprobs_num: int | None = 0,
        token_ids_logprob: list[int] | None = None,
        logprob_start_len: int | None = -1,
    ) -> list[dict[str, Any]]:
        """Generate for a batch of prompts; return ``n`` results per prompt, prompt-major.

        A bad request yields a result with ``finish_reason`` type ``"abort"`` and a
        ``message`` instead of raising; the others are unaffected.
        """
        if self._paused:
            raise RuntimeError("the engine is paused: call resume() before generate()")
        options = LogprobOptions.build(top_logprobs_num, token_ids_logprob, logprob_start_len)
        prompts, params_list, rids = normalise_batch(input_ids, sampling_params, rid)
        slots: list[_Request | list[dict]] = []
        for prompt, params, r in zip(prompts, params_list, rids):
            try:
                slots.append(self._add(r, prompt, params, return_logprob, return_routed_experts, options))
            except ValueError as error:
                slots.append(self._rejected(r, prompt, params, error))
        while any(isinstance(s, _Request) and not s.done for s in slots):
            self.step()
        self._ready_outputs.extend(self._drain())  # a launched step of finished rows (overlap)
        mine = {s.rid for s in slots if isinstance(s, _Request)}
        self._ready_outputs = [o for o in self._ready_outputs if o["meta_info"]["id"] not in mine]
        return [o for s in slots for o in (s.outputs if isinstance(s, _Request) else s)]

    def _rejected(self, rid, prompt, params, error: ValueError) -> list[dict[str, Any]]:
        n = params.get("n", 1) if isinstance(params, Mapping) else getattr(params, "n", 1)
        n = n if isinstance(n, int) and n >= 1 else 1
        num_prompt = len(prompt) if isinstance(prompt, (list, tuple)) else 0
        return [rejected_output(str(rid), str(error), num_prompt, self.weight_version) for _ in range(n)]


def _bump(version: Any) -> Any:
    if isinstance(version, int):
        return version + 1
    try:
        return str(int(version) + 1)
    except (TypeError, ValueError):
        return f"{version}+1"


def _try_load_tokenizer(path: str) -> Any | None:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 - a checkpoint without a tokenizer is fine
        return None
