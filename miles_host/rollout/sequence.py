"""One sequence being generated: its tokens, KV blocks and results so far."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_host.rollout.logprobs import InputLogprobs, LogprobOptions, OutputExtras
from miles_host.rollout.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # not yet (or no longer, after preemption) holding KV blocks
    RUNNING = "running"      # holds KV blocks and is decoded every step
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A prompt plus the tokens generated for it.

    ``rid`` is the request id returned to the caller; samples ``1..n-1`` of a
    request with ``n > 1`` are sequences with ``sample_index > 0`` whose
    ``parent`` is sample 0: they are not queued on their own; when the parent's
    prompt is first scheduled they fork its KV blocks (see
    :meth:`BlockManager.fork`) and sample their first token from the parent's
    logits, so the prompt is prefilled once.
    """

    rid: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    sample_index: int = 0
    parent: "Sequence | None" = None
    children: list["Sequence"] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0          # tokens whose K/V are in the cache
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    generator: torch.Generator | None = None
    #: [[first output index, weight version], ...]: which weights generated which output tokens
    weight_version_spans: list[list[Any]] = field(default_factory=list)
    want_routed_experts: bool = False
    # routes kept when it gave up its KV blocks unfinished (the engine's route store holds the
    # rest): (first position, [tokens, layers, k] ids) chunks; later chunks win
    routed_expert_chunks: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    num_prompt_cached_tokens: int = 0   # prompt tokens found in the prefix cache at first prefill
    stop_text_checked: int = 0          # output tokens already searched for stop strings
    eos_token_ids: tuple[int, ...] = ()
    full_block_hashes: list[int] = field(default_factory=list)  # prefix-cache hashes of full blocks
    draft_state: Any = None             # a decoding strategy's per-sequence state (speculative drafts)
    spec_info: dict[str, Any] = field(default_factory=dict)  # strategy statistics, copied to meta_info
    logprob_options: LogprobOptions | None = None  # top / requested-id / input logprobs asked for
    output_extras: OutputExtras = field(default_factory=OutputExtras)  # per generated position
    input_logprobs: InputLogprobs | None = None    # the prompt's, once its prefill ran
    grammar: Any = None                            # a grammar.RequestGrammar when constrained

    @property
    def needs_processed_logits(self) -> bool:
        """Whether its logits change before sampling (penalties, ``logit_bias``, a grammar)."""
        return self.params.has_penalties or self.grammar is not None

    @property
    def wants_position_extras(self) -> bool:
        """Whether each generated position needs top / requested-id logprobs."""
        return self.logprob_options is not None and self.logprob_options.wants_output_extras

    @property
    def wants_input_logprobs(self) -> bool:
        """Whether its prompt's logprobs are still to be computed: at the first prefill of
        sample 0 (the other samples share its prompt and read them from it)."""
        return (
            self.logprob_options is not None and self.logprob_options.wants_input and self.input_logprobs is None
            and self.parent is None and self.num_output_tokens == 0
        )

    def banned_tokens(self) -> list[int]:
        """Tokens this sequence may not sample yet (``min_new_tokens`` not reached)."""
        if self.num_output_tokens >= self.params.min_new_tokens:
            return []
        banned = list(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            banned.extend(self.eos_token_ids)
        return banned

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
