"""Gemma-3n's text decoder (transformers' ``Gemma3nForCausalLM``, ``gemma3n_text``).

What differs from the other decoders:

- **AltUp**: the residual stream is ``A`` streams ``[A, T, H]``; stream 0 is the embedding,
  the others its projections rescaled to its RMS. Each layer *predicts* all streams from a
  per-token mix (coefficients from a tanh router over the active stream), runs its block on
  the active prediction and *corrects* every stream with the block's innovation. After the
  last layer the streams are projected back, rescaled and averaged.
- **per-layer embeddings**: a second token table gives every layer ``P`` dims per token
  (plus a projection of the embedding), gated into the stream after each layer.
- **LAuReL**: a low-rank residual branch beside attention; ``(attn + laurel) / sqrt(2)``.
- **KV sharing**: the last layers reuse the keys and values of the last earlier layer of
  their type (:attr:`~miles_host.models.config.Gemma3nConfig.kv_source`); they attend through
  that layer's cache entry (rewriting the same keys is a no-op) and keep none of their own.
- **activation sparsity**: some MLPs zero the gate activations below
  ``mean + std * Phi^-1(sparsity)`` per token (a Gaussian top-k).
- q/k RMSNorm per head, a weightless v norm, attention scale 1, plain (not unit-offset)
  RMSNorms computed in float32 as transformers does.

Training and rollout share these modules through the forward's attention context (packed
training, the reference cache, the engine's paged cache). ``--true-on-policy`` (the per-token
batch-invariant forward) is refused: that forward walks the standard decoder layers.

Tensor legend: A AltUp streams, T tokens, H hidden, L layers, P per-layer input dims,
N heads, D head dim, I intermediate.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from miles_host.kernels.eager_ops import activation, apply_rotary
from miles_host.models.config import ModelConfig
from miles_host.models.context import ForwardContext
from miles_host.models.mlp import GatedMLP
from miles_host.models.model import CausalLM
from miles_host.routing import NO_ROUTING_HOOKS, RoutingHooks

TRUE_ON_POLICY_REFUSAL = (
    "gemma3n does not support --true-on-policy: the batch-invariant per-token forward walks the standard "
    "decoder layers, not Gemma-3n's AltUp streams and per-layer inputs; run without --true-on-policy"
)


class Gemma3nRMSNorm(torch.nn.Module):
    """``x * (mean(x^2) + eps) ** -0.5 [* w]`` in float32 (transformers' formula); no weight for the v norm."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)


class Gemma3nAttention(torch.nn.Module):
    """GQA with q/k/v norms; a KV-sharing layer has no k/v projections and reads its source's."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        eps, bias = config.rms_norm_eps, config.qkv_bias
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.kv_source = config.gemma3n.kv_source[layer_index]
        self.sliding_window = config.sliding_window_of(layer_index)
        self.q_proj = torch.nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.q_norm = Gemma3nRMSNorm(self.head_dim, eps)
        if self.kv_source is None:
            self.k_proj = torch.nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
            self.v_proj = torch.nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
            self.k_norm = Gemma3nRMSNorm(self.head_dim, eps)
            self.v_norm = Gemma3nRMSNorm(self.head_dim, eps, with_scale=False)
        self.o_proj = torch.nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_bias)

    def forward(self, x_TH: torch.Tensor, rope_cos_sin, attention: Any, shared_kv: dict) -> torch.Tensor:
        num_tokens = x_TH.shape[0]
        cos, sin = rope_cos_sin
        q_TND = apply_rotary(self.q_norm(self.q_proj(x_TH).view(num_tokens, -1, self.head_dim)), cos, sin, False)
        if self.kv_source is None:
            k_TND = self.k_norm(self.k_proj(x_TH).view(num_tokens, -1, self.head_dim))
            k_TND = apply_rotary(k_TND, cos, sin, False)
            v_TND = self.v_norm(self.v_proj(x_TH).view(num_tokens, -1, self.head_dim))
            shared_kv[self.layer_index] = (k_TND, v_TND)
            cache_layer = self.layer_index
        else:
            k_TND, v_TND = shared_kv[self.kv_source]
            cache_layer = self.kv_source
        y_TND = attention.attend(cache_layer, q_TND, k_TND, v_TND, scale=1.0, sliding_window=self.sliding_window)
        return self.o_proj(y_TND.reshape(num_tokens, -1))

    def layout(self) -> tuple[int, int, int, int | None]:
        """A KV-sharing layer keeps no cache of its own (zero-width entries)."""
        width = self.head_dim if self.kv_source is None else 0
        return self.num_kv_heads, width, width, self.sliding_window


class Gemma3nMLP(GatedMLP):
    """GeGLU whose gate activations may be sparsified by a Gaussian top-k (``sparsity > 0``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, sparsity: float):
        super().__init__(hidden_size, intermediate_size, act)
        self.sparsity = sparsity

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        gate_TI, up_TI = self.gate_up_proj(x_TH).chunk(2, dim=-1)
        if self.sparsity > 0.0:
            gate_TI = gaussian_topk(gate_TI, self.sparsity)
        return self.down_proj(self.act(gate_TI) * up_TI)

    def forward_fused(self, x_TH: torch.Tensor) -> torch.Tensor:
        return self.forward(x_TH)


def gaussian_topk(x_TI: torch.Tensor, sparsity: float) -> torch.Tensor:
    """``relu(x - (mean + std * Phi^-1(sparsity)))`` per row (population std)."""
    multiplier = torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(sparsity, dtype=torch.float32))
    cutoff = x_TI.mean(-1, keepdim=True) + x_TI.std(-1, keepdim=True, unbiased=False) * multiplier.to(x_TI.dtype)
    return F.relu(x_TI - cutoff)


class AltUp(torch.nn.Module):
    """Predicts every stream before a layer and corrects them with the layer's innovation."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        g = config.gemma3n
        self.num_inputs, self.active, self.clip = g.altup_num_inputs, g.altup_active_idx, g.altup_coef_clip
        self.correct_output_scale = torch.nn.Parameter(torch.zeros(config.hidden_size))
        self.correction_coefs = torch.nn.Linear(self.num_inputs, self.num_inputs, bias=False)
        self.prediction_coefs = torch.nn.Linear(self.num_inputs, self.num_inputs**2, bias=False)
        self.modality_router = torch.nn.Linear(config.hidden_size, self.num_inputs, bias=False)
        self.router_norm = Gemma3nRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.router_input_scale = config.hidden_size**-1.0

    def modalities(self, x_TH: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.router_input_scale, dtype=torch.float32)
        routed = self.modality_router(self.router_norm(x_TH) * scale)
        return torch.tanh(routed.float()).type_as(x_TH)

    def predict(self, streams_ATH: torch.Tensor) -> torch.Tensor:
        modalities_TA = self.modalities(streams_ATH[self.active])
        if self.training and self.clip is not None:  # transformers clips the weight in place
            with torch.no_grad():
                self.prediction_coefs.weight.clamp_(-self.clip, self.clip)
        coefs_TAA = self.prediction_coefs(modalities_TA).reshape(-1, self.num_inputs, self.num_inputs).permute(0, 2, 1)
        predictions_THA = torch.matmul(streams_ATH.permute(1, 2, 0), coefs_TAA)
        return (predictions_THA.permute(2, 0, 1) + streams_ATH).contiguous().type_as(streams_ATH)

    def correct(self, predictions_ATH: torch.Tensor, activated_TH: torch.Tensor) -> torch.Tensor:
        modalities_TA = self.modalities(activated_TH)
        innovation_TH = activated_TH - predictions_ATH[self.active]
        weight = self.correction_coefs.weight
        if self.training and self.clip is not None:
            weight = weight.clamp(-self.clip, self.clip)
        coefs_AT1 = (F.linear(modalities_TA, weight) + 1.0).permute(1, 0).unsqueeze(-1)
        return (innovation_TH.unsqueeze(0) * coefs_AT1 + predictions_ATH).contiguous().type_as(activated_TH)

    def scale_corrected_output(self, x_TH: torch.Tensor) -> torch.Tensor:
        return (x_TH.type_as(self.correct_output_scale) * self.correct_output_scale).type_as(x_TH)


class Laurel(torch.nn.Module):
    """Learned augmented residual: ``x + norm(right(left(x)))``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.linear_left = torch.nn.Linear(config.hidden_size, config.gemma3n.laurel_rank, bias=False)
        self.linear_right = torch.nn.Linear(config.gemma3n.laurel_rank, config.hidden_size, bias=False)
        self.post_laurel_norm = Gemma3nRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return x_TH + self.post_laurel_norm(self.linear_right(self.linear_left(x_TH)))


class Gemma3nDecoderLayer(torch.nn.Module):
    """One Gemma-3n layer over the AltUp streams (transformers' ``Gemma3nTextDecoderLayer``)."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        g, eps, hidden = config.gemma3n, config.rms_norm_eps, config.hidden_size
        self.layer_index = layer_index
        self.active, self.correct_scale = g.altup_active_idx, g.altup_correct_scale
        self.attn_norm = Gemma3nRMSNorm(hidden, eps)
        self.attn = Gemma3nAttention(config, layer_index)
        self.post_attn_norm = Gemma3nRMSNorm(hidden, eps)
        self.mlp_norm = Gemma3nRMSNorm(hidden, eps)
        self.mlp = Gemma3nMLP(
            hidden, g.intermediate_sizes[layer_index], config.hidden_act, g.activation_sparsity[layer_index]
        )
        self.post_mlp_norm = Gemma3nRMSNorm(hidden, eps)
        self.altup = AltUp(config)
        self.laurel = Laurel(config)
        self.per_layer_input_gate = torch.nn.Linear(hidden, g.hidden_size_per_layer_input, bias=False)
        self.per_layer_projection = torch.nn.Linear(g.hidden_size_per_layer_input, hidden, bias=False)
        self.post_per_layer_input_norm = Gemma3nRMSNorm(hidden, eps)
        self.act = activation(config.hidden_act)

    def forward(self, streams_ATH, per_layer_TP, rope_cos_sin, ctx: ForwardContext, shared_kv: dict):
        predictions_ATH = self.altup.predict(streams_ATH)
        active_TH = predictions_ATH[self.active]
        normed_TH = self.attn_norm(active_TH)
        laurel_TH = self.laurel(normed_TH)
        attn_TH = self.post_attn_norm(self.attn(normed_TH, rope_cos_sin, ctx.attention, shared_kv))
        x_TH = (active_TH + attn_TH + laurel_TH) / math.sqrt(2)
        x_TH = x_TH + self.post_mlp_norm(self.mlp(self.mlp_norm(x_TH)))
        corrected_ATH = self.altup.correct(predictions_ATH, x_TH)
        first_TH = corrected_ATH[self.active]
        if self.correct_scale:
            first_TH = self.altup.scale_corrected_output(first_TH)
        gated_TP = self.act(self.per_layer_input_gate(first_TH)) * per_layer_TP
        update_TH = self.post_per_layer_input_norm(self.per_layer_projection(gated_TP))
        rest = corrected_ATH[1:] + update_TH
        return torch.cat((corrected_ATH[:1], rest), dim=0)


class Gemma3nCausalLM(CausalLM):
    """:class:`CausalLM` with Gemma-3n's layers, per-layer embeddings and AltUp streams."""

    def __init__(self, config: ModelConfig, routing_hooks: RoutingHooks = NO_ROUTING_HOOKS):
        if config.gemma3n is None:
            raise ValueError("Gemma3nCausalLM needs ModelConfig.gemma3n")
        super().__init__(config, routing_hooks)
        g, hidden = config.gemma3n, config.hidden_size
        per_layer_width = config.num_layers * g.hidden_size_per_layer_input
        self.embed_tokens_per_layer = torch.nn.Embedding(g.vocab_size_per_layer_input, per_layer_width)
        self.per_layer_model_projection = torch.nn.Linear(hidden, per_layer_width, bias=False)
        self.per_layer_projection_norm = Gemma3nRMSNorm(g.hidden_size_per_layer_input, config.rms_norm_eps)
        self.altup_projections = torch.nn.ModuleList(
            torch.nn.Linear(hidden, hidden, bias=False) for _ in range(1, g.altup_num_inputs)
        )
        self.altup_unembed_projections = torch.nn.ModuleList(
            torch.nn.Linear(hidden, hidden, bias=False) for _ in range(1, g.altup_num_inputs)
        )
        self.norm = Gemma3nRMSNorm(hidden, config.rms_norm_eps)

    def build_layers(self, config: ModelConfig, routing_hooks: RoutingHooks) -> torch.nn.ModuleList:
        return torch.nn.ModuleList(Gemma3nDecoderLayer(config, i) for i in range(config.num_layers))

    def per_layer_inputs(self, input_ids_T: torch.Tensor, x_TH: torch.Tensor) -> torch.Tensor:
        """``[T, L, P]``: the per-layer token embeddings mixed with a projection of the embedding."""
        g, num_layers = self.config.gemma3n, self.config.num_layers
        ids = torch.where((input_ids_T >= 0) & (input_ids_T < g.vocab_size_per_layer_input), input_ids_T, 0)
        table = self.embed_tokens_per_layer
        token_TLP = table(ids) * torch.tensor(g.hidden_size_per_layer_input**0.5).to(table.weight.dtype)
        token_TLP = token_TLP.view(-1, num_layers, g.hidden_size_per_layer_input)
        projected = self.per_layer_model_projection(x_TH) * torch.tensor(self.config.hidden_size**-0.5).to(x_TH.dtype)
        projected_TLP = self.per_layer_projection_norm(projected.view(-1, num_layers, g.hidden_size_per_layer_input))
        return (projected_TLP + token_TLP) * torch.rsqrt(torch.tensor(2.0)).to(x_TH.dtype)

    @staticmethod
    def _rescaled(projections, streams, target_TH: torch.Tensor) -> list[torch.Tensor]:
        """Each projected stream rescaled to the RMS of ``target_TH``."""
        target = torch.mean(target_TH**2, dim=-1, keepdim=True) ** 0.5
        out = []
        for projection, stream in zip(projections, streams):
            p = projection(stream).to(target_TH.dtype)
            out.append(p * target / torch.sqrt(torch.mean(p**2, dim=-1, keepdim=True).clamp(min=1e-5)))
        return out

    def forward_hidden(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.batch_invariant:
            raise ValueError(TRUE_ON_POLICY_REFUSAL)
        x_TH = self.embed(input_ids_T)
        per_layer_TLP = self.per_layer_inputs(input_ids_T, x_TH)
        others = self._rescaled(self.altup_projections, [x_TH] * len(self.altup_projections), x_TH)
        streams_ATH = torch.stack([x_TH, *others], dim=0)
        tables = self._rope_tables(positions_T, x_TH.dtype)
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            args = (streams_ATH, per_layer_TLP[:, i], tables[id(self.config.rope_of(i))], ctx, shared_kv)
            streams_ATH = checkpoint(layer, *args, use_reentrant=False) if recompute else layer(*args)
        others = self._rescaled(self.altup_unembed_projections, list(streams_ATH[1:]), streams_ATH[0])
        return self.norm(torch.stack([streams_ATH[0], *others]).mean(dim=0))
