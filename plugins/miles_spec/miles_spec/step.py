"""The device side of one speculative step, shared by the eager path and the CUDA graphs.

Each function is a fixed sequence of device operations on device tensors: no host
synchronisation, no host-to-device copy, no branch on device values. The eager path
(:class:`~miles_spec.strategy.EagleStrategy`) calls them on freshly built inputs; the
CUDA graphs (:mod:`miles_spec.graphs`) capture the same calls over static input buffers,
so the eager path is the reference for the graphs.

A step, after the draft's start features (the last pending entry of every sequence):
``K - 1`` single-token draft steps (:func:`draft_chain`), one policy forward over
``[x_{n-1}, d_1 .. d_K]`` per sequence (:func:`verify`), and speculative sampling
(:func:`judge`), whose result is packed into one float64 tensor for a single
device-to-host read.

Tensor legend: B sequences, K draft tokens, J = K + 1, T tokens, H hidden (H' the draft's),
V vocabulary, R = 2K + 1 uniform numbers per sequence, L MoE layers, E experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from miles_host.models.context import ForwardContext, RoutingContext
from miles_host.rollout.cuda_graphs import stack_routes
from miles_host.rollout.sampler import inverse_cdf

from miles_spec.sampling import RowSettings, accept, distributions


@dataclass
class Forward:
    """One forward over a paged KV cache: token positions ``[T]`` and the attention context."""

    positions_T: torch.Tensor
    attention: Any


@dataclass
class StepInputs:
    """Everything after the start features, on the device."""

    chain: list[Forward]            # the K - 1 single-token draft steps (T = B each)
    verify: Forward                 # the policy over J tokens per sequence (T = B * J)
    last_ids_B: torch.Tensor        # x_{n-1}, the first verified token
    rows: RowSettings
    uniforms_BR: torch.Tensor       # float32: K draws, K acceptances, 1 extra token
    banned_BJV: torch.Tensor | None
    capture_routes: bool


@dataclass
class StepOutputs:
    """``packed_BP``: float64 ``[B, 2J + 1]`` = emitted tokens ``[J]``, their logprobs ``[J]``,
    accepted drafts ``[1]`` (tokens past ``accepted + 1`` are not emitted); ``hidden_TH``: the
    verify's hidden states ``[B * J, H]``; ``routes_TLE``: its routes (int32) or None."""

    packed_BP: torch.Tensor
    hidden_TH: torch.Tensor
    routes_TLE: torch.Tensor | None


def extend_features(draft, hidden_TH, ids_T: torch.Tensor, forward: Forward, last_B: torch.Tensor) -> torch.Tensor:
    """The draft over pending entries (their K/V written); ``[B, H']`` features of rows ``last_B``."""
    feature_TH = draft.features(hidden_TH, ids_T, forward.positions_T, forward.attention)
    return feature_TH.index_select(0, last_B)


def draft_chain(draft, feature_BH: torch.Tensor, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft tokens ``[B, K]`` and the distributions they were drawn from ``[B, K, V]``."""
    num_drafts = len(inputs.chain) + 1
    tokens, probs = [], []
    for j in range(num_drafts):
        probs_BV = distributions(draft.logits(feature_BH)[:, None], inputs.rows, None)[0][:, 0]
        token_B = inverse_cdf(probs_BV, inputs.uniforms_BR[:, j])
        tokens.append(token_B)
        probs.append(probs_BV)
        if j < num_drafts - 1:
            step = inputs.chain[j]
            feature_BH = draft.features(feature_BH, token_B, step.positions_T, step.attention)
    return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)


def verify(model, drafts_BK: torch.Tensor, inputs: StepInputs, fused_kernels: bool):
    """The policy's final hidden states ``[B * J, H]`` over ``[x_{n-1}, d_1 .. d_K]`` and,
    when captured, their routes ``[B * J, L, E]`` int32 (else None)."""
    ids_T = torch.cat([inputs.last_ids_B[:, None], drafts_BK], dim=1).reshape(-1)
    routing = RoutingContext(phase="rollout")
    routing.extra["capture"] = inputs.capture_routes
    context = ForwardContext(attention=inputs.verify.attention, routing=routing, fused_kernels=fused_kernels)
    hidden_TH = model.forward_hidden(ids_T, inputs.verify.positions_T, context)
    return hidden_TH, (stack_routes(routing.captured) if inputs.capture_routes else None)


def judge(model, hidden_TH, drafts_BK, draft_probs_BKV, inputs: StepInputs) -> torch.Tensor:
    """Speculative sampling over the verify's logits; the packed ``[B, 2J + 1]`` float64 result."""
    batch, num_drafts = drafts_BK.shape
    logits_BJV = model.compute_logits(hidden_TH).view(batch, num_drafts + 1, -1)
    probs_BJV, logprobs_BJV = distributions(logits_BJV, inputs.rows, inputs.banned_BJV)
    uniforms_BR = inputs.uniforms_BR
    verdict = accept(probs_BJV, logprobs_BJV, draft_probs_BKV, drafts_BK,
                     uniforms_BR[:, num_drafts:2 * num_drafts], uniforms_BR[:, 2 * num_drafts])
    return torch.cat([verdict.tokens_BJ.double(), verdict.logprobs_BJ.double(),
                      verdict.num_accepted_B[:, None].double()], dim=1)


def draft_and_verify(model, draft, feature_BH: torch.Tensor, inputs: StepInputs, fused_kernels: bool) -> StepOutputs:
    """The step from the draft's start features ``[B, H']`` on."""
    drafts_BK, draft_probs_BKV = draft_chain(draft, feature_BH, inputs)
    hidden_TH, routes_TLE = verify(model, drafts_BK, inputs, fused_kernels)
    return StepOutputs(judge(model, hidden_TH, drafts_BK, draft_probs_BKV, inputs), hidden_TH, routes_TLE)
