"""DeepSeek Sparse Attention (DSA) over the paged KV cache: the lightning indexer's scores and
the top-k sparse attention.

Every token ``t`` of an engine step belongs to sequence ``seq_T[t]``, sits at position
``pos_T[t]`` and sees the keys at positions ``0 .. pos_T[t]`` of its sequence (read through
the sequence's block table). The indexer scores each of those keys

    ``score[t, j] = sum_n w[t, n] * relu(scale * q[t, n] . k_index[j])``

(``w`` already carries the ``index_n_heads ** -0.5`` factor), :func:`topk_positions` keeps
the ``index_topk`` best, and the query attends to those keys only.

Two implementations compute the same thing: plain PyTorch (``*_reference``: CPU, and the
oracle of the kernels) and the Triton kernels of :mod:`miles_host.kernels._dsa_triton` (CUDA).
:func:`index_scores` / :func:`sparse_attention` pick one; every shape they use is fixed by the
step's token count and ``max_keys``, so a decode step can be captured in a CUDA graph.

Tensor legend: T tokens of the step, B sequences, M blocks per sequence, N cache blocks,
S slots per block, H attention heads, I indexer heads, D head dim, L keys (``max_keys``),
K selected keys (top-k).
"""

from __future__ import annotations

import torch

from miles_host.kernels.attention_metadata import AttentionMetadata


def weighted_relu_scores(q_QID: torch.Tensor, k_QLD: torch.Tensor, w_QI: torch.Tensor, scale: float) -> torch.Tensor:
    """``[Q, L]`` indexer scores in float32: ``sum_i w[q, i] * relu(scale * q[q, i] . k[q, l])``.

    ``k_QLD`` may be ``[L, D]`` (keys shared by every query: a packed sequence)."""
    q = q_QID.float()
    k = k_QLD.float()
    if k.dim() == 2:
        scores_QIL = torch.matmul(q, k.transpose(0, 1)) * scale
    else:
        scores_QIL = torch.matmul(q, k.transpose(1, 2)) * scale
    return torch.matmul(w_QI.float().unsqueeze(1), torch.relu(scores_QIL)).squeeze(1)


def topk_positions(scores_QL: torch.Tensor, topk: int) -> torch.Tensor:
    """``[Q, min(topk, L)]`` key positions of each query's best scores; ``-1`` marks a masked key
    (a score of ``-inf``: a query with fewer than ``topk`` visible keys keeps all of them)."""
    values, index = scores_QL.topk(min(topk, scores_QL.shape[-1]), dim=-1)
    return index.masked_fill(values == float("-inf"), -1)


def selection_mask(positions_QK: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Boolean ``[Q, L]``: True at the keys :func:`topk_positions` selected."""
    mask = torch.zeros(positions_QK.shape[0], num_keys + 1, dtype=torch.bool, device=positions_QK.device)
    mask.scatter_(1, torch.where(positions_QK < 0, num_keys, positions_QK), True)
    return mask[:, :num_keys]


def step_tokens(meta: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seq_T, pos_T)``: the sequence and position of every token of a step, on the device,
    from the metadata's device tensors only (no host synchronisation)."""
    cu = meta.cu_seqlens_q.long()
    num_seqs = cu.shape[0] - 1
    seq_T = torch.repeat_interleave(
        torch.arange(num_seqs, device=cu.device), cu[1:] - cu[:-1], output_size=num_tokens
    )
    token_T = torch.arange(num_tokens, device=cu.device)
    pos_T = meta.context_lens_B.long()[seq_T] - (cu[1:][seq_T] - token_T)
    return seq_T, pos_T


def _key_slots_TL(block_tables_BM, seq_T, num_keys: int, block_size: int) -> torch.Tensor:
    key_L = torch.arange(num_keys, device=seq_T.device)
    blocks_TL = block_tables_BM.long()[seq_T][:, key_L // block_size]
    return blocks_TL * block_size + key_L % block_size


def index_scores_reference(
    q_TID: torch.Tensor, w_TI: torch.Tensor, k_index_NS1D: torch.Tensor, block_tables_BM: torch.Tensor,
    seq_T: torch.Tensor, pos_T: torch.Tensor, max_keys: int, scale: float,
) -> torch.Tensor:
    """``[T, max_keys]`` float32 indexer scores; ``-inf`` past each token's position."""
    slots_TL = _key_slots_TL(block_tables_BM, seq_T, max_keys, k_index_NS1D.shape[1])
    keys_TLD = k_index_NS1D.reshape(-1, k_index_NS1D.shape[-1])[slots_TL]
    scores_TL = weighted_relu_scores(q_TID, keys_TLD, w_TI, scale)
    visible_TL = torch.arange(max_keys, device=pos_T.device)[None, :] <= pos_T[:, None]
    return scores_TL.masked_fill(~visible_TL, float("-inf"))


def sparse_attention_reference(
    q_THD: torch.Tensor, k_cache_NSHD: torch.Tensor, v_cache_NSHD: torch.Tensor, block_tables_BM: torch.Tensor,
    seq_T: torch.Tensor, positions_TK: torch.Tensor, scale: float,
) -> torch.Tensor:
    """``[T, H, Dv]``: each query over its selected keys (``-1`` entries skipped), softmax in float32."""
    block_size = k_cache_NSHD.shape[1]
    blocks_TK = block_tables_BM.long()[seq_T.unsqueeze(1), positions_TK.clamp(min=0) // block_size]
    slots_TK = blocks_TK * block_size + positions_TK.clamp(min=0) % block_size
    keys_TKHD = k_cache_NSHD.reshape(-1, *k_cache_NSHD.shape[2:])[slots_TK].float()
    values_TKHD = v_cache_NSHD.reshape(-1, *v_cache_NSHD.shape[2:])[slots_TK].float()
    scores_THK = torch.einsum("thd,tkhd->thk", q_THD.float(), keys_TKHD) * scale
    scores_THK = scores_THK.masked_fill((positions_TK < 0).unsqueeze(1), float("-inf"))
    probs_THK = torch.softmax(scores_THK, dim=-1)
    return torch.einsum("thk,tkhd->thd", probs_THK, values_TKHD).to(q_THD.dtype)


def _use_triton(tensor: torch.Tensor) -> bool:
    if not tensor.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def index_scores(q_TID, w_TI, k_index_NS1D, block_tables_BM, seq_T, pos_T, max_keys: int, scale: float) -> torch.Tensor:
    """:func:`index_scores_reference`, by the Triton kernel on CUDA."""
    if _use_triton(q_TID):
        from miles_host.kernels._dsa_triton import index_scores_triton

        return index_scores_triton(q_TID, w_TI, k_index_NS1D, block_tables_BM, seq_T, pos_T, max_keys, scale)
    return index_scores_reference(q_TID, w_TI, k_index_NS1D, block_tables_BM, seq_T, pos_T, max_keys, scale)


def sparse_attention(
    q_THD, k_cache_NSHD, v_cache_NSHD, block_tables_BM, seq_T, positions_TK, scale: float
) -> torch.Tensor:
    """:func:`sparse_attention_reference`, by the Triton kernel on CUDA."""
    if _use_triton(q_THD):
        from miles_host.kernels._dsa_triton import sparse_attention_triton

        return sparse_attention_triton(q_THD, k_cache_NSHD, v_cache_NSHD, block_tables_BM, seq_T, positions_TK, scale)
    return sparse_attention_reference(q_THD, k_cache_NSHD, v_cache_NSHD, block_tables_BM, seq_T, positions_TK, scale)
