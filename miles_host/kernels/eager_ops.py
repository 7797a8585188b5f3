"""The plain-PyTorch math that the fused kernels compute: the models run it where no
kernel applies (CPU, gradients of the eager path) and the kernels' tests use it as their
reference. It lives here, below the models, so that kernels never import a model module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """The norm in plain PyTorch (also the reference of the fused kernel)."""
    dtype = x.dtype
    x_fp32 = x.float()
    x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x_fp32 * (1.0 + weight.float())).to(dtype)
    return weight * x_fp32.to(dtype)


def apply_rotary(x_THD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the first ``2R`` dims of every head; the remaining dims pass through.

    Interleaved pairs come out de-interleaved (rotated evens, then odds): the
    same permutation is applied to queries and keys, so attention scores are
    those of the interleaved layout (as transformers' DeepSeek does).
    """
    rotary = 2 * cos_TR.shape[-1]
    x_rot, x_pass = x_THD[..., :rotary], x_THD[..., rotary:]
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
    else:
        x1, x2 = x_rot[..., : rotary // 2], x_rot[..., rotary // 2 :]
    cos, sin = cos_TR[:, None, :], sin_TR[:, None, :]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if x_pass.shape[-1] == 0:
        return rotated
    return torch.cat((rotated, x_pass), dim=-1)


def activation(name: str):
    """The elementwise activation of a gated MLP by config name."""
    if name == "silu":
        return F.silu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported activation {name!r}")


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss' gated activation: ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
    ``(u + 1) * (g * sigmoid(alpha * g))`` (the fused epilogue rounds each of these ops in turn)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gated_activation(gate: torch.Tensor, up: torch.Tensor, act, swiglu_limit: float | None = None,
                     swiglu_alpha: float = 1.0) -> torch.Tensor:
    """A gated MLP's hidden: ``act(gate) * up``, or :func:`clamped_swiglu` where ``swiglu_limit`` is set."""
    if swiglu_limit is None:
        return act(gate) * up
    return clamped_swiglu(gate, up, swiglu_limit, swiglu_alpha)
