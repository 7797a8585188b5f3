"""miles-spec's online-trained draft (``--enable-mtp-training``) on Megatron-Core's MTP layer.

The native draft (:class:`miles_spec.draft.MTPDraft` over the host's ``MTPLayer``) is
DeepSeek-V3's multi-token-prediction module: ``head_norm(layer(eh_proj(cat(enorm(embed(
x_{t+1})), hnorm(h_t)))))`` and the policy's LM head give the log-prob of ``x_{t+2}``.
Megatron-Core's ``MultiTokenPredictionLayer`` is the same module (``enorm``, ``hnorm``,
``eh_proj``, ``transformer_layer``, ``final_layernorm``; it rolls the input ids by one
itself), so the megatron backend runs the draft on it:

- :func:`attach_mtp_block` builds a ``MultiTokenPredictionBlock`` from the policy's
  ``TransformerConfig`` with ``mtp_num_layers`` set and routing replay off for its
  router (R3 replays the policy's layers only, as natively), initialises it as the
  native fresh draft (``MTPLayer.fresh``, mapped by :mod:`miles_megatron.weights`),
  and registers it as ``gpt.mtp``: its
  parameters join the optimizer, ``state_dict`` exports them under the native
  ``mtp.0.*`` names, so weight sync carries the draft to the engine as natively.
- :func:`draft_log_probs` runs the layer on the policy's last forward (kept by
  ``MegatronPolicy.forward_hidden``: no second policy forward), with the policy's hidden
  states and embedding detached and the LM head detached, as the native loss does: the
  draft's loss trains the draft only.

One rank only for now (TP = EP = PP = 1): the MTP parameters are not in the TP/EP shard
maps, nor placed on a pipeline stage. MLA models build the layer with the policy's latent
core attention (:mod:`miles_megatron.mla_spec`); a model whose group-limited routing
Megatron scores differently (:func:`~miles_megatron.moe_routing.megatron_group_rule_differs`)
is refused, as its draft router is not bridged to the native choice.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from miles_megatron.moe_routing import megatron_group_rule_differs
from miles_megatron.runtime import on_device, quiet_imports


def attach_mtp_block(policy: Any, num_layers: int) -> None:
    """Build, initialise and register ``policy.gpt.mtp`` (see module doc)."""
    if num_layers != 1:
        raise ValueError(f"--mtp-num-layers {num_layers}: a freshly initialised draft supports 1 MTP layer")
    if policy.sizes.parallel:
        raise ValueError(
            "--enable-mtp-training with --train-backend megatron runs at tensor, expert and pipeline parallel "
            "size 1 for now (the MTP layer is not in the TP/EP shard maps nor on a pipeline stage); use sizes 1 "
            "or --train-backend native"
        )
    moe = policy.config.moe
    if moe is not None and megatron_group_rule_differs(moe):
        raise ValueError(
            f"--enable-mtp-training with --train-backend megatron: the draft's MoE router would take Megatron's "
            f"group-limited top-k, which differs from this model's (top_k {moe.top_k}, topk_group {moe.topk_group}: "
            "groups are scored by their top 2 experts); use --train-backend native"
        )
    if policy.has_mtp_draft:
        return
    with quiet_imports():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
        from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    from miles_megatron.policy import adjust_layer, pin_autocast, transformer_config

    config = transformer_config(policy.config)
    config.mtp_num_layers = num_layers
    config.moe_enable_routing_replay = False
    device = policy.embed_tokens.weight.device
    with warnings.catch_warnings(), on_device(device):
        warnings.simplefilter("ignore")
        decoder_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        if config.multi_latent_attention:
            from miles_megatron.mla_spec import with_latent_core_attention

            decoder_spec = with_latent_core_attention(decoder_spec)
        from miles_megatron.sdpa_attention import with_sdpa_attention

        decoder_spec = with_sdpa_attention(decoder_spec, config)
        if policy.config.moe is not None:
            from miles_megatron.grouped_experts import with_grouped_experts

            decoder_spec = with_grouped_experts(decoder_spec, policy.config.moe.experts_impl)
        block = MultiTokenPredictionBlock(config, get_gpt_mtp_block_spec(config, decoder_spec, False))
    for layer in block.layers:
        adjust_layer(layer.transformer_layer)
        pin_autocast(layer.transformer_layer, policy.autocast_state)
    policy.gpt.mtp = block.to(device)
    _load_fresh_native_draft(policy.gpt.mtp, policy.config)


def _load_fresh_native_draft(block: torch.nn.Module, native_config: Any) -> None:
    """The weights of a freshly attached native draft layer (``MTPLayer.fresh``), through the maps."""
    from miles_host.models.model import MTPLayer
    from miles_host.routing import NO_ROUTING_HOOKS

    from miles_megatron.weights import native_to_megatron

    layer = MTPLayer.fresh(native_config, native_config.num_layers, NO_ROUTING_HOOKS)
    native = {f"mtp.0.{name}": tensor.detach().float() for name, tensor in layer.state_dict().items()}
    state = {name.removeprefix("mtp."): tensor for name, tensor in native_to_megatron(native, native_config).items()}
    missing, unexpected = block.load_state_dict(state, strict=False)
    missing = [name for name in missing if not name.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"native -> Megatron-Core MTP weights do not match: missing {missing}, unexpected {unexpected}")


def draft_log_probs(policy: Any, batch: Any, rows_R: torch.Tensor, targets_R: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``targets_R`` (``x_{t+2}``) at packed rows ``rows_R`` of the last forward."""
    from miles_host.models.logprobs import chunked_log_probs

    inputs = policy.last_forward
    if inputs is None or inputs.layout.megatron_row_T.numel() != batch.input_ids_T.shape[0]:
        raise RuntimeError("MTP loss: the kept policy forward is not this micro-batch's")
    embedding = policy.gpt.embedding
    device = inputs.hidden_SBH.device

    def detached_embedding(input_ids, position_ids):
        return embedding(input_ids=input_ids, position_ids=position_ids).detach()

    with on_device(device):
        feature_SBH, _, _ = policy.gpt.mtp.layers[0](
            input_ids=inputs.ids_SB.t(), position_ids=inputs.positions_SB.t(), hidden_states=inputs.hidden_SBH,
            attention_mask=inputs.layout.causal_mask(), rotary_pos_emb=inputs.rotary_SB1D, embedding=detached_embedding,
        )
    feature_TH = inputs.layout.from_sb(feature_SBH)
    log_probs_R, _ = chunked_log_probs(feature_TH[rows_R], policy.lm_head_weight.detach(), targets_R)
    return log_probs_R
