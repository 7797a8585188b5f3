"""MoE training throughput: miles' grouped-GEMM experts vs its per-expert loop vs transformers, same run.

One forward + backward (no optimizer step) of a random-init Qwen3-30B-A3B-shaped model cut to
8 layers (128 experts top-8, hidden 2048, moe_intermediate 768, 32 q / 4 kv heads of dim 128,
vocab 151936, untied embeddings), bf16 weights, 8 x 2048 tokens. Rows, each with the same
weights and batch:

- miles grouped: ``MoEConfig.experts_impl="auto"`` (``torch._grouped_mm``, :mod:`miles_host.kernels.moe_train`)
- miles loop: ``experts_impl="loop"`` (the per-expert loop of ``routed_forward``)
- transformers: ``Qwen3MoeForCausalLM`` (sdpa) with its default experts implementation
  (``grouped_mm`` where torch has it) and with ``experts_implementation="eager"`` (its expert loop)

Reports the median step time of the timed steps after warm-up, tokens/s, peak memory and the
active-parameter MFU = 6 * N_active * tokens/s / 790 TFLOP/s, where N_active counts every
matmul weight a token uses (attention, router, its top-k experts, the LM head; not the input
embedding, a lookup).

    python bench/moe_train.py                 # on the GPU
    python bench/moe_train.py --tiny          # CPU smoke check (hidden 64, 2 layers, 8 experts top-2)
    python bench/moe_train.py --json out.json

Needs torch and transformers only (no network).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "plugins" / "models"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import torch  # noqa: E402
import transformers  # noqa: E402

from miles_host.models import CausalLM, ForwardContext, PackedAttention  # noqa: E402
from miles_host.models.loading import load_hf_tensors, native_config  # noqa: E402
from miles_host.models.mlp import Experts  # noqa: E402
from miles_models import qwen  # noqa: E402

PEAK_FLOPS = 790e12

FULL = dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
            vocab_size=151936)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, vocab_size=512)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke check)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 8, tiny 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048, tiny 32)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--chunk-size", type=int, default=4096, help="miles' log-prob chunk (tokens)")
    parser.add_argument("--rows", default="grouped,loop,hf,hf_eager",
                        help="comma-separated rows to run: grouped, loop, hf, hf_eager")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--profile", action="store_true", help="after timing, the top kernels of one grouped step")
    return parser.parse_args(argv)


def hf_config(shape: dict) -> transformers.PretrainedConfig:
    return transformers.Qwen3MoeConfig(
        **shape, tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def active_params(hf: torch.nn.Module, shape: dict) -> int:
    """Matmul weights one token uses: all but the input embedding and the unchosen experts."""
    total = embedding = experts = 0
    for name, param in hf.named_parameters():
        total += param.numel()
        if name.endswith("embed_tokens.weight"):
            embedding += param.numel()
        elif ".experts." in name:
            experts += param.numel()
    used = experts * shape["num_experts_per_tok"] // shape["num_experts"]
    return total - embedding - experts + used


def build_hf(shape: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    with device:
        model = transformers.Qwen3MoeForCausalLM._from_config(hf_config(shape), attn_implementation="sdpa", dtype=dtype)
    return model


def build_miles(hf: torch.nn.Module, shape: dict, device: torch.device, dtype: torch.dtype) -> CausalLM:
    family = next(f for f in qwen.miles_register_model_families() if "qwen3_moe" in f.model_types)
    native = native_config(hf.config.to_dict() | {"model_type": "qwen3_moe"}, family)
    with torch.device("meta"):
        miles = CausalLM(native)
    miles.to_empty(device=device).to(dtype)
    load_hf_tensors(miles, family, hf.state_dict().items())
    return miles


def set_experts_impl(model: CausalLM, impl: str) -> None:
    for module in model.modules():
        if isinstance(module, Experts):
            module.experts_impl = impl


def miles_step_fn(model: CausalLM, input_ids: torch.Tensor, chunk_size: int):
    num_seqs, seq_len = input_ids.shape
    input_ids_T = input_ids.reshape(-1)
    positions_T = torch.arange(seq_len, device=input_ids.device).repeat(num_seqs)
    targets_T = torch.roll(input_ids, -1, dims=1).reshape(-1)
    cu_seqlens = torch.arange(0, num_seqs + 1, device=input_ids.device, dtype=torch.int32) * seq_len
    attention = PackedAttention(cu_seqlens, seq_len)

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        log_probs_T, _ = model.packed_log_probs(
            input_ids_T, positions_T, cu_seqlens, targets_T, ctx=ForwardContext(attention=attention),
            chunk_size=chunk_size,
        )
        loss = -log_probs_T.mean()
        loss.backward()
        return loss.detach()

    return step


def hf_step_fn(model: torch.nn.Module, input_ids: torch.Tensor):
    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        return loss.detach()

    return step


def measure(step, warmup: int, steps: int, device: torch.device) -> dict:
    """Median seconds per step, its spread, peak memory (GiB) and the last loss."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        loss = step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return dict(seconds=statistics.median(times), min_s=min(times), max_s=max(times), peak_gib=peak, loss=float(loss))


def profile(step) -> None:
    """One step under the torch profiler: the 20 kernels that took the most device time."""
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=70), flush=True)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if args.tiny else FULL
    num_seqs = args.batch or (2 if args.tiny else 8)
    seq_len = args.seq_len or (32 if args.tiny else 2048)
    rows = [row.strip() for row in args.rows.split(",") if row.strip()]
    unknown = set(rows) - {"grouped", "loop", "hf", "hf_eager"}
    if unknown:
        raise ValueError(f"--rows: unknown rows {sorted(unknown)}; choose among grouped, loop, hf, hf_eager")
    tokens = num_seqs * seq_len
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device={gpu} torch={torch.__version__} transformers={transformers.__version__} dtype={dtype} "
          f"batch={num_seqs}x{seq_len} shape={shape}", flush=True)

    hf = build_hf(shape, device, dtype)
    n_active = active_params(hf, shape)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, shape["vocab_size"], (num_seqs, seq_len), generator=generator).to(device)
    results = {}
    miles_rows = [row for row in rows if row in ("grouped", "loop")]
    if miles_rows:
        miles = build_miles(hf, shape, device, dtype).train()
        for row in miles_rows:
            # on CPU the default path is the loop: the tiny smoke run forces the grouped one
            set_experts_impl(miles, {"grouped": "grouped" if args.tiny else "auto", "loop": "loop"}[row])
            results[f"miles {row}"] = measure(miles_step_fn(miles, input_ids, args.chunk_size), args.warmup,
                                              args.steps, device)
            print(f"miles {row}: {results[f'miles {row}']}", flush=True)
            if args.profile and row == "grouped":
                profile(miles_step_fn(miles, input_ids, args.chunk_size))
        del miles
        release(device)
    for row in [row for row in rows if row in ("hf", "hf_eager")]:
        if row == "hf_eager":
            hf.config._experts_implementation = "eager"  # read by every experts module at forward
        hf.train()
        name = f"transformers {hf.config._experts_implementation}"
        results[name] = measure(hf_step_fn(hf, input_ids), args.warmup, args.steps, device)
        print(f"{name}: {results[name]}", flush=True)
        release(device)

    print(f"\nactive params N = {n_active / 1e6:.1f}M, tokens/step = {tokens}, MFU = 6*N*tok/s / {PEAK_FLOPS:.0e}")
    print(f"{'step (fwd+bwd)':30s} {'ms/step':>9s} {'tokens/s':>11s} {'MFU':>7s} {'peak GiB':>9s} {'loss':>8s}")
    for name, r in results.items():
        r["tokens_per_s"] = tokens / r["seconds"]
        r["mfu"] = 6 * n_active * r["tokens_per_s"] / PEAK_FLOPS
        print(f"{name:30s} {r['seconds'] * 1e3:9.1f} {r['tokens_per_s']:11,.0f} {r['mfu']:7.1%} {r['peak_gib']:9.2f} "
              f"{r['loss']:8.4f}")
    if "miles grouped" in results:
        base = results["miles grouped"]["tokens_per_s"]
        for name, r in results.items():
            if name != "miles grouped":
                print(f"miles grouped / {name}: {base / r['tokens_per_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(dict(device=gpu, torch=torch.__version__, transformers=transformers.__version__,
                                             tokens=tokens, active_params=n_active, results=results), indent=2))
    return results


if __name__ == "__main__":
    main()
