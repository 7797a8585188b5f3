"""One GRPO step (rollout + reward + train + weight sync): miles vs TRL, same run.

Qwen3-0.6B-shaped random-init model, bf16, 32 prompts x 8 samples,
128-token prompts, 512 new tokens (EOS ignored / min_new_tokens=512). miles runs
its real loop pieces (``Run.step``: embedded engine, native trainer, in-process
weight sync); TRL runs ``GRPOTrainer`` with transformers generation. Steady-state
step time is the median of the steps after the first.

    python bench/grpo_step.py                 # both, on the H200
    python bench/grpo_step.py --only miles
    python bench/grpo_step.py --tiny          # CPU smoke test
    python bench/grpo_step.py --only miles --fully-async   # miles synchronous vs --fully-async

``--fully-async`` compares miles' synchronous step with ``FullyAsyncRun``'s (the
producer thread generating on the same GPU while the main thread trains): step, rollout
(for the asynchronous run: what the trainer waited for its batch), train, trainer and
engine idle time, staleness, the step ratio (goal: asynchronous <= 0.75x synchronous)
and the overlap achieved, (sync rollout + sync train - async step) / min(sync rollout,
sync train). When one GPU cannot overlap, the same table says why: the generation
throughput and the training time of the asynchronous run against the synchronous run's
(both phases slowed by sharing the GPU), and with ``--profile`` the GPU busy time of one
more step of each (a GPU busy through the synchronous step has nothing left to overlap).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "models"), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402


def random_reward(sample, config=None):
    """Rewards with variance inside each group (no learning signal needed for timing)."""
    return random.random()


#: the Qwen3 decoder shapes the GRPO benchmarks build (the 0.6B one is this bench's)
QWEN3_SHAPES = {
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=6144),
}


def build_assets(root: Path, tiny: bool, prompts: int, prompt_len: int, shape_name: str = "0.6b") -> tuple[Path, Path]:
    """A random Qwen3 model of ``QWEN3_SHAPES[shape_name]`` (or a tiny one), a word-level
    tokenizer covering its vocab, and prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab_size = 512 if tiny else 151936
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")
    shape = (
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)
        if tiny
        else QWEN3_SHAPES[shape_name]
    )
    config = Qwen3Config(vocab_size=vocab_size, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0,
                         max_position_embeddings=4096, **shape)
    torch.manual_seed(0)
    model_dir = root / "model"
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    rng = random.Random(0)
    data = root / "prompts.jsonl"
    with data.open("w") as handle:
        for _ in range(prompts):
            handle.write(json.dumps({"input": " ".join(f"w{rng.randrange(2, vocab_size)}" for _ in range(prompt_len))}) + "\n")
    return model_dir, data


def bench_miles(model_dir: Path, data: Path, args, fully_async: bool = False) -> dict:
    """miles' steps (``Run.step``), or with ``fully_async`` those of ``FullyAsyncRun``: the
    producer thread generates on the same GPU while this thread trains."""
    from miles_host.cli.args import resolve_run_config
    from miles_host.fully_async.run import FullyAsyncRun
    from miles_host.loop import Run
    from miles_host.plugin_manager import MilesPluginManager

    argv = [
        "--hf-checkpoint", str(model_dir), "--prompt-data", str(data), "--custom-rm-path", "grpo_step.random_reward",
        "--rollout-batch-size", str(args.prompts), "--n-samples-per-prompt", str(args.samples),
        "--rollout-max-response-len", str(args.new_tokens), "--num-rollout", str(args.steps),
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(args.max_tokens_per_gpu), "--lr", "1e-6",
        "--output-dir", str(args.workdir / "miles_out"), "--no-progress", *(["--train-compile"] if args.train_compile else []),
        *(["--sglang-disable-overlap-schedule"] if args.no_overlap else []),
        *(["--fully-async"] if fully_async else []),
        *(["--colocate", "--rollout-backend", "process"] if fully_async and args.engine_process else []),
    ]
    manager = MilesPluginManager()
    config, _ = resolve_run_config(argv, manager)
    run = (FullyAsyncRun if fully_async else Run)(config, manager)
    sampling_params = run.rollout.sampling_params
    run.rollout.sampling_params = lambda *a, **k: {**sampling_params(*a, **k), "ignore_eos": True}
    run.sync_weights(version=run.state.weight_version)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    steps = []
    for rollout_id in range(args.steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        metrics = run.step(rollout_id)
        steps.append(metrics)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items() if k.startswith("perf/")}))
    profiled = profile_step(run, args.steps) if args.profile else {}
    run.close()  # the asynchronous run's producer stops here; the trainer's resources go
    steady = steps[1:] or steps
    med = lambda key: statistics.median(m[key] for m in steady)  # noqa: E731
    extra = {}
    if fully_async:
        extra = {"trainer_idle_s": med("perf/trainer_idle_time_s"), "engine_idle_s": med("perf/engine_idle_time_s"),
                 "avg_staleness": med("rollout/fully_async/avg_staleness")}
    return {
        **extra,
        **profiled,
        "first_step_s": steps[0]["perf/step_time_s"],
        "step_s": med("perf/step_time_s"),
        "rollout_s": med("perf/rollout_time_s"),
        "train_s": med("perf/train_time_s"),
        "sync_s": med("perf/weight_sync_time_s"),
        "rollout_tok_per_s": med("perf/rollout_tok_per_s"),
        "response_len": med("rollout/response_len_mean"),
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else float("nan"),
    }


def bench_miles_and_free(model_dir: Path, data: Path, args, fully_async: bool) -> dict:
    """:func:`bench_miles`, then its run's memory freed, so a second run in this process
    starts from the same GPU memory as the first (the engine sizes its KV cache from the
    memory in use). ``left_gb``: GPU memory still allocated afterwards; well above zero,
    the second run had less room (run without ``--only``: each run in its own process)."""
    result = bench_miles(model_dir, data, args, fully_async=fully_async)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        result["left_gb"] = torch.cuda.memory_allocated() / 1e9
        if result["left_gb"] > 1.0:
            print(f"warning: {result['left_gb']:.1f} GB still allocated after the run; the next run in this process "
                  "has less room for its KV cache (run without --only for one process per run)")
    return result


def async_comparison(sync: dict, fa: dict) -> dict:
    """The fully-async step against the synchronous one (steady-state medians of each):
    the ratio, the overlap achieved (the fraction of the shorter synchronous phase hidden
    behind the other), and what sharing the GPU cost each phase."""
    shorter = min(sync["rollout_s"], sync["train_s"])
    return {
        "sync_step_s": sync["step_s"],
        "async_step_s": fa["step_s"],
        "ratio": fa["step_s"] / sync["step_s"],
        "goal_met": fa["step_s"] <= 0.75 * sync["step_s"],
        "overlap": (sync["rollout_s"] + sync["train_s"] - fa["step_s"]) / shorter if shorter > 0 else float("nan"),
        "trainer_idle_s": fa["trainer_idle_s"],
        "engine_idle_s": fa["engine_idle_s"],
        "avg_staleness": fa["avg_staleness"],
        # < 1: generation slowed by the training it shares the GPU with
        "generation_speed_vs_sync": fa["rollout_tok_per_s"] / sync["rollout_tok_per_s"],
        # > 1: training slowed by the generation it shares the GPU with
        "train_time_vs_sync": fa["train_s"] / sync["train_s"],
        **({f"{k}_{run}": r[k] for run, r in (("sync", sync), ("async", fa))
            for k in ("gpu_busy_s", "gpu_busy_fraction", "profiled_step_s") if k in r}),
    }


def print_async_table(sync: dict, fa: dict, cmp: dict) -> None:
    print("\nmiles synchronous vs --fully-async (steady-state medians; async rollout = the trainer's wait for its batch)")
    print(f"{'run':<12} {'step s':>8} {'rollout s':>10} {'train s':>8} {'sync s':>7} {'gen tok/s':>10} "
          f"{'trainer idle s':>15} {'engine idle s':>14} {'staleness':>10}")
    for name, r in (("synchronous", sync), ("fully-async", fa)):
        print(f"{name:<12} {r['step_s']:8.2f} {r['rollout_s']:10.2f} {r['train_s']:8.2f} {r['sync_s']:7.3f} "
              f"{r['rollout_tok_per_s']:10.0f} {r.get('trainer_idle_s', r['rollout_s']):15.2f} "
              f"{r.get('engine_idle_s', float('nan')):14.2f} {r.get('avg_staleness', 0.0):10.2f}")
    print(f"async / sync step: {cmp['ratio']:.2f}x (goal <= 0.75x: {'met' if cmp['goal_met'] else 'not met'}); "
          f"overlap achieved: {cmp['overlap']:.0%} of the shorter synchronous phase")
    print(f"sharing the GPU: generation at {cmp['generation_speed_vs_sync']:.0%} of its synchronous speed, "
          f"training {cmp['train_time_vs_sync']:.2f}x its synchronous time")
    if "gpu_busy_s" in sync and torch.cuda.is_available():
        print(f"--profile: the GPU was busy {sync['gpu_busy_fraction']:.0%} of a synchronous step "
              f"({sync['gpu_busy_s']:.2f} of {sync['profiled_step_s']:.2f} s) and {fa['gpu_busy_fraction']:.0%} of an "
              f"asynchronous one ({fa['gpu_busy_s']:.2f} of {fa['profiled_step_s']:.2f} s): what one GPU leaves to overlap")


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``(start_us, end_us)`` intervals (kernels of several
    streams running at once count once)."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e6


def profile_step(run, rollout_id: int) -> dict:
    """One more step under the host profiler and the CUDA profiler: where the time goes.
    Returns the profiled step's time and the time the GPU ran kernels or copies in it (any
    thread's: with ``--fully-async`` the producer's too); a GPU busy through a synchronous
    step leaves an asynchronous run on the same GPU nothing to overlap."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    host = cProfile.Profile()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as trace:
        host.enable()
        metrics = run.step(rollout_id)
        host.disable()
    print("profiled step:", json.dumps({k: round(v, 4) for k, v in metrics.items() if k.startswith("perf/")}))
    pstats.Stats(host).sort_stats("tottime").print_stats(30)
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(trace.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70))
    from torch.autograd import DeviceType

    device = [(e.time_range.start, e.time_range.end) for e in trace.events() if e.device_type == DeviceType.CUDA]
    step_s = metrics["perf/step_time_s"]
    gpu_busy_s = busy_seconds(device) if torch.cuda.is_available() else float("nan")
    print(f"profiled step {step_s:.2f} s: GPU busy {gpu_busy_s:.2f} s ({gpu_busy_s / step_s:.0%})")
    return {"profiled_step_s": step_s, "gpu_busy_s": gpu_busy_s, "gpu_busy_fraction": gpu_busy_s / step_s}


def sync_points_step(run, rollout_id: int, top: int = 25) -> dict[str, int]:
    """One more step with CUDA's sync debug mode on during its training phase: every host
    synchronisation there (``.item()``, ``.cpu()``, a pageable copy, ``nonzero`` ...) counted by
    the innermost frame outside torch that caused it, the most frequent printed. A sync drains
    the GPU's queue, so the host's next launches run with the GPU idle."""
    import collections
    import traceback
    import warnings

    counts: collections.Counter = collections.Counter()
    train = run.trainer.train

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/torch/" not in f.filename and "/warnings.py" not in f.filename]
        where = frames[-3:] if frames else []
        counts[" <- ".join(f"{Path(f.filename).name}:{f.lineno}({f.name})" for f in reversed(where))] += 1

    def train_with_sync_debug(samples):
        if not torch.cuda.is_available():
            return train(samples)
        shown = warnings.showwarning
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                return train(samples)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown

    run.trainer.train = train_with_sync_debug
    try:
        run.step(rollout_id)
    finally:
        run.trainer.train = train
    print(f"host syncs in the training phase: {sum(counts.values())}")
    for where, count in counts.most_common(top):
        print(f"{count:6d}  {where}")
    return dict(counts)


def bench_trl(model_dir: Path, data: Path, args) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    prompts = [json.loads(line)["input"] for line in data.read_text().splitlines()]
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    config = GRPOConfig(
        output_dir=str(args.workdir / "trl_out"), per_device_train_batch_size=args.prompts,
        gradient_accumulation_steps=args.samples, num_generations=args.samples,
        max_completion_length=args.new_tokens, generation_kwargs={"min_new_tokens": args.new_tokens},
        bf16=True, max_steps=args.steps, learning_rate=1e-6, logging_steps=1, report_to=[], save_strategy="no",
        use_vllm=False, temperature=1.0,
    )
    torch.cuda.reset_peak_memory_stats()
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [random.random() for _ in completions]],
                          args=config, train_dataset=Dataset.from_dict({"prompt": prompts * args.steps}),
                          processing_class=tokenizer, callbacks=[Timer()])
    trainer.train()
    return {"first_step_s": times[0], "step_s": statistics.median(times[1:] or times),
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9}


def run_isolated(system: str, args) -> dict | None:
    """``--only SYSTEM`` in a subprocess; its result, or None (with the reason printed)."""
    import subprocess

    out = args.workdir / f"{system}_result.json"
    out.unlink(missing_ok=True)
    argv = [sys.executable, __file__, "--only", system, "--result-json", str(out), "--workdir", str(args.workdir)]
    for name in ("steps", "prompts", "samples", "new_tokens", "prompt_len", "max_tokens_per_gpu"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    argv += [flag for flag, on in (("--train-compile", args.train_compile), ("--no-overlap", args.no_overlap),
                                   ("--profile", args.profile)) if on]
    returncode = subprocess.run(argv).returncode
    if returncode or not out.exists():
        print(f"{system} benchmark failed (exit code {returncode})")
        return None
    return json.loads(out.read_text())[system]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--train-compile", action="store_true", help="miles: torch.compile the decoder layers")
    parser.add_argument("--only", choices=["miles", "miles_async", "trl"],
                        help="one system in this process (with --fully-async, --only miles runs both miles runs here, "
                             "one after the other)")
    parser.add_argument("--fully-async", action="store_true",
                        help="miles synchronous vs --fully-async (the producer generating on the same GPU while the "
                             "trainer trains); without --only each in its own process; TRL not run")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 3; 2 with --tiny)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    parser.add_argument("--no-overlap", action="store_true", help="miles: read each decode step before launching the next")
    parser.add_argument("--profile", action="store_true", help="miles: profile one extra step (host and CUDA)")
    parser.add_argument("--engine-process", action="store_true",
                        help="with --fully-async: the engine in its own process on the trainer's GPU (--colocate "
                             "--rollout-backend process: no shared interpreter lock, both resident) instead of the "
                             "producer thread's in-process engine")
    parser.add_argument("--result-json", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/miles_grpo_bench"))
    args = parser.parse_args(argv)
    if args.tiny:
        args.prompts, args.samples, args.new_tokens, args.prompt_len = 4, 4, 16, 8
    args.steps = args.steps or (2 if args.tiny else 3)
    args.workdir.mkdir(parents=True, exist_ok=True)
    model_dir, data = build_assets(args.workdir, args.tiny, args.prompts, args.prompt_len)
    results = {}
    systems = ("miles", "miles_async") if args.fully_async else ("miles", "trl")
    if args.only is None and not args.tiny:
        # each system in a fresh process: neither inherits the other's GPU memory or allocator state
        for system in systems:
            result = run_isolated(system, args)
            if result is not None:
                results[system] = result
    else:
        if args.only in (None, "miles"):
            results["miles"] = bench_miles_and_free(model_dir, data, args, fully_async=False)
        if args.only == "miles_async" or (args.only in (None, "miles") and args.fully_async):
            results["miles_async"] = bench_miles_and_free(model_dir, data, args, fully_async=True)
        if args.only == "trl":
            results["trl"] = bench_trl(model_dir, data, args)
    completion_tokens = args.prompts * args.samples * args.new_tokens
    print(f"\nGRPO step, {args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens")
    print(f"{'system':<12} {'first s':>8} {'step s':>8} {'rollout s':>10} {'train s':>8} {'sync s':>7} {'tok/s':>9} "
          f"{'peak GB':>8}")
    for name, r in results.items():
        print(f"{name:<12} {r['first_step_s']:8.2f} {r['step_s']:8.2f} {r.get('rollout_s', float('nan')):10.2f} "
              f"{r.get('train_s', float('nan')):8.2f} {r.get('sync_s', float('nan')):7.3f} "
              f"{completion_tokens / r['step_s']:9.0f} {r['peak_gb']:8.1f}")
    if "miles" in results and "trl" in results:
        print(f"speed-up per steady step: {results['trl']['step_s'] / results['miles']['step_s']:.2f}x")
    if "miles" in results and "miles_async" in results:
        results["async_vs_sync"] = async_comparison(results["miles"], results["miles_async"])
        print_async_table(results["miles"], results["miles_async"], results["async_vs_sync"])
    if args.result_json:
        args.result_json.write_text(json.dumps(results))
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
