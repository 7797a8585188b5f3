"""The batch-invariant GEMM (:mod:`miles_host.kernels.invariant_matmul`) against cuBLAS on the
Qwen3-0.6B linears, each at 1, 64 and 4096 rows: microseconds per call (the median of
graph replays, :func:`bench.small_m.graph_seconds`) and TFLOP/s against the GPU's bf16 peak.
Each output is first checked against a float64 product.

    python -m bench.invariant_matmul [--rows 1,64,4096] [--json out.json]
"""

from __future__ import annotations

import argparse

import torch

from bench.device_peaks import bf16_flops
from bench.small_m import graph_seconds, relative_error, write_rows

#: (N, K) of the Qwen3-0.6B linears: q/k/v fused, o, gate/up fused, down, LM head
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]


def measure(m: int, n: int, k: int, replays: int, device: torch.device) -> dict:
    from miles_host.kernels.invariant_matmul import invariant_mm

    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=generator)
    b = (torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=generator) * k ** -0.5).t()
    error = relative_error(invariant_mm(a, b), a.double() @ b.double())
    if error > 1e-2:
        raise AssertionError(f"invariant_mm {m}x{n}x{k}: relative error {error:.3g} against float64")
    invariant = graph_seconds(lambda: invariant_mm(a, b), device, replays)
    cublas = graph_seconds(lambda: a @ b, device, replays)
    flops = 2 * m * n * k
    return dict(m=m, n=n, k=k, invariant_us=invariant * 1e6, cublas_us=cublas * 1e6,
                invariant_tflops=flops / invariant / 1e12, cublas_tflops=flops / cublas / 1e12,
                of_peak=flops / invariant / bf16_flops())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,64,4096")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/invariant_matmul.py times CUDA kernels; no GPU here")
        return 1
    rows = []
    for n, k in SHAPES:
        for m in (int(r) for r in args.rows.split(",")):
            row = measure(m, n, k, args.replays, torch.device("cuda"))
            rows.append(row)
            print(f"M={m:5d} N={n:6d} K={k:4d}: invariant {row['invariant_us']:8.1f} us "
                  f"({row['invariant_tflops']:6.1f} TFLOP/s, {row['of_peak']:.1%} of peak), "
                  f"cuBLAS {row['cublas_us']:8.1f} us ({row['cublas_tflops']:6.1f})", flush=True)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
