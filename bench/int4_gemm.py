"""Weight-only INT4 GEMMs vs bf16 matmul at decode shapes (miles-int4).

    python bench/int4_gemm.py                      # H200: Qwen3-1.7B linears, M = 1, 8, 32
    python bench/int4_gemm.py --model 0.6b --batch-sizes 1,2,4,8,16,32,64
    python bench/int4_gemm.py --sweep              # + every tile/split variant of the Triton kernel
    python bench/int4_gemm.py --tiny               # CPU smoke run of the same code paths

For each linear shape of one decoder layer (qkv, o, gate_up, down; no lm_head) and
each token count M, ``--layers`` weights (one per decoder layer, so nothing stays in
L2) are multiplied back to back inside one CUDA graph (``bench/small_m.py``); the
per-GEMM time is the replay time over the layer count. Columns: bf16 ``F.linear``;
``tinygemm`` (torch's ``_weight_int4pack_mm``, the rollout's packed path before the
Triton kernel); ``dequant`` (unpack + dequantize + ``F.linear``, bit-identical to the
QAT forward; the rollout's path above 64 rows); ``triton`` (:mod:`miles_int4.decode_gemm`
on the ``halves`` layout, the rollout's packed path at M <= 64: a CUDA-core GEMV at M = 1, the
tensor-core kernel above); ``mma``: the tensor-core kernel at every M (the M = 1 path before the GEMV). The HBM bound is the
INT4 bytes read once at 4.24 TB/s (0.5 byte/param + a bf16 scale per group); the
goal is INT4 >= 1.5x bf16 at batch 1. Before timing, every INT4 output is
checked against its float reference. A last table sums the four linears (one layer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "plugins", "miles_int4"))

from bench import small_m  # noqa: E402
from miles_host.kernels import switches  # noqa: E402
from miles_int4.kernels import halves_rows, int4_mm, kernel_supports, pack_for_kernel, reference_mm  # noqa: E402
from miles_int4.quant import dequantize_packed, pack_int32, quantize  # noqa: E402

PATHS = ("bf16", "tinygemm", "dequant", "mma", "triton")


def build_weights(n: int, k: int, group_size: int, device: torch.device, layers: int) -> list[dict]:
    """Per layer: bf16 weight, q/scale, and each path's layout (missing where the device has no such kernel)."""
    act = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = []
    for _ in range(layers):
        w = torch.randn(n, k, device=device) * 0.02
        q, scale = quantize(w, group_size)
        entry = {"bf16": w.to(act), "q": q, "scale": scale, "packed": pack_int32(q)}
        if device.type == "cuda":
            entry["triton"] = pack_for_kernel(q, scale, act, layout="halves")
            if kernel_supports(n, k, device, "tinygemm"):
                entry["tinygemm"] = pack_for_kernel(q, scale, act, layout="tinygemm")
        else:
            entry["tinygemm"] = pack_for_kernel(q, scale, act, layout="cpu")  # torch's CPU kernel
        out.append(entry)
    return out


def int4_bytes(n: int, k: int, group_size: int) -> int:
    return n * k // 2 + n * (k // group_size) * 2


def gemm_fns(x: torch.Tensor) -> dict:
    """path -> ``gemm(entry)``."""
    return {
        "bf16": lambda w: F.linear(x, w["bf16"]),
        "tinygemm": lambda w: int4_mm(x, w["tinygemm"]),
        "dequant": lambda w: F.linear(x, dequantize_packed(w["packed"], w["scale"], x.dtype)),
        "mma": lambda w: _without_gemv(lambda: int4_mm(x, w["triton"])),
        "triton": lambda w: int4_mm(x, w["triton"]),
    }


def _without_gemv(fn):
    """``fn()`` with one-token inputs on the tensor-core kernel (``--int4-gemv 0``): the kernel before the GEMV."""
    with switches.switched(int4_gemv=0):
        return fn()


def check(weights: list[dict], x: torch.Tensor) -> float:
    """Largest relative error of the INT4 paths against dequantize + matmul in float64."""
    expected = reference_mm(x.double(), weights[0]["q"], weights[0]["scale"])
    fns = gemm_fns(x)
    return max(small_m.relative_error(fns[path](weights[0]), expected)
               for path in ("tinygemm", "dequant", "mma", "triton")
               if path in weights[0] or (path == "mma" and "triton" in weights[0]))


def sweep(x: torch.Tensor, weights: list[dict], device: torch.device, repeats: int) -> tuple[float, str]:
    """Fastest (microseconds, description) of the Triton kernel over tile presets x splits."""
    from miles_host.kernels.split_k import SmallMConfig
    from miles_int4 import decode_gemm

    m, k = x.shape
    pack = weights[0]["triton"]
    groups = k // pack.group_size
    block_m = decode_gemm.small_m_config(m).block_m
    best = (float("inf"), "")
    if m == 1:  # the CUDA-core GEMV's variants
        out = torch.empty(1, pack.out_features, dtype=x.dtype, device=x.device)
        for w in weights:  # the same bytes stored row by row
            w.setdefault("rows", halves_rows(w["triton"]))
        for block_n, warps in [(32, 4), (64, 4), (128, 4), (128, 8), (256, 8)]:
            for layout in ("tiles", "rows"):  # the rollout's tiles (one tile's bytes of a group contiguous), or rows
                for split in [s for s in (None, 1, 2, 4, 8) if s is None or groups % s == 0]:
                    us = small_m.per_gemm_us(
                        lambda w: decode_gemm._int4_gemv(
                            x, w["triton"].weight if layout == "tiles" else w["rows"], w["triton"].scales,
                            pack.group_size, out, block_n=block_n, warps=warps, split=split),
                        weights, device, repeats)
                    print(f"{'':<17}   GEMV {layout} BLOCK_N={block_n} warps={warps} split={split or 'planned'}: "
                          f"{us:.1f} us", flush=True)
                    if us < best[0]:
                        best = (us, f"GEMV {layout} BLOCK_N={block_n} warps={warps} split={split or 'planned'}")
    for block_n, warps, stages in [(64, 4, 4), (64, 4, 8), (32, 4, 8), (128, 4, 4), (128, 4, 6), (128, 8, 6)]:
        config = SmallMConfig(block_m, block_n, warps, stages)
        for split in [s for s in (1, 2, 4, 8, 16) if groups % s == 0]:
            us = small_m.per_gemm_us(
                lambda w: decode_gemm.int4_small_m_mm(x, w["triton"].weight, w["triton"].scales, pack.group_size,
                                                      config=config, split=split),
                weights, device, repeats)
            if us < best[0]:
                best = (us, f"BLOCK_N={block_n} warps={warps} stages={stages} split={split}")
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="1.7b", choices=[m for m in small_m.MODELS if m != "tiny"])
    parser.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128])
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--layers", type=int, default=None, help="weights per shape (default: the model's layers)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="also time every tile/split variant of the Triton kernel")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on tiny shapes")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.tiny:
        device, model, layers, repeats, group_size, batch_sizes = torch.device("cpu"), "tiny", 2, 3, 32, [1, 4]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (use --tiny for a CPU smoke run)")
        device, model, repeats, group_size = torch.device("cuda"), args.model, args.repeats, args.group_size
        layers = args.layers or small_m.num_layers(model)
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    torch.manual_seed(0)
    act = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke: no Triton kernel)"
    print(f"{name}: {model} linears, {layers} weights per shape, INT4 group {group_size}; per-GEMM microseconds "
          f"(CUDA graph of {layers} GEMMs); HBM bound of the INT4 bytes at {small_m.HBM_BYTES_PER_S / 1e12:.2f} TB/s")
    print(f"{'linear':<13} {'M':>3} {'bf16':>7} {'tinygemm':>9} {'dequant':>8} {'mma':>7} {'triton':>7} {'triton %HBM':>12} "
          f"{'triton/bf16':>12} {'triton/tinygemm':>16} {'rel err':>8}")
    rows = []
    totals: dict[int, dict[str, float]] = {m: {path: 0.0 for path in PATHS} for m in batch_sizes}
    bytes_per_layer = 0
    for shape, n, k in small_m.layer_shapes(model):
        weights = build_weights(n, k, group_size, device, layers)
        bytes_per_layer += int4_bytes(n, k, group_size)
        for m in batch_sizes:
            x = torch.randn(m, k, device=device, dtype=act)
            error = check(weights, x)
            if error > 2e-2:
                raise SystemExit(f"an int4 path disagrees with its float reference at {shape} M={m}: {error:.2e}")
            fns = gemm_fns(x)
            times = {path: (small_m.per_gemm_us(fns[path], weights, device, repeats) if path in weights[0] or
                            path in ("bf16", "dequant") or (path == "mma" and "triton" in weights[0])
                            else float("nan")) for path in PATHS}
            share = small_m.hbm_fraction(int4_bytes(n, k, group_size), times["triton"])
            row = dict(linear=shape, M=m, N=n, K=k, **{f"{p}_us": t for p, t in times.items()},
                       triton_hbm_fraction=share, max_rel_err=error)
            for path in PATHS:
                totals[m][path] += times[path]
            print(f"{shape:<13} {m:>3} {times['bf16']:>7.1f} {times['tinygemm']:>9.1f} {times['dequant']:>8.1f} {times['mma']:>7.1f} "
                  f"{times['triton']:>7.1f} {100 * share:>11.0f}% {times['bf16'] / times['triton']:>11.2f}x "
                  f"{times['tinygemm'] / times['triton']:>15.2f}x {error:>8.1e}", flush=True)
            if args.sweep and device.type == "cuda":
                row["sweep_best_us"], row["sweep_best"] = sweep(x, weights, device, repeats)
                print(f"{'':<17} sweep: {row['sweep_best_us']:.1f} us with {row['sweep_best']}", flush=True)
            rows.append(row)
        del weights
    print("\nOne layer (the four linears):")
    for m, total in totals.items():
        share = small_m.hbm_fraction(bytes_per_layer, total["triton"])
        print(f"  M={m:<3} bf16 {total['bf16']:.1f} us, tinygemm {total['tinygemm']:.1f}, dequant {total['dequant']:.1f}, "
              f"mma {total['mma']:.1f}, "
              f"triton {total['triton']:.1f} ({100 * share:.0f}% of HBM; {total['bf16'] / total['triton']:.2f}x bf16, "
              f"{total['tinygemm'] / total['triton']:.2f}x tinygemm)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": name, "model": model, "group_size": group_size, "layers": layers, "rows": rows,
                       "per_layer": totals}, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
