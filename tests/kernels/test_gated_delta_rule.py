"""The Gated DeltaNet rule on CUDA (flash-linear-attention's kernels when ``fla`` imports, else the
PyTorch forms on the GPU) against the chunked reference on CPU, at Qwen3-Next's head shapes."""

from __future__ import annotations

import pytest
import torch

from miles_host.kernels.gated_delta_rule import causal_conv, fla_kernels, gated_delta_rule

# Qwen3-Next-80B-A3B: 16 key heads of 128 repeated to 32 value heads of 128
HEADS, KEY_DIM, VALUE_DIM = 32, 128, 128


def _inputs(lengths, device, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, HEADS, KEY_DIM, generator=generator)
    k = torch.randn(total, HEADS, KEY_DIM, generator=generator)
    v = torch.randn(total, HEADS, VALUE_DIM, generator=generator)
    g = -torch.rand(total, HEADS, generator=generator) * 0.5
    beta = torch.rand(total, HEADS, generator=generator)
    initial = torch.randn(len(lengths), HEADS, KEY_DIM, VALUE_DIM, generator=generator) * 0.1
    move = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    return [move(x) for x in (q, k, v)] + [g.to(device), move(beta), initial.to(device)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lengths", [[300, 1, 77, 64], [1, 1, 1, 1, 1]], ids=["prefill", "decode"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-3), (torch.bfloat16, 6e-2)])
def test_cuda_rule_matches_the_cpu_reference(lengths, dtype, atol):
    cuda_args = _inputs(lengths, "cuda", dtype)
    cpu_args = [x.detach().cpu().float() for x in cuda_args]
    expected_o, expected_states = gated_delta_rule(*cpu_args[:5], lengths, cpu_args[5], use_fla=False)
    o, states = gated_delta_rule(*cuda_args[:5], lengths, cuda_args[5])
    print(f"\nbackend: {'fla' if fla_kernels() is not None else 'torch on CUDA'}, {dtype}, lengths {lengths}: "
          f"max |o| err {(o.cpu() - expected_o).abs().max():.2e}, state err {(states.cpu() - expected_states).abs().max():.2e}")
    torch.testing.assert_close(o.float().cpu(), expected_o, atol=atol, rtol=atol)
    torch.testing.assert_close(states.float().cpu(), expected_states, atol=atol, rtol=atol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_short_convolution_matches_the_cpu():
    generator = torch.Generator().manual_seed(2)
    channels = 2 * 16 * 128 + 32 * 128
    x, weight = torch.randn(40, channels, generator=generator), torch.randn(channels, 4, generator=generator)
    state = torch.randn(3, channels, 3, generator=generator)
    expected, expected_state = causal_conv(x, weight, [30, 1, 9], state)
    got, got_state = causal_conv(x.cuda(), weight.cuda(), [30, 1, 9], state.cuda())
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_state.cpu(), expected_state)


def _fla_stand_ins():
    """Stand-ins with flash-linear-attention 0.6's signatures (``fused_recurrent_gated_delta_rule``
    has ``gk`` and ``gv`` between ``g`` and ``beta``), computing with the PyTorch rule: a caller
    that passes the tensors by position hands ``beta`` to ``gk`` and gets a TypeError here."""
    from miles_host.kernels.gated_delta_rule import chunked_reference, recurrent_step

    def fused_recurrent(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        assert gk is None and gv is None and beta is not None and use_qk_l2norm_in_kernel
        o, state = recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], initial_state)  # [S, 1, ...]
        return o[:, None], state

    def chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        assert cu_seqlens is not None and use_qk_l2norm_in_kernel
        bounds = cu_seqlens.tolist()
        parts = [chunked_reference(q[0, a:b], k[0, a:b], v[0, a:b], g[0, a:b], beta[0, a:b], initial_state[s])
                 for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
        return torch.cat([o for o, _ in parts])[None], torch.stack([state for _, state in parts])

    return chunk, fused_recurrent


@pytest.mark.parametrize("lengths", [[9, 1, 4], [1, 1, 1]], ids=["prefill", "decode"])
def test_fla_calls_pass_every_tensor_by_keyword(lengths, monkeypatch):
    from miles_host.kernels import gated_delta_rule as rule

    monkeypatch.setattr(rule, "fla_kernels", _fla_stand_ins)
    args = _inputs(lengths, "cpu", torch.float32)
    expected_o, expected_states = gated_delta_rule(*args[:5], lengths, args[5], use_fla=False)
    o, states = gated_delta_rule(*args[:5], lengths, args[5], use_fla=True)
    torch.testing.assert_close(o, expected_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, expected_states, atol=1e-5, rtol=1e-5)
