"""FP8 routed experts: stacked ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, 128x128 blocks per expert.

:class:`Fp8Experts` (training) keeps the stacked master parameters of the host's
``Experts`` and runs each expert's two GEMMs through :func:`fp8_linear`;
:class:`Fp8InferenceExperts` (rollout) holds the FP8 stacks and
``gate_up_proj_scale_inv [E, 2I/128, H/128]`` / ``down_proj_scale_inv [E, H/128, I/128]``.
Training runs the host's token routing loop (sorted by expert, one GEMM pair per
expert with tokens); rollout runs the host's fused MoE with the grouped FP8 GEMMs
of :mod:`miles_fp8.moe_fused` (same quantization and block scales, one launch per
projection), or the loop with ``--moe-kernel loop``.
Tensor legend: T tokens, H hidden, I expert intermediate, E experts, K experts per token.
"""

from __future__ import annotations

import torch

from miles_host.kernels.moe_grouped import FUSED_ACTIVATIONS, Routing, fused_moe
from miles_host.models.mlp import Experts, routed_forward, uses_fused_moe
from miles_fp8.linear import _Fp8Buffers, fp8_inference_linear, fp8_linear
from miles_fp8.moe_fused import WEIGHT_FORMAT, Fp8ExpertGemms
from miles_fp8.quant import BLOCK, FP8_DTYPE, check_block_divisible, quantize_weight


def check_experts(experts: Experts, name: str) -> None:
    """ValueError naming the layer unless both expert stacks have 128-divisible dims."""
    check_block_divisible(tuple(experts.gate_up_proj.shape), f"{name}.gate_up_proj")
    check_block_divisible(tuple(experts.down_proj.shape), f"{name}.down_proj")


class Fp8Experts(Experts):
    """Training experts with FP8 GEMMs; same parameters (names, shapes, master dtype) as ``Experts``."""

    @classmethod
    def from_experts(cls, experts: Experts, power_of_two: bool = False, name: str = "experts") -> "Fp8Experts":
        """Take over ``experts``' parameters (no copy)."""
        check_experts(experts, name)
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
        module.num_experts = experts.num_experts
        module.gate_up_proj = experts.gate_up_proj
        module.down_proj = experts.down_proj
        module.act = experts.act
        module.power_of_two = power_of_two
        module.train(experts.training)
        return module

    def _expert_mlp(self, x_e: torch.Tensor, expert: int) -> torch.Tensor:
        gate, up = fp8_linear(x_e, self.gate_up_proj[expert], None, self.power_of_two).chunk(2, dim=-1)
        return fp8_linear(self.act(gate) * up, self.down_proj[expert], None, self.power_of_two)

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                routing: Routing | None = None) -> torch.Tensor:
        """The per-expert loop (``routing``, a fused router's layout, is not needed here)."""
        return routed_forward(x_TH, ids_TK, weights_TK, self.num_experts, self._expert_mlp)


class Fp8InferenceExperts(_Fp8Buffers):
    """Rollout experts: FP8 stacks + ``*_scale_inv`` per-expert 128x128 block scales."""

    _keep_dtype = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")
    #: ``forward`` takes the ``routing`` layout of the host's fused router
    takes_routing = True
    #: the tile table's name of these weights (the fused router lays rows out for the same row block)
    weight_format = WEIGHT_FORMAT

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act, device=None,
                 power_of_two: bool = False):
        super().__init__()
        self.num_experts, self.act, self.power_of_two = num_experts, act, power_of_two
        #: the activation's config name (the fused kernels' epilogue computes it); None: the loop only
        self.act_name: str | None = None
        #: inference path (``--moe-kernel``): the fused kernels of :mod:`miles_fp8.moe_fused` or the loop
        self.moe_kernel = "fused"
        e, h, i = num_experts, hidden_size, intermediate_size
        self.register_buffer("gate_up_proj", torch.zeros(e, 2 * i, h, dtype=FP8_DTYPE, device=device))
        self.register_buffer("gate_up_proj_scale_inv", torch.ones(e, 2 * i // BLOCK, h // BLOCK, device=device))
        self.register_buffer("down_proj", torch.zeros(e, h, i, dtype=FP8_DTYPE, device=device))
        self.register_buffer("down_proj_scale_inv", torch.ones(e, h // BLOCK, i // BLOCK, device=device))

    @classmethod
    @torch.no_grad()
    def from_experts(cls, experts: Experts, power_of_two: bool = False, name: str = "experts") -> "Fp8InferenceExperts":
        """Quantize ``experts``' stacks per expert."""
        check_experts(experts, name)
        e, two_i, h = experts.gate_up_proj.shape
        module = cls(e, h, two_i // 2, experts.act, device=experts.gate_up_proj.device, power_of_two=power_of_two)
        module.act_name = getattr(experts, "act_name", None)
        module.gate_up_proj, module.gate_up_proj_scale_inv = quantize_weight(experts.gate_up_proj.detach(), power_of_two)
        module.down_proj, module.down_proj_scale_inv = quantize_weight(experts.down_proj.detach(), power_of_two)
        return module

    def _expert_mlp(self, x_e: torch.Tensor, expert: int) -> torch.Tensor:
        gate, up = fp8_inference_linear(
            x_e, self.gate_up_proj[expert], self.gate_up_proj_scale_inv[expert], None, self.power_of_two
        ).chunk(2, dim=-1)
        return fp8_inference_linear(
            self.act(gate) * up, self.down_proj[expert], self.down_proj_scale_inv[expert], None, self.power_of_two
        )

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                routing: Routing | None = None) -> torch.Tensor:
        """The routed experts' output; ``routing``: the layout of a fused router (the fused path reuses it)."""
        if uses_fused_moe(self, x_TH) and self.act_name in FUSED_ACTIVATIONS:
            gemms = Fp8ExpertGemms(self.gate_up_proj, self.gate_up_proj_scale_inv, self.down_proj,
                                   self.down_proj_scale_inv, self.act_name, self.power_of_two)
            return fused_moe(x_TH, ids_TK, weights_TK, gemms, routing=routing)
        return routed_forward(x_TH, ids_TK, weights_TK, self.num_experts, self._expert_mlp)
