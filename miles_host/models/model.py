"""The decoder-only causal LM shared by the trainer and the rollout engine.

Every forward is over the flattened tokens of a batch (``T`` tokens, all
sequences concatenated) plus their positions; the
:class:`~miles_host.models.context.ForwardContext` says how attention sees the
sequences (packed training/prefill, or a KV cache) and carries the routing
context. Tensor legend: B batch, L padded length, T tokens, H hidden, V vocab.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from miles_host.models import batch_invariant, invariant_gpu
from miles_host.models.attention import PackedAttention
from miles_host.models.attention_variants import gqa_block, rotary_module
from miles_host.models.config import ModelConfig
from miles_host.models.context import ForwardContext
from miles_host.models.dsa import DSAttention
from miles_host.models.gated_deltanet import token_mixer_for
from miles_host.models.logprobs import chunked_log_probs, compute_logits
from miles_host.models.mlp import Experts, GatedMLP, MoE, Router
from miles_host.models.moe_variants import VariantExperts, moe_block
from miles_host.models.norm import RMSNorm
from miles_host.models.rope import RotaryEmbedding
from miles_host.models.self_attention import GQAAttention, MLAttention
from miles_host.routing import NO_ROUTING_HOOKS, RoutingHooks


class DecoderLayer(torch.nn.Module):
    """Pre-norm attention + MLP/MoE, with optional sandwich norms on both outputs."""

    def __init__(self, config: ModelConfig, layer_index: int, routing_hooks: RoutingHooks, moe: bool):
        super().__init__()
        eps, offset = config.rms_norm_eps, config.norm_unit_offset
        self.layer_index = layer_index
        self.attn_norm = RMSNorm(config.hidden_size, eps, offset)
        self.attn = token_mixer_for(config, layer_index) or (
            MLAttention(config, layer_index) if config.mla is not None else gqa_block(config, layer_index)
        ) if config.dsa is None else DSAttention(config, layer_index)
        self.mlp_norm = RMSNorm(config.hidden_size, eps, offset)
        if moe:
            self.mlp = moe_block(config.hidden_size, config.moe, config.hidden_act, layer_index, routing_hooks)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
        self.post_attn_norm = RMSNorm(config.hidden_size, eps, offset) if config.sandwich_norm else None
        self.post_mlp_norm = RMSNorm(config.hidden_size, eps, offset) if config.sandwich_norm else None

    def forward(self, x_TH: torch.Tensor, rope_cos_sin, ctx: ForwardContext) -> torch.Tensor:
        h_TH = self.attn(self.attn_norm(x_TH), rope_cos_sin, ctx.attention)
        if self.post_attn_norm is not None:
            h_TH = self.post_attn_norm(h_TH)
        x_TH = x_TH + h_TH
        h_TH = self.mlp_norm(x_TH)
        h_TH = self.mlp(h_TH, ctx.routing) if isinstance(self.mlp, MoE) else self.mlp(h_TH)
        if self.post_mlp_norm is not None:
            h_TH = self.post_mlp_norm(h_TH)
        return x_TH + h_TH

    def forward_fused(
        self, h_TH: torch.Tensor, residual_TH: torch.Tensor | None, rope_cos_sin, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inference form of :meth:`forward` over the residual stream (``ctx.fused_kernels``).

        Takes the previous layer's output ``h`` and the residual it has not added
        yet (None before the first layer: ``h`` is the embedding); returns the
        same pair. The residual add is fused into each norm; numerics are the
        eager forward's up to the norms' reduction order.
        """
        from miles_host.kernels.rmsnorm import rmsnorm

        norm = self.attn_norm
        x_TH, residual_TH = rmsnorm(h_TH, norm.weight, norm.eps, norm.unit_offset, residual_TH)
        if residual_TH is None:
            residual_TH = h_TH
        if isinstance(self.attn, GQAAttention):
            h_TH = self.attn.forward_fused(x_TH, rope_cos_sin, ctx.attention)
        else:
            h_TH = self.attn(x_TH, rope_cos_sin, ctx.attention)
        if self.post_attn_norm is not None:
            h_TH = self.post_attn_norm(h_TH)
        norm = self.mlp_norm
        x_TH, residual_TH = rmsnorm(h_TH, norm.weight, norm.eps, norm.unit_offset, residual_TH)
        if isinstance(self.mlp, MoE):
            h_TH = self.mlp(x_TH, ctx.routing)
        elif isinstance(self.mlp, GatedMLP):
            h_TH = self.mlp.forward_fused(x_TH)
        else:
            h_TH = self.mlp(x_TH)
        if self.post_mlp_norm is not None:
            h_TH = self.post_mlp_norm(h_TH)
        return h_TH, residual_TH


class MTPLayer(DecoderLayer):
    """A DeepSeek multi-token-prediction layer (weights load and save; no forward yet).

    ``eh_proj(cat(enorm(embed(next_tokens)), hnorm(hidden)))`` feeds a decoder
    layer whose output goes through ``head_norm`` and the shared lm head.
    """

    def __init__(self, config: ModelConfig, layer_index: int, routing_hooks: RoutingHooks):
        super().__init__(config, layer_index, routing_hooks, moe=config.moe is not None)
        eps, offset = config.rms_norm_eps, config.norm_unit_offset
        self.enorm = RMSNorm(config.hidden_size, eps, offset)
        self.hnorm = RMSNorm(config.hidden_size, eps, offset)
        self.eh_proj = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.head_norm = RMSNorm(config.hidden_size, eps, offset)
        self.embed_tokens = self.head = None  # the policy's (Qwen3-Next), else private copies (DeepSeek)
        if not config.mtp_shared_embeddings:
            self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
            self.head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def fresh(cls, config: ModelConfig, layer_index: int, routing_hooks: RoutingHooks) -> "MTPLayer":
        """A layer no checkpoint fills (an online-trained draft): no private embedding/head
        copies (the policy's are shared), every weight initialised (``torch.nn.Linear``'s
        default; the MoE router and experts are otherwise allocated uninitialised)."""
        layer = cls(config, layer_index, routing_hooks)
        layer.embed_tokens = layer.head = None
        for module in layer.modules():
            if isinstance(module, (Router, Experts, VariantExperts)):
                module.reset_parameters()
        return layer


class CausalLM(torch.nn.Module):
    """One implementation for training (packed log-probs) and rollout (KV-cache steps)."""

    def __init__(self, config: ModelConfig, routing_hooks: RoutingHooks = NO_ROUTING_HOOKS):
        super().__init__()
        self.config = config
        self.routing_hooks = routing_hooks
        #: recompute each layer in backward (activation checkpointing) when training
        self.gradient_checkpointing = False
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = self.build_layers(config, routing_hooks)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = torch.nn.ModuleList(
            MTPLayer(config, config.num_layers + j, routing_hooks) for j in range(config.num_mtp_layers)
        )
        self._ropes: dict[int, RotaryEmbedding] = {}
        for layer_index in range(config.num_layers):
            rope = config.rope_of(layer_index)
            self._ropes.setdefault(id(rope), rotary_module(rope))

    def build_layers(self, config: ModelConfig, routing_hooks: RoutingHooks) -> torch.nn.ModuleList:
        """The decoder layers (a model class with other layers overrides this)."""
        return torch.nn.ModuleList(
            DecoderLayer(config, i, routing_hooks, config.moe_layers[i]) for i in range(config.num_layers)
        )

    # -- weights ---------------------------------------------------------------

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[V, H]`` output projection (the embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def rotary_embedding(self, rope: Any) -> RotaryEmbedding | None:
        """The rotary table this model keeps for the rope config ``rope`` (one per distinct
        config, shared by its layers); ``None`` when no layer uses it."""
        return self._ropes.get(id(rope))

    def attention_layout(self, latent_mla: bool = False) -> list[tuple[int, int, int, int | None]]:
        """Per layer ``(num_kv_heads, k_head_dim, v_head_dim, sliding_window or None)``, then the
        extra paged-cache entries of blocks that keep some (DSA's indexer keys), in layer order.
        ``latent_mla``: MLA layers that can are cached as latents (:meth:`MLAttention.layout`)."""
        layout = [
            layer.attn.layout(latent=True) if latent_mla and getattr(layer.attn, "can_cache_latents", bool)()
            else layer.attn.layout()
            for layer in self.layers
        ]
        return layout + [entry for layer in self.layers for entry in getattr(layer.attn, "extra_cache_layouts", list)()]

    # -- forward ---------------------------------------------------------------

    def cache_rotary_tables(self, max_positions: int, device: torch.device) -> None:
        """Keep every rotary module's rows of positions below ``max_positions`` on ``device`` in the
        model's dtype (:meth:`RotaryEmbedding.cache_table`: what CUDA-graph captures look up)."""
        dtype = self.embed_tokens.weight.dtype
        for rope in self._ropes.values():
            if isinstance(rope, RotaryEmbedding):
                rope.cache_table(max_positions, device, dtype)

    def _rope_tables(self, positions_T: torch.Tensor, dtype: torch.dtype) -> dict[int, tuple]:
        return {key: rope(positions_T, dtype) for key, rope in self._ropes.items()}

    def embed(self, input_ids_T: torch.Tensor) -> torch.Tensor:
        """Token embeddings (times the family's embedding scale, in the weight dtype)."""
        x_TH = self.embed_tokens(input_ids_T)
        if self.config.embed_scale is not None:
            x_TH = x_TH * torch.tensor(self.config.embed_scale, dtype=x_TH.dtype)
        return x_TH

    def forward_hidden(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Final-norm hidden states ``[T, H]`` of the flattened batch.

        ``ctx.batch_invariant``: on CPU one token at a time (:mod:`miles_host.models.batch_invariant`),
        on CUDA the whole batch with batch-invariant kernels (:mod:`miles_host.models.invariant_gpu`).
        """
        if ctx.batch_invariant:
            if input_ids_T.is_cuda:
                return invariant_gpu.forward_hidden(self, input_ids_T, positions_T, ctx)
            return batch_invariant.forward_hidden(self, input_ids_T, positions_T, ctx)
        x_TH = self.embed(input_ids_T)
        tables = self._rope_tables(positions_T, x_TH.dtype)
        if ctx.fused_kernels:
            return self._forward_hidden_fused(x_TH, tables, ctx)
        for i, layer in enumerate(self.layers):
            cos_sin = tables[id(self.config.rope_of(i))]
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x_TH = checkpoint(layer, x_TH, cos_sin, ctx, use_reentrant=False)
            else:
                x_TH = layer(x_TH, cos_sin, ctx)
        return self.norm(x_TH)

    def _forward_hidden_fused(self, x_TH: torch.Tensor, tables: dict, ctx: ForwardContext) -> torch.Tensor:
        from miles_host.kernels.rmsnorm import rmsnorm

        h_TH, residual_TH = x_TH, None
        for i, layer in enumerate(self.layers):
            h_TH, residual_TH = layer.forward_fused(h_TH, residual_TH, tables[id(self.config.rope_of(i))], ctx)
        if residual_TH is None:  # no layers
            return self.norm(h_TH)
        return rmsnorm(h_TH, self.norm.weight, self.norm.eps, self.norm.unit_offset, residual_TH)[0]

    def compute_logits(self, hidden_TH: torch.Tensor, matmul=F.linear) -> torch.Tensor:
        """``[T, V]`` logits in the model dtype (final soft-capping applied); ``matmul(x, w)``: ``x @ w^T``."""
        return compute_logits(hidden_TH, self.lm_head_weight, self.config.final_logit_softcap, matmul)

    def packed_log_probs(
        self,
        input_ids_T: torch.Tensor,
        positions_T: torch.Tensor,
        cu_seqlens: torch.Tensor,
        target_ids_T: torch.Tensor,
        temperature: float = 1.0,
        ctx: ForwardContext | None = None,
        chunk_size: int = 1024,
        return_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Training forward over packed sequences: float32 log-probs of the targets.

        ``cu_seqlens`` (int32 ``[S + 1]``) delimits the sequences; ``target_ids_T``
        is usually the next token of each position. Logits are computed
        ``chunk_size`` tokens at a time, forward and backward. With
        ``ctx.batch_invariant`` every token is computed on its own and its log-prob
        by :func:`~miles_host.models.batch_invariant.log_softmax_row`, as the engine does.
        """
        if ctx is None:
            ctx = ForwardContext(attention=PackedAttention(cu_seqlens))
        hidden_TH = self.forward_hidden(input_ids_T, positions_T, ctx)
        if ctx.batch_invariant:
            return batch_invariant.token_log_probs(
                hidden_TH, self.lm_head_weight, target_ids_T, temperature=temperature,
                logit_softcap=self.config.final_logit_softcap, return_entropy=return_entropy,
            )
        return chunked_log_probs(
            hidden_TH, self.lm_head_weight, target_ids_T,
            temperature=temperature, logit_softcap=self.config.final_logit_softcap,
            chunk_size=chunk_size, return_entropy=return_entropy,
        )

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Convenience ``[B, L] -> [B, L, V]`` logits; padding (left or right) is packed away.

        Positions restart at 0 at each sequence's first real token; logits at
        padded positions are zero.
        """
        batch, length = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        mask_BL = attention_mask.bool()
        lengths = mask_BL.sum(dim=1)
        keep = lengths > 0
        flat_index = mask_BL.reshape(-1).nonzero().squeeze(1)
        input_ids_T = input_ids.reshape(-1)[flat_index]
        positions_T = (mask_BL.long().cumsum(dim=1) - 1).reshape(-1)[flat_index]
        cu_seqlens = F.pad(lengths[keep].cumsum(0), (1, 0)).to(torch.int32)
        ctx = ForwardContext(attention=PackedAttention(cu_seqlens))
        logits_TV = self.compute_logits(self.forward_hidden(input_ids_T, positions_T, ctx))
        out = logits_TV.new_zeros(batch * length, logits_TV.shape[-1])
        out[flat_index] = logits_TV
        return out.view(batch, length, -1)
