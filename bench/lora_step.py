"""LoRA vs full fine-tune: miles' GRPO step (``Run.step``) on a Qwen3-1.7B-shaped model.

Random-init Qwen3-1.7B shape (hidden 2048, 28 layers, 16 q / 8 kv heads of dim 128,
intermediate 6144, vocab 151936, tied embeddings), bf16 rollout, 16 prompts x 8 samples,
128-token prompts, 256 new tokens (EOS ignored). Each variant runs in its own process
with the same engine: its KV cache sized to the rollout (``--max-total-tokens``, passed as SGLang's, default
every sequence's prompt and response at once, as a colocated run would size SGLang's pool;
``--mem-fraction`` only caps it), so a step's peak is the memory the step needs rather than
a fraction of whichever GPU runs it; and the same activation recomputation,
``--recompute-granularity full``: the full model,
then ``--lora-rank 16 --lora-alpha 32`` on all linears. Reported per variant: the
steady-state medians of step / rollout / train / weight-sync seconds, trainable parameters,
the peak GPU memory of a whole step and of the training phase (both include the engine's
weights and KV cache, the same in both runs), the trainer's own peak (the training phase's
peak less the engine's share) and its resident state (parameters + gradients + optimizer
state); then LoRA / full against the goals (peak memory <= 0.5x, step time <= 1.0x).

    python bench/lora_step.py          # on the GPU
    python bench/lora_step.py --tiny   # CPU smoke check (hidden 64, 2 layers)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "models"), str(Path(__file__).resolve().parent)]

import gpu_idle  # noqa: E402
import grpo_step  # noqa: E402
import torch  # noqa: E402

#: tokens of one KV-cache block: the default cache holds one more per sequence than its tokens need
KV_BLOCK = 16

VARIANTS = {"full": [], "lora": ["--lora-rank", "16", "--lora-alpha", "32", "--target-modules", "all-linear"]}


def build_assets(root: Path, tiny: bool, prompts: int, prompt_len: int) -> tuple[Path, Path]:
    """A random Qwen3 model of the 1.7B shape (or a tiny one), a word-level tokenizer, prompts."""
    return grpo_step.build_assets(root, tiny, prompts, prompt_len, shape_name="1.7b")


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def trainer_state_bytes(trainer) -> dict:
    """Bytes of the policy's parameters, gradients and optimizer state."""
    params = list(trainer.model.parameters())
    state = [t for s in trainer.optimizer.state.values() for t in s.values()]
    return {"param_gb": _tensor_bytes(params) / 1e9, "grad_gb": _tensor_bytes(p.grad for p in params) / 1e9,
            "optimizer_gb": _tensor_bytes(state) / 1e9}


def bench_variant(name: str, model_dir: Path, data: Path, args, flags: list[str] | None = None) -> dict:
    """``args.steps`` steps of miles' loop with the variant's flags (``flags``, else
    ``VARIANTS[name]``); medians after the first."""
    from miles_host.cli.args import resolve_run_config
    from miles_host.loop import Run
    from miles_host.plugin_manager import MilesPluginManager

    argv = [
        "--hf-checkpoint", str(model_dir), "--prompt-data", str(data), "--custom-rm-path", "grpo_step.random_reward",
        "--rollout-batch-size", str(args.prompts), "--n-samples-per-prompt", str(args.samples),
        "--rollout-max-response-len", str(args.new_tokens), "--num-rollout", str(args.steps),
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(args.max_tokens_per_gpu), "--lr", "1e-6",
        "--output-dir", str(args.workdir / f"out_{name}"), "--no-progress", *(VARIANTS[name] if flags is None else flags),
        *([] if args.tiny else ["--sglang-mem-fraction-static", str(args.mem_fraction),
                                "--sglang-max-total-tokens", str(args.max_total_tokens)]),
        *(["--recompute-granularity", "full"] if args.recompute else []),
    ]
    manager = MilesPluginManager()
    config, _ = resolve_run_config(argv, manager)
    run = Run(config, manager)
    sampling_params = run.rollout.sampling_params
    run.rollout.sampling_params = lambda *a, **k: {**sampling_params(*a, **k), "ignore_eos": True}
    cuda = torch.cuda.is_available()
    train_peaks: list[float] = []
    trainer_peaks: list[float] = []  # the training phase's peak less what the engine holds meanwhile
    train = run.trainer.train

    def measured_train(samples):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            resident = sum(trainer_state_bytes(run.trainer).values())  # GB: the trainer's part of what is allocated
            before = torch.cuda.memory_allocated() / 1e9
        out = train(samples)
        if cuda:
            train_peaks.append(torch.cuda.max_memory_allocated() / 1e9)
            trainer_peaks.append(train_peaks[-1] - before + resident)
        return out

    run.trainer.train = measured_train
    run.sync_weights(version=run.state.weight_version)
    steps, step_peaks = [], []
    for rollout_id in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        steps.append(run.step(rollout_id))
        if cuda:
            step_peaks.append(torch.cuda.max_memory_allocated() / 1e9)
    if getattr(args, "profile", False):  # one more step, not in the medians: host and CUDA time by function / kernel
        grpo_step.profile_step(run, args.steps)
    if getattr(args, "sync_points", False):  # one more step: where the training phase synchronises with the GPU
        grpo_step.sync_points_step(run, args.steps + 1)
    if getattr(args, "idle_gaps", False) and cuda:  # one more step: where the training phase leaves the GPU idle
        gpu_idle.idle_gaps_step(run, args.steps + 2, json_path=args.workdir / f"idle_gaps_{name}.json")
    state = trainer_state_bytes(run.trainer)
    trainable = sum(p.numel() for p in run.trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in run.trainer.model.parameters())
    run.close()
    steady = steps[1:] or steps
    med = lambda key: statistics.median(m[key] for m in steady)  # noqa: E731
    return {
        "step_s": med("perf/step_time_s"), "rollout_s": med("perf/rollout_time_s"), "train_s": med("perf/train_time_s"),
        "sync_s": med("perf/weight_sync_time_s"), "train_tok_per_s": med("perf/train_tok_per_s"),
        "trainable_params": trainable, "total_params": total,
        "step_peak_gb": max(step_peaks) if step_peaks else float("nan"),
        "train_peak_gb": max(train_peaks) if train_peaks else float("nan"),
        "trainer_peak_gb": max(trainer_peaks) if trainer_peaks else float("nan"), **state,
    }


def run_in_subprocess(name: str, args, script: str = __file__, extra: tuple[str, ...] = ()) -> dict | None:
    """``script --only NAME`` in its own process (a clean allocator) with the run-shape flags of
    ``args`` (and ``extra``); its result, or None."""
    result = args.workdir / f"result_{name.replace(':', '_')}.json"
    result.unlink(missing_ok=True)
    argv = [sys.executable, script, "--only", name, "--result-json", str(result), "--workdir", str(args.workdir),
            "--steps", str(args.steps), "--prompts", str(args.prompts), "--samples", str(args.samples),
            "--new-tokens", str(args.new_tokens), "--prompt-len", str(args.prompt_len),
            "--max-tokens-per-gpu", str(args.max_tokens_per_gpu), "--mem-fraction", str(args.mem_fraction),
            "--max-total-tokens", str(args.max_total_tokens),
            *(["--tiny"] if args.tiny else []), *extra]
    if subprocess.run(argv).returncode != 0 or not result.is_file():
        print(f"{name}: the run failed (see above)")
        return None
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="hidden-64, 2-layer model on the CPU (smoke check)")
    parser.add_argument("--only", choices=sorted(VARIANTS), help="run one variant in this process")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 3; 2 with --tiny)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=8192)
    parser.add_argument("--no-recompute", dest="recompute", action="store_false",
                        help="keep every layer's activations (default: --recompute-granularity full in both runs; "
                             "without it a full fine-tune of this shape does not fit an 80 GB GPU beside the engine)")
    parser.add_argument("--mem-fraction", type=float, default=0.3,
                        help="the engine's GPU memory fraction (both runs): a cap on its weights + KV cache")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="the engine's KV cache in tokens (both runs; default prompts x samples x (prompt + new "
                             "tokens + one cache block): the whole rollout resident at once)")
    parser.add_argument("--profile", action="store_true", help="profile one more step of each variant (host and CUDA)")
    parser.add_argument("--result-json", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/miles_lora_bench"))
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 2 if args.tiny else 3
    if args.tiny:
        args.prompts, args.samples, args.new_tokens, args.prompt_len = 2, 2, 4, 4
    if args.max_total_tokens is None:
        args.max_total_tokens = args.prompts * args.samples * (args.prompt_len + args.new_tokens + KV_BLOCK)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not (args.workdir / "model").is_dir():
        build_assets(args.workdir, args.tiny, args.prompts, args.prompt_len)
    data = args.workdir / "prompts.jsonl"
    if args.only:
        result = bench_variant(args.only, args.workdir / "model", data, args)
        if args.result_json:
            args.result_json.write_text(json.dumps(result))
        return {args.only: result}
    extra = (() if args.recompute else ("--no-recompute",)) + (("--profile",) if args.profile else ())
    results = {name: run_in_subprocess(name, args, extra=extra) for name in VARIANTS}
    print(f"\n{'variant':<6} {'step s':>7} {'rollout s':>9} {'train s':>8} {'sync s':>7} {'trainable':>12} "
          f"{'step peak GB':>12} {'train peak GB':>13} {'trainer peak GB':>15} {'params+grads+opt GB':>20}")
    for name, r in results.items():
        if r is not None:
            state = r["param_gb"] + r["grad_gb"] + r["optimizer_gb"]
            print(f"{name:<6} {r['step_s']:7.2f} {r['rollout_s']:9.2f} {r['train_s']:8.2f} {r['sync_s']:7.3f} "
                  f"{r['trainable_params']:12,d} {r['step_peak_gb']:12.2f} {r['train_peak_gb']:13.2f} "
                  f"{r['trainer_peak_gb']:15.2f} {state:20.2f}")
    full, lora = results["full"], results["lora"]
    if full and lora:
        ratios = {"step_time": lora["step_s"] / full["step_s"], "step_peak_memory": lora["step_peak_gb"] / full["step_peak_gb"],
                  "train_peak_memory": lora["train_peak_gb"] / full["train_peak_gb"],
                  "trainer_peak_memory": lora["trainer_peak_gb"] / full["trainer_peak_gb"]}
        print(f"LoRA / full: step time {ratios['step_time']:.2f}x (goal <= 1.0x), peak memory of the step "
              f"{ratios['step_peak_memory']:.2f}x, of training {ratios['train_peak_memory']:.2f}x, the trainer's own "
              f"{ratios['trainer_peak_memory']:.2f}x (goal <= 0.5x); "
              f"trainable {lora['trainable_params'] / lora['total_params']:.2%} of the parameters")
        results["ratios"] = ratios
    return results


if __name__ == "__main__":
    main()
