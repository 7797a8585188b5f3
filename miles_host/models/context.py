"""Per-forward context shared by the training forward and the rollout engine.

The model modules never know whether they run in training or in rollout: every
forward receives a :class:`ForwardContext` that says how attention reads and
writes keys and values (packed variable-length sequences for training and
prefill, a paged KV cache for the engine) and how MoE routing is chosen and
observed. That is what makes one model implementation serve both sides.

Tensor legend: T = tokens in the flattened batch, H = heads, D = head dim,
E = experts, K = top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from miles_host.routing import RoutingContext


class AttentionContext(Protocol):
    """How one forward pass computes attention for all of its tokens.

    ``attend`` gets the current tokens' queries, keys and values (rotary already
    applied), stores keys/values where the context keeps them (nowhere for a
    training pass, the KV cache for the engine), and returns the attention
    output for the current tokens.
    """

    def attend(
        self,
        layer_index: int,
        q_THD: torch.Tensor,
        k_THD: torch.Tensor,
        v_THD: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        chunk_size: int | None = None,
    ) -> torch.Tensor:
        """Return ``[T, Hq, Dv]`` attention output (causal within each sequence). ``sinks``: ``[Hq]`` sink
        logits (an extra softmax column, dropped: gpt-oss); ``chunk_size``: a query sees the keys of its own
        ``chunk_size``-token block only (Llama-4's local layers)."""
        ...


@dataclass
class ForwardContext:
    """Everything a model forward needs besides the token ids and positions.

    ``batch_invariant``: compute every token on its own with fixed shapes
    (:mod:`miles_host.models.batch_invariant`), so its result does not depend on
    the batch, the packing or whether it is forwarded in a prefill, a decode step
    or a training pass (``--true-on-policy``). The attention context must then be
    a :class:`PackedAttention` or provide ``attend_token``.

    ``fused_kernels``: inference only (no autograd), on CUDA: the residual add
    and norms, q/k norm + rotary and SiLU-mul run as the Triton kernels of
    :mod:`miles_host.kernels` (the rollout engine's default on a GPU).
    """

    attention: AttentionContext
    routing: RoutingContext = field(default_factory=RoutingContext)
    batch_invariant: bool = False
    fused_kernels: bool = False
