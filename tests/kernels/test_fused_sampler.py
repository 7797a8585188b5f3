"""The fused draw (:mod:`miles_host.kernels.fused_sampler`) against the PyTorch sampler and the
float64 CDF: under Triton's interpreter on CPU (``interpreted_fused_sampler.py``), and on a GPU
at the Qwen3 vocabulary, eagerly and inside a CUDA graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.plugins.triton_interpret import run_interpreted


def _batch(rows: int, vocab: int, unit: bool, device: str, seed: int = 0):
    from miles_host.rollout.sampler import SamplingBatch

    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(torch.bfloat16)
    temperature = torch.ones(rows) if unit else torch.rand(rows, generator=generator) * 1.5 + 0.3
    greedy = torch.zeros(rows, dtype=torch.bool)
    greedy[1] = True
    temperature[1] = 1.0  # a greedy row's temperature
    uniforms = torch.rand(rows, generator=generator)
    uniforms[0] = 0.0
    uniforms[-1] = 1.0 - 2.0**-24  # the draw at both ends of the CDF
    batch = SamplingBatch(temperature_B=temperature.to(device), greedy_B=greedy.to(device), top_k_B=None,
                          top_p_B=None, min_p_B=None, generators=[None] * rows, all_greedy=False,
                          banned=[[] for _ in range(rows)], any_greedy=True, all_unit_temperature=unit)
    return logits.to(device), batch, uniforms.to(device)


def check_against_torch_and_float64(fused_sample, vocab: int, unit: bool, rows: int, device: str) -> None:
    """Tokens equal to the PyTorch sampler's wherever ``u * total`` lies clear of float32 rounding
    of a CDF step (elsewhere the two sums in different orders may round to either side); every
    token inside its float64 CDF step at ``u``, or the heaviest token where the target reaches the
    total (the documented fallback); log-probs within float32 rounding of float64; greedy rows take
    the argmax."""
    from miles_host.rollout.sampler import sample_with_distribution

    logits, batch, uniforms = _batch(rows, vocab, unit, device)
    tokens, logprobs = fused_sample(logits, batch.temperature_B, batch.greedy_B, uniforms, unit_temperature=unit)
    expected_tokens, expected_logprobs = sample_with_distribution(logits, batch, uniforms)
    logprobs64 = torch.log_softmax(logits.double() / batch.temperature_B.double()[:, None], dim=-1)
    chosen64 = logprobs64.gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.double(), chosen64, atol=2e-5, rtol=0)
    torch.testing.assert_close(logprobs, expected_logprobs.gather(1, tokens[:, None]).squeeze(1), atol=2e-5, rtol=0)
    cdf64 = logprobs64.exp().cumsum(dim=-1).cpu()
    rounding = 1e-5  # float32 sums of ~1e5 terms
    clear_rows = 0
    for row, token in enumerate(tokens.tolist()):
        if batch.greedy_B[row]:
            assert token == int(logits[row].float().argmax()) == int(expected_tokens[row])
            continue
        target = float(uniforms[row]) * float(cdf64[row, -1])
        if float((cdf64[row] - target).abs().min()) > rounding and target < float(cdf64[row, -1]) - rounding:
            assert token == int(expected_tokens[row]), (row, token, int(expected_tokens[row]))
            clear_rows += 1
        if target >= float(cdf64[row, -1]) - rounding and token == int(logits[row].float().argmax()):
            continue  # the target rounded up to the total: the heaviest token
        low = float(cdf64[row, token - 1]) if token > 0 else 0.0
        assert low - rounding <= target <= float(cdf64[row, token]) + rounding, (row, token, target)
    assert clear_rows >= rows // 2  # the equality was checked on most rows


def test_cpu_kernels_under_the_triton_interpreter(request):
    run_interpreted(Path(__file__).with_name("interpreted_fused_sampler.py"), request)


def test_the_chunks_are_the_torch_samplers():
    from miles_host.kernels.fused_sampler import CHUNK
    from miles_host.rollout.sampler import CDF_CHUNK

    assert CHUNK == CDF_CHUNK


def test_the_fused_draw_runs_where_triton_does_by_default():
    from miles_host.kernels import fused_sampler, switches

    logits = torch.zeros(2, 10)
    assert switches.value(fused_sampler.SAMPLER) == "triton"
    assert not fused_sampler.enabled(logits)  # CPU without the interpreter: the PyTorch sampler
    with switches.switched(sampler_kernel="torch"):
        assert not fused_sampler.enabled(logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("unit", [True, False])
def test_gpu_draw_at_the_qwen3_vocabulary(unit):
    from miles_host.kernels.fused_sampler import fused_sample

    check_against_torch_and_float64(fused_sample, 151936, unit, rows=16, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_draw_in_a_cuda_graph():
    from miles_host.kernels.fused_sampler import fused_sample

    logits, batch, uniforms = _batch(4, 151936, False, "cuda")
    expected = fused_sample(logits, batch.temperature_B, batch.greedy_B, uniforms)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_sample(logits, batch.temperature_B, batch.greedy_B, uniforms)
    graph.replay()
    assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_draws_the_same_tokens_with_the_fused_sampler():
    """Seeded sampling at temperature 1 and 0.7 in the sampling graphs: the same tokens with either
    sampler, log-probs within float32 rounding."""
    from miles_host.kernels import switches
    from tests.kernels.small_moe_decode import decode

    for temperature in (1.0, 0.7):
        params = {"temperature": temperature, "sampling_seed": 11, "max_new_tokens": 24, "ignore_eos": True}
        with switches.switched(sampler_kernel="torch"):
            plain = decode(params)
        with switches.switched(sampler_kernel="triton"):
            fused = decode(params)
        assert fused["tokens"] == plain["tokens"]
        difference = max(abs(a - b) for rows in zip(fused["logprobs"], plain["logprobs"]) for a, b in zip(*rows))
        assert difference <= 1e-4


def test_kernels_compile_for_sm90():
    """The GPU branches (hardware division, the scans) build for the H100/H200 without spilling."""
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    from miles_host.kernels import _sampling_triton
    from tests.plugins.triton_sm90 import compile_sm90

    scalars = {"V": "i32", "stride_lb": "i32", "num_chunks": "i32"}
    stats = {"Logits": "*bf16", "Temperature": "*fp32", "ChunkMax": "*fp32", "ChunkSum": "*fp32", "ChunkTop": "*i32",
             "ChunkTopValue": "*fp32", **scalars}
    draw = {"Logits": "*bf16", "Temperature": "*fp32", "Greedy": "*i1", "Uniforms": "*fp32", "ChunkMax": "*fp32",
            "ChunkSum": "*fp32", "ChunkTop": "*i32", "ChunkTopValue": "*fp32", "Tokens": "*i64", "Logprobs": "*fp32",
            **scalars}
    for unit in (True, False):
        ptx = compile_sm90(_sampling_triton._chunk_stats_kernel, stats, dict(CHUNK=1024, UNIT=unit), 4, 1,
                           unaligned=tuple(scalars))
        assert ".local" not in ptx and ("div.rn.f32" in ptx) != unit
        ptx = compile_sm90(_sampling_triton._draw_kernel, draw, dict(CHUNK=1024, CHUNKS_P=256, UNIT=unit), 8, 1,
                           unaligned=tuple(scalars))
        assert ".local" not in ptx
