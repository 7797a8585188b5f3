"""Feed-forward blocks: gated MLP (SwiGLU / GeGLU) and the mixture-of-experts block.

Tensor legend: T tokens, H hidden, I intermediate, E experts, K experts per token.
The MoE block asks :class:`~miles_host.routing.RoutingHooks` for its expert ids
(so a plugin can observe or replace them) and always recomputes the gate weights
from the scores at those ids, so the router keeps its gradient under replay.
For inference on decode-sized batches through the fused experts, and when no plugin
replaces ids, one launch of :func:`~miles_host.kernels.moe_router.fused_route` does
the router's work after the gate linear (ids, weights and the experts' row layout;
see :func:`uses_fused_router`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from miles_host.kernels import invariant_experts, invariant_ops, moe_grouped, moe_router, moe_train
from miles_host.kernels.eager_ops import activation, gated_activation
from miles_host.kernels.invariant_matmul import DTYPES, uses_triton
from miles_host.kernels.moe_configs import moe_tiles
from miles_host.kernels.small_m_gemm import decode_linear, decode_matmul
from miles_host.models.config import MoEConfig
from miles_host.models.context import RoutingContext
from miles_host.routing import NO_ROUTING_HOOKS, RoutingHooks


def _linear_default_init(weight_OI: torch.Tensor) -> None:
    """``U(-1/sqrt(in), 1/sqrt(in))`` over the last dim's fan-in: what ``torch.nn.Linear`` draws
    (Kaiming-uniform with a = sqrt(5)); a leading expert dim is a stack of such matrices."""
    bound = 1.0 / weight_OI.shape[-1] ** 0.5
    with torch.no_grad():
        weight_OI.uniform_(-bound, bound)


class GatedMLP(torch.nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused in one ``[2I, H]`` weight."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = torch.nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)
        self.act_name = act

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        gate_TI, up_TI = self.gate_up_proj(x_TH).chunk(2, dim=-1)
        return self.down_proj(self.act(gate_TI) * up_TI)

    def forward_fused(self, x_TH: torch.Tensor) -> torch.Tensor:
        """Inference forward with the fused SiLU-mul kernel (other activations: eager), the
        projections of a few tokens by the small-M GEMM (:mod:`miles_host.kernels.small_m_gemm`)."""
        if self.act_name != "silu":
            return self.forward(x_TH)
        from miles_host.kernels.activation import silu_and_mul

        return decode_linear(self.down_proj, silu_and_mul(decode_linear(self.gate_up_proj, x_TH)))


class Router(torch.nn.Module):
    """Scores every expert for every token; ``expert_bias`` only shifts the choice."""

    def __init__(self, hidden_size: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.weight = torch.nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        if moe.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        #: parameters the loader keeps in float32 whatever the model dtype
        self.keep_fp32 = moe.router_fp32

    def reset_parameters(self) -> None:
        """``torch.nn.Linear``'s default initialisation (a fresh layer that no checkpoint fills)."""
        _linear_default_init(self.weight)

    def logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        """The gate linear ``[T, E]`` (float32 with ``router_fp32``, else x's dtype)."""
        if self.moe.router_fp32:
            return F.linear(x_TH.float(), self.weight.float())
        return F.linear(x_TH, self.weight)

    def decode_logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        """:meth:`logits` of a decode step (no autograd): the small-M GEMM where it serves
        (:func:`~miles_host.kernels.small_m_gemm.decode_matmul`; the sums in another order than cuBLAS's)."""
        if self.moe.router_fp32:
            return self.logits(x_TH)
        return decode_matmul(x_TH, self.weight)

    def forward(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(scores_TE, scores_for_choice_TE)`` in float32."""
        logits_TE = self.logits(x_TH)
        if self.moe.score_func == "softmax":
            scores_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        else:
            scores_TE = torch.sigmoid(logits_TE.float())
        choice_TE = scores_TE if self.expert_bias is None else scores_TE + self.expert_bias.float()
        return scores_TE, choice_TE

    def default_choice(self, choice_TE: torch.Tensor) -> torch.Tensor:
        """The router's own top-k ids, group-limited when ``n_group > 1``."""
        moe = self.moe
        if moe.n_group > 1:
            grouped = choice_TE.detach().view(-1, moe.n_group, moe.num_experts // moe.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            group_ids = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1.0).bool()
            expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(-1, moe.num_experts)
            choice_TE = choice_TE.detach().masked_fill(~expert_mask, float("-inf"))
        return torch.topk(choice_TE.detach(), k=moe.top_k, dim=-1, sorted=False).indices


def init_experts(module: torch.nn.Module, hidden_size: int, moe: MoEConfig, act: str) -> None:
    """The weights (uninitialised) and settings of routed experts on ``module`` (:class:`Experts`
    and the variants of :mod:`miles_host.models.moe_variants`)."""
    module.num_experts = moe.num_experts
    module.gate_up_proj = torch.nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, hidden_size))
    module.down_proj = torch.nn.Parameter(torch.empty(moe.num_experts, hidden_size, moe.intermediate_size))
    module.act = activation(act)
    #: gpt-oss' clamped SwiGLU (replaces ``act(gate) * up`` where the limit is set)
    module.swiglu_limit, module.swiglu_alpha = moe.swiglu_limit, moe.swiglu_alpha
    #: the gated activation's name in the fused kernels (:func:`~miles_host.kernels.moe_grouped.fuses`)
    module.act_name = moe_grouped.CLAMPED_SWIGLU if moe.swiglu_limit is not None else act
    #: gpt-oss' per-expert biases ``gate_up [E, 2I]`` and ``down [E, H]`` (parameters of the variant experts)
    module.gate_up_proj_bias = module.down_proj_bias = None
    #: the inference path, one of :data:`MOE_KERNELS` (the engine sets it from ``--moe-kernel``)
    module.moe_kernel = "fused"
    #: the gradient-enabled path (``MoEConfig.experts_impl``; :mod:`miles_host.kernels.moe_train`)
    module.experts_impl = moe.experts_impl


def gated_expert(x_TH: torch.Tensor, gate_up_2IH: torch.Tensor, down_HI: torch.Tensor,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One expert's gated MLP: ``down(act(gate x) * (up x))``, gate rows first in ``gate_up``."""
    gate_TI, up_TI = F.linear(x_TH, gate_up_2IH).chunk(2, dim=-1)
    return F.linear(act(gate_TI) * up_TI, down_HI)


def _expert_mlp_of(experts: torch.nn.Module, gate_up_E2IH: torch.Tensor, down_EHI: torch.Tensor):
    """``expert_mlp(x_e, expert)`` of ``routed_forward`` over the given stacks, with the module's
    biases and gated activation (gpt-oss' clamped SwiGLU) where it has them."""
    gate_up_bias, down_bias = experts.gate_up_proj_bias, experts.down_proj_bias
    if gate_up_bias is None and down_bias is None and experts.swiglu_limit is None:
        return lambda x_e, expert: gated_expert(x_e, gate_up_E2IH[expert], down_EHI[expert], experts.act)

    def expert_mlp(x_e: torch.Tensor, expert: int) -> torch.Tensor:
        gate, up = F.linear(x_e, gate_up_E2IH[expert], _row(gate_up_bias, expert)).chunk(2, dim=-1)
        hidden = gated_activation(gate, up, experts.act, experts.swiglu_limit, experts.swiglu_alpha)
        return F.linear(hidden, down_EHI[expert], _row(down_bias, expert))

    return expert_mlp


def _row(bias_EO: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return bias_EO[expert] if bias_EO is not None else None


class Experts(torch.nn.Module):
    """All routed experts as 3-D weights: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""

    #: ``forward`` takes the ``routing`` layout of a fused router (modules without it get ids and weights only)
    takes_routing = True

    def __init__(self, hidden_size: int, moe: MoEConfig, act: str):
        super().__init__()
        init_experts(self, hidden_size, moe, act)

    def reset_parameters(self) -> None:
        """Each expert's matrices as ``torch.nn.Linear`` initialises its weight (a fresh layer)."""
        for weight in (self.gate_up_proj, self.down_proj):
            _linear_default_init(weight)

    def expert_mlp(self, x_e: torch.Tensor, expert: int) -> torch.Tensor:
        """One expert's gated MLP on its tokens (with its biases and clamped SwiGLU where it has them)."""
        return _expert_mlp_of(self, self.gate_up_proj, self.down_proj)(x_e, expert)

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                routing: moe_grouped.Routing | None = None) -> torch.Tensor:
        """The routed experts' output; ``routing``: the layout of ids and weights if the caller has it (fused path)."""
        return self.routed_with(x_TH, ids_TK, weights_TK, routing, self.gate_up_proj, self.down_proj)

    def takes_grouped(self, x_TH: torch.Tensor) -> bool:
        """Whether this forward takes the training path of grouped GEMMs (:mod:`~miles_host.kernels.moe_train`)."""
        return (
            torch.is_grad_enabled()
            and not _invariant_active()
            and moe_train.uses_grouped_experts(self.experts_impl, x_TH, self.gate_up_proj)
        )

    def routed_with(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                    routing: moe_grouped.Routing | None, gate_up_E2IH: torch.Tensor,
                    down_EHI: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` over the given stacked weights (LoRA passes its merged ``W + scaling * B @ A``;
        :mod:`miles_host.lora.experts`), on the path the batch takes: grouped GEMMs with gradients,
        the fused kernels at inference, else the per-expert loop. gpt-oss' expert biases and clamped
        SwiGLU (:mod:`~miles_host.models.moe_variants`) take all three."""
        biases = (self.gate_up_proj_bias, self.down_proj_bias)
        # training: one grouped GEMM per projection, forward and backward, no host sync
        if self.takes_grouped(x_TH):
            return moe_train.grouped_experts(x_TH, ids_TK, weights_TK, gate_up_E2IH, down_EHI, self.act,
                                             biases=biases, swiglu_limit=self.swiglu_limit,
                                             swiglu_alpha=self.swiglu_alpha)
        # inference: the fused kernels (one routing launch, one GEMM per projection, one combine; no host sync)
        if uses_fused_moe(self, x_TH) and moe_grouped.fuses(self.act_name, self.swiglu_limit):
            gemms = moe_grouped.DenseExpertGemms(gate_up_E2IH, down_EHI, self.act_name, *biases, self.swiglu_limit,
                                                 self.swiglu_alpha)
            return moe_grouped.fused_moe(x_TH, ids_TK, weights_TK, gemms, routing=routing)
        # a batch-invariant decode step in CUDA graphs: all experts in a few launches (same bits as the loop)
        if takes_invariant_batched(self, x_TH):
            return invariant_experts.dense_experts(x_TH, ids_TK, weights_TK, gate_up_E2IH, down_EHI, self.act)
        expert_mlp = _expert_mlp_of(self, gate_up_E2IH, down_EHI)
        return routed_forward(x_TH, ids_TK, weights_TK, self.num_experts, expert_mlp)


def takes_invariant_batched(experts: torch.nn.Module, x_TH: torch.Tensor) -> bool:
    """Whether a batch-invariant decode step's routed ``experts`` (:class:`Experts` or a variant
    sharing its ``routed_with``) run batched (``--moe-invariant-decode batched``,
    :mod:`~miles_host.kernels.invariant_experts`): in CUDA-graph capture, no autograd, plain gated
    experts (no biases, no clamped SwiGLU)."""
    return (
        invariant_experts.batched()
        and _invariant_active()
        and x_TH.is_cuda and torch.cuda.is_current_stream_capturing()
        and not torch.is_grad_enabled()
        and experts.gate_up_proj_bias is None and experts.down_proj_bias is None and experts.swiglu_limit is None
    )


#: inference paths of the routed experts: the fused kernels of :mod:`miles_host.kernels.moe_grouped`
#: (where Triton runs) or :func:`routed_forward`'s per-expert loop
MOE_KERNELS = ("fused", "loop")


def uses_fused_moe(experts: torch.nn.Module, x_TH: torch.Tensor) -> bool:
    """Whether ``experts`` runs the fused kernels on ``x_TH``: its ``moe_kernel`` is ``"fused"``,
    no autograd, the batch-invariant mode off (it keeps its fixed-order loop), and Triton runs here
    (CUDA, or the CPU interpreter in tests)."""
    return (
        getattr(experts, "moe_kernel", "loop") == "fused"
        and not torch.is_grad_enabled()
        and not _invariant_active()
        and uses_triton(x_TH)
        and x_TH.dtype in DTYPES
    )


def _set_on_modules(model: torch.nn.Module, attribute: str, value: str, choices: tuple[str, ...], what: str) -> int:
    """Set ``attribute`` to ``value`` (one of ``choices``) on every module that has it; how many."""
    if value not in choices:
        raise ValueError(f"{what} must be one of {', '.join(choices)}; got {value!r}")
    modules = [m for m in model.modules() if hasattr(m, attribute)]
    for module in modules:
        setattr(module, attribute, value)
    return len(modules)


def set_moe_kernel(model: torch.nn.Module, kernel: str) -> int:
    """Set every routed-experts module's inference path (``--moe-kernel``); return how many modules."""
    return _set_on_modules(model, "moe_kernel", kernel, MOE_KERNELS, "--moe-kernel")


#: routers of the MoE block's inference path: ``fused`` (:func:`~miles_host.kernels.moe_router.fused_route`
#: where :func:`uses_fused_router` allows, else the eager one) or ``torch`` (always the eager router and ``plan``)
MOE_ROUTERS = ("fused", "torch")


def uses_fused_router(moe: torch.nn.Module, x_TH: torch.Tensor) -> bool:
    """Whether the MoE block ``moe`` routes ``x_TH`` with the one-launch fused router: its
    ``router_kernel`` is ``"fused"``, its experts take the fused kernels (:func:`uses_fused_moe`, a
    fused activation) and a ``routing`` argument, no plugin replaces expert ids, and
    :func:`~miles_host.kernels.moe_router.supports` the batch (decode sizes)."""
    experts = moe.experts
    return (
        getattr(moe, "router_kernel", "torch") == "fused"
        and getattr(experts, "takes_routing", False)
        and getattr(experts, "act_name", None) in moe_grouped.FUSED_ACTIVATIONS
        and uses_fused_moe(experts, x_TH)
        and not moe.routing_hooks.replaces_ids
        and moe_router.supports(moe.router_spec, x_TH.shape[0])
    )


def set_moe_router(model: torch.nn.Module, router: str) -> int:
    """Set every MoE block's inference router (one of :data:`MOE_ROUTERS`); return how many blocks."""
    return _set_on_modules(model, "router_kernel", router, MOE_ROUTERS, "the MoE router")


def routed_forward(
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    num_experts: int,
    expert_mlp: Callable[[torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    """Dispatch tokens to their experts, run ``expert_mlp(x_e, expert)`` on each
    expert's tokens, and combine with the gate weights. Precision plugins reuse it
    with their own per-expert MLP (FP8, INT4), so the routing stays one code path."""
    num_tokens, top_k = ids_TK.shape
    ordered = _invariant_active()
    if x_TH.is_cuda and torch.cuda.is_current_stream_capturing():
        return _dense_over_experts(x_TH, ids_TK, weights_TK, num_experts, expert_mlp, ordered)
    if ordered:
        return _ordered_combine(x_TH, ids_TK, weights_TK, num_experts, expert_mlp)
    flat_ids = ids_TK.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    x_sorted = x_TH[token_of]
    w_sorted = weights_TK.reshape(-1)[order]
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        y_e = expert_mlp(x_sorted[start : start + count], expert)
        outputs.append(y_e * w_sorted[start : start + count, None])
        start += count
    y_sorted = torch.cat(outputs, dim=0) if outputs else x_sorted.new_zeros(0, x_TH.shape[1])
    y_TH = torch.zeros(num_tokens, x_TH.shape[1], dtype=y_sorted.dtype, device=x_TH.device)
    y_TH.index_add_(0, token_of, y_sorted)
    return y_TH.to(x_TH.dtype)


def _dense_over_experts(x_TH, ids_TK, weights_TK, num_experts, expert_mlp, ordered=False) -> torch.Tensor:
    """The CUDA-graph form of :func:`routed_forward` (no host sync, static shapes): every
    expert runs on every token and its output is weighted by the token's gate weight
    for it (zero when not chosen). Each expert's weights are read once, as a decode
    step reads them anyway; the extra FLOPs are cheap at decode batch sizes.
    ``ordered``: the products of :func:`_ordered_combine` (a token's unchosen experts
    add exact zeros, so both forms give the same bits)."""
    y_TH = torch.zeros(x_TH.shape, dtype=torch.float32, device=x_TH.device)
    for expert in range(num_experts):
        gate_T = (weights_TK * (ids_TK == expert)).sum(dim=-1)
        if ordered:
            y_TH += expert_mlp(x_TH, expert).float() * gate_T[:, None].float()
        else:
            y_TH += (expert_mlp(x_TH, expert) * gate_T[:, None].to(x_TH.dtype)).float()
    return y_TH.to(x_TH.dtype)


def _ordered_combine(x_TH, ids_TK, weights_TK, num_experts, expert_mlp) -> torch.Tensor:
    """Batch-invariant :func:`routed_forward`: each token's expert outputs times their gate
    weights (float32 products) summed in float32 in ascending expert order, one expert
    at a time (a token appears at most once per expert, so no two adds race)."""
    top_k = ids_TK.shape[1]
    flat_ids = ids_TK.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    x_sorted = x_TH[token_of]
    w_sorted = weights_TK.reshape(-1)[order].float()
    y_TH = torch.zeros(x_TH.shape, dtype=torch.float32, device=x_TH.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        y_TH.index_add_(0, token_of[rows], expert_mlp(x_sorted[rows], expert).float() * w_sorted[rows, None])
        start += count
    return y_TH.to(x_TH.dtype)


def _invariant_active() -> bool:
    """Whether the batch-invariant kernels are on (``--true-on-policy`` on CUDA)."""
    return invariant_ops.is_active()


def _row_sum(x_TK: torch.Tensor) -> torch.Tensor:
    """``x.sum(-1, keepdim=True)``; column by column in order in batch-invariant mode."""
    if not _invariant_active():
        return x_TK.sum(dim=-1, keepdim=True)
    total = x_TK[:, :1]
    for k in range(1, x_TK.shape[1]):
        total = total + x_TK[:, k : k + 1]
    return total


class MoE(torch.nn.Module):
    """Router + routed experts (+ shared experts, optionally sigmoid-gated)."""

    def __init__(
        self,
        hidden_size: int,
        moe: MoEConfig,
        act: str,
        layer_index: int,
        routing_hooks: RoutingHooks = NO_ROUTING_HOOKS,
    ):
        super().__init__()
        self.moe = moe
        self.layer_index = layer_index
        self.routing_hooks = routing_hooks
        self.router = Router(hidden_size, moe)
        self.experts = Experts(hidden_size, moe, act)
        self.shared_experts = (
            GatedMLP(hidden_size, moe.shared_intermediate_size, act) if moe.shared_intermediate_size else None
        )
        self.shared_gate = torch.nn.Linear(hidden_size, 1, bias=False) if moe.shared_expert_gate else None
        #: the inference router, one of :data:`MOE_ROUTERS` (see :func:`uses_fused_router`)
        self.router_kernel = "fused"
        self.router_spec = moe_router.RouterSpec.of(moe)

    def forward(self, x_TH: torch.Tensor, routing_context: RoutingContext | None = None) -> torch.Tensor:
        if uses_fused_router(self, x_TH):
            y_TH = self._fused_routed(x_TH, routing_context)
        else:
            y_TH = self._routed(x_TH, routing_context)
        if self.shared_experts is not None:
            shared_TH = self.shared_experts(x_TH)
            if self.shared_gate is not None:
                shared_TH = torch.sigmoid(self.shared_gate(x_TH)) * shared_TH
            y_TH = y_TH + shared_TH
        return y_TH

    def _fused_routed(self, x_TH: torch.Tensor, routing_context: RoutingContext | None) -> torch.Tensor:
        """The routed experts with ids, weights and layout from one fused router launch.

        The layout's row block is the experts' tile table's for this batch (a precision
        plugin whose experts name no ``weight_format`` gets the dense one's; if its
        tiles differ, ``fused_moe`` plans the layout again)."""
        moe = self.moe
        weight_format = getattr(self.experts, "weight_format", None) or moe_grouped.DENSE_FORMATS.get(x_TH.dtype, "")
        block_m = moe_tiles(x_TH.shape[0], moe.top_k, moe.num_experts, x_TH.shape[1], moe.intermediate_size,
                            x_TH.dtype, weight_format).block_m
        ids_TK, routing = moe_router.fused_route(
            self.router.decode_logits(x_TH), self.router_spec, self.router.expert_bias, block_m,
            torch.float32 if moe.router_fp32 else x_TH.dtype,
        )
        self.routing_hooks.observe(self.layer_index, ids_TK, routing_context)
        return self.experts(x_TH, ids_TK, routing.weights_TK, routing=routing)

    def _routed(self, x_TH: torch.Tensor, routing_context: RoutingContext | None) -> torch.Tensor:
        """The routed experts through the eager router (and the routing hooks)."""
        scores_TE, choice_TE = self.router(x_TH)
        default_ids_TK = self.router.default_choice(choice_TE)
        ids_TK = self.routing_hooks.select(
            self.layer_index, choice_TE, self.moe.top_k, routing_context, default_ids_TK=default_ids_TK
        )
        weights_TK = scores_TE.gather(1, ids_TK)
        if self.moe.norm_topk_prob:
            weights_TK = weights_TK / (_row_sum(weights_TK) + self.moe.norm_eps)
        if self.moe.routed_scaling_factor != 1.0:
            weights_TK = weights_TK * self.moe.routed_scaling_factor
        if not self.moe.router_fp32:
            weights_TK = weights_TK.to(x_TH.dtype)
        return self.experts(x_TH, ids_TK, weights_TK)
