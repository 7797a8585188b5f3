"""Qwen3-Next / Qwen3.5 token mixers: Gated DeltaNet linear attention and gated full attention.

:class:`GatedDeltaNet` (layer type ``linear_attention``): one input projection gives
q/k/v (through a short causal convolution + SiLU), the output gate ``z``, the write
strength ``beta = sigmoid(b)`` and the log-decay ``g = -exp(A_log) * softplus(a + dt_bias)``;
the gated delta rule (:mod:`miles_host.kernels.gated_delta_rule`) mixes the tokens, a
gated RMSNorm (``norm(o) * silu(z)``) and ``out_proj`` finish. It keeps no KV cache:
across engine steps it carries a per-sequence conv state and delta-rule state, which
the forward's attention context provides as :class:`RecurrentStates` (the rollout
engine's); a training / prefill context (:class:`~miles_host.models.attention.PackedAttention`)
starts every sequence from zero states.

:class:`GatedAttention`: grouped-query attention whose ``q_proj`` also emits a per-head
output gate (``attn_out * sigmoid(gate)`` before ``o_proj``), with zero-centred q/k norms
and partial rotary from the config.

Tensor legend: T tokens, S sequences, H hidden, Hk key heads, Hv value heads, K key head
dim, V value head dim, C conv channels, W conv width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from miles_host.kernels.eager_ops import apply_rotary
from miles_host.kernels.gated_delta_rule import causal_conv, gated_delta_rule
from miles_host.models.self_attention import GQAAttention


@dataclass
class GatedDeltaNetConfig:
    """Dimensions of the Gated DeltaNet layers.

    ``grouped_projection``: the fused input projection's rows are grouped per key head
    (Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``: for each key head its q, k, the v and z
    of its value heads; then b and a per key head); otherwise they are flat
    (Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` stacked).
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int = 4
    grouped_projection: bool = False

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_key_heads})"
            )
        if self.conv_kernel_size < 2:
            raise ValueError(f"linear_conv_kernel_dim must be at least 2, got {self.conv_kernel_size}")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def projection_size(self) -> int:
        """Rows of the fused input projection: q, k, v, z, b, a."""
        return self.conv_dim + self.value_dim + 2 * self.num_value_heads

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Per-sequence ``(conv state [C, W - 1], delta-rule state [Hv, K, V])`` of one layer."""
        return (self.conv_dim, self.conv_kernel_size - 1), (self.num_value_heads, self.key_head_dim, self.value_head_dim)


#: why ``--true-on-policy`` is refused for models with Gated DeltaNet layers (validation and engine say it)
TRUE_ON_POLICY_REFUSAL = (
    "--true-on-policy (the batch-invariant engine) is not supported for models with Gated DeltaNet "
    "(linear attention) layers: training runs the chunked delta rule and rollout the per-token recurrence, "
    "whose float sums differ in order, so train and rollout log-probs cannot agree bit for bit; run without "
    "--true-on-policy (TIS/MIS correct the small mismatch)"
)


def true_on_policy_refusal(config) -> str | None:
    """The reason ``--true-on-policy`` cannot hold for a native model config, or None."""
    return TRUE_ON_POLICY_REFUSAL if "linear_attention" in config.layer_types else None


class RecurrentStates(Protocol):
    """The engine's per-sequence states of a forward's sequences (see the rollout engine).

    ``lengths``: new tokens of each sequence, in the forward's order. ``read`` returns the
    states the sequences continue from (zeros for a sequence that starts now);
    ``write`` stores their states after this forward.
    """

    lengths: Sequence[int]

    def read(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv [S, C, W - 1], delta rule [S, Hv, K, V])``."""
        ...

    def write(self, layer_index: int, conv_SCw: torch.Tensor, ssm_SHKV: torch.Tensor) -> None:
        """Store the sequences' states after this forward."""
        ...


def sequences_of(attention) -> tuple[Sequence[int], RecurrentStates | None]:
    """``(new tokens per sequence, recurrent states or None)`` of a forward's attention context."""
    states = getattr(attention, "recurrent_states", None)
    if states is not None:
        return states.lengths, states
    lengths = getattr(attention, "lengths", None)
    metadata = getattr(attention, "metadata", None)
    if lengths is None and metadata is not None and not metadata.is_decode:
        # a prefill outside the engine's state pool (the engine's start-up memory measurement)
        cu_seqlens = metadata.cu_seqlens_q_host
        lengths = [end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    if lengths is None:
        raise ValueError(
            f"Gated DeltaNet (linear attention) layers run over packed sequences (PackedAttention) or in the "
            f"rollout engine, which keeps their recurrent state; {type(attention).__name__} provides neither "
            "(batch-invariant --true-on-policy and the contiguous-cache reference decoder do not support these layers)"
        )
    return lengths, None


class GatedRMSNorm(torch.nn.Module):
    """``w * rmsnorm(x)`` (in x's dtype) times ``silu(gate)`` (float32), per value head."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(torch.nn.Module):
    """A ``linear_attention`` layer (same call signature as the attention blocks)."""

    def __init__(self, config, layer_index: int):
        super().__init__()
        linear: GatedDeltaNetConfig = config.linear_attention
        self.layer_index = layer_index
        self.linear = linear
        self.in_proj = torch.nn.Linear(config.hidden_size, linear.projection_size, bias=False)
        self.conv1d = torch.nn.Conv1d(
            linear.conv_dim, linear.conv_dim, linear.conv_kernel_size, groups=linear.conv_dim, bias=False
        )
        self.dt_bias = torch.nn.Parameter(torch.ones(linear.num_value_heads))
        self.A_log = torch.nn.Parameter(torch.zeros(linear.num_value_heads))
        self.norm = GatedRMSNorm(linear.value_head_dim, config.rms_norm_eps)
        self.out_proj = torch.nn.Linear(linear.value_dim, config.hidden_size, bias=False)

    def _split(self, proj_TP: torch.Tensor):
        """``(qkv [T, C], z [T, Hv, V], b [T, Hv], a [T, Hv])`` from the fused projection."""
        lin, num_tokens = self.linear, proj_TP.shape[0]
        if not lin.grouped_projection:
            qkv, z, b, a = proj_TP.split((lin.conv_dim, lin.value_dim, lin.num_value_heads, lin.num_value_heads), -1)
            return qkv, z.reshape(num_tokens, lin.num_value_heads, lin.value_head_dim), b, a
        group = lin.num_value_heads // lin.num_key_heads
        qkvz, ba = proj_TP.split((lin.conv_dim + lin.value_dim, 2 * lin.num_value_heads), dim=-1)
        sizes = (lin.key_head_dim, lin.key_head_dim, group * lin.value_head_dim, group * lin.value_head_dim)
        q, k, v, z = qkvz.reshape(num_tokens, lin.num_key_heads, sum(sizes)).split(sizes, dim=-1)
        b, a = ba.reshape(num_tokens, lin.num_key_heads, 2 * group).split((group, group), dim=-1)
        qkv = torch.cat([x.reshape(num_tokens, -1) for x in (q, k, v)], dim=-1)
        z = z.reshape(num_tokens, lin.num_value_heads, lin.value_head_dim)
        return qkv, z, b.reshape(num_tokens, -1), a.reshape(num_tokens, -1)

    def forward(self, x_TH: torch.Tensor, rope_cos_sin, attention) -> torch.Tensor:
        lin, num_tokens = self.linear, x_TH.shape[0]
        lengths, states = sequences_of(attention)
        conv_state = ssm_state = None
        if states is not None:
            conv_state, ssm_state = states.read(self.layer_index)
        qkv_TC, z_THV, b_TH, a_TH = self._split(self.in_proj(x_TH))
        qkv_TC, new_conv_state = causal_conv(qkv_TC, self.conv1d.weight[:, 0], lengths, conv_state)
        q, k, v = qkv_TC.split((lin.key_dim, lin.key_dim, lin.value_dim), dim=-1)
        group = lin.num_value_heads // lin.num_key_heads
        q_THK = q.reshape(num_tokens, lin.num_key_heads, lin.key_head_dim).repeat_interleave(group, dim=1)
        k_THK = k.reshape(num_tokens, lin.num_key_heads, lin.key_head_dim).repeat_interleave(group, dim=1)
        v_THV = v.reshape(num_tokens, lin.num_value_heads, lin.value_head_dim)
        beta_TH = torch.sigmoid(b_TH)
        g_TH = -self.A_log.float().exp() * F.softplus(a_TH.float() + self.dt_bias)
        o_THV, new_ssm_state = gated_delta_rule(q_THK, k_THK, v_THV, g_TH, beta_TH, lengths, ssm_state)
        if states is not None:
            states.write(self.layer_index, new_conv_state, new_ssm_state)
        y_THV = self.norm(o_THV.to(x_TH.dtype), z_THV)
        return self.out_proj(y_THV.reshape(num_tokens, lin.value_dim))

    def layout(self) -> tuple[int, int, int, int | None]:
        """No paged KV cache: ``(0, 0, 0, None)`` (the engine keeps :meth:`state_shapes` instead)."""
        return 0, 0, 0, None


class GatedAttention(GQAAttention):
    """GQA whose ``qkv_proj`` rows are ``[q and gate interleaved per head, k, v]`` (HF ``q_proj``
    of ``2 * head_dim`` rows per head); the attention output is scaled by ``sigmoid(gate)``."""

    def __init__(self, config, layer_index: int):
        super().__init__(config, layer_index)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = (2 * q_size, kv_size, kv_size)
        self.qkv_proj = torch.nn.Linear(config.hidden_size, 2 * q_size + 2 * kv_size, bias=config.qkv_bias)

    def forward(self, x_TH: torch.Tensor, rope_cos_sin, attention) -> torch.Tensor:
        num_tokens = x_TH.shape[0]
        qg, k, v = self.qkv_proj(x_TH).split(self.split_sizes, dim=-1)
        q_TND, gate_TND = qg.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q_TND = self.q_norm(q_TND)
        k_TND = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        cos, sin = rope_cos_sin
        q_TND = apply_rotary(q_TND, cos, sin, self.rope_interleaved)
        k_TND = apply_rotary(k_TND, cos, sin, self.rope_interleaved)
        y_TND = attention.attend(
            self.layer_index, q_TND, k_TND, v.view(num_tokens, self.num_kv_heads, self.head_dim),
            scale=self.scale, sliding_window=self.sliding_window, logit_softcap=self.logit_softcap,
        )
        y_TND = y_TND * torch.sigmoid(gate_TND)
        return self.o_proj(y_TND.reshape(num_tokens, -1))

    def forward_fused(self, x_TH: torch.Tensor, rope_cos_sin, attention) -> torch.Tensor:
        """The eager forward (the fused q/k-norm + rotary kernel does not know the gate)."""
        return self.forward(x_TH, rope_cos_sin, attention)


def token_mixer_for(config, layer_index: int) -> torch.nn.Module | None:
    """The Gated DeltaNet or gated-attention mixer of a layer, or None for the plain blocks."""
    if layer_index < config.num_layers and config.layer_types[layer_index] == "linear_attention":
        return GatedDeltaNet(config, layer_index)
    if getattr(config, "attn_output_gate", False):
        return GatedAttention(config, layer_index)
    return None


def linear_attention_layers(model: torch.nn.Module) -> dict[int, GatedDeltaNetConfig]:
    """``{layer index: its config}`` of a model's Gated DeltaNet layers (empty for other models)."""
    return {
        module.layer_index: module.linear for module in model.modules() if isinstance(module, GatedDeltaNet)
    }
