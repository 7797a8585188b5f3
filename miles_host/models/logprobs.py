"""Per-token log-probabilities of target tokens, computed in chunks of tokens.

``chunked_log_probs`` never materialises float32 logits for the whole batch:
forward and backward both walk the tokens ``chunk_size`` at a time and recompute
each chunk's logits from the hidden states (one extra lm-head matmul in
backward, no stored ``[T, V]`` tensor). Tensor legend: T tokens, H hidden,
V vocab, C chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_logits(hidden_TH: torch.Tensor, weight_VH: torch.Tensor, logit_softcap: float | None,
                   matmul=F.linear) -> torch.Tensor:
    """``[T, V]`` logits in the hidden states' dtype, final soft-capping applied in that dtype
    (what the engine samples from); ``matmul(x, w)`` is ``x @ w^T`` (the engine's decode steps:
    :func:`~miles_host.kernels.small_m_gemm.swept_matmul`)."""
    logits_TV = matmul(hidden_TH, weight_VH)
    if logit_softcap is not None:
        logits_TV = torch.tanh(logits_TV / logit_softcap) * logit_softcap
    return logits_TV


def _chunk_logits(hidden_CH, weight_VH, temperature, softcap):
    """Float32 logits of one chunk, as ``compute_logits`` + temperature would give."""
    logits_CV = F.linear(hidden_CH, weight_VH).float()
    capped_CV = logits_CV
    if softcap is not None:
        capped_CV = torch.tanh(logits_CV / softcap) * softcap
    return logits_CV, capped_CV / temperature


def token_log_probs(
    logits_TV: torch.Tensor, target_ids_T: torch.Tensor, temperature: float = 1.0, return_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits / temperature) at the targets (and entropy), float32."""
    scaled = logits_TV.float() / temperature
    log_probs_TV = torch.log_softmax(scaled, dim=-1)
    log_probs_T = log_probs_TV.gather(1, target_ids_T[:, None]).squeeze(1)
    entropy_T = None
    if return_entropy:
        entropy_T = -(log_probs_TV.exp() * log_probs_TV).sum(-1)
    return log_probs_T, entropy_T


def _autocast_weight(weight_VH: torch.Tensor, hidden_TH: torch.Tensor) -> torch.Tensor:
    """The lm-head weight as autocast would cast it for each chunk's GEMM, cast once: autocast
    caches a cast only for a weight that requires grad, so a frozen head (LoRA's, a reference
    model's) would be read and cast again for every chunk, forward and backward."""
    device = hidden_TH.device.type
    if not torch.is_autocast_enabled(device) or not weight_VH.is_floating_point():
        return weight_VH
    dtype = torch.get_autocast_dtype(device)
    return weight_VH if weight_VH.dtype == dtype else weight_VH.to(dtype)


class _ChunkedLogProbs(torch.autograd.Function):
    # backward runs under the forward's autocast state: its recomputed logits and its two
    # GEMMs per chunk take the forward's precision (bf16 under bf16 autocast), not the fp32
    # of the master weights (fp32 GEMMs over the vocabulary were most of a GRPO train step)
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden_TH, weight_VH, target_ids_T, temperature, softcap, chunk_size, return_entropy):
        num_tokens = hidden_TH.shape[0]
        log_probs_T = hidden_TH.new_empty(num_tokens, dtype=torch.float32)
        entropy_T = hidden_TH.new_empty(num_tokens if return_entropy else 0, dtype=torch.float32)
        compute_weight_VH = _autocast_weight(weight_VH, hidden_TH)
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            _, scaled_CV = _chunk_logits(hidden_TH[start:end], compute_weight_VH, temperature, softcap)
            lse_C = torch.logsumexp(scaled_CV, dim=-1)
            log_probs_T[start:end] = scaled_CV.gather(1, target_ids_T[start:end, None]).squeeze(1) - lse_C
            if return_entropy:
                probs_CV = torch.exp(scaled_CV - lse_C[:, None])
                entropy_T[start:end] = lse_C - (probs_CV * scaled_CV).sum(-1)
        ctx.save_for_backward(hidden_TH, weight_VH, target_ids_T, entropy_T)
        ctx.settings = (temperature, softcap, chunk_size, return_entropy)
        return log_probs_T, entropy_T

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_log_probs_T, grad_entropy_T):
        hidden_TH, weight_VH, target_ids_T, entropy_T = ctx.saved_tensors
        temperature, softcap, chunk_size, return_entropy = ctx.settings
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden_TH = torch.empty_like(hidden_TH) if need_hidden else None
        grad_weight_VH = torch.zeros_like(weight_VH, dtype=torch.float32) if need_weight else None
        num_tokens = hidden_TH.shape[0]
        compute_weight_VH = _autocast_weight(weight_VH, hidden_TH)
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            hidden_CH = hidden_TH[start:end]
            logits_CV, scaled_CV = _chunk_logits(hidden_CH, compute_weight_VH, temperature, softcap)
            log_probs_CV = torch.log_softmax(scaled_CV, dim=-1)
            probs_CV = log_probs_CV.exp()
            # d log p_target / d z = onehot - p
            grad_CV = probs_CV * (-grad_log_probs_T[start:end, None])
            grad_CV.scatter_add_(1, target_ids_T[start:end, None], grad_log_probs_T[start:end, None].float())
            if return_entropy and grad_entropy_T is not None:
                # d H / d z_j = -p_j (log p_j + H)
                grad_CV -= grad_entropy_T[start:end, None] * probs_CV * (log_probs_CV + entropy_T[start:end, None])
            grad_CV = grad_CV / temperature
            if softcap is not None:
                grad_CV = grad_CV * (1 - torch.tanh(logits_CV / softcap) ** 2)
            grad_CV = grad_CV.to(hidden_TH.dtype)
            if need_hidden:
                grad_hidden_TH[start:end] = grad_CV @ compute_weight_VH
            if need_weight:
                grad_weight_VH += (grad_CV.t() @ hidden_CH).float()
        if grad_weight_VH is not None:
            grad_weight_VH = grad_weight_VH.to(weight_VH.dtype)
        return grad_hidden_TH, grad_weight_VH, None, None, None, None, None


def chunked_log_probs(
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    target_ids_T: torch.Tensor,
    *,
    temperature: float = 1.0,
    logit_softcap: float | None = None,
    chunk_size: int = 1024,
    return_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(softcap(hidden @ W.T) / temperature)`` at ``target_ids`` (float32).

    Returns ``(log_probs_T, entropy_T or None)``; differentiable w.r.t. hidden
    states and the lm-head weight. Peak extra memory is a few ``[C, V]``
    float32 buffers.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    log_probs_T, entropy_T = _ChunkedLogProbs.apply(
        hidden_TH, weight_VH, target_ids_T.long(), float(temperature), logit_softcap, int(chunk_size), return_entropy
    )
    return log_probs_T, (entropy_T if return_entropy else None)
