"""Routed experts of a batch-invariant decode step (``--true-on-policy``) in a few launches.

Inside CUDA graphs the batch-invariant MoE runs every expert on every token and weights
each output by the token's gate weight for it, summed in float32 in ascending expert
order (:func:`miles_host.models.mlp.routed_forward`'s graph form): per layer and expert
two invariant GEMMs, the activation and the weighting, one launch each, so a decode step
of a 64-expert model replays thousands of small kernels. :func:`dense_experts` computes
the same numbers with one :func:`~miles_host.kernels.invariant_matmul.invariant_bmm` per
projection over all experts (each expert's rows as ``invariant_mm`` computes them: the same
kernel body and tile config), one activation and one weighting over all experts, then the
float32 sum in expert order: the same bits, which the training side's ordered combine
(``_ordered_combine``, per expert on its tokens only) also gives.

``--moe-invariant-decode``: ``batched`` (this module, the default: 2.9x the loop's rollout tok/s on the MoE
bench shape, ``bench/RESULTS.md``) or ``loop`` (the per-expert form).

Tensor legend: E experts, T tokens, H hidden, I expert intermediate, K experts per token.
"""

from __future__ import annotations

from typing import Callable

import torch

from miles_host.kernels import switches
from miles_host.kernels.invariant_matmul import invariant_bmm

#: ``--moe-invariant-decode``: the batch-invariant decode step's experts per expert, or batched
DECODE = switches.declare_host("moe_invariant_decode")


def batched() -> bool:
    """Whether ``--moe-invariant-decode batched`` is set in this process."""
    return switches.value(DECODE) == "batched"


def dense_experts(x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, gate_up_E2IH: torch.Tensor,
                  down_EHI: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Every expert's gated MLP on every token, weighted by the tokens' gate weights (zero where
    not chosen) and summed in float32 in ascending expert order, in ``x``'s dtype (module doc)."""
    num_experts = gate_up_E2IH.shape[0]
    gate_up_ET2I = invariant_bmm(x_TH.expand(num_experts, *x_TH.shape), gate_up_E2IH.transpose(1, 2))
    gate_ETI, up_ETI = gate_up_ET2I.chunk(2, dim=-1)
    out_ETH = invariant_bmm(act(gate_ETI) * up_ETI, down_EHI.transpose(1, 2))
    experts_E11 = torch.arange(num_experts, device=ids_TK.device).view(-1, 1, 1)
    gate_ET = (weights_TK.unsqueeze(0) * (ids_TK.unsqueeze(0) == experts_E11)).sum(dim=-1)  # (one nonzero term)
    weighted_ETH = out_ETH.float() * gate_ET.unsqueeze(-1).float()
    y_TH = torch.zeros(x_TH.shape, dtype=torch.float32, device=x_TH.device)
    for expert in range(num_experts):
        y_TH += weighted_ETH[expert]
    return y_TH.to(x_TH.dtype)
