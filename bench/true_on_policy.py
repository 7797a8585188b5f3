"""True on-policy: cost of ``--true-on-policy`` and the mismatch it removes, same run.

For each mode (default fast kernels, then ``--true-on-policy``) miles runs real GRPO
steps (``Run.step``: embedded engine, native trainer, in-process weight sync) on a
random-init model and reports the steady-state rollout tok/s and training tok/s
(median over the steps after the first) and ``train/train_rollout_logprob_abs_diff``
(mean over the steps) and its max. The goal: abs diff == 0.0 exactly
with the flag, at most 1.3x slower.

    python bench/true_on_policy.py                     # H200: Qwen3-0.6B-shaped, bf16, 64 x 8 samples
    python bench/true_on_policy.py --model moe         # a Qwen3-MoE-shaped model (8 of 64 experts)
    python bench/true_on_policy.py --tiny              # CPU float32 smoke run (numbers meaningless)
    python bench/true_on_policy.py --json out.json

On CUDA the flag runs the batch-invariant kernels (``miles_host/models/invariant_gpu.py``);
on CPU the per-token construction (``miles_host/models/batch_invariant.py``). On the GPU
each mode runs in its own process (one engine's memory never shadows the other's).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "models"), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402


def random_reward(sample, config=None):
    """Rewards with variance inside each group (timing only)."""
    return random.random()


def build_moe_assets(root: Path, tiny: bool, prompts: int, prompt_len: int, layers: int) -> tuple[Path, Path]:
    """A random Qwen3-MoE, a word-level tokenizer over its vocab, and prompts."""
    from grpo_step import build_assets
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model_dir, data = build_assets(root, True, prompts, prompt_len) if tiny else build_assets(root, False, prompts, prompt_len)
    vocab_size = 512 if tiny else 151936
    shape = (
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
        if tiny
        else dict(hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                  intermediate_size=3072, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384)
    )
    config = Qwen3MoeConfig(vocab_size=vocab_size, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0,
                            max_position_embeddings=4096, decoder_sparse_step=1, mlp_only_layers=[],
                            norm_topk_prob=True, **shape)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(torch.float32 if tiny else torch.bfloat16).save_pretrained(model_dir)
    return model_dir, data


def run_mode(model_dir: Path, data: Path, args, true_on_policy: bool) -> dict:
    from miles_host.cli.args import resolve_run_config
    from miles_host.loop import Run
    from miles_host.plugin_manager import MilesPluginManager

    name = "true_on_policy" if true_on_policy else "default"
    argv = [
        "--hf-checkpoint", str(model_dir), "--prompt-data", str(data), "--custom-rm-path", "true_on_policy.random_reward",
        "--rollout-batch-size", str(args.prompts), "--n-samples-per-prompt", str(args.samples),
        "--rollout-max-response-len", str(args.new_tokens), "--num-rollout", str(args.steps),
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(args.max_tokens_per_gpu), "--lr", "1e-6",
        "--rollout-temperature", "1.0", "--output-dir", str(args.workdir / f"out_{name}"), "--no-progress",
        *(["--device", "cpu", "--dtype", "float32"] if args.tiny else []),
        *(["--true-on-policy"] if true_on_policy else []),
        "--moe-invariant-decode", args.moe_invariant_decode,
    ]
    manager = MilesPluginManager()
    config, _ = resolve_run_config(argv, manager)
    run = Run(config, manager)
    sampling_params = run.rollout.sampling_params
    run.rollout.sampling_params = lambda *a, **k: {**sampling_params(*a, **k), "ignore_eos": True}
    run.sync_weights(version=run.state.weight_version)
    steps = []
    for rollout_id in range(args.steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        metrics = run.step(rollout_id)
        steps.append(metrics)
        keep = ("perf/rollout_tok_per_s", "perf/train_tok_per_s", "train/train_rollout_logprob_abs_diff",
                "train/train_rollout_logprob_abs_diff_max")
        print(name, json.dumps({k: metrics.get(k) for k in keep}))
    steady = steps[1:] or steps
    med = lambda key: statistics.median(m[key] for m in steady)  # noqa: E731
    return {
        "rollout_tok_per_s": med("perf/rollout_tok_per_s"),
        "train_tok_per_s": med("perf/train_tok_per_s"),
        "step_s": med("perf/step_time_s"),
        "abs_diff_mean": statistics.fmean(m["train/train_rollout_logprob_abs_diff"] for m in steps),
        "abs_diff_max": max(m["train/train_rollout_logprob_abs_diff_max"] for m in steps),
    }


def run_isolated(mode: str) -> dict:
    """This script with ``--only MODE`` in a subprocess; its result."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", mode, "--json", str(out)], check=True)
        return json.loads(out.read_text())[mode]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU float32 smoke run with a tiny model")
    parser.add_argument("--model", choices=["dense", "moe"], default="dense")
    parser.add_argument("--moe-layers", type=int, default=8,
                        help="decoder layers of the MoE model (64 experts, top-8; 16 did not fit a 5-minute call)")
    parser.add_argument("--only", choices=["default", "true_on_policy"])
    parser.add_argument("--moe-invariant-decode", choices=["loop", "batched"], default="batched",
                        help="the batch-invariant decode step's routed experts (the kernel switch of the same name)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/miles_true_on_policy_bench"))
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if args.tiny:
        args.prompts, args.samples, args.new_tokens, args.prompt_len, args.steps = 3, 4, 8, 6, 2
        args.max_tokens_per_gpu = 64
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.model == "moe":
        model_dir, data = build_moe_assets(args.workdir, args.tiny, args.prompts, args.prompt_len, args.moe_layers)
    else:
        from grpo_step import build_assets

        model_dir, data = build_assets(args.workdir, args.tiny, args.prompts, args.prompt_len)
        if args.tiny:  # the CPU smoke runs in float32
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_pretrained(model_dir).float().save_pretrained(model_dir)
    results = {}
    for mode in ("default", "true_on_policy"):
        if args.only == mode or (args.only is None and args.tiny):
            results[mode] = run_mode(model_dir, data, args, mode == "true_on_policy")
        elif args.only is None:
            results[mode] = run_isolated(mode)
    print(f"\n{args.model} model, {args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens"
          f"{' (tiny, CPU)' if args.tiny else ''}")
    print(f"{'mode':<15} {'rollout tok/s':>13} {'train tok/s':>12} {'step s':>8} {'abs diff mean':>14} {'abs diff max':>13}")
    for name, r in results.items():
        print(f"{name:<15} {r['rollout_tok_per_s']:13.1f} {r['train_tok_per_s']:12.1f} {r['step_s']:8.2f} "
              f"{r['abs_diff_mean']:14.3e} {r['abs_diff_max']:13.3e}")
    if len(results) == 2:
        base, exact = results["default"], results["true_on_policy"]
        print(f"slowdown with --true-on-policy: rollout {base['rollout_tok_per_s'] / exact['rollout_tok_per_s']:.2f}x, "
              f"train {base['train_tok_per_s'] / exact['train_tok_per_s']:.2f}x")
    if "true_on_policy" in results and results["true_on_policy"]["abs_diff_max"] != 0.0:
        print("NOT EXACT: --true-on-policy left a train/rollout logprob difference")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "tiny": args.tiny, **results}, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
