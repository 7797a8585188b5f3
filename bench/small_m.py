"""Shared by ``bench/fp8_gemm.py`` and ``bench/int4_gemm.py``: decode GEMM shapes and their timing.

Per-GEMM time at decode: for one linear shape, ``layers`` weights (one per decoder
layer, so nothing is served from L2 the way a real decode step is not) are
multiplied back to back inside one CUDA graph (launch overhead out of the
picture, as in the engine's captured decode steps); the replay time divided by
``layers`` is the time of one GEMM. The HBM bound is the bytes the GEMM must read
(its weight in the kernel's format) at :data:`HBM_BYTES_PER_S`.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

HBM_BYTES_PER_S = 4.24e12
#: (name, N out features, K in features) of a Qwen3-1.7B decoder layer's linears (qkv and gate/up fused)
SHAPES_1_7B = [("qkv_proj", 4096, 2048), ("o_proj", 2048, 2048), ("gate_up_proj", 12288, 2048), ("down_proj", 2048, 6144)]
LAYERS_1_7B = 28
TINY_SHAPES = [("tiny qkv", 256, 128), ("tiny down", 128, 256)]


def graph_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of one call of ``fn`` (CUDA: one replay of a CUDA graph of it; CPU: wall time)."""
    fn()
    if device.type != "cuda":
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(samples)


def per_gemm_us(gemm: Callable[[object], object], weights: list, device: torch.device, repeats: int) -> float:
    """Microseconds of one ``gemm(weight)`` when every weight of ``weights`` is multiplied once, back to back."""
    def step():
        for weight in weights:
            gemm(weight)

    return graph_seconds(step, device, repeats) / len(weights) * 1e6


def hbm_fraction(num_bytes: int, microseconds: float) -> float:
    """Fraction of the HBM bound reached when ``num_bytes`` are read in ``microseconds``."""
    return num_bytes / HBM_BYTES_PER_S / (microseconds * 1e-6)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| / max |expected| (float64)."""
    got, expected = got.double(), expected.double()
    return float((got - expected).abs().max() / expected.abs().max().clamp(min=1e-30))
