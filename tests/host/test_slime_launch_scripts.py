"""slime's launch scripts, argument array by argument array, through ``miles run``.

Each set copies the structure and flag content of one of slime's scripts
(``scripts/run-qwen3-4B.sh``, ``run-qwen3-30B-A3B.sh``, ``run-deepseek-r1.sh``,
``run-glm4.5-355B-A32B.sh``): MODEL_ARGS + CKPT_ARGS + ROLLOUT_ARGS + EVAL_ARGS + PERF_ARGS +
GRPO_ARGS + OPTIMIZER_ARGS + WANDB_ARGS + SGLANG_ARGS + MISC_ARGS. Paths point at tiny local
checkpoints built with transformers; MODEL_ARGS are computed from their configs
(:mod:`tests.host.test_megatron_args`); sizes that must fit a 2-layer, 4-head model
(parallel sizes, GPUs) are scaled down, every flag of the script stays.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from miles_host.cli.main import main
from tests.host.test_megatron_args import MODELS

def _ckpt_args(folder: Path, root: Path, name: str, save: bool) -> list[str]:
    args = ["--hf-checkpoint", str(folder), "--ref-load", str(folder)]
    if save:  # an empty --load starts fresh, as slime's does
        args += ["--load", str(root / f"{name}_slime"), "--save", str(root / f"{name}_slime"), "--save-interval", "20"]
    return args


def _rollout_args(root: Path, batch: int, samples: int, response: int, *extra: str) -> list[str]:
    return ["--prompt-data", str(root / "dapo.jsonl"), "--input-key", "prompt", "--label-key", "label",
            "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler", "--num-rollout", "3000",
            "--rollout-batch-size", str(batch), "--n-samples-per-prompt", str(samples),
            "--rollout-max-response-len", str(response), "--rollout-temperature", "0.8", *extra]


def _eval_args(root: Path, interval: bool, samples: int, response: int) -> list[str]:
    return [*(["--eval-interval", "20"] if interval else []), "--eval-prompt-data", "aime", str(root / "aime.jsonl"),
            "--n-samples-per-eval-prompt", str(samples), "--eval-max-response-len", str(response), "--eval-top-p", "0.7"]


def _perf_args(tp: int, pp: int, cp: int, ep: int, tokens: int, *extra: str) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--sequence-parallel", "--pipeline-model-parallel-size", str(pp),
            "--context-parallel-size", str(cp), "--expert-model-parallel-size", str(ep),
            "--expert-tensor-parallel-size", "1", *extra, "--recompute-granularity", "full",
            "--recompute-method", "uniform", "--recompute-num-layers", "1", "--use-dynamic-batch-size",
            "--max-tokens-per-gpu", str(tokens)]


GRPO_ARGS = ["--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
             "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28"]
OPTIMIZER_ARGS = ["--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
                  "--adam-beta1", "0.9", "--adam-beta2", "0.98"]
CPU_OPTIMIZER_ARGS = ["--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"]
MISC_ARGS = ["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
             "--attention-softmax-in-fp32", "--attention-backend", "flash"]
SLIME_FILTER = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"


def qwen3_4b(root: Path, folder: Path, model_args: list[str]) -> dict[str, list[str]]:
    """``scripts/run-qwen3-4B.sh``."""
    return {
        "LAUNCH": ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--colocate"],
        "MODEL_ARGS": model_args,
        "CKPT_ARGS": _ckpt_args(folder, root, "qwen3", save=True),
        "ROLLOUT_ARGS": _rollout_args(root, 32, 8, 8192, "--global-batch-size", "256", "--balance-data"),
        "EVAL_ARGS": _eval_args(root, True, 16, 16384),
        "PERF_ARGS": _perf_args(2, 1, 1, 1, 9216),
        "GRPO_ARGS": GRPO_ARGS,
        "OPTIMIZER_ARGS": OPTIMIZER_ARGS,
        "WANDB_ARGS": [],  # commented out in the script
        "SGLANG_ARGS": ["--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7"],
        "MISC_ARGS": MISC_ARGS,
    }


def qwen3_30b_a3b(root: Path, folder: Path, model_args: list[str]) -> dict[str, list[str]]:
    """``scripts/run-qwen3-30B-A3B.sh`` (EP 8 -> 2 for 8 tiny experts on 2 GPUs; ``--wandb-mode disabled``
    added so that a test run never reaches wandb's servers with the placeholder key)."""
    return {
        "LAUNCH": ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--colocate"],
        "MODEL_ARGS": model_args,
        "CKPT_ARGS": _ckpt_args(folder, root, "qwen3_moe", save=False),
        "ROLLOUT_ARGS": _rollout_args(root, 8, 4, 8192, "--global-batch-size", "32", "--balance-data"),
        "EVAL_ARGS": _eval_args(root, False, 16, 16384),
        "PERF_ARGS": _perf_args(2, 1, 1, 2, 20480),
        "GRPO_ARGS": [*GRPO_ARGS, "--use-tis", "--tis-level", "geometric"],
        "OPTIMIZER_ARGS": [*OPTIMIZER_ARGS, *CPU_OPTIMIZER_ARGS],
        "WANDB_ARGS": ["--use-wandb", "--wandb-project", "slime-dev", "--wandb-group", "qwen3-30B-A3B-TIS",
                       "--wandb-run-id", "qwen3-30B-A3B-TIS-sequence", "--wandb-key", "0123456789abcdef",
                       "--wandb-mode", "disabled"],
        "SGLANG_ARGS": ["--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7",
                        "--sglang-cuda-graph-bs", "1", "2", "4", "8", *map(str, range(16, 257, 8))],
        "MISC_ARGS": MISC_ARGS,
    }


def deepseek_r1(root: Path, folder: Path, model_args: list[str]) -> dict[str, list[str]]:
    """``scripts/run-deepseek-r1.sh`` (PP 4 / CP 4 / EP 32 / TP 8 -> 2 / 1 / 2 / 1 on 4 GPUs)."""
    return {
        "LAUNCH": ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "4", "--colocate"],
        "MODEL_ARGS": model_args,
        "CKPT_ARGS": _ckpt_args(folder, root, "deepseek_v3", save=True),
        "ROLLOUT_ARGS": _rollout_args(root, 128, 8, 32768, "--over-sampling-batch-size", "256",
                                      "--dynamic-sampling-filter-path", SLIME_FILTER, "--num-steps-per-rollout", "4",
                                      "--balance-data"),
        "EVAL_ARGS": _eval_args(root, True, 8, 32768),
        "PERF_ARGS": _perf_args(1, 2, 1, 2, 16384, "--decoder-last-pipeline-num-layers", "1"),
        "GRPO_ARGS": GRPO_ARGS,
        "OPTIMIZER_ARGS": [*OPTIMIZER_ARGS, *CPU_OPTIMIZER_ARGS],
        "WANDB_ARGS": [],
        "SGLANG_ARGS": ["--rollout-num-gpus-per-engine", "4", "--sglang-mem-fraction-static", "0.7",
                        "--sglang-enable-ep-moe", "--sglang-enable-dp-attention", "--sglang-dp-size", "2",
                        "--sglang-moe-dense-tp-size", "1", "--sglang-enable-dp-lm-head", "--sglang-disable-radix-cache",
                        "--sglang-enable-deepep-moe", "--sglang-deepep-mode", "auto", "--sglang-server-concurrency", "1024"],
        "MISC_ARGS": [*MISC_ARGS, "--moe-enable-deepep", "--moe-token-dispatcher-type", "flex"],
    }


def glm45_355b(root: Path, folder: Path, model_args: list[str]) -> dict[str, list[str]]:
    """``scripts/run-glm4.5-355B-A32B.sh`` (TP 8 / PP 4 / CP 2 / EP 16 -> 2 / 1 / 1 / 2 on 2 GPUs)."""
    return {
        "LAUNCH": ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--colocate",
                   "--save-debug-rollout-data", str(root / "glm_data.pt")],
        "MODEL_ARGS": model_args,
        "CKPT_ARGS": _ckpt_args(folder, root, "glm4_moe", save=False),
        "ROLLOUT_ARGS": _rollout_args(root, 128, 8, 32768, "--over-sampling-batch-size", "256",
                                      "--dynamic-sampling-filter-path", SLIME_FILTER, "--num-steps-per-rollout", "4",
                                      "--balance-data", "--rollout-stop-token-ids", "120", "121", "122"),
        "EVAL_ARGS": _eval_args(root, True, 8, 32768),
        "PERF_ARGS": _perf_args(2, 1, 1, 2, 16384),
        "GRPO_ARGS": ["--advantage-estimator", "gspo", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
                      "--kl-coef", "0.00", "--entropy-coef", "0.00", "--eps-clip", "1e-4", "--eps-clip-high", "2e-4",
                      "--use-tis"],
        "OPTIMIZER_ARGS": [*OPTIMIZER_ARGS, *CPU_OPTIMIZER_ARGS],
        "WANDB_ARGS": [],
        "SGLANG_ARGS": ["--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7",
                        "--sglang-enable-dp-attention", "--sglang-dp-size", "2"],
        "MISC_ARGS": MISC_ARGS,
    }


#: the scripts whose sizes reduce to a CPU run (one process, no model parallelism); DeepSeek-R1's
#: --decoder-last-pipeline-num-layers asks for pipeline stages, which one process has not
REDUCIBLE = ("qwen3", "qwen3_moe", "glm4_moe")
SCRIPTS = {"qwen3": qwen3_4b, "qwen3_moe": qwen3_30b_a3b, "deepseek_v3": deepseek_r1, "glm4_moe": glm45_355b}
ORDER = ["LAUNCH", "MODEL_ARGS", "CKPT_ARGS", "ROLLOUT_ARGS", "OPTIMIZER_ARGS", "GRPO_ARGS", "WANDB_ARGS", "PERF_ARGS",
         "EVAL_ARGS", "SGLANG_ARGS", "MISC_ARGS"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``(root, {name: (folder, MODEL_ARGS)})``: tiny checkpoints (model, tokenizer) and data files."""
    root = tmp_path_factory.mktemp("slime-scripts")
    records = [{"prompt": f"{a}+{a}=", "label": str(2 * a)} for a in range(4)]
    for name in ("dapo.jsonl", "aime.jsonl"):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    built = {}
    for name, (build, model_args) in MODELS.items():
        hf = build(root / name)
        _tiny_tokenizer(root / name)
        if name in REDUCIBLE:  # these train on CPU: they need weights
            _save_weights(root / name)
        built[name] = (root / name, model_args(hf))
    return root, built


def _save_weights(folder: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)


def _tiny_tokenizer(folder: Path) -> None:
    """A 128-token word-level tokenizer with a chat template (the tiny configs' vocab size)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for i in range(125):
        vocab[chr(33 + i) if 33 + i < 127 else f"w{i}"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(folder)


def script_argv(checkpoints, name: str) -> list[str]:
    root, built = checkpoints
    folder, model_args = built[name]
    arrays = SCRIPTS[name](root, folder, model_args)
    return [arg for key in ORDER for arg in arrays[key]]


def run_miles(argv: list[str], capsys) -> tuple[int, str]:
    """``miles run ARGV``: exit code and stderr (argparse's own errors exit 2)."""
    try:
        code = main(["run", *argv])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def refused_flags(err: str) -> list[str]:
    """The flags argparse did not know (``unrecognized arguments: ...``)."""
    found = re.search(r"unrecognized arguments: (.*)", err)
    return [word for word in found.group(1).split() if word.startswith("--")] if found else []


@pytest.fixture
def sglang_installed(monkeypatch):
    """slime's scripts run where SGLang is installed: the servers the sglang backend launches (picked
    by ``--rollout-num-gpus-per-engine N > 1``) are real SGLang with tensor parallel size N. Here,
    without SGLang, they would be ``miles serve`` (one GPU each), which the dry run refuses with
    "install SGLang" (tests/host/test_backend_choice.py)."""
    monkeypatch.setattr("miles_sglang.launcher.server_kind", lambda config: "sglang")


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_slime_script_passes_dry_run(checkpoints, name, capsys, sglang_installed):
    code, err = run_miles([*script_argv(checkpoints, name), "--dry-run"], capsys)
    refused = refused_flags(err)
    assert not refused, f"{name}: flags still refused: {' '.join(refused)}"
    assert code == 0, f"{name}: the dry run stopped:\n{err[-3000:]}"
    assert "roll out with --rollout-backend sglang" in err  # slime's engines: SGLang, tensor parallel


async def slime_parity_reward(args, sample, **kwargs):
    """A slime-contract reward: the parity of the last response token."""
    return float(sample.tokens[-1] % 2)


def reduced(argv: list[str], root: Path, out: str, **values: str) -> list[str]:
    """A script with its sizes reduced to a CPU run of 2 steps: every flag stays; ``values``
    replace more (``lr="0.01"`` for ``--lr``)."""
    sizes = {"--num-rollout": "2", "--rollout-batch-size": "2", "--n-samples-per-prompt": "2",
             "--rollout-max-response-len": "4", "--global-batch-size": "4", "--eval-max-response-len": "4",
             "--n-samples-per-eval-prompt": "1", "--eval-interval": "1", "--save-interval": "1",
             "--max-tokens-per-gpu": "64", "--tensor-model-parallel-size": "1", "--actor-num-gpus-per-node": "1",
             "--rollout-num-gpus-per-engine": "1", "--expert-model-parallel-size": "1",
             "--pipeline-model-parallel-size": "1",
             "--over-sampling-batch-size": "4",
             "--load": str(root / f"{out}_ckpt"), "--save": str(root / f"{out}_ckpt"),
             **{"--" + key.replace("_", "-"): value for key, value in values.items()}}
    argv = list(argv)
    for flag, value in sizes.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
    # one CPU process: no GPUs to share; Megatron turns sequence parallelism off at TP 1 itself
    drop = {"--colocate", "--sequence-parallel"}
    # a random tiny model earns no deepscaler reward: a slime-contract reward gives the filters and
    # the loss a signal (it takes precedence over --rm-type)
    return [a for a in argv if a not in drop] + ["--device", "cpu", "--output-dir", str(root / out),
                                                 "--custom-rm-path", f"{__name__}.slime_parity_reward"]


def _train_metrics(folder: Path) -> list[dict]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "train/loss" in r]


@pytest.mark.parametrize("name", REDUCIBLE)
def test_reducible_script_trains_on_cpu(checkpoints, name, capsys):
    """A reducible script end to end: 2 rollouts, metrics, and (with --save) a checkpoint each."""
    root, _ = checkpoints
    argv = reduced(script_argv(checkpoints, name), root, f"{name}_out")
    code, err = run_miles(argv, capsys)
    assert not refused_flags(err), f"{name}: flags still refused: {' '.join(refused_flags(err))}"
    assert code == 0, err[-3000:]
    assert 1 <= len(_train_metrics(root / f"{name}_out")) <= 2 * 4  # --num-steps-per-rollout 4 in some
    if "--load" in argv:
        assert "no checkpoint there yet; starting fresh" in err  # the script's --load was empty
        assert (root / f"{name}_out_ckpt" / "latest_checkpointed_iteration.txt").exists()


def test_cpu_offloaded_optimizer_trains_as_the_device_one(checkpoints, capsys):
    """The Qwen3 script with the 30B-A3B script's OPTIMIZER_ARGS (--optimizer-cpu-offload ...): the same
    losses and gradient norms as without them (the step on CPU master copies is AdamW's)."""
    root, built = checkpoints
    plain_arrays = qwen3_4b(root, *built["qwen3"])
    runs = {}
    for label, optimizer_args in (("plain", OPTIMIZER_ARGS), ("offload", [*OPTIMIZER_ARGS, *CPU_OPTIMIZER_ARGS])):
        arrays = {**plain_arrays, "OPTIMIZER_ARGS": optimizer_args}
        argv = reduced([a for key in ORDER for a in arrays[key]], root, f"qwen3_{label}", lr="0.01", num_rollout="3")
        code, err = run_miles(argv, capsys)
        assert code == 0, err[-3000:]
        runs[label] = _train_metrics(root / f"qwen3_{label}")
    assert any(step["train/grad_norm"] > 0 for step in runs["plain"])  # the steps moved the weights
    for plain, offload in zip(runs["plain"], runs["offload"], strict=True):
        for key in ("train/loss", "train/grad_norm"):
            assert offload[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("backend, message", [
    ("native", None),
    ("fsdp", "--optimizer-cpu-offload with --train-backend fsdp: the FSDP2 trainer"),
    ("megatron", None),
])
def test_cpu_offload_accepted_or_refused_before_the_run(checkpoints, backend, message, capsys):
    root, built = checkpoints
    arrays = {**qwen3_4b(root, *built["qwen3"]), "OPTIMIZER_ARGS": [*OPTIMIZER_ARGS, *CPU_OPTIMIZER_ARGS]}
    argv = reduced([a for key in ORDER for a in arrays[key]], root, f"qwen3_{backend}")
    code, err = run_miles([*argv, "--train-backend", backend, "--dry-run"], capsys)
    if message is None:
        assert code == 0, err[-2000:]
    else:
        assert code == 2 and message in err, err[-2000:]
