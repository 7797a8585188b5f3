"""Rollout sessions with token-in-token-out: one agent trajectory recorded as exact token ids.

An agent talks to a session through an OpenAI base URL
(:mod:`miles_host.agentic.session_server`). Each chat request is rendered to prompt token
ids with the checkpoint's chat template; the engine generates from those ids and returns
token ids and their log-probs. :class:`Trajectory` keeps, turn by turn, what the engine saw
and sampled, never detokenizing and retokenizing what the policy generated:

- turn 1: the rendered prompt is the sample's prompt;
- turn k > 1: the rendered prompt must start with everything recorded so far (the prompt
  and generated tokens of the earlier turns). What it adds (the end of the assistant turn
  the template writes, tool output, user turns, the next assistant header) is appended
  with loss mask 0; the generated tokens with loss mask 1 and their log-probs.

A rendered prompt that does not start with the recorded tokens (the agent edited its
history, or the template renders the generated text differently from how it was sampled)
is handled by ``--session-prefix-mismatch``, a record of :data:`MISMATCH_POLICIES`:

- ``error`` (default): the request is refused (HTTP 400) and the sample fails, naming the
  turn and the first differing position;
- ``retokenize``: the shared prefix keeps its loss mask and log-probs, the rest is taken
  from the new rendering, not trained (mask 0);
- ``drop``: as ``retokenize`` while the agent runs, then the whole sample is not trained
  (every loss mask 0) and ``metadata["session_dropped"]`` says why.

:meth:`Trajectory.fill_sample` writes the training sample: ``tokens`` the full sequence,
``loss_mask`` 1 exactly on generated tokens, ``rollout_log_probs`` the engine's log-probs of
those tokens (0.0 elsewhere), and with routing replay (``--rollout-return-routed-experts``)
``rollout_routed_experts``: each token's experts as the engine routed them in the turn that
first saw it (the earlier turns' rows are kept, each turn adds the rows of its new tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from miles_host.sample import Sample, Status, compact_expert_ids, output_token_versions


class SessionPrefixMismatch(ValueError):
    """A turn's rendered prompt does not start with the tokens recorded so far."""


@dataclass(frozen=True)
class MismatchPolicy:
    """What a prefix mismatch does: ``refuse`` the request, and/or ``drop`` the sample from training."""

    name: str
    refuse: bool
    drop: bool
    description: str


#: ``--session-prefix-mismatch`` choices
MISMATCH_POLICIES: dict[str, MismatchPolicy] = {
    policy.name: policy
    for policy in (
        MismatchPolicy("error", refuse=True, drop=False, description="refuse the request; the sample fails"),
        MismatchPolicy("retokenize", refuse=False, drop=False,
                       description="keep the shared prefix, take the rest from the new rendering (not trained)"),
        MismatchPolicy("drop", refuse=False, drop=True,
                       description="go on as retokenize, then train on none of the sample's tokens"),
    )
}


def mismatch_policy(name: str) -> MismatchPolicy:
    """The policy called ``name``; ValueError listing the known ones otherwise."""
    try:
        return MISMATCH_POLICIES[name]
    except KeyError:
        raise ValueError(f"--session-prefix-mismatch {name!r}: choose one of {sorted(MISMATCH_POLICIES)}") from None


def first_difference(recorded: list[int], rendered: list[int]) -> int:
    """The first position where the two sequences differ (the shorter one's length if one is a prefix)."""
    for position, (a, b) in enumerate(zip(recorded, rendered)):
        if a != b:
            return position
    return min(len(recorded), len(rendered))


@dataclass
class Trajectory:
    """The token record of one session (see the module docstring)."""

    policy: MismatchPolicy = field(default_factory=lambda: MISMATCH_POLICIES["error"])
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # per token of ``tokens`` (prompt tokens included)
    log_probs: list[float] = field(default_factory=list)
    prompt_length: int | None = None
    turns: int = 0
    mismatches: list[str] = field(default_factory=list)
    error: str | None = None
    finish_reason: dict | None = None
    weight_versions: list = field(default_factory=list)
    #: per token of ``tokens``: the weights that generated it (None: not generated)
    token_versions: list = field(default_factory=list)
    #: ``[len(tokens) - 1, moe_layers, topk]`` routes, when the engine returns them
    routed_experts: np.ndarray | None = None

    def begin_turn(self, prompt_ids: list[int], describe: Callable[[list[int]], str] = str) -> list[int]:
        """Check a new turn's rendered prompt against the record and take its new tokens
        (mask 0); the ids to generate from. Raises :class:`SessionPrefixMismatch` under the
        ``error`` policy. ``describe`` shows token ids in messages (e.g. decoded)."""
        turn = self.turns + 1
        if self.error is not None:
            raise SessionPrefixMismatch(f"{self.error}; the session stays refused")
        if self.prompt_length is None:
            self._append(prompt_ids, 0)
            self.prompt_length = len(prompt_ids)
            return list(prompt_ids)
        recorded = len(self.tokens)
        if prompt_ids[:recorded] != self.tokens:
            at = first_difference(self.tokens, prompt_ids)
            message = (
                f"turn {turn}: the rendered prompt does not start with the {recorded} tokens recorded so far (the "
                f"prompt and generated tokens of turns 1-{turn - 1}); first difference at token {at}: recorded "
                f"{describe(self.tokens[at:at + 12])!r}, rendered {describe(prompt_ids[at:at + 12])!r}. The agent "
                "changed its message history, or the chat template renders the generated text differently; "
                "--session-prefix-mismatch retokenize or drop lets such turns through"
            )
            if self.policy.refuse:
                self.error = message
                raise SessionPrefixMismatch(message)
            self.mismatches.append(message)
            del self.tokens[at:], self.loss_mask[at:], self.log_probs[at:], self.token_versions[at:]
            self.prompt_length = min(self.prompt_length, at)
            if self.routed_experts is not None:  # row i depends on tokens 0..i only
                self.routed_experts = self.routed_experts[:at]
        self._append(prompt_ids[len(self.tokens):], 0)
        return list(prompt_ids)

    def record_output(self, output_ids: list[int], log_probs: list[float], finish_reason: dict | None,
                      weight_version=None, routed_experts: Any = None, weight_version_spans: list | None = None) -> None:
        """The engine's answer to the current turn: generated ids (mask 1), their log-probs and,
        if given, the turn's routes (``[prompt + output - 1, moe_layers, topk]``)."""
        if len(log_probs) != len(output_ids):
            raise ValueError(f"{len(output_ids)} generated tokens but {len(log_probs)} log-probs")
        if routed_experts is not None:
            routed = np.asarray(routed_experts)
            keep = 0 if self.routed_experts is None else self.routed_experts.shape[0]
            self.routed_experts = routed if keep == 0 else np.concatenate(
                [self.routed_experts.astype(np.int64), routed[keep:].astype(np.int64)], axis=0)
        self.tokens.extend(output_ids)
        self.loss_mask.extend([1] * len(output_ids))
        self.log_probs.extend(float(lp) for lp in log_probs)
        meta = {"weight_version": weight_version, "weight_version_spans": weight_version_spans}
        self.token_versions.extend(output_token_versions(meta, len(output_ids)))
        self.turns += 1
        self.finish_reason = finish_reason
        if output_ids:
            self.weight_versions.append(weight_version)

    def _append(self, ids: list[int], mask: int) -> None:
        self.tokens.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.log_probs.extend([0.0] * len(ids))
        self.token_versions.extend([None] * len(ids))

    def fill_sample(self, sample: Sample, decode: Callable[[list[int]], str]) -> Sample:
        """Write the trajectory into ``sample`` (tokens, loss mask, log-probs, response,
        status from the last turn). Raises :class:`SessionPrefixMismatch` when the session
        was refused; a sample of the ``drop`` policy gets loss mask 0 everywhere."""
        if self.error is not None:
            raise SessionPrefixMismatch(self.error)
        start = self.prompt_length or 0
        sample.tokens = list(self.tokens)
        sample.response_length = len(self.tokens) - start
        sample.loss_mask = list(self.loss_mask[start:])
        sample.rollout_log_probs = list(self.log_probs[start:])
        sample.weight_versions = list(self.weight_versions)
        sample.token_weight_versions = list(self.token_versions[start:])
        if self.routed_experts is not None:
            sample.rollout_routed_experts = compact_expert_ids(self.routed_experts)
        sample.response = decode(self.tokens[start:])
        sample.metadata["session_turns"] = self.turns
        if self.mismatches:
            sample.metadata["session_mismatches"] = list(self.mismatches)
            if self.policy.drop:
                sample.loss_mask = [0] * sample.response_length
                sample.metadata["session_dropped"] = self.mismatches[0]
        kind = (self.finish_reason or {}).get("type")
        sample.status = {"length": Status.TRUNCATED, "abort": Status.ABORTED}.get(kind, Status.COMPLETED)
        return sample
