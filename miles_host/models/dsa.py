"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): MLA whose queries attend only to the
``index_topk`` keys a lightning indexer picks for them.

The indexer (transformers' ``DeepseekV32Indexer``) projects the q latent to ``I`` small
query heads (``wq_b``) and the hidden state to one key (``wk`` + LayerNorm ``k_norm``), both
rotated with half-split rotary on their first ``qk_rope_head_dim`` dims (the MLA heads use
the interleaved one), and per-head weights (``weights_proj``, float32). A query's score of a
causal key is ``sum_i w_i * I**-0.5 * relu(D**-0.5 * q_i . k)``; it keeps the top
``index_topk`` keys (all of them while its context is shorter) and attends to those in MLA.
The indexer is computed without gradients (its weights do not train from the LM loss), as
in transformers.

How attention sees the keys depends on the forward's attention context, through
:data:`DSA_CONTEXTS` (context type -> function): packed training/prefill sequences
(:class:`~miles_host.models.attention.PackedAttention`: per sequence, the selection as a
mask of a dense attention) and the engine's paged cache
(:class:`~miles_host.rollout.attention.PagedAttention`: the indexer keys live in the same
paged cache as extra entries after the layers' own, see :meth:`DSAttention.extra_cache_layouts`,
and the scores and sparse attention run in :mod:`miles_host.kernels.dsa`). The batch-invariant
contexts of ``--true-on-policy`` are refused (:data:`TRUE_ON_POLICY_REFUSAL`): the top-k
selection is not implemented there.

Tensor legend: T tokens, H hidden, N attention heads, I indexer heads, D head dim,
Q queries of one sequence, L keys of one sequence.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from miles_host.kernels import dsa as dsa_kernels
from miles_host.kernels.eager_ops import apply_rotary
from miles_host.kernels.small_m_gemm import decode_linear
from miles_host.models import batch_invariant, invariant_gpu
from miles_host.models.attention import PackedAttention
from miles_host.models.config import ModelConfig
from miles_host.models.self_attention import MLAttention

#: float32 elements of the ``[Q, I, L]`` per-head indexer scores a packed sequence holds at once
INDEX_SCORE_ELEMENTS = 2**26


class Indexer(torch.nn.Module):
    """The lightning indexer of one layer (weights named as in transformers' checkpoints)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        dsa, mla = config.dsa, config.mla
        self.num_heads, self.head_dim, self.topk = dsa.index_n_heads, dsa.index_head_dim, dsa.index_topk
        self.wq_b = torch.nn.Linear(mla.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = torch.nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = torch.nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = torch.nn.Linear(config.hidden_size, self.num_heads, bias=False)
        self.weights_proj.keep_fp32_weight = True  # float32 in every model dtype, as transformers keeps it
        self.scale = self.head_dim**-0.5

    @torch.no_grad()
    def project(self, x_TH: torch.Tensor, q_latent_TR: torch.Tensor, rope_cos_sin) -> tuple[torch.Tensor, ...]:
        """``(q_TID, k_TD, w_TI)``: rotated indexer queries and keys, float32 head weights."""
        num_tokens = x_TH.shape[0]
        cos, sin = rope_cos_sin
        q_TID = self.wq_b(q_latent_TR).view(num_tokens, self.num_heads, self.head_dim)
        q_TID = apply_rotary(q_TID, cos, sin, interleaved=False)
        k_T1D = self.k_norm(self.wk(x_TH)).view(num_tokens, 1, self.head_dim)
        k_TD = apply_rotary(k_T1D, cos, sin, interleaved=False)[:, 0]
        weight = self.weights_proj.weight
        w_TI = F.linear(x_TH.to(weight.dtype), weight).float() * self.num_heads**-0.5
        return q_TID, k_TD, w_TI


class DSAttention(MLAttention):
    """MLA with a lightning indexer choosing each query's keys (see the module docstring)."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__(config, layer_index)
        self.indexer = Indexer(config)

    def forward(self, x_TH: torch.Tensor, rope_cos_sin: tuple[torch.Tensor, torch.Tensor], attention: Any):
        q_latent = self.q_a_norm(self.q_a_proj(x_TH))
        q_TND, k_TND, v_TND = self.project_qkv(x_TH, rope_cos_sin, q_latent)
        index = self.indexer.project(x_TH, q_latent, rope_cos_sin)
        y_TND = attend_in_context(self, attention, q_TND, k_TND, v_TND.contiguous(), index, self.layer_index)
        return decode_linear(self.o_proj, y_TND.reshape(x_TH.shape[0], -1))

    def can_cache_latents(self) -> bool:
        """Never: the sparse attention reads keys and values per head."""
        return False

    def extra_cache_layouts(self) -> list[tuple[int, int, int, None]]:
        """The paged-cache entry of the indexer keys: one head of ``index_head_dim``, no values."""
        return [(1, self.indexer.head_dim, 0, None)]


# ----------------------------------------------------------------------------- contexts


def attend_in_context(layer: DSAttention, attention: Any, q_TND, k_TND, v_TND, index, cache_layer: int) -> torch.Tensor:
    """``[T, N, Dv]``: the layer's sparse attention in ``attention``'s context (:data:`DSA_CONTEXTS`);
    ``cache_layer``: the layer's entry in a cache the context keeps (a wrapping context that
    renumbers layers passes its own)."""
    return _context_handler(attention)(layer, attention, q_TND, k_TND, v_TND, index, cache_layer)


def _packed(layer: DSAttention, attention: PackedAttention, q_TND, k_TND, v_TND, index, cache_layer) -> torch.Tensor:
    """Each packed sequence: the indexer's selection as the mask of a dense causal attention."""
    q_TID, k_TD, w_TI = index
    bounds = attention.cu_seqlens.tolist()
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        mask_QL = _selection_QL(layer.indexer, q_TID[start:end], k_TD[start:end], w_TI[start:end])
        q, k, v = (x[start:end].transpose(0, 1) for x in (q_TND, k_TND, v_TND))
        y_NQD = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_QL, scale=layer.scale)
        outputs.append(y_NQD.transpose(0, 1))
    return torch.cat(outputs, dim=0)


@torch.no_grad()
def _selection_QL(indexer: Indexer, q_QID, k_LD, w_QI) -> torch.Tensor:
    """Boolean ``[Q, L]`` mask of the keys a sequence's queries attend to (causal and selected)."""
    length = k_LD.shape[0]
    causal_QL = torch.ones(length, length, dtype=torch.bool, device=k_LD.device).tril()
    chunks = []
    step = max(1, INDEX_SCORE_ELEMENTS // (indexer.num_heads * length))
    for start in range(0, length, step):
        rows = slice(start, start + step)
        scores = dsa_kernels.weighted_relu_scores(q_QID[rows], k_LD, w_QI[rows], indexer.scale)
        scores = scores.masked_fill(~causal_QL[rows], float("-inf"))
        chunks.append(dsa_kernels.selection_mask(dsa_kernels.topk_positions(scores, indexer.topk), length))
    return torch.cat(chunks, dim=0) & causal_QL


def paged_attend(layer: DSAttention, attention: Any, q_TND, k_TND, v_TND, index, cache_layer: int) -> torch.Tensor:
    """The engine's step (the rollout package registers it for its paged context in
    :data:`DSA_CONTEXTS`): K/V and indexer keys written at the tokens' slots, then the indexer's
    top-k over each token's cached context and the sparse attention over those keys; the
    batch-invariant paged backend (``--true-on-policy``) is refused.

    A cache of ``n`` DSA layers holds their K/V entries ``0 .. n-1``, then their indexer-key
    entries ``n .. 2n-1`` (the order of :meth:`CausalLM.attention_layout`)."""
    if attention.backend == "triton_invariant":
        _refuse_true_on_policy()
    q_TID, k_TD, w_TI = index
    meta, cache = attention.metadata, attention.kv_cache
    num_layers, odd = divmod(len(cache.k_NSHD), 2)
    if odd or cache.layout[cache_layer + num_layers][2] != 0:
        raise ValueError(
            f"the paged cache has no indexer entry for DSA layer {layer.layer_index}: size it with the model's "
            "attention_layout() (the layers' K/V entries, then their indexer-key entries)"
        )
    k_cache, v_cache = cache.k_NSHD[cache_layer], cache.v_NSHD[cache_layer]
    index_cache = cache.k_NSHD[cache_layer + num_layers]
    slots = meta.slot_mapping_T
    for store, rows in ((k_cache, k_TND), (v_cache, v_TND), (index_cache, k_TD.unsqueeze(1))):
        store.view(-1, *store.shape[2:]).index_copy_(0, slots, rows.to(store.dtype))
    num_tokens = q_TND.shape[0]
    seq_T, pos_T = dsa_kernels.step_tokens(meta, num_tokens)
    max_keys = int(meta.max_context_len)
    scores_TL = dsa_kernels.index_scores(
        q_TID.to(index_cache.dtype), w_TI, index_cache, meta.block_tables_BM, seq_T, pos_T, max_keys,
        layer.indexer.scale,
    )
    positions_TK = dsa_kernels.topk_positions(scores_TL, layer.indexer.topk)
    return dsa_kernels.sparse_attention(
        q_TND.to(k_cache.dtype), k_cache, v_cache, meta.block_tables_BM, seq_T, positions_TK, layer.scale
    )


TRUE_ON_POLICY_REFUSAL = (
    "DeepSeek Sparse Attention does not support --true-on-policy: the batch-invariant forwards (one token at a "
    "time on CPU, the invariant kernels on CUDA) have no form of the indexer's top-k selection; run without "
    "--true-on-policy (the train/rollout log-prob difference is then measured and logged)"
)


def _refuse_true_on_policy(*_: Any) -> torch.Tensor:
    raise ValueError(TRUE_ON_POLICY_REFUSAL)


#: attention context type -> how a DSA layer attends in it (plugins may add their contexts); the
#: batch-invariant contexts of ``--true-on-policy`` are refused
DSA_CONTEXTS: dict[type, Callable[..., torch.Tensor]] = {
    PackedAttention: _packed,
    batch_invariant.PackedTokenAttention: _refuse_true_on_policy,
    batch_invariant.PagedTokenAttention: _refuse_true_on_policy,
    batch_invariant._TokenSlot: _refuse_true_on_policy,  # what a layer sees of the two above
    invariant_gpu.InvariantPackedAttention: _refuse_true_on_policy,
}


def _context_handler(attention: Any) -> Callable[..., torch.Tensor]:
    for kind in type(attention).__mro__:
        if kind in DSA_CONTEXTS:
            return DSA_CONTEXTS[kind]
    supported = sorted(kind.__name__ for kind, handler in DSA_CONTEXTS.items() if handler is not _refuse_true_on_policy)
    raise ValueError(
        f"DeepSeek Sparse Attention cannot attend in a {type(attention).__name__} context; "
        f"supported: {', '.join(supported)}"
    )
