"""Decode throughput of a Qwen3-Next-shaped hybrid model (Gated DeltaNet + gated attention) vs its HBM bound.

    python bench/qwen_next_decode.py                     # H200: Qwen3-Next-80B-A3B widths, 4 layers (3 linear + 1 full)
    python bench/qwen_next_decode.py --batches 1,32 --layers 8
    python bench/qwen_next_decode.py --tiny              # CPU smoke run of the same code (float32, tiny widths)

The model is a random-init miles model built from an HF ``qwen3_next`` config dict through the
family adapter (bench/moe.py's builder), served by ``miles_host.rollout.Engine`` (decode in CUDA
graphs that gather and scatter the recurrent state), the Gated DeltaNet through
flash-linear-attention's kernels when ``fla`` imports (else the PyTorch step), the line says which.

Decode: B sequences of ``--prompt-len`` random tokens, ``--new-tokens`` new tokens, temperature 1;
decode tok/s = B * (new - 1) / (t(full) - t(max_new_tokens=1)), medians of ``--repeats`` after a
warm-up. HBM bound of a decode step: every weight the step reads once (bench/moe.py ``step_bytes``:
non-expert weights but the input embedding, plus the experts touched under uniform routing), the KV
cache of the full-attention layers for every sequence, and each sequence's recurrent state of the
linear-attention layers read and written once (conv state in the model dtype, delta-rule state in
float32), at the machine's copy bandwidth (bench/device_peaks.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import moe  # noqa: E402

#: Qwen3-Next-80B-A3B widths (``--layers`` decoder layers, every 4th full attention)
QWEN3_NEXT = dict(
    model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    rms_norm_eps=1e-6, max_position_embeddings=65536, tie_word_embeddings=False,
)
TINY = dict(
    QWEN3_NEXT, vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
)


def shape(args) -> dict:
    """The HF config dict of the benchmarked model."""
    hf = dict(TINY if args.tiny else QWEN3_NEXT, num_hidden_layers=args.layers)
    hf["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)]
    return hf


def bench(args) -> list[dict]:
    from miles_host.kernels.gated_delta_rule import fla_kernels
    from miles_host.rollout import Engine

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    moe.SHAPES["qwen3_next_bench"] = shape(args)
    model = moe.build_model("qwen3_next_bench", dtype, device)
    moe.free_memory(device)
    start = time.perf_counter()
    kwargs = {"kv_cache_tokens": 4096} if args.tiny else {"mem_fraction_static": args.mem_fraction}
    engine = Engine(model, tokenizer=None, max_num_seqs=max(args.batches),
                    max_model_len=args.prompt_len + args.new_tokens + 16, **kwargs)
    state_bytes = engine.recurrent_states.bytes_per_sequence()
    backend = "fla" if device == "cuda" and fla_kernels() is not None else "torch"
    print(f"[qwen3_next x{args.layers}] engine built in {time.perf_counter() - start:.1f} s, delta rule: {backend}, "
          f"cuda_graphs={bool(engine.runner.graphs)}, "
          f"KV {engine.num_kv_cache_tokens} tokens x {engine.kv_bytes_per_token} B, recurrent state "
          f"{state_bytes / 2**20:.1f} MiB per sequence", flush=True)
    generator = torch.Generator().manual_seed(1)
    rows = []
    for batch in args.batches:
        prompts = torch.randint(1, model.config.vocab_size - 1, (batch, args.prompt_len), generator=generator).tolist()
        t_full = moe.timed(lambda: moe.generate(engine, prompts, args.new_tokens), device, args.repeats)
        t_first = moe.timed(lambda: moe.generate(engine, prompts, 1), device, args.repeats)
        decode = batch * (args.new_tokens - 1) / (t_full - t_first) if t_full > t_first else float("nan")
        weight_bytes, _ = moe.step_bytes(model, batch)
        seconds = sum(
            (weight_bytes + batch * ((args.prompt_len + i) * engine.kv_bytes_per_token + 2 * state_bytes))
            / moe.HBM_BYTES_PER_S
            for i in range(1, args.new_tokens)
        )
        bound = batch * (args.new_tokens - 1) / seconds
        rows.append(dict(batch=batch, tok_s=decode, bound_tok_s=bound, fraction=decode / bound, backend=backend))
        print(f"[qwen3_next x{args.layers}] decode batch {batch:>3}: {decode:,.0f} tok/s, HBM bound {bound:,.0f} tok/s "
              f"({decode / bound:.1%}); step weights {weight_bytes / 1e9:.2f} GB, recurrent state "
              f"{2 * batch * state_bytes / 1e9:.3f} GB read+written", flush=True)
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (every 4th is full attention)")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mem-fraction", type=float, default=0.85)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (float32, tiny widths)")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.tiny:
        args.batches, args.prompt_len, args.new_tokens, args.repeats = args.batches[:2], 16, 6, 1
    return args


if __name__ == "__main__":
    bench(parse_args())
