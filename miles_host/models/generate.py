"""Greedy generation over :class:`ContiguousKVCache` (reference decoding loop).

Shows how the engine drives the model: one prefill forward over all prompts
(flattened), then one decode forward per step with one new token per live
sequence, each with its cache positions.
"""

from __future__ import annotations

from typing import Sequence

import torch

from miles_host.models.attention import ContiguousKVCache
from miles_host.models.context import ForwardContext, RoutingContext
from miles_host.models.model import CausalLM


@torch.no_grad()
def greedy_generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> list[list[int]]:
    """Return the generated tokens (without the prompt) of each prompt, argmax decoding."""
    device = model.embed_tokens.weight.device
    cache = ContiguousKVCache()
    ctx = ForwardContext(attention=cache, routing=RoutingContext(phase="rollout"))
    outputs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    step_tokens = [list(p) for p in prompts]
    for _ in range(max_new_tokens):
        if not live:
            break
        cache.set_batch(live, [len(step_tokens[s]) for s in live])
        input_ids_T = torch.tensor([t for s in live for t in step_tokens[s]], device=device)
        positions_T = cache.positions().to(device)
        hidden_TH = model.forward_hidden(input_ids_T, positions_T, ctx)
        cache.commit()
        last = torch.tensor([len(step_tokens[s]) for s in live], device=device).cumsum(0) - 1
        next_ids = model.compute_logits(hidden_TH[last]).argmax(dim=-1).tolist()
        still_live = []
        for seq, token in zip(live, next_ids):
            outputs[seq].append(token)
            step_tokens[seq] = [token]
            if eos_token_id is None or token != eos_token_id:
                still_live.append(seq)
            else:
                cache.free(seq)
        live = still_live
    return outputs
