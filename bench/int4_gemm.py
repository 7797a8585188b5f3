"""Weight-only INT4 GEMM vs bf16 matmul at decode shapes (miles-int4).

    python bench/int4_gemm.py                # H200: the linears of Qwen3-0.6B, M = 1..64
    python bench/int4_gemm.py --model 1.7b   # Qwen3-1.7B shapes
    python bench/int4_gemm.py --tiny         # CPU smoke run of the same code paths

One decode step's linears of every layer (qkv, o, gate_up, down; no lm_head),
each layer with its own weights so nothing stays in L2, run back to back inside
one CUDA graph (launch overhead out of the picture) for each batch size M:
bf16 ``F.linear``, torch's int4 kernel (``_weight_int4pack_mm``, the rollout's
``packed`` path) and the ``dequant`` path (unpack + dequantize + ``F.linear``,
bit-identical to the QAT forward). The HBM bound is the weight bytes read once
at 4.24 TB/s (bf16: 2 bytes/param; INT4: 0.5 byte/param + a bf16 scale per group).
Before timing, every int4 output is checked against its float reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plugins", "miles_int4"))

from miles_int4.kernels import int4_mm, pack_for_kernel, reference_mm  # noqa: E402
from miles_int4.quant import dequantize_packed, pack_int32, quantize  # noqa: E402

HBM_BYTES_PER_S = 4.24e12

#: hidden, intermediate, q heads, kv heads, head dim, layers
MODELS = {
    "0.6b": (1024, 3072, 16, 8, 128, 28),
    "1.7b": (2048, 6144, 16, 8, 128, 28),
    "tiny": (128, 256, 4, 2, 32, 2),
}


def layer_shapes(model: str) -> list[tuple[str, int, int]]:
    """``(name, out_features N, in_features K)`` of one decoder layer's linears."""
    hidden, inter, heads, kv_heads, head_dim, _ = MODELS[model]
    return [
        ("qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden),
        ("o_proj", hidden, heads * head_dim),
        ("gate_up_proj", 2 * inter, hidden),
        ("down_proj", hidden, inter),
    ]


def build_weights(model: str, group_size: int, device: torch.device, layers: int):
    """Per layer and linear: bf16 weight, packed-kernel weight, compressed-tensors buffers."""
    out = []
    for _ in range(layers):
        for name, n, k in layer_shapes(model):
            w = torch.randn(n, k, device=device) * 0.02
            q, scale = quantize(w, group_size)
            act = torch.bfloat16 if device.type == "cuda" else torch.float32
            out.append({
                "name": name, "bf16": w.to(act), "q": q, "scale": scale,
                "kernel": pack_for_kernel(q, scale, act), "packed": pack_int32(q),
            })
    return out


def weight_bytes(weights, group_size: int) -> tuple[int, int]:
    params = sum(w["q"].numel() for w in weights)
    return 2 * params, params // 2 + params // group_size * 2


def check(weights, x_by_k: dict[int, torch.Tensor]) -> float:
    """Largest relative error of the int4 kernel against dequantize + matmul in float64."""
    worst = 0.0
    for w in weights[:4]:
        x = x_by_k[w["q"].shape[1]]
        expected = reference_mm(x.double(), w["q"], w["scale"])
        got = int4_mm(x, w["kernel"]).double()
        worst = max(worst, float((got - expected).abs().max() / expected.abs().max()))
    return worst


def step_fns(weights, x_by_k):
    def bf16():
        for w in weights:
            F.linear(x_by_k[w["q"].shape[1]], w["bf16"])

    def packed():
        for w in weights:
            int4_mm(x_by_k[w["q"].shape[1]], w["kernel"])

    def dequant():
        for w in weights:
            x = x_by_k[w["q"].shape[1]]
            F.linear(x, dequantize_packed(w["packed"], w["scale"], x.dtype))

    return {"bf16": bf16, "int4 packed": packed, "int4 dequant": dequant}


def time_fn(fn, device: torch.device, repeats: int) -> float:
    """Median seconds per call (CUDA: replay of a CUDA graph of one call)."""
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
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="0.6b", choices=[m for m in MODELS if m != "tiny"])
    parser.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128])
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on tiny shapes")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.tiny:
        device, model, layers, repeats, group_size = torch.device("cpu"), "tiny", 2, 3, 32
        batch_sizes = [1, 4]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (use --tiny for a CPU smoke run)")
        device, model, layers, repeats, group_size = torch.device("cuda"), args.model, MODELS[args.model][-1], args.repeats, args.group_size
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    torch.manual_seed(0)
    weights = build_weights(model, group_size, device, layers)
    bf16_bytes, int4_bytes = weight_bytes(weights, group_size)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}: {model} linears x {layers} layers, {bf16_bytes / 1e6:.1f} MB bf16 / {int4_bytes / 1e6:.1f} MB int4 "
          f"(group {group_size}); HBM bound at {HBM_BYTES_PER_S / 1e12:.2f} TB/s: "
          f"bf16 {bf16_bytes / HBM_BYTES_PER_S * 1e6:.1f} us, int4 {int4_bytes / HBM_BYTES_PER_S * 1e6:.1f} us")
    print(f"{'M':>4} {'bf16 us':>9} {'int4 packed us':>15} {'int4 dequant us':>16} {'packed speedup':>15} "
          f"{'packed % of HBM':>16} {'max rel err':>12}")
    results = []
    act = torch.bfloat16 if device.type == "cuda" else torch.float32
    for m in batch_sizes:
        x_by_k = {k: torch.randn(m, k, device=device, dtype=act) for k in {w["q"].shape[1] for w in weights}}
        error = check(weights, x_by_k)
        times = {label: time_fn(fn, device, repeats) for label, fn in step_fns(weights, x_by_k).items()}
        bound = int4_bytes / HBM_BYTES_PER_S
        row = {"M": m, **{f"{k} s": v for k, v in times.items()}, "max_rel_err": error,
               "speedup": times["bf16"] / times["int4 packed"], "hbm_fraction": bound / times["int4 packed"]}
        results.append(row)
        print(f"{m:>4} {times['bf16'] * 1e6:>9.1f} {times['int4 packed'] * 1e6:>15.1f} {times['int4 dequant'] * 1e6:>16.1f} "
              f"{row['speedup']:>14.2f}x {100 * row['hbm_fraction']:>15.0f}% {error:>12.1e}")
        if error > 2e-2:
            raise SystemExit(f"int4 kernel disagrees with its float reference at M={m}: {error:.2e}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": name, "model": model, "group_size": group_size, "bf16_bytes": bf16_bytes,
                       "int4_bytes": int4_bytes, "rows": results}, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
