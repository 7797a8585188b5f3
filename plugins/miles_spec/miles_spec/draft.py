"""Draft models for speculative rollout.

Two kinds, one interface (:class:`Draft`): ``features(hidden_TH, token_ids_T,
positions_T, attention) -> feature_TH`` and ``logits(feature_TH) -> logits_TV``
(``forward`` does both).

- :class:`MTPDraft`: an MTP/EAGLE head on the policy itself, the policy's
  ``mtp[0]`` :class:`~miles_host.models.model.MTPLayer`:
  ``eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))`` -> one decoder layer ->
  ``head_norm`` -> the policy's lm head. It reads the policy's final (post-norm)
  hidden state ``h_t`` and the next token's embedding and predicts ``x_{t+2}``.
  Embedding and output head are the policy's (the layer's own DeepSeek copies,
  when a checkpoint has them, are loaded and synced but not used). Weights:
  from the checkpoint when it has MTP layers (DeepSeek-V3/GLM
  ``num_nextn_predict_layers``, through the host's ``mtp.*`` slot, exported
  back by ``save_pretrained`` for those families), else a fresh layer is
  attached (:func:`attach_mtp`, ``MTPLayer.fresh``: ``torch.nn.Linear``'s default init) and learns online with
  ``--enable-mtp-training``. Chain drafting feeds the layer's own output
  feature back as ``h`` for the next draft token (as SGLang does with one
  DeepSeek MTP layer), so one layer serves every draft step.
- :class:`ModelDraft`: a separate small causal LM
  (``--sglang-speculative-draft-model-path``); reads tokens only.

Draft *entries*: entry ``t`` pairs ``(h_t, x_{t+1})`` and predicts ``x_{t+2}``;
it lives in KV slot/position ``t + offset`` (``offset`` 0 for MTP, 1 for a
model draft, whose entry ``t`` is the token ``x_{t+1}`` at its own position).

Tensor legend: T tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from miles_host.models import dsa
from miles_host.models.context import ForwardContext, RoutingContext
from miles_host.models.model import CausalLM, DecoderLayer, MTPLayer
from miles_host.models.rope import RotaryEmbedding

from miles_spec.hot_vocab import HotVocabHead


class Draft(Protocol):
    """What the speculative strategy needs from a draft."""

    uses_hidden: bool
    offset: int
    feature_size: int
    hot: HotVocabHead | None  # the FR-Spec token map's head, or None

    def layout(self) -> list[tuple[int, int, int, int | None]]:
        """KV layout of the draft's own attention layers."""
        ...

    def features(self, hidden_TH, token_ids_T, positions_T, attention) -> torch.Tensor:
        """``[T, H]`` features of the draft entries (writing their K/V through ``attention``)."""
        ...

    def logits(self, feature_TH: torch.Tensor) -> torch.Tensor:
        """``[T, V]`` draft logits of features."""
        ...

    def forward(self, hidden_TH, token_ids_T, positions_T, attention) -> tuple[torch.Tensor, torch.Tensor]:
        """``(feature_TH, logits_TV)`` of the draft entries."""
        ...


class _LayerOffset:
    """An attention context whose layer ``i`` is layer ``i - first`` of the wrapped one
    (the MTP layer's index is ``num_layers + j``; its KV cache has one layer)."""

    def __init__(self, attention: Any, first: int):
        self.attention = attention
        self.first = first

    def attend(self, layer_index, q_THD, k_THD, v_THD, **kwargs):
        return self.attention.attend(layer_index - self.first, q_THD, k_THD, v_THD, **kwargs)


def _sparse_attention_through_offset(layer, offset: _LayerOffset, q_THD, k_THD, v_THD, index, cache_layer: int):
    """A DeepSeek-V3.2 MTP layer's sparse attention in the wrapped context, layers renumbered."""
    return dsa.attend_in_context(layer, offset.attention, q_THD, k_THD, v_THD, index, cache_layer - offset.first)


dsa.DSA_CONTEXTS[_LayerOffset] = _sparse_attention_through_offset


def attach_mtp(model: CausalLM, num_layers: int = 1) -> bool:
    """Give ``model`` MTP layers when its checkpoint had none; True when attached.

    The fresh layers have no private embedding/head copies (the policy's are
    shared). Same names (``mtp.{j}.*``) on the trainer's and the engine's
    model, so weight sync carries them.
    """
    if len(model.mtp) > 0:
        return False
    if num_layers != 1:
        raise ValueError(
            f"--mtp-num-layers {num_layers}: a freshly initialised draft supports 1 MTP layer (it is reused "
            "for every draft step, as SGLang does); use --mtp-num-layers 1 or a checkpoint with MTP layers"
        )
    reference = model.embed_tokens.weight
    config = model.config
    layers = []
    for j in range(num_layers):
        layer = MTPLayer.fresh(config, config.num_layers + j, model.routing_hooks)
        layers.append(layer.to(device=reference.device, dtype=reference.dtype))
    model.mtp = torch.nn.ModuleList(layers)
    return True


class MTPDraft:
    """The policy's first MTP layer as an EAGLE-style draft head."""

    uses_hidden = True
    offset = 0
    #: the token map's head (FR-Spec), or None: the whole vocabulary
    hot: HotVocabHead | None = None

    def __init__(self, policy: CausalLM, token_map: torch.Tensor | None = None):
        """``token_map``: propose only these ids (FR-Spec, :mod:`miles_spec.hot_vocab`)."""
        if len(policy.mtp) == 0:
            raise ValueError("the policy has no MTP layer: call attach_mtp(model) first")
        self.policy = policy
        if token_map is not None:
            self.hot = HotVocabHead(token_map, lambda: policy.lm_head_weight, policy.config.final_logit_softcap)
        layer = policy.mtp[0]
        rope = policy.config.rope_of(layer.layer_index)
        self.rope = policy.rotary_embedding(rope) or RotaryEmbedding(rope)
        self.feature_size = policy.config.hidden_size

    @property
    def layer(self) -> MTPLayer:
        return self.policy.mtp[0]

    def layout(self):
        # the layer's K/V entry, then any entries its attention keeps beside them (DSA's indexer keys)
        return [self.layer.attn.layout(), *getattr(self.layer.attn, "extra_cache_layouts", list)()]

    def features(self, hidden_TH, token_ids_T, positions_T, attention, detach_shared: bool = False) -> torch.Tensor:
        """The decoder layer's output ``[T, H]`` (before ``head_norm``)."""
        layer = self.layer
        embedded_TH = self.policy.embed(token_ids_T)
        if detach_shared:
            embedded_TH = embedded_TH.detach()
        x_TH = layer.eh_proj(torch.cat([layer.enorm(embedded_TH), layer.hnorm(hidden_TH.to(embedded_TH.dtype))], dim=-1))
        ctx = ForwardContext(attention=_LayerOffset(attention, layer.layer_index), routing=RoutingContext(phase="draft"))
        return DecoderLayer.forward(layer, x_TH, self.rope(positions_T, x_TH.dtype), ctx)

    def logits(self, feature_TH: torch.Tensor) -> torch.Tensor:
        normed_TH = self.layer.head_norm(feature_TH)
        return self.policy.compute_logits(normed_TH) if self.hot is None else self.hot.logits(normed_TH)

    def forward(self, hidden_TH, token_ids_T, positions_T, attention):
        feature_TH = self.features(hidden_TH, token_ids_T, positions_T, attention)
        return feature_TH, self.logits(feature_TH)


class ModelDraft:
    """A separate small causal LM as the draft (same vocabulary as the policy)."""

    uses_hidden = False
    offset = 1
    hot: HotVocabHead | None = None

    def __init__(self, model: CausalLM, policy_vocab: int, token_map: torch.Tensor | None = None):
        if model.config.vocab_size != policy_vocab:
            raise ValueError(
                f"the draft model's vocabulary ({model.config.vocab_size}) differs from the policy's "
                f"({policy_vocab}); --sglang-speculative-draft-model-path needs the same tokenizer"
            )
        self.model = model.eval()
        self.feature_size = model.config.hidden_size
        if token_map is not None:
            self.hot = HotVocabHead(token_map, lambda: model.lm_head_weight, model.config.final_logit_softcap)

    def layout(self):
        return self.model.attention_layout()

    def features(self, hidden_TH, token_ids_T, positions_T, attention) -> torch.Tensor:
        """The draft model's final-norm hidden states ``[T, H']`` (``hidden_TH`` is not read)."""
        ctx = ForwardContext(attention=attention, routing=RoutingContext(phase="draft"))
        return self.model.forward_hidden(token_ids_T, positions_T, ctx)

    def logits(self, feature_TH: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(feature_TH) if self.hot is None else self.hot.logits(feature_TH)

    def forward(self, hidden_TH, token_ids_T, positions_T, attention):
        feature_TH = self.features(hidden_TH, token_ids_T, positions_T, attention)
        return feature_TH, self.logits(feature_TH)
