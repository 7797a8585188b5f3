"""Tile configurations of the fused MoE launches, by shape: a swept table and a default.

A fused MoE forward of T tokens uses one row block ``block_m`` (the routing layout's)
and one tile configuration per projection. :func:`moe_tiles` looks the shape up in
:data:`TUNED`, keyed ``(E, H, I, weight format)`` and then by a token bucket (the
power of two at or above T, capped at :data:`MAX_BUCKET`), as SGLang's fused_moe
config files are keyed by E, N and M; shapes not in the table get
:func:`default_tiles`. Every choice is a pure function of T's bucket and the model
shape, so a CUDA graph of a given batch size always replays the same launches.

``bench/moe.py --sweep`` times the candidates of :data:`SWEEP_GEMMS` on the H200 and
prints the entries to paste here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GemmConfig:
    """Tile configuration of one grouped GEMM launch (``block_m`` is the routing's row block)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoETiles:
    """The row block of the layout and the tiles of the gate_up and down launches."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig


@dataclass(frozen=True)
class GemvLaunch:
    """Launch of the one-pair CUDA-core expert GEMV (``--moe-gemv-tokens``): output columns per
    program, K elements per unrolled block (0: the largest of 512, 256, ... dividing K) and warps."""

    block_n: int
    block_k: int = 0
    num_warps: int = 4


#: the expert GEMV's launch per projection (the gate_up program reads gate and up rows, so half the
#: down's columns; ``down_combine``: the down projection with the top-k sum, a program per token's
#: columns over all its slots); ``bench/moe_gemv_sweep.py`` times the candidates of :data:`SWEEP_GEMV`.
#: On an H100 (Qwen3-30B-A3B experts, one token, 16 launches over disjoint experts, us per launch): gate_up
#: 4 columns x 512 x 8 warps 18.5 (2.72 TB/s) against 8 x 512 x 4 18.9; down 16 x 256 x 2 warps 9.0 (2.79 TB/s)
#: against 16 x 256 x 4 10.2; down_combine 4 x 256 x 4 11.9, the fastest within 2%
GEMV_LAUNCHES = {"gate_up": GemvLaunch(4, num_warps=8), "down": GemvLaunch(16, num_warps=2),
                 "down_combine": GemvLaunch(4)}
#: (block_n, block_k, num_warps) candidates of the GEMV sweep
SWEEP_GEMV = tuple((n, k, w) for n in (4, 8, 16, 32) for k in (128, 256, 512) for w in (2, 4, 8))


#: largest token bucket of the table (more tokens use this bucket's entry)
MAX_BUCKET = 8192

#: (E, H, I, weight format) -> {token bucket: (block_m, gate_up (bn, bk, warps, stages), down (...))}.
#: Qwen3-30B-A3B experts, bf16: the fastest of ``bench/moe.py --sweep`` on the H200 (graph-timed; the
#: timings are in ``bench/RESULTS.md``).
TUNED: dict[tuple[int, int, int, str], dict[int, tuple[int, tuple[int, int, int, int], tuple[int, int, int, int]]]] = {
    (128, 2048, 768, "bf16"): {
        1: (16, (64, 128, 4, 4), (128, 128, 8, 3)),
        32: (16, (64, 128, 4, 4), (128, 128, 8, 3)),
        128: (16, (64, 128, 4, 3), (128, 128, 8, 3)),
        256: (32, (64, 128, 4, 3), (64, 128, 4, 4)),
        1024: (64, (64, 64, 4, 3), (128, 64, 8, 3)),
        8192: (128, (128, 64, 8, 3), (128, 64, 8, 3)),
    },
}

#: the (block_n, block_k, num_warps, num_stages) candidates the sweep times per projection (the narrow
#: ones spread a few tokens' weight reads over more programs: the quantized kernels' decode tiles)
SWEEP_GEMMS = ((16, 128, 2, 4), (16, 128, 4, 3), (32, 128, 2, 4), (32, 128, 4, 3), (32, 128, 4, 4), (64, 64, 4, 3),
               (64, 128, 4, 3), (64, 128, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3))
#: the row blocks the sweep tries
SWEEP_BLOCK_M = (16, 32, 64, 128)


def token_bucket(num_tokens: int) -> int:
    """The power of two at or above ``num_tokens`` (at least 1, at most :data:`MAX_BUCKET`)."""
    return min(MAX_BUCKET, 1 << max(num_tokens - 1, 0).bit_length())


def pick_block_m(num_pairs: int, num_experts: int) -> int:
    """Row block by the mean rows per expert: 16 for decode, up to 128 for prefill."""
    per_expert = -(-num_pairs // max(num_experts, 1))
    for block_m in (16, 32, 64):
        if per_expert <= 2 * block_m:
            return block_m
    return 128


def _fit(block: int, size: int) -> int:
    return min(block, max(16, 1 << (max(size, 1) - 1).bit_length()))


def gemm_config(block_m: int, n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """Default tiles of an ``[R, k] x [k, n]`` grouped GEMM with row block ``block_m``."""
    if dtype == torch.float32:
        return GemmConfig(block_m, _fit(64, n), _fit(32, k), num_warps=4, num_stages=2)
    block_n = 64 if block_m <= 32 else 128
    num_warps = 8 if block_m >= 128 else 4
    return GemmConfig(block_m, _fit(block_n, n), _fit(64, k), num_warps=num_warps, num_stages=3)


def default_tiles(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> MoETiles:
    """Tiles of a shape the table does not hold (by the bucket, so graph-stable)."""
    block_m = pick_block_m(token_bucket(num_tokens) * top_k, num_experts)
    return MoETiles(block_m, gemm_config(block_m, inter, hidden, dtype), gemm_config(block_m, hidden, inter, dtype))


def moe_tiles(
    num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, weight_format: str,
) -> MoETiles:
    """The swept tiles of this shape and token bucket, else :func:`default_tiles`.

    ``weight_format``: ``"bf16"``, ``"fp16"``, ``"fp32"`` or a precision plugin's
    name for its expert weights (``"fp8_block128"``, ``"int4_g128"``, ...).
    """
    entries = TUNED.get((num_experts, hidden, inter, weight_format))
    bucket = token_bucket(num_tokens)
    if entries:
        nearest = min(entries, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
        block_m, gate_up, down = entries[nearest]
        return MoETiles(block_m, GemmConfig(block_m, *gate_up), GemmConfig(block_m, *down))
    return default_tiles(num_tokens, top_k, num_experts, hidden, inter, dtype)


def max_row_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Row blocks of the layout: every expert's rows padded to ``block_m``; never more than one per pair."""
    return min(num_pairs, -(-(num_pairs + num_experts * (block_m - 1)) // block_m))
