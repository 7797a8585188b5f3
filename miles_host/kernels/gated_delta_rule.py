"""The gated delta rule (Gated DeltaNet linear attention) and its short causal convolution.

Per value head the layer keeps a state ``S`` (``[K, V]``) and, for each token with
L2-normalised query ``q`` and key ``k``, value ``v``, log-decay ``g <= 0`` and write
strength ``beta``::

    S <- exp(g) * S
    S <- S + k (beta * (v - S^T k))^T        (the delta rule: overwrite what k recalls)
    o  = S^T (q / sqrt(K))

Three forms compute it:

- :func:`recurrent_step`: one token per sequence from a state, batched over sequences
  (the engine's decode step).
- :func:`chunked_reference`: the plain-PyTorch chunked form (training and prefill on
  CPU): within a chunk of ``N`` tokens the delta rule's writes solve one unit lower
  triangular system, chunks pass the state along. Differentiable.
- flash-linear-attention's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``
  (Triton) on CUDA when ``fla`` imports (:func:`fla_kernels`); never required.

:func:`gated_delta_rule` picks among them. Tensor legend: T tokens, S sequences, H value
heads, K key head dim, V value head dim, C conv channels, W conv width, N chunk length.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn.functional as F

L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (flash-linear-attention's convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """Float32 copies with q/k normalised and q scaled by ``K^-0.5``."""
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    return q * q.shape[-1] ** -0.5, k, v.float(), g.float(), beta.float()


def recurrent_step(
    q_SHK: torch.Tensor, k_SHK: torch.Tensor, v_SHV: torch.Tensor, g_SH: torch.Tensor, beta_SH: torch.Tensor,
    state_SHKV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of every sequence: ``(o [S, H, V] float32, new state [S, H, K, V] float32)``."""
    q, k, v, g, beta = _prepare(q_SHK, k_SHK, v_SHV, g_SH, beta_SH)
    state = state_SHKV.float() * g.exp()[..., None, None]
    recalled_SHV = (state * k[..., None]).sum(dim=-2)
    delta_SHV = (v - recalled_SHV) * beta[..., None]
    state = state + k[..., :, None] * delta_SHV[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def chunked_reference(
    q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor, beta_TH: torch.Tensor,
    initial_state_HKV: torch.Tensor | None = None, chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in chunks: ``(o [T, H, V] float32, final state [H, K, V] float32)``.

    Within a chunk, with ``G_i`` the cumulative log-decay up to token ``i`` and the
    per-token writes ``u_i = beta_i (v_i - S_{i-1}^T k_i)``, the writes satisfy
    ``(I + A) u = beta (v - exp(G) K S_0)`` with ``A_ij = beta_i exp(G_i - G_j) k_i.k_j``
    for ``j < i``; outputs and the chunk's final state follow from ``u`` by matmuls.
    """
    q, k, v, g, beta = _prepare(q_THK, k_THK, v_THV, g_TH, beta_TH)
    num_tokens, num_heads, key_dim = k.shape
    state = (
        torch.zeros(num_heads, key_dim, v.shape[-1], dtype=torch.float32, device=v.device)
        if initial_state_HKV is None else initial_state_HKV.float()
    )
    outputs = []
    for start in range(0, num_tokens, chunk_size):
        rows = slice(start, min(start + chunk_size, num_tokens))
        # heads first: [H, N, *]
        q_c, k_c, v_c = (x[rows].transpose(0, 1) for x in (q, k, v))
        g_c, beta_c = g[rows].transpose(0, 1), beta[rows].transpose(0, 1)
        cum_HN = g_c.cumsum(dim=-1)
        n = cum_HN.shape[-1]
        causal_NN = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
        log_ratio_HNN = (cum_HN[:, :, None] - cum_HN[:, None, :]).masked_fill(~causal_NN, float("-inf"))
        decay_HNN = log_ratio_HNN.exp()
        strict_HNN = (k_c @ k_c.transpose(1, 2)) * decay_HNN * beta_c[:, :, None]
        system_HNN = torch.eye(n, device=v.device) + strict_HNN.tril(-1)
        right_HNV = beta_c[..., None] * (v_c - cum_HN.exp()[..., None] * (k_c @ state))
        u_HNV = torch.linalg.solve_triangular(system_HNN, right_HNV, upper=False, unitriangular=True)
        scores_HNN = (q_c @ k_c.transpose(1, 2)) * decay_HNN
        o_HNV = cum_HN.exp()[..., None] * (q_c @ state) + scores_HNN @ u_HNV
        to_end_HN = (cum_HN[:, -1:] - cum_HN).exp()
        state = cum_HN[:, -1].exp()[:, None, None] * state + (k_c * to_end_HN[..., None]).transpose(1, 2) @ u_HNV
        outputs.append(o_HNV.transpose(0, 1))
    return torch.cat(outputs, dim=0), state


@functools.lru_cache(maxsize=1)
def fla_kernels():
    """``(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)`` from flash-linear-attention,
    or None when it does not import (it is optional)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def uses_fla(x: torch.Tensor) -> bool:
    """Whether :func:`gated_delta_rule` runs flash-linear-attention's kernels on ``x``."""
    return x.is_cuda and fla_kernels() is not None


def gated_delta_rule(
    q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor, beta_TH: torch.Tensor,
    lengths: Sequence[int], initial_states_SHKV: torch.Tensor | None = None, *, use_fla: bool | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over packed sequences of ``lengths`` tokens, each from its initial state (zeros
    when None): ``(o [T, H, V] float32, final states [S, H, K, V] float32)``.

    Query/key heads are already repeated to the value heads. ``use_fla`` (default: on CUDA when
    ``fla`` imports) runs flash-linear-attention's varlen kernels; otherwise single-token
    sequences (decode) take :func:`recurrent_step` together and longer ones
    :func:`chunked_reference` one by one.
    """
    num_seqs, (num_heads, key_dim), value_dim = len(lengths), k_THK.shape[1:], v_THV.shape[-1]
    if initial_states_SHKV is None:
        initial_states_SHKV = torch.zeros(num_seqs, num_heads, key_dim, value_dim, dtype=torch.float32, device=v_THV.device)
    if use_fla is None:
        use_fla = uses_fla(v_THV)
    if use_fla:  # pragma: no cover - CUDA with fla only
        return _fla_rule(q_THK, k_THK, v_THV, g_TH, beta_TH, lengths, initial_states_SHKV)
    if all(n == 1 for n in lengths):
        return recurrent_step(q_THK, k_THK, v_THV, g_TH, beta_TH, initial_states_SHKV)
    outputs, finals, start = [], [], 0
    for s, n in enumerate(lengths):
        rows = slice(start, start + n)
        o, final = chunked_reference(
            q_THK[rows], k_THK[rows], v_THV[rows], g_TH[rows], beta_TH[rows], initial_states_SHKV[s], chunk_size
        )
        outputs.append(o)
        finals.append(final)
        start += n
    return torch.cat(outputs, dim=0), torch.stack(finals)


def _fla_rule(q, k, v, g, beta, lengths, initial_states):  # pragma: no cover - CUDA with fla only
    """flash-linear-attention's kernels, every tensor passed by keyword: the positional order
    differs between its versions (0.6's ``fused_recurrent_gated_delta_rule`` has ``gk`` and
    ``gv`` between ``g`` and ``beta``)."""
    chunk, fused_recurrent = fla_kernels()
    dtype = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.float32
    tensors = {"q": q.to(dtype)[None], "k": k.to(dtype)[None], "v": v.to(dtype)[None], "g": g.float()[None],
               "beta": beta.to(dtype)[None]}
    common = {"initial_state": initial_states.float(), "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    if all(n == 1 for n in lengths):  # decode: each sequence one token, batched as [S, 1, ...]
        o, final = fused_recurrent(**{name: x[0][:, None] for name, x in tensors.items()}, **common)
        return o[:, 0].float(), final
    cu_seqlens = torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()], dtype=torch.long, device=v.device)
    o, final = chunk(**tensors, cu_seqlens=cu_seqlens, **common)
    return o[0].float(), final


# ---------------------------------------------------------------------------- short convolution


def causal_conv(
    x_TC: torch.Tensor, weight_CW: torch.Tensor, lengths: Sequence[int], states_SCw: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution + SiLU of packed sequences, each continuing from its last
    ``W - 1`` inputs (``states``, zeros when None): ``(y [T, C], new states [S, C, W - 1])``."""
    num_channels, width = weight_CW.shape
    num_seqs = len(lengths)
    if states_SCw is None:
        states_SCw = x_TC.new_zeros(num_seqs, num_channels, width - 1)
    states_SCw = states_SCw.to(x_TC.dtype)
    if all(n == 1 for n in lengths):  # decode: one window per sequence
        window_SCW = torch.cat((states_SCw, x_TC[:, :, None]), dim=-1)
        y_SC = (window_SCW.to(weight_CW.dtype) * weight_CW).sum(dim=-1)
        return F.silu(y_SC).to(x_TC.dtype), window_SCW[:, :, 1:]
    outputs, new_states, start = [], [], 0
    for s, n in enumerate(lengths):
        window_CL = torch.cat((states_SCw[s], x_TC[start:start + n].transpose(0, 1)), dim=-1)
        y_CL = F.conv1d(window_CL[None].to(weight_CW.dtype), weight_CW[:, None, :], groups=num_channels)[0]
        outputs.append(F.silu(y_CL).transpose(0, 1).to(x_TC.dtype))
        new_states.append(window_CL[:, window_CL.shape[-1] - (width - 1):])
        start += n
    return torch.cat(outputs, dim=0), torch.stack(new_states)
