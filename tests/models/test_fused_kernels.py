"""The engine's fused inference kernels (miles_host.kernels) against their plain-PyTorch references.

CPU: the fused forward (residual stream, fused calls falling back to the
references) equals the eager forward bit for bit for every model type.
GPU: each Triton kernel against its reference, and a whole bf16 model.
"""

from __future__ import annotations

import pytest
import torch

from miles_host.kernels.activation import silu_and_mul, silu_and_mul_reference
from miles_host.kernels.rmsnorm import rmsnorm, rmsnorm_reference
from miles_host.kernels.rotary import qk_norm_rope, qk_norm_rope_into_cache, qk_norm_rope_reference
from miles_host.models import load_pretrained
from miles_host.models.attention import PackedAttention
from miles_host.models.context import ForwardContext

from .conftest import CASES, family_lookup, prompts_batch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _packed_prompts():
    input_ids, attention_mask = prompts_batch()
    lengths = attention_mask.sum(1).tolist()
    ids = torch.cat([input_ids[row, :n] for row, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu_seqlens = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    return ids, positions, cu_seqlens


def _hidden(model, ids, positions, cu_seqlens, fused: bool):
    with torch.inference_mode():
        ctx = ForwardContext(attention=PackedAttention(cu_seqlens.to(ids.device)), fused_kernels=fused)
        return model.forward_hidden(ids, positions, ctx)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_forward_equals_eager_forward_on_cpu(case, checkpoints):
    model = load_pretrained(checkpoints[case], family=family_lookup)
    ids, positions, cu_seqlens = _packed_prompts()
    eager = _hidden(model, ids, positions, cu_seqlens, fused=False)
    fused = _hidden(model, ids, positions, cu_seqlens, fused=True)
    assert torch.equal(eager, fused)


def _assert_close(actual, expected, dtype, min_equal: float = 0.99):
    """float32: 1e-5; bf16: all within one bf16 step, and ``min_equal`` of elements bit-identical."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=2 ** -7)
    assert (actual == expected).float().mean().item() >= min_equal


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 1000, 4096])
@pytest.mark.gpu
@requires_cuda
def test_rmsnorm_kernel_matches_reference(dtype, unit_offset, with_residual, hidden):
    generator = torch.Generator().manual_seed(hidden)
    x = torch.randn(37, hidden, generator=generator).to("cuda", dtype)
    residual = torch.randn(37, hidden, generator=generator).to("cuda", dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to("cuda", dtype)
    out, res_out = rmsnorm(x, weight, 1e-6, unit_offset, residual)
    ref_out, ref_res = rmsnorm_reference(x, weight, 1e-6, unit_offset, residual)
    _assert_close(out, ref_out, dtype)
    if with_residual:
        assert torch.equal(res_out, ref_res)
    else:
        assert res_out is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_norm", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim,rotary_half", [(128, 64), (64, 16), (96, 48)])
@pytest.mark.gpu
@requires_cuda
def test_qk_norm_rope_kernel_matches_reference(dtype, head_norm, interleaved, head_dim, rotary_half):
    generator = torch.Generator().manual_seed(head_dim + rotary_half)
    tokens, nq, nk = 29, 16, 4
    qkv = torch.randn(tokens, (nq + 2 * nk) * head_dim, generator=generator).to("cuda", dtype)
    q, k, _ = qkv.split((nq * head_dim, nk * head_dim, nk * head_dim), dim=-1)  # row-strided views
    angles = torch.rand(tokens, rotary_half, generator=generator) * 6.28
    cos, sin = angles.cos().to("cuda", dtype), angles.sin().to("cuda", dtype)
    weights = {}
    if head_norm:
        weights = dict(
            q_weight=(1 + 0.1 * torch.randn(head_dim, generator=generator)).to("cuda", dtype),
            k_weight=(1 + 0.1 * torch.randn(head_dim, generator=generator)).to("cuda", dtype),
            eps=1e-6,
        )
    args = (q, k, nq, nk, head_dim, cos, sin)
    q_out, k_out = qk_norm_rope(*args, interleaved=interleaved, **weights)
    q_ref, k_ref = qk_norm_rope_reference(*args, interleaved=interleaved, **weights)
    # bf16: eager rounds each product before the sum; the kernel's products may be
    # contracted differently, so only closeness (not a share of equal bits) is asserted
    _assert_close(q_out, q_ref.contiguous(), dtype, min_equal=0.0)
    _assert_close(k_out, k_ref.contiguous(), dtype, min_equal=0.0)


def _rope_case(device, dtype, tokens=5, nq=8, nk=2, head_dim=64, half=32, slots_total=64):
    generator = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (nq + 2 * nk) * head_dim, generator=generator).to(device, dtype)
    q, k, v = qkv.split((nq * head_dim, nk * head_dim, nk * head_dim), dim=-1)  # row-strided views
    angles = torch.rand(tokens, half, generator=generator) * 6.28
    weights = dict(q_weight=(1 + 0.1 * torch.randn(head_dim, generator=generator)).to(device, dtype),
                   k_weight=(1 + 0.1 * torch.randn(head_dim, generator=generator)).to(device, dtype), eps=1e-6)
    slots = torch.randperm(slots_total, generator=generator)[:tokens].to(device)
    caches = [torch.zeros(slots_total, nk, head_dim, dtype=dtype, device=device) for _ in range(2)]
    return (q, k, v, nq, nk, head_dim, angles.cos().to(device, dtype), angles.sin().to(device, dtype)), weights, slots, caches


def _into_cache_then_separately(device):
    """``qk_norm_rope_into_cache`` and ``qk_norm_rope`` + the cache write, on the same inputs."""
    (q, k, v, nq, nk, d, cos, sin), weights, slots, (k_cache, v_cache) = _rope_case(device, torch.bfloat16)
    q_fused = qk_norm_rope_into_cache(q, k, v, nq, nk, d, cos, sin, k_cache, v_cache, slots, **weights)
    q_alone, k_alone = qk_norm_rope(q, k, nq, nk, d, cos, sin, **weights)
    k_expected, v_expected = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    k_expected[slots] = k_alone
    v_expected[slots] = v.reshape(-1, nk, d)
    return (q_fused, k_cache, v_cache), (q_alone, k_expected, v_expected)


def test_qk_norm_rope_into_cache_stores_what_the_separate_write_stores_on_cpu():
    for got, expected in zip(*_into_cache_then_separately("cpu")):
        assert torch.equal(got, expected)


@pytest.mark.gpu
@requires_cuda
def test_qk_norm_rope_kernel_stores_keys_and_values_bit_for_bit():
    """The decode form (keys and values into the paged cache by the same kernel) against the kernel's
    queries and keys and a separate cache write: the same bits."""
    for got, expected in zip(*_into_cache_then_separately("cuda")):
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [96, 3072, 5000])
@pytest.mark.gpu
@requires_cuda
def test_silu_and_mul_kernel_matches_reference(dtype, inter):
    gate_up = torch.randn(23, 2 * inter, generator=torch.Generator().manual_seed(inter)).to("cuda", dtype) * 3
    _assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up), dtype)


@pytest.mark.parametrize("case", ["qwen3", "llama", "gemma2", "qwen3_moe"])
@pytest.mark.gpu
@requires_cuda
def test_fused_bf16_forward_on_gpu_close_to_eager(case, checkpoints):
    if case not in CASES:
        pytest.skip(f"no {case} case")
    model = load_pretrained(checkpoints[case], family=family_lookup, dtype=torch.bfloat16, device="cuda")
    ids, positions, cu_seqlens = (t.cuda() for t in _packed_prompts())
    eager = _hidden(model, ids, positions, cu_seqlens, fused=False).float()
    fused = _hidden(model, ids, positions, cu_seqlens, fused=True).float()
    scale = eager.abs().max().item()
    assert (fused - eager).abs().max().item() <= 0.03 * scale
