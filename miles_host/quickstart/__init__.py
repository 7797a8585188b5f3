"""Assets for ``miles run`` with no arguments: a CPU RL quickstart.

- :mod:`miles_host.quickstart.task`: the task (two-digit addition with a carry),
  the deterministic train/eval split and the exact-match checker.
- :mod:`miles_host.quickstart.tokenizer`: the character-level tokenizer.
- ``model/``: the tiny Qwen3 base policy (HF directory), made by
  ``scripts/make_quickstart_model.py``.
- ``data/train.jsonl``, ``data/eval.jsonl``: records ``{"input", "label"}``.
"""

from pathlib import Path

QUICKSTART_DIR = Path(__file__).resolve().parent
MODEL_DIR = QUICKSTART_DIR / "model"
DATA_DIR = QUICKSTART_DIR / "data"
TRAIN_PATH = DATA_DIR / "train.jsonl"
EVAL_PATH = DATA_DIR / "eval.jsonl"

__all__ = ["DATA_DIR", "EVAL_PATH", "MODEL_DIR", "QUICKSTART_DIR", "TRAIN_PATH"]
