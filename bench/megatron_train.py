"""Megatron backend vs the native trainer: training tok/s at TP = PP = 1 on one GPU.

Two models, each trained by miles' GRPO loop (``Run.step``: rollout on the embedded engine,
then the trainer) with ``--train-backend native`` and with ``--train-backend megatron``, each
variant in its own process (a clean allocator) of the same call:

- ``dense``: the Qwen3-0.6B shape (hidden 1024, 28 layers, 16 q / 8 kv heads, vocab 151936);
- ``moe``: the MoE bench shape of ``bench/true_on_policy.py --model moe`` (hidden 1024, 8 layers,
  64 experts top-8, moe_intermediate 384).

Reported per run: the steady-state median of ``perf/train_tok_per_s`` (trained tokens over the
training phase's seconds: old-policy log-probs, forward, backward, optimizer step), of the
step, rollout and train seconds, and the compute bound of the training phase, ``bf16 peak /
(8 * active parameters)`` tokens/s (forward 2N, backward 4N, the old-policy pass 2N), so the
figure reads as a fraction of it; then megatron / native per model (goal >= 1.0x).

    python bench/megatron_train.py             # on the GPU (needs megatron-core)
    python bench/megatron_train.py --tiny      # CPU smoke check (hidden 64, 2 layers)
    python bench/megatron_train.py --models moe --sync-points   # + each backend's host syncs in a training phase
    python bench/megatron_train.py --models moe --idle-gaps     # + where each backend's training phase leaves the GPU idle
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "models"), str(Path(__file__).resolve().parent)]

import grpo_step  # noqa: E402
import lora_step  # noqa: E402
import true_on_policy  # noqa: E402

BACKENDS = ("native", "megatron")
MODELS = ("dense", "moe")


def build(model: str, root: Path, args) -> tuple[Path, Path]:
    """The model's random HF checkpoint and the prompts, under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    if (root / "model").is_dir():
        return root / "model", root / "prompts.jsonl"
    if model == "moe":
        return true_on_policy.build_moe_assets(root, args.tiny, args.prompts, args.prompt_len, args.moe_layers)
    model_dir, data = grpo_step.build_assets(root, args.tiny, args.prompts, args.prompt_len)
    if args.tiny:  # the CPU smoke check trains in float32
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(model_dir).float().save_pretrained(model_dir)
    return model_dir, data


def active_params(model_dir: Path) -> int:
    """Parameters a token goes through: every weight but the unchosen experts' and the
    embedding lookup (the tied head's matmul counts once)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    attention = h * head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    if getattr(cfg, "num_experts", 0):
        mlp = 3 * h * cfg.moe_intermediate_size * cfg.num_experts_per_tok + h * cfg.num_experts
    else:
        mlp = 3 * h * cfg.intermediate_size
    return layers * (attention + mlp) + cfg.vocab_size * h


def run_one(model: str, backend: str, args) -> dict:
    model_dir, data = build(model, args.workdir / model, args)
    args.recompute = False  # (bench_variant's flag: every layer's activations kept, in both runs)
    return lora_step.bench_variant(f"{model}_{backend}", model_dir, data, args, flags=["--train-backend", backend])


def run_isolated(model: str, backend: str, args) -> dict | None:
    """``--only MODEL:BACKEND`` in its own process; its result, or None if it failed."""
    return lora_step.run_in_subprocess(f"{model}:{backend}", args, script=__file__,
                                       extra=("--moe-layers", str(args.moe_layers), *(["--profile"] if args.profile else []),
                                              *(["--sync-points"] if args.sync_points else []),
                                              *(["--idle-gaps"] if args.idle_gaps else [])))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="hidden-64, 2-layer models on the CPU (smoke check)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: dense, moe")
    parser.add_argument("--only", help="MODEL:BACKEND, run in this process")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 3; 2 with --tiny)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=8192,
                        help="tokens per micro-batch, both backends (at 16384 the megatron run of the 0.6B shape ran "
                             "out of an 80 GB H100 before its attention ran on SDPA)")
    parser.add_argument("--moe-layers", type=int, default=8)
    parser.add_argument("--mem-fraction", type=float, default=0.3, help="the engine's GPU memory fraction")
    parser.add_argument("--profile", action="store_true", help="profile one more step of each run (host and CUDA)")
    parser.add_argument("--sync-points", action="store_true",
                        help="one more step of each run listing the training phase's host syncs by where they come from")
    parser.add_argument("--idle-gaps", action="store_true",
                        help="one more step of each run: the training phase's GPU idle gaps by the host code after them")
    parser.add_argument("--result-json", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/miles_megatron_bench"))
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 2 if args.tiny else 3
    if args.tiny:
        args.prompts, args.samples, args.new_tokens, args.prompt_len = 2, 2, 4, 4
        args.max_tokens_per_gpu = 64
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.only:
        model, backend = args.only.split(":")
        result = run_one(model, backend, args)
        if args.result_json:
            args.result_json.write_text(json.dumps(result))
        return result
    from device_peaks import bf16_flops

    results: dict = {}
    for model in args.models.split(","):
        build(model, args.workdir / model, args)
        bound = bf16_flops() / (8 * active_params(args.workdir / model / "model"))
        runs = {backend: run_isolated(model, backend, args) for backend in BACKENDS}
        results[model] = {"bound_tok_per_s": bound, **runs}
        native, megatron = runs["native"], runs["megatron"]
        if native and megatron:
            results[model]["megatron_over_native"] = megatron["train_tok_per_s"] / native["train_tok_per_s"]
    print(f"\n{'model':<6} {'backend':<9} {'train tok/s':>12} {'% of bound':>10} {'step s':>7} {'rollout s':>9} "
          f"{'train s':>8}")
    for model, entry in results.items():
        for backend in BACKENDS:
            r = entry[backend]
            if r:
                print(f"{model:<6} {backend:<9} {r['train_tok_per_s']:12,.0f} "
                      f"{100 * r['train_tok_per_s'] / entry['bound_tok_per_s']:9.1f}% {r['step_s']:7.2f} "
                      f"{r['rollout_s']:9.2f} {r['train_s']:8.2f}")
        if "megatron_over_native" in entry:
            print(f"{model}: megatron / native train tok/s = {entry['megatron_over_native']:.2f}x (goal >= 1.0x); "
                  f"bound {entry['bound_tok_per_s']:,.0f} tok/s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
