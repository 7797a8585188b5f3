"""Sweep the launches of the small-M (decode) bf16 GEMM on the shapes of a decode step.

For each ``(M, N, K)`` every candidate :class:`~miles_host.kernels.small_m_gemm.Launch` (the
tensor-core kernel at several tiles and K-splits, the one-token CUDA-core GEMV at several tiles
and splits) and cuBLAS (``F.linear``) run inside one CUDA graph over ``--copies`` distinct
weights (more bytes than the L2 holds, as the layers of a decode step), replayed
(:func:`bench.small_m.graph_seconds`, the median of ``--replays``); the figure is microseconds per
GEMM and the weight bytes read per second. The planned default is marked.

    python bench/small_m_sweep.py --shapes 1x5120x2048,1x2048x4096,1x128x2048
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch

from bench.small_m import graph_seconds, write_rows


def candidates(m: int, n: int, k: int):
    from miles_host.kernels.small_m_gemm import Launch

    yield "planned", None
    for block_n, split in itertools.product((32, 64), (2, 4, 8, 16)):
        yield f"mma n{block_n} s{split}", Launch("mma", block_n, 128, split, 4, 4)
    if m == 1:
        for block_n, block_k, split in itertools.product((16, 32), (256, 512), (1, 2, 4, 8)):
            yield f"gemv n{block_n} k{block_k} s{split}", Launch("gemv", block_n, block_k, split, 4, 1)


def fastest_launches(path: str) -> dict:
    """``{(M, N, K): Launch}``: the fastest swept launch of each shape in a ``--json`` file, where it
    is one of the candidates (not the planned default or cuBLAS)."""
    from miles_host.kernels.small_m_gemm import Launch

    with open(path) as f:
        rows = json.load(f)
    table = {}
    for shape in dict.fromkeys(row["shape"] for row in rows):
        best = min((row for row in rows if row["shape"] == shape), key=lambda row: row["us"])
        if best["fields"] is not None:
            table[tuple(int(v) for v in shape.split("x"))] = Launch(**best["fields"])
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x5120x2048,1x2048x4096,1x128x2048", help="MxNxK, comma separated")
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--replays", type=int, default=30, help="timed replays (their median)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from miles_host.kernels.small_m_gemm import small_m_linear

    rows = []
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        generator = torch.Generator(device="cuda").manual_seed(0)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
                   for _ in range(args.copies)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=generator)
        bytes_per_gemm = n * k * 2
        results = []
        device = torch.device("cuda")
        cublas = graph_seconds(lambda: [torch.nn.functional.linear(x, w) for w in weights], device,
                               args.replays) / args.copies
        results.append(("cublas", cublas, None))
        reference = x.double() @ weights[0].double().T
        for name, launch in candidates(m, n, k):
            try:
                if launch is not None and not launch.tiles(n, k):
                    continue
                if launch is not None and launch.split and (k // launch.block_k) % launch.split:
                    continue
                out = small_m_linear(x, weights[0], launch=launch)
                error = (out.double() - reference).abs().max().item() / reference.abs().max().item()
                if error > 1e-2:
                    print(f"{shape} {name}: WRONG (relative error {error:.3g})", flush=True)
                    continue
                seconds = graph_seconds(lambda: [small_m_linear(x, w, launch=launch) for w in weights], device,
                                        args.replays) / args.copies
                results.append((name, seconds, launch))
            except Exception as error:  # noqa: BLE001 - a candidate that does not build is reported, skipped
                print(f"{shape} {name}: failed: {str(error).splitlines()[0][:160]}", flush=True)
        results.sort(key=lambda item: item[1])
        for name, seconds, launch in results:
            print(f"{shape} {name:<22} {seconds * 1e6:7.2f} us  {bytes_per_gemm / seconds / 1e12:5.2f} TB/s", flush=True)
            rows.append(dict(shape=shape, launch=name, us=seconds * 1e6, tb_s=bytes_per_gemm / seconds / 1e12,
                             fields=dataclasses.asdict(launch) if launch is not None else None))
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
