"""Block-scaled FP8 GEMM vs bf16 in the same run: prefill-sized GEMMs, then decode-sized linears.

    python bench/fp8_gemm.py                # on the GPU: both parts
    python bench/fp8_gemm.py --decode-only  # the decode part: 1.7B linears at M = 1, 8, 32
    python bench/fp8_gemm.py --decode-only --sweep   # + every tile/split variant of the small-M kernel
    python bench/fp8_gemm.py --tiny         # CPU smoke (reference path; numbers meaningless)
    python bench/fp8_gemm.py --train-model 8b --train-tokens 16384   # prefill part on 8B training shapes
    python bench/fp8_gemm.py --json out.json

Prefill part (M=8192 square, and one layer's linears of ``--train-model`` at ``--train-tokens`` rows,
default Qwen3-0.6B at 8192): bf16 ``torch.matmul``; the FP8
GEMM alone with each available backend (cuBLAS block-scaled ``_scaled_mm`` when
usable, the Triton kernel); and the FP8 linear as a layer ran it before the fused
kernel (1x128 activation quantization + GEMM). TFLOP/s = 2*M*N*K / time. Bounds
quoted for the H200: 1468 TFLOP/s FP8 (tensor-wise, measured), 808 bf16 (measured).

Decode part (``bench/small_m.py``: one weight per decoder layer of ``--model``'s
linear shapes, default Qwen3-1.7B, back to back in a CUDA graph): per-GEMM microseconds of bf16 ``F.linear``, the old FP8 path
(``quantize_act`` + ``block_scaled_mm``, two launches; cuBLAS when usable, else
Triton), and the fused small-M kernel (:mod:`miles_fp8.decode_gemm`, one launch),
with its % of the HBM bound (FP8 weight + scales) and its speedup over bf16 (the
goal: >= 1.4x). Every fused output is checked against the float reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "miles_fp8"))

from bench import small_m  # noqa: E402
from miles_fp8 import gemm  # noqa: E402
from miles_host.kernels import switches  # noqa: E402
from miles_fp8.quant import quantize_act, quantize_weight  # noqa: E402

FP8_BOUND, BF16_BOUND = 1468.0, 808.0


def train_shapes(model: str, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, M, N, K): a square GEMM and one decoder layer's linears of ``model`` at ``tokens`` rows."""
    return [("square", 8192, 4096, 4096)] + [
        (f"{model} {name}", tokens, n, k) for name, n, k in small_m.layer_shapes(model)
    ]


TINY_SHAPES = [("tiny", 64, 256, 256), ("tiny qkv", 32, 512, 128)]


def _time(fns: dict, device: torch.device, iters: int, warmup: int, rounds: int = 5) -> dict:
    """Median seconds per call of each of ``fns`` (name -> callable).

    On the GPU each sample is ``iters`` calls back to back between two events (the host runs
    ahead, so launch overhead is not timed: a training step's big GEMMs are queued the same
    way), and the functions take turns round by round so that clock and thermal drift hit them
    alike (one function timed after another had moved by ~15% between runs).
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    fn()
                end.record()
                torch.cuda.synchronize()
                samples[name].append(start.elapsed_time(end) / 1e3 / iters)
            else:
                begin = time.perf_counter()
                for _ in range(iters):
                    fn()
                samples[name].append((time.perf_counter() - begin) / iters)
    return {name: sorted(values)[len(values) // 2] for name, values in samples.items()}


def _backends(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["reference"]
    backends = ["triton"]
    if gemm.scaled_mm_usable(device):
        backends.insert(0, "scaled_mm")
    return backends


def bench_shape(name, m, n, k, device, iters, warmup) -> dict:
    """One row: bf16 and FP8 timings for ``y[M, N] = x[M, K] @ w[N, K]^T``."""
    flops = 2 * m * n * k
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    row = {"shape": name, "M": m, "N": n, "K": k}
    w_t = w.t()
    x_q, x_s = quantize_act(x)
    w_q, w_s = quantize_weight(w)

    def with_backend(backend, fn):
        def call():
            with switches.switched(fp8_gemm=backend):
                return fn()
        return call

    fns = {"bf16": lambda: torch.matmul(x, w_t), "act_quant": lambda: quantize_act(x)}
    for backend in _backends(device):
        fns[backend] = with_backend(backend, lambda: gemm.block_scaled_mm(x_q, x_s, w_q, w_s, torch.bfloat16))
        fns[f"{backend}_with_act_quant"] = with_backend(
            backend, lambda: gemm.block_scaled_mm(*quantize_act(x), w_q, w_s, torch.bfloat16))
    seconds = _time(fns, device, iters, warmup)
    row["bf16_tflops"] = flops / seconds.pop("bf16") / 1e12
    quant_s = seconds.pop("act_quant")
    row["act_quant_us"] = quant_s * 1e6
    row["act_quant_tb_per_s"] = (m * k * 2 + m * k + m * (k // 128) * 4) / quant_s / 1e12  # bf16 in, fp8 + scales out
    for key, value in seconds.items():
        row[f"fp8_{key}_tflops"] = flops / value / 1e12
    best = max(v for key, v in row.items() if key.startswith("fp8_") and "with_act" not in key)
    row["fp8_over_bf16"] = best / row["bf16_tflops"]
    return row


def layer_summary(rows: list[dict]) -> str:
    """FP8 vs bf16 over one decoder layer's GEMMs, weighted by their time (= FLOP-weighted TFLOP/s)."""
    flops = [2 * r["M"] * r["N"] * r["K"] for r in rows]
    bf16_s = sum(f / (r["bf16_tflops"] * 1e12) for f, r in zip(flops, rows))
    parts = []
    for suffix in ("", "_with_act_quant"):
        times = []
        for f, r in zip(flops, rows):
            best = max(v for key, v in r.items() if key.startswith("fp8_") and key.endswith(suffix + "_tflops")
                       and (suffix or "with_act" not in key))
            times.append(f / (best * 1e12))
        parts.append(f"{bf16_s / sum(times):.2f}x" + (" with act quant" if suffix else " GEMMs"))
    return f"  one layer (time-weighted): FP8 / bf16 = {', '.join(parts)}"


# ----------------------------------------------------------------------------- decode (small M)


def _fp8_bytes(n: int, k: int) -> int:
    return n * k + (n // 128) * (k // 128) * 4


def _check_fused(x, w_q, w_s) -> float:
    from miles_fp8 import decode_gemm
    from miles_fp8.gemm import block_scaled_mm_ref
    from miles_fp8.quant import quantize_act_ref

    expected = block_scaled_mm_ref(*quantize_act_ref(x.float()), w_q, w_s, torch.float32)
    return small_m.relative_error(decode_gemm.fused_act_quant_mm(x, w_q, w_s), expected)


def _old_path_us(x, weights, device, repeats) -> float:
    """quantize_act + block_scaled_mm (auto: cuBLAS when its self-check passed, else Triton), two launches."""
    with switches.switched(fp8_gemm="auto"):
        return small_m.per_gemm_us(lambda w: gemm.block_scaled_mm(*quantize_act(x), *w, torch.bfloat16),
                                   weights, device, repeats)


def sweep_variants(k: int) -> list[tuple]:
    """(config, split) pairs tried by ``--sweep``: tile presets x every split the K-blocks allow."""
    from miles_host.kernels.split_k import SmallMConfig

    presets = [(64, 4, 4), (128, 4, 4), (128, 8, 3), (128, 8, 6)]
    splits = [s for s in (1, 2, 4, 8, 16) if (k // 128) % s == 0 and (k // 128) // s >= 1]
    return [(SmallMConfig(0, bn, warps, stages), split) for bn, warps, stages in presets for split in splits]


def sweep_shape(x, weights, device, repeats) -> tuple[float, str]:
    """Fastest (microseconds, description) among :func:`sweep_variants` with fp16 products, and the same
    variants with FP8 tensor-core products."""
    from dataclasses import replace

    from miles_fp8 import decode_gemm

    m, k = x.shape
    block_m = decode_gemm.small_m_config(m).block_m

    def fastest(fp8_mma: bool) -> tuple[float, str]:
        best = (float("inf"), "")
        for config, split in sweep_variants(k):
            config = replace(config, block_m=block_m, fp8_mma=fp8_mma)
            us = small_m.per_gemm_us(lambda w: decode_gemm.fused_act_quant_mm(x, *w, config=config, split=split),
                                     weights, device, repeats)
            if us < best[0]:
                best = (us, f"BLOCK_N={config.block_n} warps={config.num_warps} stages={config.num_stages} "
                            f"split={split}")
        return best

    (us, what), (mma_us, mma_what) = fastest(False), fastest(True)
    return us, what + f" (FP8 MMA best: {mma_us:.1f} us with {mma_what})"


def bench_decode(device, batch_sizes, layers, repeats, sweep, model="1.7b") -> list[dict]:
    """Per-GEMM microseconds of bf16, the old FP8 path and the fused kernel on one model's linears."""
    import torch.nn.functional as F

    from miles_fp8 import decode_gemm

    shapes = small_m.layer_shapes(model if device.type == "cuda" else "tiny")
    layers = layers or small_m.num_layers(model)
    rows = []
    print(f"\nDecode GEMMs (per GEMM, {layers} weights back to back in a CUDA graph); HBM bound at "
          f"{small_m.HBM_BYTES_PER_S / 1e12:.2f} TB/s of the FP8 weight + scales")
    print(f"{'linear':<13} {'M':>3} {'bf16 us':>8} {'fp8 old us':>11} {'fp8 fused us':>13} {'fused %HBM':>11} "
          f"{'fused/bf16':>11} {'fused/old':>10} {'rel err':>8}")
    for name, n, k in shapes:
        dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        weights = [quantize_weight(w) for w in dense]
        for m in batch_sizes:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            error = _check_fused(x, *weights[0]) if device.type == "cuda" else float("nan")
            bf16 = small_m.per_gemm_us(lambda w: F.linear(x, w), dense, device, repeats)
            old = _old_path_us(x, weights, device, repeats)
            fused = (small_m.per_gemm_us(lambda w: decode_gemm.fused_act_quant_mm(x, *w), weights, device, repeats)
                     if device.type == "cuda" else float("nan"))
            share = small_m.hbm_fraction(_fp8_bytes(n, k), fused)
            row = dict(linear=name, M=m, N=n, K=k, bf16_us=bf16, fp8_old_us=old, fp8_fused_us=fused,
                       fused_hbm_fraction=share, fused_over_bf16=bf16 / fused, max_rel_err=error)
            print(f"{name:<13} {m:>3} {bf16:>8.1f} {old:>11.1f} {fused:>13.1f} {100 * share:>10.0f}% "
                  f"{bf16 / fused:>10.2f}x {old / fused:>9.2f}x {error:>8.1e}", flush=True)
            if sweep and device.type == "cuda":
                row["sweep_best_us"], row["sweep_best"] = sweep_shape(x, weights, device, repeats)
                print(f"{'':<17} sweep: {row['sweep_best_us']:.1f} us with {row['sweep_best']} "
                      f"(table: {decode_gemm.small_m_config(m)})", flush=True)
            rows.append(row)
        del dense, weights
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on tiny shapes")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--json", help="also write the rows as JSON here")
    parser.add_argument("--decode-only", action="store_true", help="only the decode-sized (small-M) part")
    parser.add_argument("--batch-sizes", default="1,8,32", help="decode part: token rows M")
    parser.add_argument("--layers", type=int, default=None, help="decode part: weights per shape (default: the model's layers)")
    parser.add_argument("--model", default="1.7b", choices=[m for m in small_m.MODELS if m != "tiny"],
                        help="decode part: whose linears (Qwen3 shapes)")
    parser.add_argument("--sweep", action="store_true", help="decode part: also time every small-M kernel variant")
    parser.add_argument("--train-model", default="0.6b", choices=[m for m in small_m.MODELS if m != "tiny"],
                        help="prefill/training part: whose linears (e.g. 8b: hidden 4096, K up to 12288)")
    parser.add_argument("--train-tokens", type=int, default=8192, help="prefill/training part: token rows M")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type == "cpu" and not args.tiny:
        parser.error("no CUDA device: pass --tiny for the CPU smoke run")
    if device.type == "cuda":
        from miles_fp8.device import check_fp8_device

        check_fp8_device(device)
    shapes = [] if args.decode_only else (TINY_SHAPES if args.tiny else train_shapes(args.train_model, args.train_tokens))
    iters = args.iters or (3 if args.tiny else 50)
    rows = [bench_shape(*shape, device, 2 if args.tiny else 20, warmup=1 if args.tiny else 5) for shape in shapes]
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke: reference path)"
    print(f"block-scaled FP8 GEMM vs bf16 on {label}; bounds: fp8 {FP8_BOUND:.0f}, bf16 {BF16_BOUND:.0f} TFLOP/s")
    for row in rows:
        fp8 = "  ".join(f"{key[4:-7]} {value:8.2f}" for key, value in row.items() if key.startswith("fp8_") and key.endswith("_tflops"))
        print(f"  {row['shape']:<18} M={row['M']:<5} N={row['N']:<5} K={row['K']:<5} bf16 {row['bf16_tflops']:8.2f}  {fp8}"
              f"  fp8/bf16 {row['fp8_over_bf16']:.2f}x  act quant {row['act_quant_us']:.1f} us"
              f" ({row['act_quant_tb_per_s']:.2f} TB/s)")
    if len(rows) > 1:
        print(layer_summary(rows[1:]))
    batch_sizes = [1, 4] if args.tiny else [int(b) for b in args.batch_sizes.split(",")]
    decode = bench_decode(device, batch_sizes, 2 if args.tiny else args.layers, iters, args.sweep, args.model)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": label, "rows": rows, "decode": decode}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
