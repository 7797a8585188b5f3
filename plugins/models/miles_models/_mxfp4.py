"""MXFP4 expert weights (the published gpt-oss checkpoints), dequantized when loading.

OpenAI's gpt-oss checkpoints store each expert projection as ``{proj}_blocks``
(uint8 ``[E, R, G, 16]``: 32 FP4 (e2m1) values per group, two per byte, low nibble
first) and ``{proj}_scales`` (uint8 ``[E, R, G]``: a power-of-two exponent per
group of 32, biased by 127), rows ``R`` being the projection's output features.
Dequantized, ``value = FP4[nibble] * 2 ** (scale - 127)`` is exact in bfloat16 and
float32. miles trains and serves the dequantized weights and saves them unquantized.
"""

from __future__ import annotations

import torch

#: the 16 e2m1 values, indexed by the 4-bit code
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks_ERGB: torch.Tensor, scales_ERG: torch.Tensor) -> torch.Tensor:
    """``[E, R, G * 2B]`` float32 weights of MXFP4 ``blocks`` and ``scales``."""
    if blocks_ERGB.shape[:-1] != scales_ERG.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks_ERGB.shape)} and scales {tuple(scales_ERG.shape)} do not match "
            "(blocks [E, R, G, 16], scales [E, R, G])"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks_ERGB.device)
    codes = blocks_ERGB.to(torch.uint8)
    values = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1).flatten(-2)
    exponents = scales_ERG.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents[..., None].to(torch.float32)).flatten(-2)


class PairedParts:
    """Collects the two parts (``blocks``, ``scales``) of each quantized tensor as a load streams them."""

    def __init__(self) -> None:
        self._pending: dict[tuple, dict[str, torch.Tensor]] = {}

    def add(self, key: tuple, part: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Both parts once the second has arrived, else None."""
        parts = self._pending.setdefault(key, {})
        parts[part] = tensor
        if len(parts) < 2:
            return None
        return self._pending.pop(key)
