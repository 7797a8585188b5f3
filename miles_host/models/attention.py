"""Attention contexts: how one forward computes attention for all its tokens.

- :class:`PackedAttention`: training and prefill over packed variable-length
  sequences, no cache. flash-attn varlen when importable on CUDA, otherwise
  PyTorch SDPA over the sequences padded to ``[S, H, L, D]`` (a view, no copy,
  when all sequences have the same length).
- :class:`ContiguousKVCache`: a simple per-sequence contiguous KV cache, the
  reference for greedy generation (the paged engine cache lives in the rollout
  engine).

Both support GQA (Hq a multiple of Hkv), key and value head dims that differ
(MLA), sliding windows (a query at position p sees keys in (p - window, p]) and
tanh logit soft-capping. Tensor legend: T tokens, S sequences, L max sequence
length, H heads, D head dim.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch
import torch.nn.functional as F

from miles_host.devices import host_values

try:  # pragma: no cover - only on machines with flash-attn
    from flash_attn import flash_attn_varlen_func as _flash_attn_varlen_func
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _flash_attn_varlen_func = None


def attention_mask_LM(
    num_queries: int, num_keys: int, query_offset: int, sliding_window: int | None, device: torch.device,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Boolean ``[Lq, Lk]`` mask: query ``i`` sits at position ``query_offset + i``
    (``chunk_size``: keys of the query's own chunk ``p // chunk_size`` only)."""
    q_pos = torch.arange(num_queries, device=device)[:, None] + query_offset
    k_pos = torch.arange(num_keys, device=device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed = allowed & (k_pos > q_pos - sliding_window)
    if chunk_size is not None:
        allowed = allowed & (k_pos // chunk_size == q_pos // chunk_size)
    return allowed


def attend_dense(
    q_SHLD: torch.Tensor,
    k_SHMD: torch.Tensor,
    v_SHMD: torch.Tensor,
    *,
    scale: float,
    query_offset: int = 0,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``[S, Hq, Lq, D]`` queries over ``[S, Hkv, Lk, D]`` keys.

    Queries sit at positions ``query_offset ..``, keys at ``0 ..``. Uses SDPA
    (``is_causal`` when possible); soft-capping and ``sinks`` (``[Hq]`` sink logits,
    one extra softmax column whose probability is dropped) fall back to an explicit
    softmax in float32 (the transformers "eager" formula).
    """
    num_q, num_k = q_SHLD.shape[2], k_SHMD.shape[2]
    gqa = q_SHLD.shape[1] != k_SHMD.shape[1]
    if sinks is not None:
        from miles_host.models.attention_variants import attend_dense_with_sinks

        mask = attention_mask_LM(num_q, num_k, query_offset, sliding_window, q_SHLD.device, chunk_size)
        return attend_dense_with_sinks(q_SHLD, k_SHMD, v_SHMD, mask, sinks, scale=scale, logit_softcap=logit_softcap)
    if chunk_size is not None:
        mask = attention_mask_LM(num_q, num_k, query_offset, sliding_window, q_SHLD.device, chunk_size)
        if logit_softcap is None:
            return F.scaled_dot_product_attention(q_SHLD, k_SHMD, v_SHMD, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if logit_softcap is not None:
        if gqa:
            repeat = q_SHLD.shape[1] // k_SHMD.shape[1]
            k_SHMD = k_SHMD.repeat_interleave(repeat, dim=1)
            v_SHMD = v_SHMD.repeat_interleave(repeat, dim=1)
        scores = torch.matmul(q_SHLD, k_SHMD.transpose(2, 3)) * scale
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
        mask = attention_mask_LM(num_q, num_k, query_offset, sliding_window, q_SHLD.device, chunk_size)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_SHLD.dtype)
        return torch.matmul(probs, v_SHMD)
    if sliding_window is None and query_offset == 0 and num_q == num_k:
        return F.scaled_dot_product_attention(q_SHLD, k_SHMD, v_SHMD, is_causal=True, scale=scale, enable_gqa=gqa)
    mask = attention_mask_LM(num_q, num_k, query_offset, sliding_window, q_SHLD.device)
    return F.scaled_dot_product_attention(q_SHLD, k_SHMD, v_SHMD, attn_mask=mask, scale=scale, enable_gqa=gqa)


class PackedAttention:
    """Causal attention within each of the packed sequences of a batch.

    ``cu_seqlens``: int32 ``[S + 1]`` cumulative lengths (``cu_seqlens[-1] == T``).
    """

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int | None = None, use_flash_attn: bool | None = None):
        self.cu_seqlens = cu_seqlens.to(torch.int32)
        bounds = host_values(cu_seqlens)  # (a packed batch's: its host copy, no device read)
        lengths = (bounds[1:] - bounds[:-1]).tolist()
        if not lengths or min(lengths) <= 0:
            raise ValueError(f"cu_seqlens must describe at least one non-empty sequence, got lengths {lengths}")
        self.lengths = lengths
        self.max_seqlen = int(max_seqlen) if max_seqlen is not None else max(lengths)
        self.use_flash_attn = use_flash_attn
        self._pad_index: torch.Tensor | None = None

    def _flash_ok(self, q: torch.Tensor) -> bool:
        if self.use_flash_attn is False or _flash_attn_varlen_func is None:
            return False
        return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)

    def _pad_index_T(self, device: torch.device) -> torch.Tensor:
        if self._pad_index is None or self._pad_index.device != device:
            rows = [torch.arange(n) + s * self.max_seqlen for s, n in enumerate(self.lengths)]
            self._pad_index = torch.cat(rows).to(device)
        return self._pad_index

    def _to_padded(self, x_THD: torch.Tensor) -> torch.Tensor:
        num_seqs, max_len = len(self.lengths), self.max_seqlen
        if all(n == max_len for n in self.lengths):
            return x_THD.view(num_seqs, max_len, *x_THD.shape[1:]).transpose(1, 2)
        flat = x_THD.new_zeros(num_seqs * max_len, *x_THD.shape[1:])
        flat = flat.index_copy(0, self._pad_index_T(x_THD.device), x_THD)
        return flat.view(num_seqs, max_len, *x_THD.shape[1:]).transpose(1, 2)

    def _from_padded(self, y_SHLD: torch.Tensor) -> torch.Tensor:
        y_SLHD = y_SHLD.transpose(1, 2)
        flat = y_SLHD.reshape(-1, *y_SLHD.shape[2:])
        if all(n == self.max_seqlen for n in self.lengths):
            return flat
        return flat.index_select(0, self._pad_index_T(y_SHLD.device))

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
    ) -> torch.Tensor:
        """Return ``[T, Hq, Dv]``; nothing is cached (sinks and chunks: the SDPA/eager path)."""
        if sinks is None and chunk_size is None and self._flash_ok(q_THD):
            return self._flash(q_THD, k_THD, v_THD, scale, sliding_window, logit_softcap)
        y_SHLD = attend_dense(
            self._to_padded(q_THD),
            self._to_padded(k_THD),
            self._to_padded(v_THD),
            scale=scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            sinks=sinks,
            chunk_size=chunk_size,
        )
        return self._from_padded(y_SHLD)

    def _flash(self, q, k, v, scale, sliding_window, logit_softcap):  # pragma: no cover - GPU only
        dv = v.shape[-1]
        if dv != q.shape[-1]:
            v = F.pad(v, (0, q.shape[-1] - dv))
        window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
        cu = self.cu_seqlens.to(q.device)
        out = _flash_attn_varlen_func(
            q, k, v, cu, cu, self.max_seqlen, self.max_seqlen,
            softmax_scale=scale, causal=True, window_size=window, softcap=logit_softcap or 0.0,
        )
        return out[..., :dv]


class ContiguousKVCache:
    """Keeps every sequence's keys and values in one growing tensor per layer.

    Before each forward call :meth:`set_batch` with the sequence ids of the
    batch and how many new tokens each contributes (tokens are flattened in
    that order). Reference implementation: correct and simple, not fast.
    """

    def __init__(self) -> None:
        self._keys: dict[tuple[int, Hashable], torch.Tensor] = {}
        self._values: dict[tuple[int, Hashable], torch.Tensor] = {}
        self._lengths: dict[Hashable, int] = {}
        self._batch: list[tuple[Hashable, int]] = []

    def set_batch(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]) -> None:
        """Declare the sequences of the next forward and their new-token counts."""
        if len(seq_ids) != len(num_new_tokens):
            raise ValueError("set_batch needs one new-token count per sequence id")
        self._batch = list(zip(seq_ids, (int(n) for n in num_new_tokens)))

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens cached so far for ``seq_id`` (after the last completed forward)."""
        return self._lengths.get(seq_id, 0)

    def positions(self) -> torch.Tensor:
        """Positions of the batch's new tokens (cache length + 0, 1, ...), flattened."""
        return torch.cat([torch.arange(n) + self.seq_len(sid) for sid, n in self._batch])

    def commit(self) -> None:
        """Advance every sequence of the batch by its new tokens (after a forward)."""
        for sid, n in self._batch:
            self._lengths[sid] = self._lengths.get(sid, 0) + n

    def free(self, seq_id: Hashable) -> None:
        """Forget a finished sequence."""
        self._lengths.pop(seq_id, None)
        for store in (self._keys, self._values):
            for key in [key for key in store if key[1] == seq_id]:
                del store[key]

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
    ) -> torch.Tensor:
        """Append this batch's keys/values to the cache and attend over the cache."""
        outputs, start = [], 0
        for seq_id, count in self._batch:
            q, k, v = (x[start : start + count] for x in (q_THD, k_THD, v_THD))
            start += count
            key = (layer_index, seq_id)
            past = self.seq_len(seq_id)
            if past:
                k = torch.cat((self._keys[key][:past], k), dim=0)
                v = torch.cat((self._values[key][:past], v), dim=0)
            self._keys[key], self._values[key] = k.detach(), v.detach()
            y = attend_dense(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                scale=scale, query_offset=past, sliding_window=sliding_window, logit_softcap=logit_softcap,
                sinks=sinks, chunk_size=chunk_size,
            )
            outputs.append(y[0].transpose(0, 1))
        if start != q_THD.shape[0]:
            raise ValueError(f"set_batch declared {start} new tokens but the forward has {q_THD.shape[0]}")
        return torch.cat(outputs, dim=0)
