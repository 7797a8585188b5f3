"""Rollout-engine benchmark: miles' embedded engine vs transformers.generate.

    python bench/rollout.py            # H200: Qwen3-0.6B-shaped random model, bf16
    python bench/rollout.py --tiny     # CPU smoke run of the same code paths

Cases: (a) 64 prompts x 128 tokens, 256 new tokens, T=1 sampling, ignore_eos,
against transformers.generate (min_new_tokens=256) in the same run; (b) 256
requests with prompt and output lengths uniform in [100, 1024], with the
HBM-bandwidth bound of the decode (weights + KV bytes read each step at
4.24 TB/s) plus the compute bound of the prefill (808 TFLOP/s); (c) 256
sequences of 1024 + 1024 tokens (2048 in all). Median of the timed repeats
after a warm-up; peak memory and KV-cache size printed with the table.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.device_peaks import hbm_bytes_per_s  # noqa: E402
from bench.device_sync import sync  # noqa: E402

HBM_BYTES_PER_S = hbm_bytes_per_s()  # this machine's copy bandwidth (bench/device_peaks.py)
BF16_FLOPS = 808e12

FULL = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    max_position_embeddings=40960,
)
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
    max_position_embeddings=4096,
)


def build_checkpoint(shape: dict, dtype: torch.dtype, device: str, folder: str):
    """A random-init Qwen3 of ``shape``, saved for miles and kept for transformers."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**shape, eos_token_id=shape["vocab_size"] - 1, pad_token_id=0)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config).to(dtype).eval()
    model.save_pretrained(folder)
    return model




def timed(fn, device: str, repeats: int) -> tuple[list[float], object]:
    fn()  # warm-up
    times, result = [], None
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times, result


def decode_bound_seconds(prompt_lens, output_lens, weight_bytes, kv_bytes_per_token, params, max_num_seqs):
    """Lower bound on wall time: bandwidth-bound decode steps + compute-bound prefill.

    Sequences run max_num_seqs at a time (longest first would be optimal; we
    take the given order). A decode step reads all weights once plus the K/V of
    every running sequence's context.
    """
    seconds = 2 * params * sum(prompt_lens) / BF16_FLOPS
    pending = list(zip(prompt_lens, output_lens))
    running: list[list[int]] = []  # [context, remaining]
    while pending or running:
        while pending and len(running) < max_num_seqs:
            prompt, output = pending.pop(0)
            running.append([prompt + 1, output - 1])  # the prefill samples the first token
        kv = sum(context for context, _ in running) * kv_bytes_per_token
        seconds += (weight_bytes + kv) / HBM_BYTES_PER_S
        for entry in running:
            entry[0] += 1
            entry[1] -= 1
        running = [e for e in running if e[1] > 0]
    return seconds


def profile_case(fn, engine, device: str) -> None:
    """Host profile of one run plus the GPU time of one decode-graph replay."""
    import cProfile
    import pstats

    fn()
    profiler = cProfile.Profile()
    sync(device)
    start = time.perf_counter()
    profiler.enable()
    tokens = fn()
    sync(device)
    profiler.disable()
    print(f"profiled run: {tokens / (time.perf_counter() - start):,.0f} tok/s")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    runner = engine.runner
    if runner.graphs and device == "cuda":
        for size in (64, 256):
            if (size, False) not in runner.graphs.graphs:
                continue
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(20):
                runner.graphs.graphs[(size, False)].replay()
            end.record()
            sync(device)
            print(f"decode graph replay, batch {size} (context 1): {begin.elapsed_time(end) / 20:.3f} ms")
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
            fn()
            sync(device)
        print(trace.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run with a tiny model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-repeats", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--mem-fraction-static", type=float, default=0.85)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--profile", action="store_true", help="profile case (a) on the host and stop")
    parser.add_argument("--no-overlap", action="store_true", help="engine overlap_schedule off (read each step before launching the next)")
    args = parser.parse_args()

    from miles_host.rollout import Engine

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shape = TINY if args.tiny else FULL
    scale = 16 if args.tiny else 1  # the tiny run shrinks every length and count
    random.seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        hf_model = build_checkpoint(shape, dtype, device, folder)
        engine_kwargs = dict(max_num_seqs=256, enforce_eager=args.enforce_eager, overlap_schedule=False if args.no_overlap else None)
        if args.tiny:
            engine_kwargs["kv_cache_tokens"] = 64 * 1024
        else:
            engine_kwargs["mem_fraction_static"] = args.mem_fraction_static
        engine = Engine.from_pretrained(folder, dtype=dtype, device=device, tokenizer=None, **engine_kwargs)
        cfg = engine.config
        params = sum(p.numel() for p in engine.model.parameters())
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        kv_per_token = engine.kv_bytes_per_token
        vocab = shape["vocab_size"]
        print(f"model: {params / 1e6:.1f}M params, {weight_bytes / 2**30:.2f} GiB weights, {dtype}, {device}")
        print(f"engine: attention={cfg.attention_backend}, cuda_graphs={bool(engine.runner.graphs)}, "
              f"block_size={cfg.block_size}, KV cache {engine.num_kv_cache_tokens} tokens "
              f"({engine.kv_cache.num_bytes / 2**30:.2f} GiB, {kv_per_token} B/token)")

        def run_engine(prompts, outputs_lens):
            sampling = [{"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True} for n in outputs_lens]
            results = engine.generate(prompts, sampling)
            return sum(r["meta_info"]["completion_tokens"] for r in results)

        # (a) fixed shapes, side by side with transformers
        n_prompts, prompt_len, new_tokens = 64 // (scale // 4 or 1), 128 // scale, 256 // scale
        prompts = [[random.randrange(1, vocab - 1) for _ in range(prompt_len)] for _ in range(n_prompts)]
        if args.profile:
            profile_case(lambda: run_engine(prompts, [new_tokens] * n_prompts), engine, device)
            return
        times, tokens = timed(lambda: run_engine(prompts, [new_tokens] * n_prompts), device, args.repeats)
        miles_a = tokens / statistics.median(times)
        rows.append(("(a) miles engine", f"{n_prompts}x{prompt_len} -> {new_tokens}", tokens, statistics.median(times), miles_a, ""))
        if not args.skip_hf:
            ids = torch.tensor(prompts, device=device)

            def run_hf():
                with torch.no_grad():
                    out = hf_model.generate(
                        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                        top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                    )
                return (out.shape[1] - prompt_len) * n_prompts

            hf_times, hf_tokens = timed(run_hf, device, args.hf_repeats)
            hf_rate = hf_tokens / statistics.median(hf_times)
            rows.append(("(a) transformers.generate", f"{n_prompts}x{prompt_len} -> {new_tokens}", hf_tokens,
                         statistics.median(hf_times), hf_rate, f"miles/hf = {miles_a / hf_rate:.1f}x"))
        hf_model = None  # frees the transformers model (run_hf above reads it only before)
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

        # (b) mixed lengths, against the bandwidth bound
        n_req, lo, hi = 256 // scale, 100 // scale, 1024 // scale
        prompt_lens = [random.randint(lo, hi) for _ in range(n_req)]
        output_lens = [random.randint(lo, hi) for _ in range(n_req)]
        prompts = [[random.randrange(1, vocab - 1) for _ in range(n)] for n in prompt_lens]
        times, tokens = timed(lambda: run_engine(prompts, output_lens), device, args.repeats)
        seconds = statistics.median(times)
        bound = decode_bound_seconds(prompt_lens, output_lens, weight_bytes, kv_per_token, params, cfg.max_num_seqs)
        rows.append(("(b) miles engine", f"{n_req} req, U[{lo},{hi}] in/out", tokens, seconds, tokens / seconds,
                     f"bound {tokens / bound:,.0f} tok/s; measured/bound = {bound / seconds:.1%}"))

        # (c) long sequences, no OOM
        n_long, half = 256 // scale, 1024 // scale
        prompts = [[random.randrange(1, vocab - 1) for _ in range(half)] for _ in range(n_long)]
        preempted = engine.scheduler.num_preemptions
        start = time.perf_counter()
        tokens = run_engine(prompts, [half] * n_long)
        sync(device)
        seconds = time.perf_counter() - start
        rows.append(("(c) miles engine", f"{n_long} x ({half}+{half}) tokens", tokens, seconds, tokens / seconds,
                     f"completed, preemptions {engine.scheduler.num_preemptions - preempted}"))
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")

    print()
    print("| case | shape | output tokens | median s | tok/s | note |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for name, shape_text, tokens, seconds, rate, note in rows:
        print(f"| {name} | {shape_text} | {tokens} | {seconds:.3f} | {rate:,.0f} | {note} |")
    print()
    print(f"peak GPU memory allocated (cases b, c): {peak:.1f} GiB; KV cache: {engine.kv_cache.num_bytes / 2**30:.1f} GiB "
          f"= {engine.num_kv_cache_tokens} tokens; torch {torch.__version__}")


if __name__ == "__main__":
    main()
