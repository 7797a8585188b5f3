"""The quickstart task (two-digit addition, GRPO) on the GPU with bf16, FP8 and INT4, side by side.

    python bench/quickstart_gpu.py                 # H200: hidden 128, 2 layers, 30 rollouts each (~3 min)
    python bench/quickstart_gpu.py --hidden 256 --layers 4
    python bench/quickstart_gpu.py --tiny          # CPU smoke: FP8 / INT4 through their CPU emulation

1. The base policy: ``scripts/make_quickstart_model.py`` (character tokenizer, SFT on
   labels that forget the carry) with ``--hidden`` / ``--layers`` chosen so every
   linear dim is a multiple of 128 (hidden 128: qkv 256x128, o 128x128, gate_up
   512x128, down 128x256), so FP8's 128x128 blocks apply to every linear; SFT runs
   on ``--device``.
2. ``miles run`` once per precision, each in its own process (a fresh GPU), with the
   quickstart preset's flags (``miles_host.quickstart_preset``) pointed at that model,
   the same seeds: ``bf16`` (no plugin; the model dtype, float32 on CPU),
   ``fp8`` (``--plugins fp8``: FP8 training GEMMs and FP8 rollout, the fused small-M
   kernel at decode) and ``int4`` (``--plugins int4 --int4-target all``: QAT, packed
   INT4 rollout, the Triton small-M kernel at decode).
3. The eval accuracy (greedy, the held-out eval pool) after every ``--eval-interval``
   rollouts, one column per precision, and the wall time of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PRECISIONS = {
    "bf16": [],
    "fp8": ["--plugins", "fp8"],
    "int4": ["--plugins", "int4", "--int4-target", "all"],
}
#: sizes of the --tiny smoke run (CPU, a few seconds per run)
TINY = dict(hidden=128, layers=1, sft_steps=30, sft_batch=32, n_train=256, n_eval=16, rollouts=2,
            eval_interval=1, rollout_batch_size=4, n_samples=4)
FULL = dict(sft_batch=128, n_train=2000, n_eval=200, rollout_batch_size=16, n_samples=8)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny sizes, emulated FP8/INT4)")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (a multiple of 128 for FP8 blocks)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sft-steps", type=int, default=3000, help="SFT steps of the base policy")
    parser.add_argument("--rollouts", type=int, default=30, help="rollouts (GRPO steps) per precision")
    parser.add_argument("--eval-interval", type=int, default=5)
    parser.add_argument("--int4-group-size", type=int, default=32, choices=[32, 64, 128])
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--seed", type=int, default=0, help="seed of the base policy's SFT")
    parser.add_argument("--workdir", help="keep the model and run outputs here (default: a temporary folder)")
    parser.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=None,
                        help="build and run in this process (default with --tiny: saves the imports); "
                             "otherwise each step gets a fresh process (and a fresh GPU)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    sizes = dict(FULL, hidden=args.hidden, layers=args.layers, sft_steps=args.sft_steps, rollouts=args.rollouts,
                 eval_interval=args.eval_interval)
    if args.tiny:
        sizes.update(TINY)
    args.sizes = sizes
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    if args.in_process is None:
        args.in_process = args.tiny
    unknown = [p for p in args.precisions.split(",") if p not in PRECISIONS]
    if unknown:
        parser.error(f"unknown precisions {unknown}; choose from {', '.join(PRECISIONS)}")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA GPU here: pass --tiny (or --device cpu)")
    if args.sizes["hidden"] % 128:
        print(f"note: hidden {args.sizes['hidden']} is not a multiple of 128: FP8 keeps those linears in bf16",
              file=sys.stderr)
    return args


def build_base_model(out: Path, args) -> float:
    """Run ``scripts/make_quickstart_model.py`` into ``out``; return its wall time."""
    sizes = args.sizes
    script = REPO / "scripts" / "make_quickstart_model.py"
    options = [
        "--out", str(out), "--hidden", str(sizes["hidden"]), "--layers", str(sizes["layers"]), "--steps", str(sizes["sft_steps"]),
        "--batch-size", str(sizes["sft_batch"]), "--n-train", str(sizes["n_train"]), "--n-eval", str(sizes["n_eval"]),
        "--seed", str(args.seed), "--device", args.device, "--no-eval",
    ]
    start = time.perf_counter()
    if args.in_process:
        import contextlib
        import importlib.util
        import io

        spec = importlib.util.spec_from_file_location("make_quickstart_model", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        with contextlib.redirect_stdout(io.StringIO()):
            module.main(options)
    else:
        subprocess.run([sys.executable, str(script), *options], check=True, cwd=REPO)
    return time.perf_counter() - start


def run_config(base: Path, args) -> dict:
    """The quickstart preset's flag values pointed at the built model and data (a ``--config`` YAML mapping)."""
    from miles_host.quickstart_preset import quickstart_defaults

    sizes = args.sizes
    config = quickstart_defaults()
    config.update(
        hf_checkpoint=str(base / "model"), prompt_data=str(base / "data" / "train.jsonl"),
        eval_prompt_data=["addition", str(base / "data" / "eval.jsonl")],
        device="cuda" if args.device.startswith("cuda") else "cpu", dtype="auto",
        num_rollout=sizes["rollouts"], eval_interval=sizes["eval_interval"],
        rollout_batch_size=sizes["rollout_batch_size"], n_samples_per_prompt=sizes["n_samples"],
        no_progress=True,
    )
    return config


def run_precision(name: str, config_path: Path, out: Path, args) -> dict:
    """``miles run`` for one precision in a fresh process; its eval curve and times."""
    argv = ["run", "--config", str(config_path), "--output-dir", str(out), *PRECISIONS[name]]
    if name == "int4":
        argv += ["--int4-group-size", str(args.int4_group_size)]
    start = time.perf_counter()
    if args.in_process:
        from miles_host.cli.main import main as miles_main

        code, report = miles_main(argv), ""
    else:
        env = dict(os.environ)
        if args.device.startswith("cuda:"):
            env["CUDA_VISIBLE_DEVICES"] = args.device.split(":", 1)[1]
        command = [sys.executable, "-c", "import sys; from miles_host.cli.main import main; sys.exit(main(sys.argv[1:]))",
                   *argv]
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        code, report = result.returncode, result.stdout + result.stderr
    seconds = time.perf_counter() - start
    if code != 0:
        tail = "\n".join(report.strip().splitlines()[-25:])
        raise RuntimeError(f"miles run ({name}) failed with exit code {code}:\n{tail}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = {int(r["rollout_id"]) + 1 if r["rollout_id"] >= 0 else 0: r["eval/addition/accuracy"]
             for r in rows if "eval/addition/accuracy" in r}
    steps = [r["perf/step_time_s"] for r in rows if "perf/step_time_s" in r]
    rollout_tok_s = [r["perf/rollout_tok_per_s"] for r in rows if "perf/rollout_tok_per_s" in r]
    return dict(curve=curve, wall_s=seconds, step_s=sum(steps) / max(len(steps), 1),
                rollout_tok_s=sorted(rollout_tok_s)[len(rollout_tok_s) // 2] if rollout_tok_s else float("nan"))


def print_report(results: dict, build_s: float, total_s: float, args) -> None:
    names = list(results)
    points = sorted({point for result in results.values() for point in result["curve"]})
    print(f"\nquickstart on {args.device}: hidden {args.sizes['hidden']}, {args.sizes['layers']} layers, "
          f"{args.sizes['rollouts']} rollouts of {args.sizes['rollout_batch_size']} prompts x "
          f"{args.sizes['n_samples']} samples; greedy eval accuracy on {args.sizes['n_eval']} held-out prompts")
    print()
    print("| rollouts | " + " | ".join(names) + " |")
    print("| ---: | " + " | ".join("---:" for _ in names) + " |")
    for point in points:
        cells = [f"{results[n]['curve'][point]:.3f}" if point in results[n]["curve"] else "-" for n in names]
        print(f"| {point} | " + " | ".join(cells) + " |")
    print("| run wall time (s) | " + " | ".join(f"{results[n]['wall_s']:.1f}" for n in names) + " |")
    print("| mean step time (s) | " + " | ".join(f"{results[n]['step_s']:.3f}" for n in names) + " |")
    print("| median rollout tok/s | " + " | ".join(f"{results[n]['rollout_tok_s']:,.0f}" for n in names) + " |")
    print(f"\nbase policy built in {build_s:.1f} s; total {total_s:.1f} s")


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.workdir or scratch)
        work.mkdir(parents=True, exist_ok=True)
        build_s = build_base_model(work / "base", args)
        config_path = work / "quickstart.yaml"
        config_path.write_text(yaml.safe_dump(run_config(work / "base", args)))
        results = {}
        for name in args.precisions.split(","):
            results[name] = run_precision(name, config_path, work / name, args)
            print(f"[{name}] {results[name]['wall_s']:.1f} s, eval accuracy "
                  f"{[round(v, 3) for v in results[name]['curve'].values()]}", flush=True)
    total_s = time.perf_counter() - start
    print_report(results, build_s, total_s, args)
    report = {"device": args.device, "sizes": args.sizes, "build_s": build_s, "total_s": total_s, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
