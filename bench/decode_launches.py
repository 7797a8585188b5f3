"""Launch overrides of a decode benchmark, from the sweeps' JSON files or explicit values.

``bench/moe.py`` takes these flags, so one device call can sweep the decode kernels' launches and
then decode with the fastest: ``--small-m-table`` (``bench/small_m_sweep.py``: the attention
projections, router and LM head), ``--gemv-table`` (``bench/moe_gemv_sweep.py``: the one-token
expert GEMV), ``--decode-split-keys`` / ``--max-decode-splits`` (the split-KV decode attention,
as ``bench/attention_decode_sweep.py`` varies them) and ``--drop-launch`` (a table entry's
baseline). They set the kernels' module tables for this process only.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--small-m-gemm", choices=["triton", "torch"], default="triton",
                        help="the decode linears of <= 4 tokens: the split-K Triton GEMM or cuBLAS (a baseline)")
    parser.add_argument("--small-m-table", default=None, help="a bench/small_m_sweep.py --json file: every case "
                        "uses its fastest launch of each swept shape")
    parser.add_argument("--gemv-table", default=None, help="a bench/moe_gemv_sweep.py --json file: the expert "
                        "GEMV's fastest launch of each projection (its shape --gemv-shape) for every case")
    parser.add_argument("--gemv-shape", default="qwen3", help="the swept shape --gemv-table takes")
    parser.add_argument("--decode-split-keys", type=int, default=None,
                        help="keys per iteration of the split-KV decode attention (paged_attention.DECODE_SPLIT_KEYS)")
    parser.add_argument("--max-decode-splits", type=int, default=None,
                        help="most KV splits of a decode launch (paged_attention.MAX_DECODE_SPLITS)")
    parser.add_argument("--drop-launch", action="append", default=[], metavar="MxNxK",
                        help="remove this shape from the small-M launch table (its default launch, or cuBLAS for the "
                             "LM head: the baseline of a table entry)")


def apply(args: argparse.Namespace) -> None:
    """Set the launch tables and constants that ``args`` name (printing each)."""
    from miles_host.kernels import moe_configs, paged_attention, small_m_gemm, switches

    keys, splits = args.decode_split_keys, args.max_decode_splits
    if keys is not None and (keys < 16 or keys & (keys - 1)):
        raise SystemExit(f"--decode-split-keys {keys}: the kernel's key block is a power of two of at least 16 "
                         "(tl.dot's smallest tile); e.g. 32 or 64")
    if splits is not None and splits < 1:
        raise SystemExit(f"--max-decode-splits {splits}: at least 1 (1: the unsplit kernel)")

    switches.setVALUES(**{small_m_gemm.SMALL_M.name: args.small_m_gemm})
    if args.small_m_table:
        from bench.small_m_sweep import fastest_launches

        small_m_gemm.LAUNCHES.update(fastest_launches(args.small_m_table))
        print(f"small-M launches: {small_m_gemm.LAUNCHES}")
    if args.gemv_table:
        from bench.moe_gemv_sweep import fastest_launches

        moe_configs.GEMV_LAUNCHES.update(fastest_launches(args.gemv_table, args.gemv_shape))
        print(f"expert GEMV launches: {moe_configs.GEMV_LAUNCHES}")
    if args.decode_split_keys or args.max_decode_splits:
        paged_attention.DECODE_SPLIT_KEYS = args.decode_split_keys or paged_attention.DECODE_SPLIT_KEYS
        paged_attention.MAX_DECODE_SPLITS = args.max_decode_splits or paged_attention.MAX_DECODE_SPLITS
        print(f"split-KV decode: {paged_attention.DECODE_SPLIT_KEYS} keys per iteration, at most "
              f"{paged_attention.MAX_DECODE_SPLITS} splits")
    for shape in args.drop_launch:
        small_m_gemm.LAUNCHES.pop(tuple(int(v) for v in shape.split("x")))
        print(f"small-M launch table without {shape}")
