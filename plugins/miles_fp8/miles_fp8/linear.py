"""FP8 linears: :class:`Fp8Linear` for training, :class:`Fp8InferenceLinear` for rollout.

Training (DeepSeek-V3 / TransformerEngine Float8BlockScaling recipe, straight-through):

- forward ``y = Q_1x128(x) @ Q_128x128(W)^T``, ``W`` the float32 (or bf16) master weight;
- dgrad ``dx = Q_1x128(dy) @ Q_128x128(W)`` (the forward's FP8 weight, transposed blocks);
- wgrad ``dW = Q_1x128(dy^T) @ Q_1x128(x^T)^T``, both quantized along the token dim
  (``x^T`` is quantized in forward from the high-precision ``x``, so only FP8
  copies are kept for backward); the token dim is zero-padded to 128.

Rollout holds ``weight`` (float8_e4m3fn) and ``weight_scale_inv`` (float32 128x128
block scales), the names SGLang and vLLM load. Both sides run their forward GEMM
through :func:`miles_fp8.gemm.quantized_linear_mm` (at decode sizes one fused
quantize-and-multiply kernel, else quantize then :func:`block_scaled_mm`), so with
the weights that :func:`miles_fp8.recipe.convert_for_rollout` sends (quantized from
the master weights by the same code) train and rollout forwards agree ("unified FP8").
Tensor legend: M tokens, K in features, N out features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles_fp8.gemm import block_scaled_mm, quantized_linear_mm
from miles_fp8.quant import BLOCK, FP8_DTYPE, check_block_divisible, dequantize, quantize_act, quantize_weight


def _pad_rows(x_MK: torch.Tensor) -> torch.Tensor:
    pad = (-x_MK.shape[0]) % BLOCK
    return F.pad(x_MK, (0, 0, 0, pad)) if pad else x_MK


def _quantize_columns(x_MK: torch.Tensor, power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x^T`` quantized in 1x128 groups along M (M zero-padded to 128): ``[K, Mp]``, ``[K, Mp/128]``."""
    return quantize_act(_pad_rows(x_MK).t().contiguous(), power_of_two)


class _Fp8LinearFunction(torch.autograd.Function):
    """Forward and backward GEMMs in block-scaled FP8; gradients reach the master weight."""

    @staticmethod
    def forward(ctx, x_MK, weight_NK, bias_N, power_of_two):
        w_q, w_s = quantize_weight(weight_NK, power_of_two)
        y_MN = quantized_linear_mm(x_MK, w_q, w_s, power_of_two, x_MK.dtype)
        if bias_N is not None:
            y_MN = y_MN + bias_N.to(y_MN.dtype)
        saved = [w_q, w_s]
        if weight_NK.requires_grad:
            saved.extend(_quantize_columns(x_MK, power_of_two))
        ctx.save_for_backward(*saved)
        ctx.power_of_two = power_of_two
        ctx.num_tokens = x_MK.shape[0]
        ctx.x_dtype, ctx.weight_dtype = x_MK.dtype, weight_NK.dtype
        ctx.has_bias = bias_N is not None
        ctx.bias_dtype = bias_N.dtype if bias_N is not None else None
        return y_MN

    @staticmethod
    def backward(ctx, dy_MN):
        w_q, w_s, *x_cols = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dy_q, dy_s = quantize_act(dy_MN, ctx.power_of_two)
            dx = block_scaled_mm(dy_q, dy_s, w_q.t(), w_s.t(), out_dtype=ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dyT_q, dyT_s = _quantize_columns(dy_MN, ctx.power_of_two)
            xT_q, xT_s = x_cols
            dw = block_scaled_mm(dyT_q, dyT_s, xT_q, xT_s, out_dtype=torch.float32).to(ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy_MN.float().sum(dim=0).to(ctx.bias_dtype)
        return dx, dw, db, None


def _compute_input(x: torch.Tensor) -> torch.Tensor:
    """Under autocast, the GEMM input dtype an ``nn.Linear`` would have used (bf16 on GPU)."""
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, power_of_two: bool) -> torch.Tensor:
    """``F.linear`` with FP8 forward and backward GEMMs; ``x [..., K]``, ``weight [N, K]``."""
    x_MK = _compute_input(x).reshape(-1, x.shape[-1])
    if x_MK.shape[0] == 0:  # no rows (an expert without tokens): nothing to quantize, zero gradients
        cast = None if bias is None else bias.to(x_MK.dtype)
        return torch.nn.functional.linear(x_MK, weight.to(x_MK.dtype), cast).reshape(*x.shape[:-1], weight.shape[0])
    with torch.autocast(x.device.type, enabled=False):
        y_MN = _Fp8LinearFunction.apply(x_MK, weight, bias, power_of_two)
    return y_MN.reshape(*x.shape[:-1], weight.shape[0])


def fp8_inference_linear(
    x: torch.Tensor, weight_q: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None,
    power_of_two: bool,
) -> torch.Tensor:
    """Rollout-side forward with pre-quantized weights; the same arithmetic as :func:`fp8_linear`."""
    x_MK = _compute_input(x).reshape(-1, x.shape[-1])
    y_MN = quantized_linear_mm(x_MK, weight_q, weight_scale_inv, power_of_two, x_MK.dtype)
    if bias is not None:
        y_MN = y_MN + bias.to(y_MN.dtype)
    return y_MN.reshape(*x.shape[:-1], weight_q.shape[0])


class Fp8Linear(torch.nn.Linear):
    """An ``nn.Linear`` whose GEMMs run in block-scaled FP8; ``weight`` stays the master weight.

    Same parameters and state-dict names as the linear it replaces, so checkpoints,
    optimizers and weight sync see no difference.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 power_of_two: bool = False, name: str = "linear"):
        check_block_divisible((out_features, in_features), name)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.power_of_two = power_of_two

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, power_of_two: bool = False, name: str = "linear") -> "Fp8Linear":
        """Wrap ``linear``'s own parameters (no copy); ValueError naming ``name`` for bad dims."""
        check_block_divisible(tuple(linear.weight.shape), name)
        with torch.device("meta"):
            module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         power_of_two=power_of_two, name=name)
        module.weight = linear.weight
        module.bias = linear.bias
        module.train(linear.training)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.power_of_two)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8=block128, power_of_two={self.power_of_two}"


class _Fp8Buffers(torch.nn.Module):
    """Moves FP8 weights and float32 scales between devices but never changes their dtypes
    (``model.to(torch.bfloat16)`` would otherwise turn them into bf16 tensors)."""

    _keep_dtype: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        kept = {name: getattr(self, name) for name in self._keep_dtype}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = getattr(self, name)
            if after.dtype != before.dtype:
                self._buffers[name] = before.to(after.device)
        return self


class Fp8InferenceLinear(_Fp8Buffers):
    """Rollout linear: ``weight`` (float8_e4m3fn ``[N, K]``) + ``weight_scale_inv`` (float32 ``[N/128, K/128]``).

    A :class:`~miles_host.models.self_attention.DequantizableLinear`: MLA's latent path reads
    ``kv_b_proj`` as ``weight * scale`` in the activations' dtype."""

    _keep_dtype = ("weight", "weight_scale_inv")
    can_dequantize = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None,
                 bias_dtype: torch.dtype = torch.bfloat16, power_of_two: bool = False, name: str = "linear"):
        super().__init__()
        check_block_divisible((out_features, in_features), name)
        self.in_features, self.out_features, self.power_of_two = in_features, out_features, power_of_two
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer(
            "weight_scale_inv",
            torch.ones(out_features // BLOCK, in_features // BLOCK, dtype=torch.float32, device=device),
        )
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device) if bias else None)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: torch.nn.Linear, power_of_two: bool = False, name: str = "linear") -> "Fp8InferenceLinear":
        """Quantize ``linear``'s weight (128x128 blocks); the bias keeps its dtype."""
        check_block_divisible(tuple(linear.weight.shape), name)
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                     device=linear.weight.device, bias_dtype=linear.weight.dtype, power_of_two=power_of_two, name=name)
        module.weight, module.weight_scale_inv = quantize_weight(linear.weight.detach(), power_of_two)
        if linear.bias is not None:
            module.bias = linear.bias.detach().clone()
        return module

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``weight`` times its block scales, as ``dtype``."""
        return dequantize(self.weight, self.weight_scale_inv, torch.float32).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_inference_linear(x, self.weight, self.weight_scale_inv, self.bias, self.power_of_two)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8=block128"
