"""The check the quantized plugins' grouped expert GEMVs share (not collected by itself)."""

from __future__ import annotations

from typing import Callable

import torch

from miles_host.kernels import switches
from miles_host.kernels.moe_configs import moe_tiles
from miles_host.kernels.moe_grouped import ExpertGemms, plan


def assert_gemv_matches_the_tensor_core_kernel(gemms: ExpertGemms, x_TH: torch.Tensor, ids_TK: torch.Tensor,
                                               weights_TK: torch.Tensor, switch: switches.Switch,
                                               takes_gemv: Callable[[object], bool]) -> None:
    """Both projections with ``switch`` (the GEMV's most tokens) at the batch's token count, then at 0: the pair
    rows agree within a bf16 rounding and are finite; the padding rows are left alone (NaN-filled here)."""
    num_tokens, top_k = ids_TK.shape
    layout = plan(ids_TK, weights_TK, gemms.num_experts, 16)
    tiles = moe_tiles(num_tokens, top_k, gemms.num_experts, gemms.hidden, gemms.inter, x_TH.dtype, gemms.weight_format)
    rows = layout.pair_row_TK.reshape(-1)
    outputs = {}
    for most_tokens in (num_tokens, 0):
        with switches.switched(**{switch.name: most_tokens}):
            assert takes_gemv(layout) == bool(most_tokens)
            num_rows = layout.row_token_R.shape[0]
            act = torch.full((num_rows, gemms.inter), float("nan"), dtype=x_TH.dtype, device=x_TH.device)
            out = torch.full((num_rows, gemms.hidden), float("nan"), dtype=x_TH.dtype, device=x_TH.device)
            gemms.gate_up(x_TH, layout, act, tiles.gate_up)
            gemms.down(act, layout, out, tiles.down)
            outputs[most_tokens] = act[rows].float(), out[rows].float()
    for gemv_rows, mma_rows in zip(outputs[num_tokens], outputs[0]):
        assert torch.isfinite(gemv_rows).all()
        torch.testing.assert_close(gemv_rows, mma_rows, rtol=2**-7, atol=1e-3)
