"""Batch-invariant forward (``--true-on-policy``): every token computed on its own.

The result of a token must not depend on which other tokens share its forward
(the batch, the packing of a training micro-batch, a prefill chunk or a decode
step). Kernels pick their reduction order from the shapes they see (GEMM
blocking, split-K, vectorised bodies vs scalar tails of elementwise and
reduction loops), so this mode gives every op the same shapes for a token
wherever it is computed:

- **one token at a time through every module**: each decoder layer is called
  with ``[1, H]`` activations, so every linear layer is one ``[1, K] x [K, N]``
  product, every norm, activation, rotary table and router softmax one row;
  the MoE block routes and combines one token (experts in a fixed, sorted order);
- **attention of one query over exactly its own causal context** by one function,
  :func:`attend_one`, used by training (:class:`PackedTokenAttention`, keys of
  the current forward) and by the engine's prefill and decode
  (:class:`PagedTokenAttention`, keys read back from the paged cache): scores
  ``q_t K[lo..t]^T``, softmax in float32, ``p V`` -- the same ``[Hq, 1, L]``
  shapes for the token at position ``t`` on both sides;
- **the log-prob by one function**, :func:`log_softmax_row`, for the engine's
  sampled tokens and for the trainer's log-prob head (:func:`token_log_probs`).

Inputs of every kernel are fresh allocations (``clone`` / ``stack`` /
``index_select``), so the memory alignment a kernel sees cannot differ either.
The mode is slow (a Python loop over tokens and layers): it is the CPU float32
construction and the plain-PyTorch reference of the GPU path.
Gradients flow through the same per-token ops (the log-prob head recomputes
its backward with the fast chunked formula: only forward values must match).

GPU: :mod:`miles_host.models.invariant_gpu` gives the same guarantee for the
whole batch at once with batch-invariant kernels (fixed-tile matmul without
split-K, one program per row for norms and log-softmax, attention with key
blocks from position 0 for decode, prefill and training alike, an ordered MoE
combine); the trainer runs the engine's dtype flow (bf16 weights and
activations, not fp32 masters under autocast), and backward passes use the fast
kernels (only forward values must match).

Tensor legend: T tokens, H hidden, N heads (Nq query, Nkv key/value), D head dim,
L context length of one query, V vocabulary.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from miles_host.models.context import ForwardContext, RoutingContext

# --------------------------------------------------------------------------- threads


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """One CPU intra-op thread while inside (restored after).

    A CPU reduction may be split across threads (its order then depends on the
    thread count), and for the tiny per-token ops of this mode the thread
    hand-offs cost far more than they save, badly so on a loaded machine. The
    setting is process-wide: the engine and trainer of one process take turns.
    """
    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# --------------------------------------------------------------------------- attention


def attend_one(
    q_1ND: torch.Tensor,
    k_LND: torch.Tensor,
    v_LND: torch.Tensor,
    *,
    scale: float,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ONE query ``[1, Nq, D]`` over its whole visible context ``[L, Nkv, D]``.

    The caller passes exactly the keys/values the query sees (causal, sliding-window
    and chunk limits already applied, in position order), so there is no
    mask and the shapes depend only on the query's position. Float32 scores,
    softmax and ``p V``; returns ``[1, Nq, Dv]`` in ``q``'s dtype. ``sinks``: ``[Nq]``
    sink logits, one more softmax column whose probability is dropped.
    """
    dtype = q_1ND.dtype
    num_q_heads, num_kv_heads = q_1ND.shape[1], k_LND.shape[1]
    k_LND, v_LND = k_LND.float(), v_LND.float()
    if num_q_heads != num_kv_heads:
        group = num_q_heads // num_kv_heads
        k_LND = k_LND.repeat_interleave(group, dim=1)
        v_LND = v_LND.repeat_interleave(group, dim=1)
    q_N1D = q_1ND.float().transpose(0, 1).contiguous()
    k_NDL = k_LND.permute(1, 2, 0).contiguous()
    v_NLD = v_LND.transpose(0, 1).contiguous()
    scores_N1L = torch.bmm(q_N1D, k_NDL) * scale
    if logit_softcap is not None:
        scores_N1L = torch.tanh(scores_N1L / logit_softcap) * logit_softcap
    if sinks is not None:
        scores_N1L = torch.cat((scores_N1L, sinks.float().view(-1, 1, 1)), dim=-1)
        probs_N1L = torch.softmax(scores_N1L, dim=-1)[..., :-1].contiguous()
    else:
        probs_N1L = torch.softmax(scores_N1L, dim=-1)
    out_N1D = torch.bmm(probs_N1L, v_NLD)
    return out_N1D.transpose(0, 1).contiguous().to(dtype)


def context_start(position: int, sliding_window: int | None, chunk_size: int | None = None) -> int:
    """First position a query at ``position`` sees (keys in ``(p - window, p]``; with
    ``chunk_size``, not before the start of its chunk)."""
    start = 0 if sliding_window is None else max(0, position - sliding_window + 1)
    return start if chunk_size is None else max(start, position - position % chunk_size)


class PackedTokenAttention:
    """Training side: per-token attention within the packed sequences of one forward.

    Keys/values of the forward are kept per layer and token index; the query of
    token ``t`` attends over its own sequence's tokens up to ``t``.
    """

    def __init__(self, cu_seqlens: torch.Tensor):
        cu = [int(c) for c in cu_seqlens.tolist()]
        self.num_tokens = cu[-1]
        self.seq_start: list[int] = []
        for start, end in zip(cu[:-1], cu[1:]):
            self.seq_start.extend([start] * (end - start))
        self._k: dict[int, list[torch.Tensor | None]] = {}
        self._v: dict[int, list[torch.Tensor | None]] = {}

    def attend_token(self, layer_index, t, q_1ND, k_1ND, v_1ND, *, scale, sliding_window=None, logit_softcap=None,
                     sinks=None, chunk_size=None):
        keys = self._k.setdefault(layer_index, [None] * self.num_tokens)
        values = self._v.setdefault(layer_index, [None] * self.num_tokens)
        keys[t], values[t] = k_1ND[0], v_1ND[0]
        start = self.seq_start[t]
        lo = start + context_start(t - start, sliding_window, chunk_size)
        k_LND = torch.stack(keys[lo : t + 1])
        v_LND = torch.stack(values[lo : t + 1])
        return attend_one(q_1ND, k_LND, v_LND, scale=scale, logit_softcap=logit_softcap, sinks=sinks)


class PagedTokenAttention:
    """Engine side: per-token attention of ONE sequence over a paged KV cache.

    ``k_caches[layer]``/``v_caches[layer]``: ``[blocks, block_size, Nkv, D]``;
    ``block_table``: the sequence's block ids; the forward's token ``t`` sits at
    position ``first_position + t``. Each token's key/value is written to its slot,
    then its context is read back from the cache (exact copies), so prefill and
    decode see the keys a training pass computes.
    """

    def __init__(self, k_caches, v_caches, block_table: list[int], block_size: int, first_position: int):
        self.k_caches, self.v_caches = k_caches, v_caches
        self.block_size = block_size
        self.first_position = int(first_position)
        self.block_table = torch.tensor(block_table, dtype=torch.long, device=k_caches[0].device)

    def _slots(self, positions: torch.Tensor) -> torch.Tensor:
        return self.block_table[positions // self.block_size] * self.block_size + positions % self.block_size

    def attend_token(self, layer_index, t, q_1ND, k_1ND, v_1ND, *, scale, sliding_window=None, logit_softcap=None,
                     sinks=None, chunk_size=None):
        k_cache, v_cache = self.k_caches[layer_index], self.v_caches[layer_index]
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        position = self.first_position + t
        slot = self._slots(torch.tensor([position], device=k_cache.device))
        k_flat.index_copy_(0, slot, k_1ND.to(k_cache.dtype))
        v_flat.index_copy_(0, slot, v_1ND.to(v_cache.dtype))
        positions = torch.arange(context_start(position, sliding_window, chunk_size), position + 1, device=k_cache.device)
        slots = self._slots(positions)
        return attend_one(
            q_1ND, k_flat.index_select(0, slots), v_flat.index_select(0, slots),
            scale=scale, logit_softcap=logit_softcap, sinks=sinks,
        )


class _TokenSlot:
    """The ``AttentionContext`` one token's layer call sees: routes to ``attend_token``."""

    __slots__ = ("inner", "t")

    def __init__(self, inner, t: int):
        self.inner, self.t = inner, t

    def attend(self, layer_index, q_THD, k_THD, v_THD, *, scale, sliding_window=None, logit_softcap=None,
               sinks=None, chunk_size=None):
        if q_THD.shape[0] != 1:
            raise ValueError(f"batch-invariant attention gets one token at a time, got {q_THD.shape[0]}")
        extra = {} if sinks is None and chunk_size is None else dict(sinks=sinks, chunk_size=chunk_size)
        return self.inner.attend_token(
            layer_index, self.t, q_THD, k_THD, v_THD,
            scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap, **extra,
        )


def token_attention(attention: Any) -> Any:
    """The per-token form of a forward's attention context."""
    from miles_host.models.attention import PackedAttention

    if hasattr(attention, "attend_token"):
        return attention
    if isinstance(attention, PackedAttention):
        return PackedTokenAttention(attention.cu_seqlens)
    raise TypeError(
        f"batch-invariant mode needs a PackedAttention or a context with attend_token, got {type(attention).__name__}"
    )


# --------------------------------------------------------------------------- forward


def _token_routing(routing: RoutingContext, t: int) -> RoutingContext:
    """One token's routing context: replay rows sliced, its own ``captured``, shared ``extra``."""
    return RoutingContext(
        phase=routing.phase,
        replay_expert_ids={layer: ids[t : t + 1] for layer, ids in routing.replay_expert_ids.items()},
        captured={},
        extra=routing.extra,
    )


def forward_hidden(model, input_ids_T: torch.Tensor, positions_T: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """``CausalLM.forward_hidden`` computed one token at a time: final-norm hidden ``[T, H]``.

    Layer-major: layer ``i`` runs over the tokens in order, so token ``t`` finds
    the keys/values of the tokens before it in that layer's store.
    """
    with single_threaded():
        return _forward_hidden(model, input_ids_T, positions_T, ctx)


def _forward_hidden(model, input_ids_T, positions_T, ctx):
    num_tokens = int(input_ids_T.shape[0])
    if num_tokens == 0:
        return model.embed(input_ids_T)
    attention = token_attention(ctx.attention)
    rows = [model.embed(input_ids_T[t : t + 1].clone()) for t in range(num_tokens)]
    dtype = rows[0].dtype
    tables = [model._rope_tables(positions_T[t : t + 1].clone(), dtype) for t in range(num_tokens)]
    contexts = [
        ForwardContext(attention=_TokenSlot(attention, t), routing=_token_routing(ctx.routing, t))
        for t in range(num_tokens)
    ]
    for i, layer in enumerate(model.layers):
        key = id(model.config.rope_of(i))
        rows = [layer(rows[t], tables[t][key], contexts[t]) for t in range(num_tokens)]
    for layer_index in contexts[0].routing.captured:
        ctx.routing.captured[layer_index] = torch.cat([c.routing.captured[layer_index] for c in contexts])
    return torch.cat([model.norm(row) for row in rows])


# --------------------------------------------------------------------------- log-probs


def log_softmax_row(
    hidden_1H: torch.Tensor, weight_VH: torch.Tensor, temperature: float = 1.0, logit_softcap: float | None = None
) -> torch.Tensor:
    """``log_softmax(softcap(h W^T) / temperature)`` of ONE row, float32 ``[1, V]``.

    THE log-prob function of true on-policy: the engine reports its sampled
    tokens' logprobs with it and the trainer's log-prob head computes with it.
    """
    logits_1V = F.linear(hidden_1H.clone(), weight_VH).float()
    if logit_softcap is not None:
        logits_1V = torch.tanh(logits_1V / logit_softcap) * logit_softcap
    return torch.log_softmax(logits_1V / float(temperature), dim=-1)


def _cpu_rows(hidden_TH, weight_VH, target_ids_T, temperature, softcap, return_entropy):
    num_tokens = hidden_TH.shape[0]
    log_probs_T = hidden_TH.new_empty(num_tokens, dtype=torch.float32)
    entropy_T = hidden_TH.new_empty(num_tokens if return_entropy else 0, dtype=torch.float32)
    targets = target_ids_T.tolist()
    with single_threaded():
        for t in range(num_tokens):
            row_1V = log_softmax_row(hidden_TH[t : t + 1], weight_VH, temperature, softcap)
            log_probs_T[t] = row_1V[0, targets[t]]
            if return_entropy:
                entropy_T[t] = -(row_1V.exp() * row_1V).sum()
    return log_probs_T, entropy_T


class _TokenLogProbs(torch.autograd.Function):
    """Forward: :func:`log_softmax_row` per token on CPU, the engine's invariant GPU
    formula on CUDA (:func:`miles_host.models.invariant_gpu.row_log_probs`).
    Backward: the fast chunked formula."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, target_ids_T, temperature, softcap, return_entropy):
        if hidden_TH.is_cuda:  # the engine's GPU formula (models.invariant_gpu)
            from miles_host.models.invariant_gpu import row_log_probs

            log_probs_T, entropy_T = row_log_probs(
                hidden_TH, weight_VH, target_ids_T, temperature, softcap, return_entropy
            )
        else:
            log_probs_T, entropy_T = _cpu_rows(hidden_TH, weight_VH, target_ids_T, temperature, softcap, return_entropy)
        ctx.save_for_backward(hidden_TH, weight_VH, target_ids_T)
        ctx.settings = (temperature, softcap, return_entropy)
        return log_probs_T, entropy_T

    @staticmethod
    def backward(ctx, grad_log_probs_T, grad_entropy_T):
        from miles_host.models.logprobs import chunked_log_probs

        hidden_TH, weight_VH, target_ids_T = ctx.saved_tensors
        temperature, softcap, return_entropy = ctx.settings
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.enable_grad():
            hidden = hidden_TH.detach().requires_grad_(need_hidden)
            weight = weight_VH.detach().requires_grad_(need_weight)
            log_probs, entropy = chunked_log_probs(
                hidden, weight, target_ids_T, temperature=temperature, logit_softcap=softcap,
                return_entropy=return_entropy,
            )
            outputs, grads = [log_probs], [grad_log_probs_T]
            if return_entropy and grad_entropy_T is not None:
                outputs.append(entropy)
                grads.append(grad_entropy_T)
            inputs = [x for x, need in ((hidden, need_hidden), (weight, need_weight)) if need]
            computed = list(torch.autograd.grad(outputs, inputs, grads, allow_unused=True)) if inputs else []
        grad_hidden = computed.pop(0) if need_hidden else None
        grad_weight = computed.pop(0) if need_weight else None
        return grad_hidden, grad_weight, None, None, None, None


def token_log_probs(
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    target_ids_T: torch.Tensor,
    *,
    temperature: float = 1.0,
    logit_softcap: float | None = None,
    return_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Batch-invariant :func:`~miles_host.models.logprobs.chunked_log_probs`: float32
    log-probs of the targets (and entropy), each row by :func:`log_softmax_row`."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    log_probs_T, entropy_T = _TokenLogProbs.apply(
        hidden_TH, weight_VH, target_ids_T.long(), float(temperature), logit_softcap, return_entropy
    )
    return log_probs_T, (entropy_T if return_entropy else None)


def sampled_token_log_prob(model, hidden_1H: torch.Tensor, token_id: int, temperature: float) -> float:
    """The engine's reported logprob of a sampled token (``temperature <= 0``: greedy, 1.0)."""
    temperature = float(temperature) if temperature > 0 else 1.0
    with single_threaded():
        row_1V = log_softmax_row(
            hidden_1H, model.lm_head_weight, temperature, model.config.final_logit_softcap
        )
    return float(row_1V[0, int(token_id)])
