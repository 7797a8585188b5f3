"""Mixture-of-experts variants of gpt-oss and Llama-4 on top of :class:`~miles_host.models.mlp.MoE`.

- **router bias** (gpt-oss, ``MoEConfig.router_bias``): the router linear has a
  bias, so it shifts both the choice and the gate weights;
- **expert biases** (gpt-oss, ``expert_biases``): every expert's ``gate_up`` and
  ``down`` projections have biases;
- **clamped SwiGLU** (gpt-oss, ``swiglu_limit``): ``g = min(gate, limit)``,
  ``u = clamp(up, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g)``;
- **scaled expert inputs** (Llama-4, ``scale_expert_inputs``): each chosen expert
  runs on ``weight * x`` and the outputs are summed unweighted.

Routing (and so R3's capture and replay through the routing hooks) is the base
block's: only the router's logits and the experts' math differ. The experts run
the plain experts' paths (:meth:`~miles_host.models.mlp.Experts.routed_with`):
with gradients the grouped GEMMs of :mod:`~miles_host.kernels.moe_train` (bias
rows added per row's expert, the clamped SwiGLU in torch ops), at inference the
fused kernels of :mod:`~miles_host.kernels.moe_grouped` (biases and the clamped
SwiGLU in the GEMM epilogues; ``--moe-kernel loop`` keeps the per-expert loop),
and the per-expert loop of :func:`~miles_host.models.mlp.routed_forward`
elsewhere (ordered in the batch-invariant mode, which keeps it). Llama-4's
scaled inputs run those paths over one row per (token, chosen expert). Tensor
legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, R = T * K rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles_host.models.config import MoEConfig
from miles_host.models.mlp import Experts, MoE, Router, _linear_default_init, init_experts
from miles_host.routing import NO_ROUTING_HOOKS, RoutingHooks


class BiasedRouter(Router):
    """A router whose linear has a bias ``[E]`` (gpt-oss)."""

    def __init__(self, hidden_size: int, moe: MoEConfig):
        super().__init__(hidden_size, moe)
        self.bias = torch.nn.Parameter(torch.empty(moe.num_experts))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            self.bias.zero_()

    def logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        if self.moe.router_fp32:
            return F.linear(x_TH.float(), self.weight.float(), self.bias.float())
        return F.linear(x_TH, self.weight, self.bias)


class VariantExperts(torch.nn.Module):
    """Routed experts with optional biases, clamped SwiGLU and scaled inputs.

    Weights as :class:`~miles_host.models.mlp.Experts` (``gate_up_proj [E, 2I, H]`` gate
    rows first, ``down_proj [E, H, I]``), plus ``gate_up_proj_bias [E, 2I]`` and
    ``down_proj_bias [E, H]`` with ``expert_biases``. Deliberately not an ``Experts``
    subclass: the precision plugins (FP8, INT4) swap ``Experts`` modules for quantized
    plain-SwiGLU ones that know none of these variants, and refuse other 3-D expert
    weights with their reason instead. The math and its paths are ``Experts``'.
    """

    takes_routing = False
    #: the plain experts' paths (grouped-GEMM training, fused inference kernels, the loop), shared
    takes_grouped = Experts.takes_grouped
    routed_with = Experts.routed_with
    expert_mlp = Experts.expert_mlp

    def __init__(self, hidden_size: int, moe: MoEConfig, act: str):
        super().__init__()
        init_experts(self, hidden_size, moe, act)
        if moe.expert_biases:
            self.gate_up_proj_bias = torch.nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size))
            self.down_proj_bias = torch.nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.scale_inputs = moe.scale_expert_inputs

    def reset_parameters(self) -> None:
        """Weights as ``torch.nn.Linear`` initialises them, biases zero (a fresh layer)."""
        for weight in (self.gate_up_proj, self.down_proj):
            _linear_default_init(weight)
        with torch.no_grad():
            for bias in (self.gate_up_proj_bias, self.down_proj_bias):
                if bias is not None:
                    bias.zero_()

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, routing=None) -> torch.Tensor:
        if not self.scale_inputs:
            return self._experts(x_TH, ids_TK, weights_TK)
        num_tokens, top_k = ids_TK.shape
        scaled_RH = (x_TH[:, None, :] * weights_TK[:, :, None].to(x_TH.dtype)).reshape(num_tokens * top_k, -1)
        ones_R1 = torch.ones(num_tokens * top_k, 1, dtype=x_TH.dtype, device=x_TH.device)
        y_RH = self._experts(scaled_RH, ids_TK.reshape(-1, 1), ones_R1)
        return y_RH.view(num_tokens, top_k, -1).sum(dim=1)

    def _experts(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return self.routed_with(x_TH, ids_TK, weights_TK, None, self.gate_up_proj, self.down_proj)


def needs_variant(moe: MoEConfig) -> bool:
    """Whether an MoE config uses any variant of this module."""
    return bool(moe.router_bias or moe.expert_biases or moe.swiglu_limit is not None or moe.scale_expert_inputs)


class VariantMoE(MoE):
    """:class:`MoE` with :class:`BiasedRouter` and :class:`VariantExperts` where the config asks."""

    def __init__(self, hidden_size: int, moe: MoEConfig, act: str, layer_index: int,
                 routing_hooks: RoutingHooks = NO_ROUTING_HOOKS):
        super().__init__(hidden_size, moe, act, layer_index, routing_hooks)
        if moe.router_bias:
            self.router = BiasedRouter(hidden_size, moe)
        self.experts = VariantExperts(hidden_size, moe, act)
        self.router_kernel = "torch"


def moe_block(hidden_size: int, moe: MoEConfig, act: str, layer_index: int, routing_hooks: RoutingHooks) -> MoE:
    """The MoE block of one layer (a variant where the config asks)."""
    cls = VariantMoE if needs_variant(moe) else MoE
    return cls(hidden_size, moe, act, layer_index, routing_hooks)
