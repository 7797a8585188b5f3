"""Self-attention blocks: grouped-query attention and DeepSeek's latent attention.

Both compute queries/keys/values for the flattened tokens of a batch, apply
rotary embeddings and hand them to the forward's
:class:`~miles_host.models.context.AttentionContext`, which decides causality,
packing and caching. Tensor legend: T tokens, H hidden, N heads, D head dim.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from miles_host.models.config import ModelConfig
from miles_host.models.context import AttentionContext
from miles_host.models.norm import RMSNorm
from miles_host.kernels import switches
from miles_host.kernels.eager_ops import apply_rotary
from miles_host.kernels.rmsnorm import rmsnorm
from miles_host.kernels.rotary import qk_norm_rope
from miles_host.kernels.small_m_gemm import decode_linear
from miles_host.models.rope import yarn_softmax_scale_factor

#: ``--mla-kv-cache``: whether the engine caches MLA layers as latents (see :class:`MLAttention`)
LATENT_CACHE = switches.declare_host("mla_kv_cache")
#: ``--mla-prefill``: a prefill step over latents ``expanded`` (per head, the default) or ``absorbed`` (the latent
#: kernel). On an H100, DeepSeek-V3's shape cut to 2 layers, 2 prompts: expanded 1.13x absorbed at 1,024 tokens,
#: 1.97x at 8,192 (``bench/moe.py --prefill-switch mla_prefill=absorbed,expanded``, bench/RESULTS.md)
LATENT_PREFILL = switches.declare_host("mla_prefill")
#: most context tokens an expanded prefill expands at once: its per-head keys and values are a transient of
#: ``heads x (k + v widths)`` values per token (DeepSeek-V3: 80 KB in bf16, 1.3 GB at this bound). A step's
#: sequences are attended in groups of at most this many context tokens, a longer context in parts of at most
#: this many keys merged by their log-sum-exps
EXPANDED_PREFILL_MAX_CONTEXT = 16384
#: weight dtypes the absorbed queries and outputs multiply by
ABSORBABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _norm(norm: RMSNorm, x_TC: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` in one launch on CUDA (:func:`~miles_host.kernels.rmsnorm.rmsnorm`), the eager math elsewhere."""
    return rmsnorm(x_TC, norm.weight, norm.eps, norm.unit_offset)[0]


@runtime_checkable
class DequantizableLinear(Protocol):
    """A quantized linear whose weight the latent path can read in float.

    A quantized ``kv_b_proj`` (FP8 blocks, INT4 groups) is dequantized once per weight
    version into the layer's absorbed copy (SGLang dequantizes ``W_UK`` / ``W_UV`` at load);
    ``can_dequantize`` is False where the module holds only a kernel layout."""

    can_dequantize: bool

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[out, in]`` as ``dtype``: what the module's own GEMM multiplies by."""
        ...


def engine_caches_latents(batch_invariant: bool) -> bool:
    """Whether an engine caches its MLA layers as latents: ``--mla-kv-cache latent`` outside
    ``--true-on-policy`` (whose rollout must compute what training computes, per head)."""
    return switches.value(LATENT_CACHE) == "latent" and not batch_invariant


class GQAAttention(torch.nn.Module):
    """Grouped-query attention with fused ``qkv_proj``, optional q/k norm and qkv bias."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = torch.nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = torch.nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.norm_unit_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.norm_unit_offset)
        elif config.qk_norm == "full":
            self.q_norm = RMSNorm(q_size, config.rms_norm_eps, config.norm_unit_offset)
            self.k_norm = RMSNorm(kv_size, config.rms_norm_eps, config.norm_unit_offset)
        self.rope_interleaved = config.rope_of(layer_index).interleaved
        self.scale = config.attn_scale if config.attn_scale is not None else self.head_dim**-0.5
        self.sliding_window = config.sliding_window_of(layer_index)
        self.logit_softcap = config.attn_logit_softcap

    def project_qkv(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [T, Nq, D]``, ``k``, ``v [T, Nkv, D]`` of the tokens, q/k norms applied (no rotary yet)."""
        num_tokens = x_TH.shape[0]
        q, k, v = self.qkv_proj(x_TH).split(self.split_sizes, dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q_TND = q.view(num_tokens, self.num_heads, self.head_dim)
        k_TND = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v_TND = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q_TND, k_TND = self.q_norm(q_TND), self.k_norm(k_TND)
        return q_TND, k_TND, v_TND

    def forward(self, x_TH: torch.Tensor, rope_cos_sin: tuple[torch.Tensor, torch.Tensor], attention: AttentionContext):
        num_tokens = x_TH.shape[0]
        q_TND, k_TND, v_TND = self.project_qkv(x_TH)
        cos, sin = rope_cos_sin
        q_TND = apply_rotary(q_TND, cos, sin, self.rope_interleaved)
        k_TND = apply_rotary(k_TND, cos, sin, self.rope_interleaved)
        y_TND = attention.attend(
            self.layer_index, q_TND, k_TND, v_TND,
            scale=self.scale, sliding_window=self.sliding_window, logit_softcap=self.logit_softcap,
        )
        return self.o_proj(y_TND.reshape(num_tokens, -1))

    def forward_fused(self, x_TH: torch.Tensor, rope_cos_sin, attention: AttentionContext) -> torch.Tensor:
        """Inference forward with q/k norm and rotary in one kernel (:mod:`miles_host.kernels.rotary`),
        the projections of a few tokens by the small-M GEMM (:mod:`miles_host.kernels.small_m_gemm`).

        Where the attention context keeps a paged cache (``kv_cache_store``: the engine's), the
        same kernel stores the step's keys and values in it, and ``attend`` only reads."""
        from miles_host.kernels.rotary import qk_norm_rope, qk_norm_rope_into_cache

        num_tokens = x_TH.shape[0]
        q, k, v = decode_linear(self.qkv_proj, x_TH).split(self.split_sizes, dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        head_norm = self.qk_norm == "head"
        cos, sin = rope_cos_sin
        norm = dict(
            q_weight=self.q_norm.weight if head_norm else None,
            k_weight=self.k_norm.weight if head_norm else None,
            eps=self.q_norm.eps if head_norm else 0.0,
            unit_offset=self.q_norm.unit_offset if head_norm else False,
            interleaved=self.rope_interleaved,
        )
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        options = dict(scale=self.scale, sliding_window=self.sliding_window, logit_softcap=self.logit_softcap)
        store = getattr(attention, "kv_cache_store", None)
        if store is not None:
            q_TND = qk_norm_rope_into_cache(q, k, v, *heads, cos, sin, *store(self.layer_index), **norm)
            y_TND = attention.attend(self.layer_index, q_TND, None, None, kv_stored=True, **options)
        else:
            q_TND, k_TND = qk_norm_rope(q, k, *heads, cos, sin, **norm)
            y_TND = attention.attend(self.layer_index, q_TND, k_TND, v.view(num_tokens, *heads[1:]), **options)
        return decode_linear(self.o_proj, y_TND.reshape(num_tokens, -1))

    def layout(self) -> tuple[int, int, int, int | None]:
        """``(num_kv_heads, k_head_dim, v_head_dim, sliding_window)`` for cache sizing."""
        return self.num_kv_heads, self.head_dim, self.head_dim, self.sliding_window


class MLAttention(torch.nn.Module):
    """DeepSeek multi-head latent attention.

    Queries come from ``q_proj`` or the low-rank ``q_a_proj -> q_a_norm -> q_b_proj``;
    keys and values from the compressed ``kv_a_proj`` (latent + shared rotary key)
    expanded by ``kv_b_proj``.

    In an attention context whose cache keeps this layer as latents (the engine's, see
    :meth:`layout`), nothing is expanded: the cache row of a token is its normalized latent
    and rotated rope key, each head's query is absorbed into the latent space
    (``q_nope @ W_UK``, ``W_UK`` the head's key rows of ``kv_b_proj``), attention is
    multi-query over the latents (``attend_latent``), and each head's output is mapped back by
    its value rows ``W_UV``. The same attention in another order of the same products: the
    scores ``(q_nope W_UK) . c`` are ``q_nope . (W_UK c)``, the outputs ``W_UV (sum p c)`` are
    ``sum p (W_UV c)``.

    A quantized ``kv_b_proj`` (:class:`DequantizableLinear`) is read through ``absorbed_kv_b``,
    its float copy, made at the first latent forward and refreshed in place after each weight
    update (:meth:`miles_weights_updated`; captured CUDA graphs keep reading its address).
    """

    #: children whose weights the latent path reads in float: quantization plugins keep them
    #: in a dequantizable form (see :class:`DequantizableLinear`)
    absorbed_weight_names = ("kv_b_proj",)

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.mla = mla
        bias = config.qkv_bias
        if mla.q_lora_rank is None:
            self.q_proj = torch.nn.Linear(config.hidden_size, self.num_heads * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = torch.nn.Linear(config.hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = torch.nn.Linear(mla.q_lora_rank, self.num_heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj = torch.nn.Linear(config.hidden_size, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_norm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.kv_b_proj = torch.nn.Linear(
            mla.kv_lora_rank, self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = torch.nn.Linear(self.num_heads * mla.v_head_dim, config.hidden_size, bias=config.o_bias)
        rope = config.rope_of(layer_index)
        self.rope_interleaved = rope.interleaved
        self.scale = mla.qk_head_dim**-0.5 * yarn_softmax_scale_factor(rope)
        self.sliding_window = config.sliding_window_of(layer_index)
        self.logit_softcap = config.attn_logit_softcap
        self.register_buffer("absorbed_kv_b", None, persistent=False)

    def forward(self, x_TH: torch.Tensor, rope_cos_sin: tuple[torch.Tensor, torch.Tensor], attention: AttentionContext):
        latent_layer = getattr(attention, "latent_layer", None)
        if latent_layer is not None and latent_layer(self.layer_index):
            return self.forward_latent(x_TH, rope_cos_sin, attention)
        q_TND, k_TND, v_TND = self.project_qkv(x_TH, rope_cos_sin)
        y_TND = attention.attend(
            self.layer_index, q_TND, k_TND, v_TND.contiguous(),
            scale=self.scale, sliding_window=self.sliding_window, logit_softcap=self.logit_softcap,
        )
        return decode_linear(self.o_proj, y_TND.reshape(x_TH.shape[0], -1))

    def project_qkv(
        self, x_TH: torch.Tensor, rope_cos_sin: tuple[torch.Tensor, torch.Tensor], q_latent_TR: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated per-head ``(q, k, v)``; ``q_latent_TR``: ``q_a_norm(q_a_proj(x))`` when the caller has it."""
        mla, num_tokens, num_heads = self.mla, x_TH.shape[0], self.num_heads
        if mla.q_lora_rank is None:
            q = self.q_proj(x_TH)
        else:
            if q_latent_TR is None:
                q_latent_TR = self.q_a_norm(self.q_a_proj(x_TH))
            q = self.q_b_proj(q_latent_TR)
        q_nope, q_rot = q.view(num_tokens, num_heads, mla.qk_head_dim).split(
            (mla.qk_nope_head_dim, mla.qk_rope_head_dim), dim=-1
        )
        kv_latent, k_rot = self.kv_a_proj(x_TH).split((mla.kv_lora_rank, mla.qk_rope_head_dim), dim=-1)
        cos, sin = rope_cos_sin
        q_rot = apply_rotary(q_rot, cos, sin, self.rope_interleaved)
        k_rot = apply_rotary(k_rot.view(num_tokens, 1, mla.qk_rope_head_dim), cos, sin, self.rope_interleaved)
        kv = self.kv_b_proj(self.kv_a_norm(kv_latent)).view(num_tokens, num_heads, -1)
        k_nope, v_TND = kv.split((mla.qk_nope_head_dim, mla.v_head_dim), dim=-1)
        q_TND = torch.cat((q_nope, q_rot), dim=-1)
        k_TND = torch.cat((k_nope, k_rot.expand(num_tokens, num_heads, mla.qk_rope_head_dim)), dim=-1)
        return q_TND, k_TND, v_TND

    def forward_latent(self, x_TH: torch.Tensor, rope_cos_sin, attention: AttentionContext) -> torch.Tensor:
        """The forward over a latent cache (see the class docstring). Its norms and rotary are one
        launch each on CUDA (the fused RMSNorm, the fused q/k rotary), the eager math elsewhere."""
        mla, num_tokens, num_heads = self.mla, x_TH.shape[0], self.num_heads
        if mla.q_lora_rank is None:
            q = decode_linear(self.q_proj, x_TH)
        else:
            q = decode_linear(self.q_b_proj, _norm(self.q_a_norm, decode_linear(self.q_a_proj, x_TH)))
        q_nope, q_rot = q.view(num_tokens, num_heads, mla.qk_head_dim).split(
            (mla.qk_nope_head_dim, mla.qk_rope_head_dim), dim=-1
        )
        kv_latent, k_rot = decode_linear(self.kv_a_proj, x_TH).split((mla.kv_lora_rank, mla.qk_rope_head_dim), dim=-1)
        cos, sin = rope_cos_sin
        q_rot, k_rot = qk_norm_rope(  # one launch on CUDA for the queries' and the shared key's rotary
            q_rot.reshape(num_tokens, -1), k_rot, num_heads, 1, mla.qk_rope_head_dim, cos, sin,
            interleaved=self.rope_interleaved,
        )
        if self._prefills_expanded(attention):
            q_TND = torch.cat((q_nope, q_rot.to(q_nope.dtype)), dim=-1)
            y_TNV = attention.attend_latent_expanded(
                self.layer_index, q_TND, _norm(self.kv_a_norm, kv_latent), k_rot[:, 0],
                lambda latent_CR: self._expand_latents(latent_CR.to(q_nope.dtype)), scale=self.scale,
                max_group_context=EXPANDED_PREFILL_MAX_CONTEXT,
            )
            return decode_linear(self.o_proj, y_TNV.reshape(num_tokens, -1).to(x_TH.dtype))
        w_uk_NDR, w_uv_NVR = self.absorbed_weights(q_nope.dtype)
        q_latent_TNR = torch.bmm(q_nope.transpose(0, 1), w_uk_NDR).transpose(0, 1)
        y_TNR = attention.attend_latent(
            self.layer_index, q_latent_TNR, q_rot, _norm(self.kv_a_norm, kv_latent), k_rot[:, 0], scale=self.scale,
        )
        y_TNV = torch.bmm(y_TNR.transpose(0, 1).to(w_uv_NVR.dtype), w_uv_NVR.transpose(1, 2)).transpose(0, 1)
        return decode_linear(self.o_proj, y_TNV.reshape(num_tokens, -1))

    @staticmethod
    def _prefills_expanded(attention: AttentionContext) -> bool:
        """Whether this step runs as multi-head attention over expanded latents (``--mla-prefill
        expanded``, a prefill step, a context that can)."""
        meta = getattr(attention, "metadata", None)
        return (switches.value(LATENT_PREFILL) == "expanded" and meta is not None and not meta.is_decode
                and hasattr(attention, "attend_latent_expanded") and bool(meta.context_lens_host))

    def _expand_latents(self, latent_CR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_nope [C, N, Dn], v [C, N, Dv])`` of normalized latents: ``kv_b_proj``, as :meth:`project_qkv`."""
        mla = self.mla
        kv = self.kv_b_proj(latent_CR).view(latent_CR.shape[0], self.num_heads, -1)
        return kv.split((mla.qk_nope_head_dim, mla.v_head_dim), dim=-1)

    def absorbed_weights(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK [N, Dnope, R], W_UV [N, Dv, R])``: views of ``kv_b_proj``'s rows per head (of its
        dequantized copy, as ``dtype``, when it is quantized)."""
        mla = self.mla
        weight = self._kv_b_weight(dtype)
        weight = weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return weight[:, : mla.qk_nope_head_dim], weight[:, mla.qk_nope_head_dim :]

    def _kv_b_weight(self, dtype: torch.dtype | None) -> torch.Tensor:
        if not isinstance(self.kv_b_proj, DequantizableLinear):
            return self.kv_b_proj.weight
        if self.absorbed_kv_b is None or (dtype is not None and self.absorbed_kv_b.dtype != dtype):
            if dtype is None:
                raise ValueError("absorbed_weights of a quantized kv_b_proj needs the dtype of the queries")
            with torch.no_grad():
                self.absorbed_kv_b = self.kv_b_proj.dequantized_weight(dtype).contiguous()
        return self.absorbed_kv_b

    @torch.no_grad()
    def miles_weights_updated(self) -> None:
        """After a weight update: the absorbed copy of a quantized ``kv_b_proj`` follows, in place."""
        if self.absorbed_kv_b is not None:
            self.absorbed_kv_b.copy_(self.kv_b_proj.dequantized_weight(self.absorbed_kv_b.dtype))

    def can_cache_latents(self) -> bool:
        """Whether this layer can run over a latent cache: a float ``kv_b_proj`` (plain, not adapted)
        or a dequantizable quantized one, and neither a sliding window nor soft-capping (the latent
        kernel has neither)."""
        kv_b = self.kv_b_proj
        if isinstance(kv_b, DequantizableLinear):
            absorbable = kv_b.can_dequantize
        else:
            absorbable = type(kv_b) is torch.nn.Linear and kv_b.weight.dtype in ABSORBABLE_DTYPES
        return absorbable and self.sliding_window is None and self.logit_softcap is None

    def layout(self, latent: bool = False) -> tuple[int, int, int, int | None]:
        """``(num_kv_heads, k_head_dim, v_head_dim, sliding_window)`` for cache sizing: keys and values
        per head, or with ``latent`` (and :meth:`can_cache_latents`) one row of ``kv_lora_rank +
        qk_rope_head_dim`` per token and no values."""
        if latent and self.can_cache_latents():
            return 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim, 0, self.sliding_window
        return self.num_heads, self.mla.qk_head_dim, self.mla.v_head_dim, self.sliding_window
