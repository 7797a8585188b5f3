"""Paged attention: the engine's :class:`AttentionContext`.

Every attention layer hands its current tokens' q/k/v to :meth:`PagedAttention.attend`,
which stores k/v in the paged cache at each token's slot and attends each
query over its sequence's cached context (causal; the new tokens of a prefill
see the cached prefix and each other). Three implementations compute the
same thing: a plain-PyTorch reference (CPU, and the oracle for the others), a
Triton kernel (GPU), and flash-attn's paged varlen kernel when it is importable.

Tensor legend: T = tokens of the step (flattened over sequences), B = sequences,
H = heads, D = head dim, N = cache blocks, S = slots per block, M = max blocks per sequence.
"""

from __future__ import annotations

import dataclasses

import torch

from miles_host.kernels.attention_metadata import AttentionMetadata
from miles_host.models.dsa import DSA_CONTEXTS, paged_attend
from miles_host.rollout.kv_cache import PagedKVCache


def paged_attention_reference(
    q_THD: torch.Tensor,
    k_cache_NSHD: torch.Tensor,
    v_cache_NSHD: torch.Tensor,
    block_tables_BM: torch.Tensor,
    cu_seqlens_q: list[int],
    context_lens: list[int],
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    key_range: tuple[int, int] | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of each sequence's new queries over its paged context, in plain PyTorch.

    The new tokens of sequence ``b`` are the last ``cu_seqlens_q[b+1] - cu_seqlens_q[b]``
    of its ``context_lens[b]`` tokens. Scores and softmax in float32 (float64 operands: float64). ``sinks``: ``[Hq]``
    sink logits (an extra softmax column, dropped); ``chunk_size``: each query sees the
    keys of its own chunk only. ``key_range`` ``(lo, hi)``: only the keys at positions
    ``[lo, hi)`` take part (the others are never read). ``return_lse``: also each row's
    log-sum-exp of its scores, ``[T, Hq]`` in the scores' dtype (``-inf`` where no key is
    seen, the row then zero), for :func:`merge_attention_states`.
    """
    num_q_heads = q_THD.shape[1]
    block_size = k_cache_NSHD.shape[1]
    num_kv_heads = k_cache_NSHD.shape[2]
    group = num_q_heads // num_kv_heads
    out = q_THD.new_zeros(q_THD.shape[0], num_q_heads, v_cache_NSHD.shape[-1])
    work = torch.float64 if q_THD.dtype == torch.float64 else torch.float32
    lse_TH = torch.full(q_THD.shape[:2], float("-inf"), dtype=work, device=q_THD.device)
    for b in range(len(context_lens)):
        start, end = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        context = context_lens[b]
        key_lo, key_hi = (0, context) if key_range is None else (key_range[0], min(key_range[1], context))
        if end == start or key_hi <= key_lo:
            continue
        first_block = key_lo // block_size
        blocks = block_tables_BM[b, first_block : -(-key_hi // block_size)].long()
        skip = key_lo - first_block * block_size
        k_LHD = k_cache_NSHD[blocks].flatten(0, 1)[skip : skip + key_hi - key_lo]
        v_LHD = v_cache_NSHD[blocks].flatten(0, 1)[skip : skip + key_hi - key_lo]
        if group > 1:
            k_LHD = k_LHD.repeat_interleave(group, dim=1)
            v_LHD = v_LHD.repeat_interleave(group, dim=1)
        q_HQD = q_THD[start:end].transpose(0, 1).to(work)
        scores_HQL = torch.matmul(q_HQD, k_LHD.transpose(0, 1).to(work).transpose(1, 2)) * scale
        if logit_softcap is not None:
            scores_HQL = logit_softcap * torch.tanh(scores_HQL / logit_softcap)
        q_pos = torch.arange(context - (end - start), context, device=q_THD.device)
        k_pos = torch.arange(key_lo, key_hi, device=q_THD.device)
        allowed_QL = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            allowed_QL &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
        if chunk_size is not None:
            allowed_QL &= (q_pos[:, None] // chunk_size) == (k_pos[None, :] // chunk_size)
        scores_HQL = scores_HQL.masked_fill(~allowed_QL, float("-inf"))
        if sinks is not None:
            sink_HQ1 = sinks.to(work)[:, None, None].expand(-1, scores_HQL.shape[1], 1)
            probs_HQL = torch.softmax(torch.cat((scores_HQL, sink_HQ1), dim=-1), dim=-1)[..., :-1]
        else:
            probs_HQL = torch.softmax(scores_HQL, dim=-1).nan_to_num(0.0)  # a row that sees no key: zeros
        out[start:end] = torch.matmul(probs_HQL, v_LHD.transpose(0, 1).to(work)).transpose(0, 1).to(out.dtype)
        lse_TH[start:end] = torch.logsumexp(scores_HQL, dim=-1).transpose(0, 1)
    return (out, lse_TH) if return_lse else out


def merge_attention_states(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """One attention output from the outputs ``[T, H, Dv]`` of the same queries over disjoint key sets and
    their rows' log-sum-exps ``[T, H]``: each part weighted by its share of the softmax's denominator
    (a row no part saw anything of: zeros). In float32 (float64 parts: float64), in the parts' order."""
    work = torch.float64 if outs[0].dtype == torch.float64 else torch.float32
    lse_PTH = torch.stack(lses).to(work)
    top_TH = lse_PTH.amax(0)
    weights_PTH = torch.exp(lse_PTH - top_TH.nan_to_num(0.0, neginf=0.0))  # 0 for a part that saw no key
    total_TH = weights_PTH.sum(0)
    merged = sum(w[..., None] * out.to(work) for w, out in zip(weights_PTH, outs))
    return (merged / torch.where(total_TH == 0, 1.0, total_TH)[..., None]).to(outs[0].dtype)


def context_groups(context_lens: list[int], max_context: int | None) -> list[tuple[int, int]]:
    """``(first, end)`` ranges of consecutive sequences whose contexts sum to at most ``max_context``
    tokens each (a longer context is a group alone; ``None``: one group)."""
    groups, first, total = [], 0, 0
    for b, context in enumerate(context_lens):
        if max_context is not None and b > first and total + context > max_context:
            groups.append((first, b))
            first, total = b, 0
        total += context
    groups.append((first, len(context_lens)))
    return groups


@dataclasses.dataclass(frozen=True)
class _ExpandedLayout:
    """What an expanded MLA prefill of some of a step's sequences needs beside the layer's cache: their
    metadata over the gathered pages (``block_tables_BM`` into the gathered rows; the kernel's tiles on
    CUDA), the cache pages to gather in order, and ``keys``: one sequence's key part, or None."""

    metadata: AttentionMetadata
    page_ids: torch.Tensor
    keys: tuple[int, int] | None


def _key_parts(context: int, most: int) -> list[tuple[int, int]]:
    """Consecutive key ranges ``(lo, hi)`` of at most ``most`` keys covering a context of ``context``."""
    return [(lo, min(lo + most, context)) for lo in range(0, context, most)]


def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return flash_attn_varlen_func


class PagedAttention:
    """The :class:`~miles_host.models.context.AttentionContext` of one engine step.

    ``backend``: ``"torch"`` (reference), ``"triton"``, ``"flash_attn"``, or
    ``"triton_invariant"`` (the Triton kernel with one tile shape for every step:
    batch-invariant, ``--true-on-policy`` on CUDA).
    """

    def __init__(self, kv_cache: PagedKVCache, metadata: AttentionMetadata, backend: str = "torch"):
        self.kv_cache = kv_cache
        self.metadata = metadata
        self.backend = backend
        self._expanded_layouts: dict[tuple, _ExpandedLayout] = {}

    @staticmethod
    def _store_kv(k_cache, v_cache, k_THD, v_THD, slots, triton_backend: bool) -> None:
        if triton_backend and k_cache.is_cuda:
            from miles_host.kernels.paged_attention import write_kv_cache

            write_kv_cache(k_cache, v_cache, k_THD, v_THD, slots)  # one kernel for K and V
        else:
            k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k_THD.to(k_cache.dtype))
            v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v_THD.to(v_cache.dtype))

    def kv_cache_store(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k_cache [X, H, D], v_cache [X, H, Dv], slots [T])`` of layer ``layer_index``: its caches
        flattened over their slots and this step's slot of each token, for a kernel that stores
        the step's keys and values itself (then :meth:`attend` with ``kv_stored=True``)."""
        k_cache = self.kv_cache.k_NSHD[layer_index]
        v_cache = self.kv_cache.v_NSHD[layer_index]
        return (k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:]),
                self.metadata.slot_mapping_T)

    def latent_layer(self, layer_index: int) -> bool:
        """Whether layer ``layer_index`` is cached as MLA latents (an entry without values)."""
        return self.kv_cache.layout[layer_index][2] == 0

    def attend_latent(
        self,
        layer_index: int,
        q_latent_TNR: torch.Tensor,
        q_rope_TNP: torch.Tensor,
        latent_TR: torch.Tensor,
        k_rope_TP: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        """Absorbed MLA (:class:`~miles_host.models.self_attention.MLAttention`): store each token's
        ``[latent, rope key]`` row in the layer's latent cache, return ``[T, N, R]``, each head's
        softmax-weighted sum of its context's latents (multi-query over the cache rows)."""
        meta = self.metadata
        cache_XS1C = self._store_latent_rows(layer_index, latent_TR, k_rope_TP)
        rank = latent_TR.shape[-1]
        q_latent_TNR, q_rope_TNP = q_latent_TNR.to(cache_XS1C.dtype), q_rope_TNP.to(cache_XS1C.dtype)
        if cache_XS1C.is_cuda and self.backend != "torch":
            from miles_host.kernels.mla_attention import mla_attention_triton

            return mla_attention_triton(q_latent_TNR, q_rope_TNP, cache_XS1C[:, :, 0], meta, scale=scale)
        return paged_attention_reference(
            torch.cat((q_latent_TNR, q_rope_TNP), dim=-1), cache_XS1C, cache_XS1C[..., :rank], meta.block_tables_BM,
            meta.cu_seqlens_q_host, meta.context_lens_host, scale=scale,
        )

    def _store_latent_rows(self, layer_index: int, latent_TR: torch.Tensor, k_rope_TP: torch.Tensor) -> torch.Tensor:
        """Each token's ``[latent, rope key]`` row into layer ``layer_index``'s latent cache (returned)."""
        cache_XS1C = self.kv_cache.k_NSHD[layer_index]
        rows_T1C = torch.cat((latent_TR, k_rope_TP), dim=-1).to(cache_XS1C.dtype)[:, None]
        cache_XS1C.view(-1, *cache_XS1C.shape[2:]).index_copy_(0, self.metadata.slot_mapping_T, rows_T1C)
        return cache_XS1C

    def attend_latent_expanded(
        self,
        layer_index: int,
        q_TND: torch.Tensor,
        latent_TR: torch.Tensor,
        k_rope_TP: torch.Tensor,
        expand,
        *,
        scale: float,
        max_group_context: int | None = None,
    ) -> torch.Tensor:
        """A prefill step of an MLA layer cached as latents, as multi-head attention (SGLang's MHA
        prefill of MLA): store each token's row as :meth:`attend_latent` does, gather the pages of
        every sequence's context, expand their latents to per-head keys and values (``expand(c)``,
        ``c [C, R]`` -> ``(k_nope [C, N, Dn], v [C, N, Dv])``: the layer's ``kv_b_proj``) and attend with
        the per-head queries ``q_TND`` (``[T, N, Dn + P]``). The absorbed path's products in the other
        order, at ``Dn + P`` and ``Dv`` per head instead of ``R + P`` and ``R`` (DeepSeek-V3: 192 + 128
        against 576 + 512): the fewer FLOPs where the step is compute-bound.

        ``max_group_context`` bounds the expanded keys and values, a transient: the step's sequences are
        expanded and attended in consecutive groups of at most this many context tokens, and a longer
        context in parts of at most this many keys whose attention states are merged by their
        log-sum-exps (SGLang's chunked prefix of MLA). Returns ``[T, N, Dv]``."""
        meta = self.metadata
        cache_XS1C = self._store_latent_rows(layer_index, latent_TR, k_rope_TP)
        rank, heads = latent_TR.shape[-1], q_TND.shape[1]
        cu = meta.cu_seqlens_q_host
        parts = []
        for b0, b1 in context_groups(meta.context_lens_host, max_group_context):
            q_group = q_TND[cu[b0]:cu[b1]]
            contexts = meta.context_lens_host[b0:b1]
            if max_group_context is not None and sum(contexts) > max_group_context:  # one long context
                states = [self._attend_expanded(cache_XS1C, rank, q_group, expand, scale,
                                                self._expanded_layout(b0, b1, heads, keys))
                          for keys in _key_parts(contexts[0], max_group_context)]
                parts.append(merge_attention_states(*zip(*states)))
            else:
                parts.append(self._attend_expanded(cache_XS1C, rank, q_group, expand, scale,
                                                   self._expanded_layout(b0, b1, heads)))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _expanded_layout(self, first: int, end: int, heads: int, keys: tuple[int, int] | None = None) -> _ExpandedLayout:
        """The :class:`_ExpandedLayout` of sequences ``first .. end - 1`` (``keys``: one sequence's keys at
        those positions only), built once per step for every layer."""
        cached = self._expanded_layouts.get((first, end, heads, keys))
        if cached is not None:
            return cached
        meta = self.metadata if (first, end) == (0, len(self.metadata.context_lens_host)) else \
            self._group_metadata(first, end)
        page = self.kv_cache.block_size
        first_pages = [0] * (end - first) if keys is None else [keys[0] // page]
        end_pages = [-(-c // page) for c in meta.context_lens_host] if keys is None else [-(-keys[1] // page)]
        page_ids = torch.cat([meta.block_tables_BM[b, p0:p1] for b, (p0, p1) in enumerate(zip(first_pages, end_pages))])
        tables_BM = torch.zeros(len(end_pages), max(end_pages), dtype=torch.int32)
        row = 0
        for b, (p0, p1) in enumerate(zip(first_pages, end_pages)):  # its pages: gathered rows row .. row + p1 - p0
            tables_BM[b, p0:p1] = torch.arange(row, row + p1 - p0, dtype=torch.int32)
            row += p1 - p0
        tiles = (None, None)
        if page_ids.is_cuda and self.backend != "torch":
            from miles_host.kernels.paged_attention import build_tiles, tokens_per_tile

            tiles = build_tiles(meta.cu_seqlens_q_host, tokens_per_tile(heads, heads, False), page_ids.device)
        meta = dataclasses.replace(meta, block_tables_BM=tables_BM.to(page_ids.device), is_decode=False,
                                   tile_seq=tiles[0], tile_q_start=tiles[1])
        layout = self._expanded_layouts[(first, end, heads, keys)] = _ExpandedLayout(meta, page_ids.long(), keys)
        return layout

    def _group_metadata(self, first: int, end: int) -> AttentionMetadata:
        """The step's metadata restricted to sequences ``first .. end - 1`` (query offsets from 0)."""
        meta = self.metadata
        cu = meta.cu_seqlens_q_host
        cu_group = [offset - cu[first] for offset in cu[first : end + 1]]
        contexts = meta.context_lens_host[first:end]
        return dataclasses.replace(
            meta, slot_mapping_T=meta.slot_mapping_T[cu[first] : cu[end]],
            cu_seqlens_q=torch.tensor(cu_group, dtype=meta.cu_seqlens_q.dtype, device=meta.cu_seqlens_q.device),
            context_lens_B=meta.context_lens_B[first:end], block_tables_BM=meta.block_tables_BM[first:end],
            max_q_len=max(b - a for a, b in zip(cu_group, cu_group[1:])), max_context_len=max(contexts),
            tile_seq=None, tile_q_start=None, cu_seqlens_q_host=cu_group, context_lens_host=contexts,
            slot_mapping_host=None,
        )

    def _attend_expanded(self, cache_XS1C, rank: int, q_TND, expand, scale: float, layout: _ExpandedLayout):
        """:meth:`attend_latent_expanded` of the sequences (or one sequence's key part) ``layout`` describes,
        their queries ``q_TND`` (``rank``: the latent width of the cache rows, the rope key after it): their
        pages gathered and expanded, then the paged kernel. A key part returns ``(out, log-sum-exp)`` for
        :func:`merge_attention_states`."""
        page = cache_XS1C.shape[1]
        rows_PSC = cache_XS1C.index_select(0, layout.page_ids)[:, :, 0]  # the pages attended, in order
        k_nope_CND, v_CND = expand(rows_PSC[..., :rank].reshape(-1, rank))
        num_pages, heads = rows_PSC.shape[0], k_nope_CND.shape[1]
        k_rope_C1P = rows_PSC[..., rank:].reshape(-1, 1, rows_PSC.shape[-1] - rank).to(k_nope_CND.dtype)
        k_PSND = torch.cat((k_nope_CND, k_rope_C1P.expand(-1, heads, -1)), dim=-1).view(num_pages, page, heads, -1)
        v_PSND = v_CND.contiguous().view(num_pages, page, heads, -1)
        q_TND, meta = q_TND.to(k_PSND.dtype), layout.metadata
        in_parts = dict(key_range=layout.keys, return_lse=True) if layout.keys is not None else {}
        if meta.tile_seq is not None:
            from miles_host.kernels.paged_attention import paged_attention_triton

            return paged_attention_triton(q_TND, k_PSND, v_PSND, meta, scale=scale, **in_parts)
        return paged_attention_reference(q_TND, k_PSND, v_PSND, meta.block_tables_BM, meta.cu_seqlens_q_host,
                                         meta.context_lens_host, scale=scale, **in_parts)

    def attend(
        self,
        layer_index: int,
        q_THD: torch.Tensor,
        k_THD: torch.Tensor,
        v_THD: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        chunk_size: int | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """Store this step's k/v in layer ``layer_index``'s cache, return ``[T, Hq, Dv]``.

        ``kv_stored``: the caller has already stored them (at :meth:`kv_cache_store`'s slots);
        ``k_THD``/``v_THD`` are then not read. Sinks and chunked local attention: the Triton
        kernel; the ``flash_attn`` backend falls back to the PyTorch reference for them (the
        decode-graph capture then fails with the reason and the engine decodes eagerly)."""
        meta = self.metadata
        k_cache = self.kv_cache.k_NSHD[layer_index]
        v_cache = self.kv_cache.v_NSHD[layer_index]
        slots = meta.slot_mapping_T
        triton_backend = self.backend in ("triton", "triton_invariant")
        if not kv_stored:
            self._store_kv(k_cache, v_cache, k_THD, v_THD, slots, triton_backend)
        q_THD = q_THD.to(k_cache.dtype)
        if (sinks is not None or chunk_size is not None) and not triton_backend:
            if q_THD.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "attention sinks and chunked local attention run the PyTorch reference, which reads "
                    "host-side lengths and cannot be captured in a CUDA graph"
                )
            return paged_attention_reference(
                q_THD, k_cache, v_cache, meta.block_tables_BM,
                meta.cu_seqlens_q_host, meta.context_lens_host,
                scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap,
                sinks=sinks, chunk_size=chunk_size,
            )
        if triton_backend:
            from miles_host.kernels.paged_attention import paged_attention_triton

            return paged_attention_triton(
                q_THD, k_cache, v_cache, meta,
                scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap,
                invariant=self.backend == "triton_invariant", sinks=sinks, chunk_size=chunk_size,
            )
        if self.backend == "flash_attn":
            flash_attn_varlen_func = _flash_attn_varlen()
            cu_k = torch.nn.functional.pad(meta.context_lens_B.cumsum(0, dtype=torch.int32), (1, 0))
            return flash_attn_varlen_func(
                q_THD, k_cache, v_cache,
                cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=cu_k,
                max_seqlen_q=meta.max_q_len, max_seqlen_k=meta.max_context_len,
                softmax_scale=scale, causal=True,
                window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
                softcap=logit_softcap or 0.0, block_table=meta.block_tables_BM,
            )
        return paged_attention_reference(
            q_THD, k_cache, v_cache, meta.block_tables_BM,
            meta.cu_seqlens_q_host, meta.context_lens_host,
            scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap,
        )


#: DeepSeek Sparse Attention layers attend in the engine's paged context through the indexer cache
DSA_CONTEXTS[PagedAttention] = paged_attend
