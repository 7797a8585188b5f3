"""The scale run: a random Qwen3-30B-A3B-shaped MoE trained by GRPO with
Megatron-Core expert parallelism on half of the GPUs while engine processes on the
other half roll out, with FP8 and R3; then the same run without FP8 and without R3.

    python bench/scale_run.py --gpus 8                 # nvidia-h200-x8: 4 engines + 4 trainers (EP 4), 48 layers
    python bench/scale_run.py --gpus 4 --layers 12     # nvidia-h200-x4: 2 + 2 (EP 2), fewer layers (stated)
    python bench/scale_run.py --tiny                   # CPU smoke run: 2 layers, 8 experts, gloo EP 2
    python bench/scale_run.py --gpus 8 --variants no_r3  # one variant per call; the model is built once
    python bench/scale_run.py --gpus 1 --layers 4 --prompts 16 --variants fp8_r3  # one H200: one process, reduced

The task is the quickstart's (two-digit addition, exact-match reward, its character
tokenizer) with a larger batch; the policy is random, so the figures are speed and
consistency (``r3/expert_agreement``, ``train/train_rollout_logprob_abs_diff``), not
learning. Per variant: step time and its phases, rollout and training tok/s, training
MFU (6 x active parameters x tokens / time / (trainer GPUs x 989 TFLOP/s bf16 dense)),
weight-sync time and each GPU's peak memory (``nvidia-smi``, sampled every second).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
H200_BF16_TFLOPS = 989.0
VARIANTS = {"fp8_r3": "fp8,r3", "no_fp8": "r3", "no_r3": "fp8"}


def model_shape(tiny: bool, layers: int | None) -> dict:
    """Qwen3-30B-A3B's published dimensions (or a CPU-sized MoE with FP8-sized blocks)."""
    if tiny:
        return dict(hidden_size=128, num_hidden_layers=layers or 2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=128, intermediate_size=256, moe_intermediate_size=128, num_experts=8,
                    num_experts_per_tok=2)
    return dict(hidden_size=2048, num_hidden_layers=layers or 48, num_attention_heads=32, num_key_value_heads=4,
                head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                num_experts_per_tok=8)


def active_params(shape: dict, vocab: int) -> int:
    """Parameters one token multiplies: attention, router, top-k experts, LM head."""
    h, d = shape["hidden_size"], shape["head_dim"]
    attention = h * d * (shape["num_attention_heads"] * 2 + shape["num_key_value_heads"] * 2)
    experts = shape["num_experts_per_tok"] * 3 * h * shape["moe_intermediate_size"]
    return shape["num_hidden_layers"] * (attention + h * shape["num_experts"] + experts) + vocab * h


def build_model(directory: Path, shape: dict, tiny: bool) -> int:
    """A random-init HF checkpoint with the quickstart tokenizer; returns the vocab size."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from miles_host.quickstart_preset import QUICKSTART_DIR

    quick = json.loads((QUICKSTART_DIR / "model" / "config.json").read_text())
    vocab = quick["vocab_size"] if tiny else 151936
    config = Qwen3MoeConfig(vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                            eos_token_id=quick["eos_token_id"], pad_token_id=quick["pad_token_id"], **shape)
    dtype = torch.float32 if tiny else torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(directory)
    for path in (QUICKSTART_DIR / "model").iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, directory / path.name)
    return vocab


class GpuMemoryPeaks:
    """Peak ``memory.used`` (GB) of every GPU, sampled by ``nvidia-smi`` every second."""

    def __init__(self):
        self.peaks: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()

    def _poll(self):
        while not self._stop.wait(1.0):
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout
            for line in out.strip().splitlines():
                index, used = (int(float(v)) for v in line.split(","))
                self.peaks[index] = max(self.peaks.get(index, 0.0), used / 1024)


def run_variant(name: str, plugins: str, model: Path, args, out: Path) -> Path:
    from miles_host.quickstart_preset import QUICKSTART_DIR

    trainers, engines = max(1, args.gpus // 2), args.engines or max(1, args.gpus // 2)
    # one GPU: the trainer and the embedded engine in one process (in-process weight sync)
    layout = [] if args.gpus == 1 else [
        "--actor-num-gpus-per-node", str(trainers), "--rollout-num-gpus", str(engines),
        "--rollout-backend", "process", "--weight-sync", "broadcast",
    ]
    output = out / name
    shutil.rmtree(output, ignore_errors=True)  # a re-run of a variant starts a fresh metrics.jsonl
    argv = [
        sys.executable, "-m", "miles_host.cli.main", "run", "--hf-checkpoint", str(model),
        "--prompt-data", str(QUICKSTART_DIR / "data" / "train.jsonl"), "--input-key", "input", "--label-key", "label",
        "--rm-type", "exact", "--advantage-estimator", "grpo", "--rollout-temperature", "1.0", "--rollout-shuffle",
        "--rollout-batch-size", str(args.prompts), "--n-samples-per-prompt", str(args.samples),
        "--rollout-max-response-len", str(args.new_tokens), "--num-rollout", str(args.steps), "--lr", "1e-6",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(args.max_tokens_per_gpu),
        "--train-backend", "megatron", "--expert-model-parallel-size", str(trainers),
        *layout, "--plugins", plugins,
        "--output-dir", str(output), "--no-progress", "--worker-timeout", str(args.worker_timeout),
        *(["--device", "cpu", "--dtype", "float32"] if args.tiny else ["--device", "cuda", "--dtype", "bfloat16"]),
    ]
    print(f"=== {name}: {' '.join(argv[3:])}", flush=True)
    subprocess.run(argv, check=True, timeout=args.timeout)
    return output


def summarize(output: Path, peaks: dict[int, float], trainers: int, active: int) -> dict:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "perf/step_time_s" in r]
    timed = steps[1:] or steps  # the first step compiles, captures graphs, sets NCCL up
    mean = lambda key: statistics.fmean(r[key] for r in timed if key in r) if any(key in r for r in timed) else None  # noqa: E731
    train_tok_s = mean("perf/train_tok_per_s")
    return {
        "steps": len(steps),
        "step_s": mean("perf/step_time_s"), "rollout_s": mean("perf/rollout_time_s"),
        "train_s": mean("perf/train_time_s"), "weight_sync_s": mean("perf/weight_sync_time_s"),
        "rollout_tok_per_s": mean("perf/rollout_tok_per_s"), "train_tok_per_s": train_tok_s,
        "train_mfu": (6 * active * train_tok_s / (trainers * H200_BF16_TFLOPS * 1e12)) if train_tok_s else None,
        "r3_expert_agreement": mean("r3/expert_agreement"),
        "train_rollout_logprob_abs_diff": mean("train/train_rollout_logprob_abs_diff"),
        "peak_gpu_memory_gb": {str(k): round(v, 1) for k, v in sorted(peaks.items())},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run")
    parser.add_argument("--gpus", type=int, default=None,
                        help="half train (EP over them), half roll out; 1: trainer and embedded engine in one process (default 8)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 48; tiny 2)")
    parser.add_argument("--engines", type=int, default=None, help="engine processes (default: half the GPUs)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {','.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per variant")
    parser.add_argument("--worker-timeout", type=int, default=600)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/miles_scale_run"))
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.gpus = args.gpus or 4
        args.engines, args.steps, args.prompts, args.samples, args.new_tokens = 1, 2, 2, 4, 4
        args.max_tokens_per_gpu = 256
    args.gpus = args.gpus or 8
    args.workdir.mkdir(parents=True, exist_ok=True)
    shape = model_shape(args.tiny, args.layers)
    model = args.workdir / "model"
    start = time.perf_counter()
    built = model / "shape.json"
    if built.exists() and json.loads(built.read_text()) == shape:  # a later call (one variant per device call)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    else:
        vocab = build_model(model, shape, args.tiny)
        built.write_text(json.dumps(shape))
    active = active_params(shape, vocab)
    print(f"model: {shape}, {active / 1e9:.2f}B active parameters, built in {time.perf_counter() - start:.0f} s")
    results = {}
    for name in args.variants.split(","):
        with GpuMemoryPeaks() as memory:
            output = run_variant(name, VARIANTS[name], model, args, args.workdir)
        results[name] = summarize(output, memory.peaks, max(1, args.gpus // 2), active)
        print(name, json.dumps(results[name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"shape": shape, "gpus": args.gpus, "results": results}, indent=2))
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
