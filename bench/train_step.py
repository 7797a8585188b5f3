"""Training-step throughput: miles' packed log-prob step vs transformers' loss step.

One fwd + bwd + fused AdamW step on a Qwen3-0.6B-shaped random model (hidden
1024, 28 layers, 16 q / 8 kv heads of dim 128, intermediate 3072, vocab 151936,
tied embeddings), bf16, 8 x 1024 tokens. Both models get the same weights and
batch in the same process; reports the median of the timed steps after warm-up,
tokens/s, MFU = 6 * N * tokens/s / 790e12 (H200 dense bf16 peak) and peak memory.

    python bench/train_step.py            # on the GPU
    python bench/train_step.py --tiny     # CPU smoke check (hidden 64, 2 layers)

Needs torch and transformers only (no network): the repo and plugins/models are
put on sys.path here.
"""

from __future__ import annotations

import argparse
import gc
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
from miles_models import qwen  # noqa: E402

PEAK_FLOPS = 790e12

FULL = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            intermediate_size=3072, vocab_size=151936)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke check)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 8, tiny 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 1024, tiny 64)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--chunk-size", type=int, default=2048, help="log-prob chunk (tokens)")
    parser.add_argument("--compile", action="store_true", help="torch.compile miles' decoder layers")
    parser.add_argument("--only", choices=("miles", "hf"), default=None)
    return parser.parse_args()


def hf_config(shape: dict) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.for_model(
        "qwen3", **shape, tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, attention_bias=False,
    )


def build_models(shape: dict, device: torch.device, dtype: torch.dtype, which: set[str]):
    """The transformers model (sdpa) and miles' model with the same weights."""
    torch.manual_seed(0)
    config = hf_config(shape)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device)
    miles = None
    if "miles" in which:
        family = qwen.miles_register_model_families()[0]
        native = native_config(config.to_dict() | {"model_type": "qwen3"}, family)
        with torch.device("meta"):
            miles = CausalLM(native)
        miles.to_empty(device=device).to(dtype)
        load_hf_tensors(miles, family, hf.state_dict().items())
    if "hf" not in which:
        del hf
        hf = None
    return hf, miles


def batch(shape: dict, num_seqs: int, seq_len: int, device: torch.device):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, shape["vocab_size"], (num_seqs, seq_len), generator=generator).to(device)
    return input_ids


def miles_step_fn(model: CausalLM, input_ids: torch.Tensor, chunk_size: int):
    num_seqs, seq_len = input_ids.shape
    input_ids_T = input_ids.reshape(-1)
    positions_T = torch.arange(seq_len, device=input_ids.device).repeat(num_seqs)
    targets_T = torch.roll(input_ids, -1, dims=1).reshape(-1)
    cu_seqlens = torch.arange(0, num_seqs + 1, device=input_ids.device, dtype=torch.int32) * seq_len
    attention = PackedAttention(cu_seqlens, seq_len)
    optimizer = make_optimizer(model)

    def step() -> float:
        log_probs_T, _ = model.packed_log_probs(
            input_ids_T, positions_T, cu_seqlens, targets_T, ctx=ForwardContext(attention=attention),
            chunk_size=chunk_size,
        )
        loss = -log_probs_T.mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def hf_step_fn(model, input_ids: torch.Tensor):
    optimizer = make_optimizer(model)
    labels = input_ids

    def step() -> float:
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    fused = params[0].is_cuda
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=fused or None)


def measure(step, warmup: int, steps: int, device: torch.device) -> tuple[float, float, float]:
    """(median seconds per step, peak memory GiB, last loss)."""
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
    return statistics.median(times), peak, float(loss)


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if args.tiny else FULL
    num_seqs = args.batch or (2 if args.tiny else 8)
    seq_len = args.seq_len or (64 if args.tiny else 1024)
    which = {args.only} if args.only else {"miles", "hf"}
    tokens = num_seqs * seq_len
    print(f"device={device} torch={torch.__version__} transformers={transformers.__version__} dtype={dtype} "
          f"batch={num_seqs}x{seq_len} shape={shape}")

    hf, miles = build_models(shape, device, dtype, which)
    input_ids = batch(shape, num_seqs, seq_len, device)
    num_params = sum(p.numel() for p in (miles or hf).parameters())
    rows = []
    if miles is not None:
        if args.compile:
            for layer in miles.layers:
                layer.compile(dynamic=False)
        miles.train()
        seconds, peak, loss = measure(miles_step_fn(miles, input_ids, args.chunk_size), args.warmup, args.steps, device)
        rows.append(("miles packed_log_probs" + (" +compile" if args.compile else ""), seconds, peak, loss))
        del miles
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
    if hf is not None:
        hf.train()
        seconds, peak, loss = measure(hf_step_fn(hf, input_ids), args.warmup, args.steps, device)
        rows.append(("transformers (sdpa) loss", seconds, peak, loss))

    print(f"\nparams N = {num_params / 1e6:.1f}M, tokens/step = {tokens}, MFU = 6*N*tok/s / {PEAK_FLOPS:.0e}")
    print(f"{'step':34s} {'ms/step':>9s} {'tokens/s':>11s} {'MFU':>7s} {'peak GiB':>9s} {'loss':>8s}")
    for name, seconds, peak, loss in rows:
        rate = tokens / seconds
        mfu = 6 * num_params * rate / PEAK_FLOPS
        print(f"{name:34s} {seconds * 1e3:9.1f} {rate:11,.0f} {mfu:7.1%} {peak:9.2f} {loss:8.4f}")
    if len(rows) == 2:
        print(f"\nspeed-up miles / transformers: {rows[1][1] / rows[0][1]:.2f}x")


if __name__ == "__main__":
    main()
