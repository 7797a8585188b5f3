"""miles-spec's online-trained draft (``--enable-mtp-training``) on Megatron-Core's MTP layer.

The native draft (:class:`miles_spec.draft.MTPDraft` over the host's ``MTPLayer``) is
DeepSeek-V3's multi-token-prediction module: ``head_norm(layer(eh_proj(cat(enorm(embed(
x_{t+1})), hnorm(h_t)))))`` and the policy's LM head give the log-prob of ``x_{t+2}``.
Megatron-Core's ``MultiTokenPredictionLayer`` is the same module (``enorm``, ``hnorm``,
``eh_proj``, ``transformer_layer``, ``final_layernorm``; it rolls the input ids by one
itself), so the megatron backend runs the draft on it:

- :func:`attach_mtp_block` builds a ``MultiTokenPredictionBlock`` from the policy's
  ``TransformerConfig`` with ``mtp_num_layers`` set and routing replay off for its
  router (R3 replays the policy's layers only, as natively), initialises it with the
  native fresh layer's initialisation (``miles_spec.draft.attach_mtp`` on a native
  layer, mapped by :mod:`miles_megatron.weights`), and registers it as ``gpt.mtp``: its
  parameters join the optimizer, ``state_dict`` exports them under the native
  ``mtp.0.*`` names, so weight sync carries the draft to the engine as natively.
- :func:`draft_log_probs` runs the layer on the policy's last forward (kept by
  ``MegatronPolicy.forward_hidden``: no second policy forward), with the policy's hidden
  states and embedding detached and the LM head detached, as the native loss does: the
  draft's loss trains the draft only.

One rank only for now (TP = EP = 1): the MTP parameters are not in the TP/EP shard maps.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from miles_megatron.runtime import on_device, quiet_imports


def attach_mtp_block(policy: Any, num_layers: int) -> None:
    """Build, initialise and register ``policy.gpt.mtp`` (see module doc)."""
    if num_layers != 1:
        raise ValueError(f"--mtp-num-layers {num_layers}: a freshly initialised draft supports 1 MTP layer")
    if policy.sizes.parallel:
        raise ValueError(
            "--enable-mtp-training with --train-backend megatron runs at tensor and expert parallel size 1 for "
            "now (the MTP layer is not in the TP/EP shard maps); use sizes 1 or --train-backend native"
        )
    if getattr(policy.gpt, "mtp", None) is not None:
        return
    with quiet_imports():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
        from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    from miles_megatron.policy import (
        _no_expert_bias,
        load_native_state,
        pin_autocast,
        residual_bias_dropout_add,
        transformer_config,
    )

    config = transformer_config(policy.config)
    config.mtp_num_layers = num_layers
    config.moe_enable_routing_replay = False
    device = policy.embed_tokens.weight.device
    with warnings.catch_warnings(), on_device(device):
        warnings.simplefilter("ignore")
        decoder_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        block = MultiTokenPredictionBlock(config, get_gpt_mtp_block_spec(config, decoder_spec, False))
    for layer in block.layers:
        layer.transformer_layer.self_attn_bda = layer.transformer_layer.mlp_bda = residual_bias_dropout_add
        router = getattr(layer.transformer_layer.mlp, "router", None)
        if router is not None and not router.enable_expert_bias:
            router._apply_expert_bias = _no_expert_bias
        pin_autocast(layer.transformer_layer, policy.autocast_state)
    policy.gpt.mtp = block.to(device)
    mtp_state = {name: tensor for name, tensor in _fresh_native_mtp(policy.config).items()}
    full = {**policy.state_dict(), **mtp_state}
    load_native_state(policy.gpt, full, policy.config)


def _fresh_native_mtp(native_config: Any) -> dict[str, torch.Tensor]:
    """``mtp.0.*`` weights of a freshly attached native draft layer (float32, CPU)."""
    from miles_host.models.mlp import Experts, Router
    from miles_host.models.model import MTPLayer
    from miles_host.routing import NO_ROUTING_HOOKS

    layer = MTPLayer(native_config, native_config.num_layers, NO_ROUTING_HOOKS)
    layer.embed_tokens = layer.head = None
    for module in layer.modules():
        if isinstance(module, (Router, Experts)):
            module.reset_parameters()
    return {f"mtp.0.{name}": tensor.detach().float() for name, tensor in layer.state_dict().items()}


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
