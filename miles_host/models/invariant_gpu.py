"""Batch-invariant forward on CUDA (``--true-on-policy``): the whole batch at once.

:mod:`miles_host.models.batch_invariant` computes every token on its own, which is
exact on CPU but far too slow for a GPU. Here the batch is forwarded as usual and
every op that reduces across a row runs a kernel whose result for one row does
not depend on the other rows (the batch, the packing, padding, prefill vs decode
vs training):

- every matmul and every ``mean`` over the last dim (so every RMSNorm) runs the
  kernels of :mod:`miles_host.kernels.invariant_ops` while :func:`forward_hidden`
  is inside :func:`~miles_host.kernels.invariant_ops.batch_invariant_aten`
  (tile shape fixed per weight, fp32 accumulation over K from 0, no split-K);
- attention is the engine's paged Triton kernel with one tile shape for decode,
  prefill and training, key blocks from position 0 and no split over keys
  (:func:`~miles_host.kernels.paged_attention.paged_attention_triton`,
  ``invariant=True``); training hands it its packed keys as a cache of one-token
  pages, so a query at position ``t`` reduces over exactly the blocks a decode
  step of that token does;
- the MoE combine sums each token's experts in ascending expert order in fp32
  (:func:`miles_host.models.mlp.routed_forward` and its CUDA-graph form);
- log-probs: the logits of :func:`~miles_host.models.logprobs.compute_logits`
  under the same kernels, then one program per row
  (:func:`~miles_host.kernels.invariant_reduce.invariant_log_probs`), for the
  engine's sampled tokens and for the trainer's targets.

- the fused norm / q-k-norm + rotary / SiLU-mul kernels (one program per row, launch
  shape from the row length) on both sides: the trainer's forward runs them too, with
  the eager modules' gradient (:mod:`miles_host.kernels.eager_backward`).

Elementwise ops are per-element and therefore invariant already. Only forward
values must match the engine: backward passes use the fast kernels (attention
recomputed by :class:`~miles_host.models.attention.PackedAttention`, the log-prob
head by :func:`~miles_host.models.logprobs.chunked_log_probs`).

Tensor legend: T tokens, S sequences, N heads, D head dim, H hidden, V vocab, B rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from miles_host.models.context import ForwardContext
from miles_host.models.logprobs import compute_logits

#: the engine attention backend whose kernel this mode uses (``rollout.config``)
INVARIANT_ATTENTION_BACKEND = "triton_invariant"


def forward_hidden(model, input_ids_T: torch.Tensor, positions_T: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """``CausalLM.forward_hidden`` of the whole batch with batch-invariant kernels."""
    from miles_host.kernels import fused_kernels_usable
    from miles_host.kernels.invariant_ops import batch_invariant_aten

    inner = dataclasses.replace(
        ctx, attention=invariant_attention(ctx.attention), batch_invariant=False,
        fused_kernels=fused_kernels_usable(input_ids_T.device),
    )
    with batch_invariant_aten():
        return model.forward_hidden(input_ids_T, positions_T, inner)


def invariant_attention(attention: Any) -> Any:
    """The batch-invariant form of a forward's attention context."""
    from miles_host.models.attention import PackedAttention

    if isinstance(attention, PackedAttention):
        return InvariantPackedAttention(attention)
    if getattr(attention, "backend", None) == INVARIANT_ATTENTION_BACKEND:
        return attention  # the engine's paged attention, already on the invariant kernel
    raise TypeError(
        f"batch-invariant mode on CUDA needs PackedAttention or the engine's {INVARIANT_ATTENTION_BACKEND!r} "
        f"paged attention, got {type(attention).__name__} (backend {getattr(attention, 'backend', None)!r})"
    )


class InvariantPackedAttention:
    """Training-side attention over packed sequences on the engine's invariant kernel.

    The packed keys ``[T, Nkv, D]`` are read as a paged cache with one token per
    page: sequence ``s`` owns pages ``cu[s] .. cu[s+1]-1`` and each query sees its
    sequence's keys ``0 .. t`` exactly as the engine's cache holds them.
    """

    def __init__(self, packed):
        self.packed = packed
        self._metadata: dict[tuple, Any] = {}

    def metadata(self, num_q_heads: int, num_kv_heads: int, device: torch.device):
        key = (num_q_heads, num_kv_heads, device)
        if key not in self._metadata:
            self._metadata[key] = _one_token_pages(self.packed, num_q_heads, num_kv_heads, device)
        return self._metadata[key]

    def attend(self, layer_index, q_THD, k_THD, v_THD, *, scale, sliding_window=None, logit_softcap=None,
               sinks=None, chunk_size=None):
        return _InvariantAttention.apply(
            q_THD, k_THD, v_THD, sinks, self, layer_index, scale, sliding_window, logit_softcap, chunk_size
        )


def _one_token_pages(packed, num_q_heads: int, num_kv_heads: int, device: torch.device):
    """Attention metadata that presents packed keys as one-token pages of a cache."""
    from miles_host.kernels.attention_metadata import AttentionMetadata
    from miles_host.kernels.paged_attention import build_tiles, tokens_per_tile

    cu_host = [int(c) for c in packed.cu_seqlens.tolist()]
    cu = torch.tensor(cu_host, dtype=torch.int32, device=device)
    lengths = cu[1:] - cu[:-1]
    offsets_L = torch.arange(packed.max_seqlen, dtype=torch.int32, device=device)
    tables_SL = torch.minimum(cu[:-1, None] + offsets_L[None, :], (cu[1:, None] - 1))
    tile_seq, tile_q_start = build_tiles(
        cu_host, tokens_per_tile(num_q_heads, num_kv_heads, False, invariant=True), device
    )
    return AttentionMetadata(
        slot_mapping_T=torch.arange(cu_host[-1], device=device),
        cu_seqlens_q=cu, context_lens_B=lengths.contiguous(), block_tables_BM=tables_SL.contiguous(),
        max_q_len=packed.max_seqlen, max_context_len=packed.max_seqlen, is_decode=False,
        tile_seq=tile_seq, tile_q_start=tile_q_start,
    )


class _InvariantAttention(torch.autograd.Function):
    """Forward: the invariant Triton kernel. Backward: the fast packed attention, recomputed."""

    @staticmethod
    def forward(ctx, q_THD, k_THD, v_THD, sinks, attention, layer_index, scale, sliding_window, logit_softcap,
                chunk_size):
        from miles_host.kernels.paged_attention import paged_attention_triton

        meta = attention.metadata(q_THD.shape[1], k_THD.shape[1], q_THD.device)
        out = paged_attention_triton(
            q_THD.contiguous(), k_THD.unsqueeze(1), v_THD.unsqueeze(1), meta,
            scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap, invariant=True,
            sinks=sinks, chunk_size=chunk_size,
        )
        ctx.save_for_backward(q_THD, k_THD, v_THD, sinks)
        ctx.settings = (attention, layer_index, scale, sliding_window, logit_softcap, chunk_size)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        attention, layer_index, scale, sliding_window, logit_softcap, chunk_size = ctx.settings
        inputs = [x.detach().requires_grad_(need) if x is not None else None
                  for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[:4])]
        q, k, v, sinks = inputs
        extra = {} if sinks is None and chunk_size is None else dict(sinks=sinks, chunk_size=chunk_size)
        with torch.enable_grad():
            out = attention.packed.attend(
                layer_index, q, k, v, scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap, **extra
            )
            wanted = [x for x in inputs if x is not None and x.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True)) if wanted else iter(())
        return (*(next(grads) if x is not None and x.requires_grad else None for x in inputs),
                None, None, None, None, None, None)


# --------------------------------------------------------------------------- log-probs


def row_log_probs(
    hidden_TH: torch.Tensor, weight_VH: torch.Tensor, target_ids_T: torch.Tensor, temperature: float,
    logit_softcap: float | None, return_entropy: bool, chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 log-probs ``[T]`` of the targets (and entropy ``[T]``, else empty), rows
    computed as the engine computes its sampled tokens' (:func:`sampled_log_probs`)."""
    from miles_host.kernels.invariant_ops import batch_invariant_aten
    from miles_host.kernels.invariant_reduce import invariant_log_probs

    num_tokens = hidden_TH.shape[0]
    log_probs_T = hidden_TH.new_empty(num_tokens, dtype=torch.float32)
    entropy_T = hidden_TH.new_empty(num_tokens if return_entropy else 0, dtype=torch.float32)
    with batch_invariant_aten():
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            logits_CV = compute_logits(hidden_TH[start:end], weight_VH, logit_softcap)
            lp, entropy = invariant_log_probs(
                logits_CV, target_ids_T[start:end], temperature=temperature, return_entropy=return_entropy
            )
            log_probs_T[start:end] = lp
            if return_entropy:
                entropy_T[start:end] = entropy
    return log_probs_T, entropy_T


def sampled_log_probs(logits_BV: torch.Tensor, token_B: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """The engine's logprobs ``[B]`` of its sampled tokens (``logits_BV`` from
    :func:`compute_logits` under :func:`batch_invariant_aten`); a temperature <= 0
    (greedy) reports at temperature 1, as the trainer computes it."""
    from miles_host.kernels.invariant_reduce import invariant_log_probs

    temperatures = [float(t) if t > 0 else 1.0 for t in temperatures]
    distinct = sorted(set(temperatures))
    if len(distinct) == 1:
        return invariant_log_probs(logits_BV, token_B, temperature=distinct[0])[0]
    log_probs_B = torch.empty(logits_BV.shape[0], dtype=torch.float32, device=logits_BV.device)
    for temperature in distinct:
        rows = torch.tensor([i for i, t in enumerate(temperatures) if t == temperature], device=logits_BV.device)
        log_probs_B[rows] = invariant_log_probs(logits_BV[rows], token_B[rows], temperature=temperature)[0]
    return log_probs_B
