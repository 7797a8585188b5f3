"""``miles run`` with no model and no data: the shipped quickstart.

A tiny policy (``miles_host/quickstart/model``, made by
``scripts/make_quickstart_model.py``) learns two-digit addition with carry by
GRPO with an exact-match reward, on a laptop CPU in a few minutes; eval accuracy
is printed at the start and the end. Any flag given on the command line
overrides the preset.
"""

from __future__ import annotations

from pathlib import Path

QUICKSTART_DIR = Path(__file__).resolve().parent / "quickstart"

#: flags that mean "the user brings their own run": the preset is not applied then
OWN_RUN_FLAGS = ("--hf-checkpoint", "--prompt-data", "--config")


def wants_quickstart(argv: list[str]) -> bool:
    """True when ``argv`` names no model, no data and no config file."""
    return not any(arg == flag or arg.startswith(flag + "=") for arg in argv for flag in OWN_RUN_FLAGS)


def quickstart_defaults() -> dict:
    """Flag values (by dest) of the quickstart run."""
    data = QUICKSTART_DIR / "data"
    return {
        "hf_checkpoint": str(QUICKSTART_DIR / "model"),
        "prompt_data": str(data / "train.jsonl"),
        "input_key": "input",
        "label_key": "label",
        "rm_type": "exact",
        "advantage_estimator": "grpo",
        "rollout_batch_size": 16,
        "n_samples_per_prompt": 8,
        "rollout_max_response_len": 6,
        "rollout_temperature": 1.0,
        "rollout_shuffle": True,
        "num_rollout": 30,
        "lr": 5e-4,
        "adam_beta2": 0.98,
        "micro_batch_size": 128,
        "eval_prompt_data": ["addition", str(data / "eval.jsonl")],
        "eval_interval": 5,
        "eval_temperature": 0.0,
        "device": "cpu",
        "dtype": "float32",
    }
