"""Shared by ``bench/fp8_gemm.py`` and ``bench/int4_gemm.py``: decode GEMM shapes and their timing.

Per-GEMM time at decode: for one linear shape, ``layers`` weights (one per decoder
layer, so nothing is served from L2 the way a real decode step is not) are
multiplied back to back inside one CUDA graph (launch overhead out of the
picture, as in the engine's captured decode steps); the replay time divided by
``layers`` is the time of one GEMM. The HBM bound is the bytes the GEMM must read
(its weight in the kernel's format) at :data:`HBM_BYTES_PER_S`.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Callable

import torch

from bench.device_peaks import hbm_bytes_per_s  # noqa: E402

HBM_BYTES_PER_S = hbm_bytes_per_s()  # this machine's copy bandwidth (bench/device_peaks.py)
#: Qwen3 shapes: hidden, intermediate, q heads, kv heads, head dim, layers
MODELS = {
    "0.6b": (1024, 3072, 16, 8, 128, 28),
    "1.7b": (2048, 6144, 16, 8, 128, 28),
    "4b": (2560, 9728, 32, 8, 128, 36),
    "8b": (4096, 12288, 32, 8, 128, 36),
    "tiny": (128, 256, 4, 2, 32, 2),
}


def layer_shapes(model: str) -> list[tuple[str, int, int]]:
    """``(name, out_features N, in_features K)`` of one decoder layer's linears (qkv and gate/up fused)."""
    hidden, inter, heads, kv_heads, head_dim, _ = MODELS[model]
    return [
        ("qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden),
        ("o_proj", hidden, heads * head_dim),
        ("gate_up_proj", 2 * inter, hidden),
        ("down_proj", hidden, inter),
    ]


def num_layers(model: str) -> int:
    """Decoder layers of ``model``."""
    return MODELS[model][-1]


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


def write_rows(path: str | None, rows: list[dict]) -> None:
    """A sweep's measured rows as JSON at ``path`` (``--json``; nothing when None)."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
