"""Tiny random checkpoints whose linear dims are multiples of 128 (dense Qwen3, MoE Qwen3),
plus an independent float64 model of block-scaled E4M3 quantization for the tests."""

from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 160
FP8_MAX = 448.0


def _common():
    return dict(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=256,
        eos_token_id=VOCAB - 1, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
    )


def _save(config, tmp_path_factory, name: str) -> str:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def qwen3_path(tmp_path_factory):
    return _save(transformers.Qwen3Config(**_common()), tmp_path_factory, "fp8_qwen3")


@pytest.fixture(scope="session")
def qwen3_moe_path(tmp_path_factory):
    config = transformers.Qwen3MoeConfig(
        **_common(), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
    )
    return _save(config, tmp_path_factory, "fp8_qwen3_moe")


def fp8_config(power_of_two: bool = False):
    """The slice of a run config the fp8 recipe reads."""
    return types.SimpleNamespace(fp8_format="e4m3", fp8_recipe="blockwise", fp8_power_of_two_scales=power_of_two)


def load(path: str, dtype=torch.float32):
    from miles_host.models import load_pretrained

    return load_pretrained(path, dtype=dtype, device="cpu")


# ---------------------------------------------------------------------------- float64 model of E4M3


def e4m3_grid() -> torch.Tensor:
    """Every finite E4M3 value, float64, sorted (from the format: 1 sign, 4 exponent (bias 7), 3 mantissa bits)."""
    values = set()
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:
                continue  # NaN in the "fn" variant
            value = (mantissa / 8) * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
            values.update((value, -value))
    return torch.tensor(sorted(values), dtype=torch.float64)


GRID = e4m3_grid()


def nearest_e4m3(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(nearest E4M3 value, distance to it) of float64 ``v`` (saturated to +-448)."""
    v = v.double().clamp(-FP8_MAX, FP8_MAX).contiguous()
    index = torch.searchsorted(GRID, v).clamp(1, len(GRID) - 1)
    low, high = GRID[index - 1], GRID[index]
    nearest = torch.where((v - low).abs() <= (high - v).abs(), low, high)
    return nearest, (nearest - v).abs()


def quantize64(x: torch.Tensor, block_rows: int, block_cols: int = 128, power_of_two: bool = False):
    """Float64 formula: scale = amax/448 per block (as float32), q = nearest E4M3 of x/scale."""
    x = x.double()
    rows, cols = x.shape
    blocks = x.reshape(rows // block_rows, block_rows, cols // block_cols, block_cols)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = (amax / FP8_MAX).float().double()
    if power_of_two:
        scale = 2.0 ** torch.ceil(torch.log2(scale))
    expanded = scale.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    q, _ = nearest_e4m3(x / expanded)
    return q, scale, expanded


def synced_linear_pair(in_features: int = 1024, out_features: int = 2048):
    """On the GPU: an ``Fp8Linear`` (float32 master) and the ``Fp8InferenceLinear`` holding its
    weights as weight sync converts them (``convert_for_rollout``), and those converted tensors."""
    from miles_fp8.linear import Fp8InferenceLinear, Fp8Linear
    from miles_fp8.recipe import convert_for_rollout

    torch.manual_seed(0)
    train = Fp8Linear.from_linear(torch.nn.Linear(in_features, out_features).cuda(), name="t")
    rollout = Fp8InferenceLinear.from_linear(torch.nn.Linear(in_features, out_features).cuda().bfloat16(), name="r")
    named = dict(convert_for_rollout([("t.weight", train.weight.detach()), ("t.bias", train.bias.detach())], fp8_config()))
    rollout.weight.copy_(named["t.weight"])
    rollout.weight_scale_inv.copy_(named["t.weight_scale_inv"])
    rollout.bias.copy_(named["t.bias"])
    return train, rollout, named
