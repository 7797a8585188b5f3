"""R3 overhead: rollout with and without routing capture, training with and without replay.

MoE model (Qwen3-MoE-shaped: hidden 1024, 8 layers, 16 q / 8 kv heads of dim 128,
8 experts top-2 of intermediate 768, vocab 151936), bf16, random init. Rollout:
64 prompts x 128 tokens, 128 new tokens, T=1, ignore_eos, the embedded engine
with the r3 plugin active, ``return_routed_experts`` off vs on (one warm-up rollout of
each, then their repeats alternating; medians). Training: one
fwd+bwd of ``packed_log_probs`` over 8 x 1024 tokens, replay off vs on.

    python bench/r3_overhead.py          # H200
    python bench/r3_overhead.py --tiny   # CPU smoke
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "models"), str(REPO / "plugins" / "miles_r3")]

import torch  # noqa: E402


def timed(fn, repeats: int) -> float:
    return interleaved([fn], repeats)[0]


def interleaved(fns, repeats: int) -> list[float]:
    """Median seconds of each of ``fns``, after one warm-up call of each, their calls
    alternating (so a drift of the machine falls on every case alike)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128,
                        help="new tokens per prompt (1024 with 128 prompts: a rollout of several seconds)")
    args = parser.parse_args()
    import transformers

    from miles_host.models import ForwardContext, PackedAttention, RoutingContext, load_pretrained
    from miles_host.plugin_manager import MilesPluginManager
    from miles_host.rollout import Engine
    from miles_host.routing import RoutingHooks
    from miles_r3 import plugin as r3

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 moe_intermediate_size=32, intermediate_size=64, vocab_size=256) if args.tiny else dict(
        hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        moe_intermediate_size=768, intermediate_size=3072, vocab_size=151936)
    config = transformers.Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                         tie_word_embeddings=True, eos_token_id=1, **shape)
    directory = tempfile.mkdtemp()
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).to(dtype).save_pretrained(directory)

    manager = MilesPluginManager()
    manager.discover()
    manager.activate(selected=["r3"])
    r3.STATE.mode = "r3"
    hooks = RoutingHooks(manager.hook)
    prompts_n, prompt_len, new = (8, 16, 16) if args.tiny else (args.prompts, 128, args.new_tokens)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, shape["vocab_size"]) for _ in range(prompt_len)] for _ in range(prompts_n)]
    params = {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 0}
    engine = Engine.from_pretrained(directory, dtype=dtype, device=device, routing_hooks=hooks, tokenizer=None,
                                    **({"mem_fraction_static": 0.5} if device == "cuda" else {}))
    rows = []
    rollouts = [lambda capture=capture: engine.generate(prompts, params, return_routed_experts=capture)
                for capture in (False, True)]
    for capture, seconds in zip((False, True), interleaved(rollouts, args.repeats)):
        rows.append((f"rollout, capture {'on' if capture else 'off'}", seconds, prompts_n * new / seconds))
    engine = None  # frees the engine (the rollouts above read it only before)
    model = load_pretrained(directory, dtype=dtype, device=device, routing_hooks=hooks)
    seqs, seq_len = (2, 32) if args.tiny else (8, 1024)
    ids = torch.randint(2, shape["vocab_size"], (seqs * seq_len,), device=device)
    positions = torch.arange(seq_len, device=device).repeat(seqs)
    cu = torch.arange(0, (seqs + 1) * seq_len, seq_len, dtype=torch.int32, device=device)
    moe_layers = [i for i, m in enumerate(model.config.moe_layers) if m]
    replay = {layer: torch.randint(0, 8, (seqs * seq_len, 2), device=device) for layer in moe_layers}

    def train_step(with_replay: bool):
        routing = RoutingContext(phase="train", replay_expert_ids=dict(replay) if with_replay else {})
        ctx = ForwardContext(attention=PackedAttention(cu), routing=routing)
        log_probs, _ = model.packed_log_probs(ids, positions, cu, ids.roll(-1), ctx=ctx)
        log_probs.sum().backward()
        model.zero_grad(set_to_none=True)

    for with_replay in (False, True):
        seconds = timed(lambda: train_step(with_replay), args.repeats)
        rows.append((f"train fwd+bwd, replay {'on' if with_replay else 'off'}", seconds, seqs * seq_len / seconds))
    print(f"\nR3 overhead ({device}, {dtype})")
    print(f"{'case':<28} {'seconds':>9} {'tok/s':>10}")
    for name, seconds, rate in rows:
        print(f"{name:<28} {seconds:9.3f} {rate:10.0f}")
    print(f"rollout slowdown with capture: {rows[1][1] / rows[0][1] - 1:+.1%}; "
          f"training slowdown with replay: {rows[3][1] / rows[2][1] - 1:+.1%}")


if __name__ == "__main__":
    main()
