"""A native :class:`~miles_host.models.config.MoEConfig` as Megatron-Core's MoE settings.

Megatron's ``topk_routing_with_score_function`` computes, per score function
(:data:`SCORE_FUNCTIONS`):

- ``softmax`` (Qwen-MoE): top-k of the logits, then a softmax over those k, i.e. the
  softmax probabilities renormalised over the chosen experts (``norm_topk_prob=True``);
- ``sigmoid`` (DeepSeek-V3, GLM-4.5): ``sigmoid(logits)``; the choice on those scores plus
  the expert bias (``moe_router_enable_expert_bias``: a buffer, the checkpoint's
  ``e_score_correction_bias``, never updated here as in the native trainer); the weights
  are the chosen scores renormalised over the k (for k > 1, whatever
  ``norm_topk_prob`` says, so ``norm_topk_prob=False`` is refused).

Then ``moe_router_topk_scaling_factor`` (``routed_scaling_factor``). Group-limited routing
(``moe_router_num_groups`` / ``moe_router_group_topk``) scores each group by the sum of its
top ``topk / group_topk`` scores; DeepSeek (and the native router) sums the top 2, so the
two agree when ``topk == 2 * topk_group`` (DeepSeek-V3: 8 = 2 x 4). Otherwise
(:func:`megatron_group_rule_differs`) the router replays the native choice at every
forward (:mod:`miles_megatron.replay`) and Megatron gathers the weights at those experts.
Shared experts are Megatron's ``SharedExpertMLP`` (``moe_shared_expert_intermediate_size``),
added to the routed output as DeepSeek does; the dense layers of ``first_k_dense_replace``
come from ``moe_layer_freq``.
"""

from __future__ import annotations

from typing import Any, Callable

#: DeepSeek's group score: the sum of each group's top 2 expert scores
GROUP_SCORE_TOP = 2


def _softmax_problems(moe: Any) -> list[str]:
    problems = []
    if not moe.norm_topk_prob:
        problems.append("softmax routing without norm_topk_prob")
    if moe.expert_bias:
        problems.append("an expert bias with softmax routing")
    return problems


def _sigmoid_problems(moe: Any) -> list[str]:
    if moe.top_k > 1 and not moe.norm_topk_prob:
        return ["sigmoid routing without norm_topk_prob (Megatron renormalises the chosen scores)"]
    return []


#: native ``score_func`` -> the routing features Megatron computes differently for it
SCORE_FUNCTIONS: dict[str, Callable[[Any], list[str]]] = {"softmax": _softmax_problems, "sigmoid": _sigmoid_problems}


def moe_problems(moe: Any) -> list[str]:
    """What of a native MoE block Megatron's router and experts compute differently."""
    problems = list(SCORE_FUNCTIONS[moe.score_func](moe))
    if moe.shared_expert_gate:
        problems.append("a sigmoid-gated shared expert (Qwen2-MoE)")
    if moe.router_bias or moe.expert_biases or moe.swiglu_limit is not None:
        problems.append("router / expert biases and the clamped SwiGLU (gpt-oss)")
    if moe.scale_expert_inputs:
        problems.append("experts on router-scaled inputs (Llama-4)")
    return problems


def megatron_group_rule_differs(moe: Any) -> bool:
    """Whether Megatron's group score (its top ``top_k / topk_group``) is not the model's (top 2)."""
    return moe.n_group > 1 and moe.top_k != GROUP_SCORE_TOP * moe.topk_group


def moe_config_kwargs(moe: Any, moe_layers: list[bool]) -> dict[str, Any]:
    """``TransformerConfig`` MoE arguments of a native MoE block (check :func:`moe_problems` first)."""
    kwargs: dict[str, Any] = {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.top_k,
        "moe_ffn_hidden_size": moe.intermediate_size,
        "moe_layer_freq": [int(is_moe) for is_moe in moe_layers],  # dense layers stay dense
        "moe_router_score_function": moe.score_func,
        "moe_router_enable_expert_bias": bool(moe.expert_bias),
        "moe_enable_routing_replay": True,
    }
    if moe.routed_scaling_factor != 1.0:
        kwargs["moe_router_topk_scaling_factor"] = float(moe.routed_scaling_factor)
    if moe.n_group > 1:
        kwargs.update(moe_router_num_groups=moe.n_group, moe_router_group_topk=moe.topk_group)
    if moe.shared_intermediate_size:
        kwargs["moe_shared_expert_intermediate_size"] = moe.shared_intermediate_size
    return kwargs
