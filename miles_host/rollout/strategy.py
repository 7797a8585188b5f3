"""The engine's extension point for decoding strategies other than one token per step.

A strategy (e.g. speculative decoding, provided by a plugin through
``miles_register_decoding_strategies``) takes over the decode steps of the
engine: it may append several tokens per sequence per step. The engine keeps
scheduling, prefill, finishing and aborting; the strategy only decides which
tokens a decode step produces, and must produce them from the policy's
distribution (the plain engine's sampling rules) with the policy's logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from miles_host.rollout.scheduler import ScheduledBatch
from miles_host.rollout.sequence import Sequence


@dataclass
class DecodeTokens:
    """What one decode step appends to one sequence.

    ``token_ids``/``logprobs``: new tokens in order (at least one), with the
    policy's ``log_softmax(logits / T)`` at each. ``routes``: ``(first position,
    [tokens, layers, k] expert ids)`` of the tokens forwarded and kept, or None.
    """

    token_ids: list[int]
    logprobs: list[float]
    routes: tuple[int, torch.Tensor] | None = None


class DecodingStrategy(Protocol):
    """What :class:`~miles_host.rollout.engine.Engine` asks of a strategy.

    ``num_lookahead_tokens``: KV slots past a sequence's last token that one
    decode step may write (the scheduler makes them writable beforehand; a
    sequence keeps those blocks until it finishes or is preempted).
    """

    num_lookahead_tokens: int

    def on_prefill(self, batch: ScheduledBatch, group: list[int], hidden_TH: torch.Tensor, cu_seqlens: list[int]) -> None:
        """Hidden states of the prefill forward of ``batch.sequences[i] for i in group``."""
        ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of KV blocks: copy the strategy's own caches too."""
        ...

    def decode(self, sequences: list[Sequence], want_routes: bool) -> list[DecodeTokens]:
        """Advance every sequence (all running, each with its lookahead slots writable)."""
        ...

    def on_weights_updated(self) -> None:
        """The engine's weights changed in place."""
        ...
