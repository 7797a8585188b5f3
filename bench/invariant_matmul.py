"""The batch-invariant GEMM (:mod:`miles_host.kernels.invariant_matmul`) against cuBLAS on the
Qwen3-0.6B linears, each at 1, 64 and 4096 rows: microseconds per call (the median of
graph replays, :func:`bench.small_m.graph_seconds`) and TFLOP/s against the GPU's bf16 peak.
Each output is first checked against a float64 product. ``--sweep``: the small-M launches
(:data:`SWEEP_CONFIGS`, the tiers' ``block_k`` and MMA family) at ``--rows``, each kept only
where its output equals the chosen tier's bit for bit, ranked per shape: a faster one is a
candidate tier of :data:`~miles_host.kernels.invariant_matmul.M_TIERS` (whose GPU test then
checks it against every other tier).

    python -m bench.invariant_matmul [--rows 1,64,4096] [--json out.json]
    python -m bench.invariant_matmul --sweep --rows 1,16 [--json sweep.json]
"""

from __future__ import annotations

import argparse

import torch

from bench.device_peaks import bf16_flops
from bench.small_m import graph_seconds, relative_error, write_rows

#: (N, K) of the Qwen3-0.6B linears: q/k/v fused, o, gate/up fused, down, LM head
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]
#: bf16 launches of ``--sweep``: 64-row tiles (wgmma, as every tier), the tiers' ``block_k`` of 64
SWEEP_CONFIGS = [(64, n, 64, warps, stages) for n in (64, 128, 256) for warps in (4, 8) for stages in (3, 4, 6)]


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


def sweep(m: int, n: int, k: int, replays: int, device: torch.device) -> list[dict]:
    """Each of :data:`SWEEP_CONFIGS` at ``[m, k] x [k, n]``: us per call, and whether its output equals
    the chosen tier's bit for bit (a launch that does not is not a candidate, whatever its speed)."""
    from miles_host.kernels.invariant_matmul import MatmulConfig, invariant_mm, matmul_config

    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=generator)
    b = (torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=generator) * k ** -0.5).t()
    tier = matmul_config(m, n, k, torch.bfloat16)
    expected = invariant_mm(a, b)
    rows = []
    for fields in SWEEP_CONFIGS:
        config = MatmulConfig(*fields[:3], num_warps=fields[3], num_stages=fields[4])
        try:
            bitwise = torch.equal(invariant_mm(a, b, config=config), expected)
            us = graph_seconds(lambda: invariant_mm(a, b, config=config), device, replays) * 1e6
        except Exception as error:  # noqa: BLE001 - a launch that does not compile (shared memory) is reported
            print(f"  M={m} N={n} K={k} {config}: {type(error).__name__}: {str(error)[:100]}", flush=True)
            continue
        rows.append(dict(m=m, n=n, k=k, config=list(fields), us=us, bitwise=bitwise, tier=config == tier,
                         tb_s=n * k * 2 / (us * 1e-6) / 1e12))
    rows.sort(key=lambda row: row["us"])
    for row in rows:
        flags = ("" if row["bitwise"] else " NOT BITWISE") + (" (tier)" if row["tier"] else "")
        print(f"M={m:5d} N={n:6d} K={k:4d} {tuple(row['config'])}: {row['us']:8.1f} us "
              f"({row['tb_s']:.2f} TB/s of weights){flags}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,64,4096")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="time the small-M launches of SWEEP_CONFIGS instead")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/invariant_matmul.py times CUDA kernels; no GPU here")
        return 1
    rows = []
    if args.sweep:
        for n, k in SHAPES:
            for m in (int(r) for r in args.rows.split(",")):
                rows += sweep(m, n, k, args.replays, torch.device("cuda"))
        write_rows(args.json, rows)
        return 0
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
