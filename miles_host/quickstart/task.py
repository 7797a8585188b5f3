"""The quickstart task: two-digit addition with a carry.

Every prompt is ``"AB+CD="`` with two 2-digit numbers whose units digits carry
(``B + D >= 10``); the answer is the decimal sum, e.g. ``"37+45="`` -> ``"82"``.
Responses end with the tokenizer's EOS; the checker compares the stripped
response with the label.

The shipped base policy (``miles_host/quickstart/model``) was fine-tuned on labels
where the carry was *forgotten* most of the time (``37+45=`` -> ``72``), so it
knows the format and the arithmetic but usually drops the carry: sampled
accuracy is low while the right answer is often among 8 samples. GRPO with an
exact-match reward teaches it to carry.

Split: all 3,645 carrying pairs are shuffled once with a fixed seed; the first
:data:`EVAL_POOL_SIZE` form the eval pool, the rest the train pool. The two pools
are disjoint, so eval prompts are never seen in SFT or RL training.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable

SPLIT_SEED = 1234
EVAL_POOL_SIZE = 400
CARRY_FORGET_PROB = 0.65  # default label corruption for the base-model SFT


def format_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer(a: int, b: int) -> str:
    return str(a + b)


def forgot_carry_answer(a: int, b: int) -> str:
    """The typical mistake: the units carry is dropped (37+45 -> 72)."""
    return str(a + b - 10)


def all_pairs() -> list[tuple[int, int]]:
    """Every (a, b) with 10 <= a, b <= 99 whose units digits carry."""
    return [(a, b) for a in range(10, 100) for b in range(10, 100) if a % 10 + b % 10 >= 10]


def split_pairs() -> dict[str, list[tuple[int, int]]]:
    """Deterministic, disjoint ``{"train": [...], "eval": [...]}`` pools."""
    pairs = all_pairs()
    random.Random(SPLIT_SEED).shuffle(pairs)
    return {"eval": pairs[:EVAL_POOL_SIZE], "train": pairs[EVAL_POOL_SIZE:]}


def make_record(a: int, b: int) -> dict:
    return {"input": format_prompt(a, b), "label": answer(a, b)}


def make_prompts(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` records ``{"input", "label"}`` from ``split``'s pool (no repeats
    while ``n`` <= pool size; the pool is cycled beyond that). Same seed, same
    records."""
    pool = list(split_pairs()[split])
    rng = random.Random(f"{split}:{seed}")
    out: list[dict] = []
    while len(out) < n:
        rng.shuffle(pool)
        out.extend(make_record(a, b) for a, b in pool[: n - len(out)])
    return out


def parse_prompt(prompt: str) -> tuple[int, int]:
    left, right = prompt.strip().rstrip("=").split("+")
    return int(left), int(right)


def check_answer(response: str, label) -> bool:
    """Exact match after stripping whitespace (and a trailing EOS string)."""
    text = response.replace("<eos>", "").strip()
    return text == str(label).strip()


def reward(response: str, label) -> float:
    return float(check_answer(response, label))


def write_jsonl(records: Iterable[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open() as handle:
        return [json.loads(line) for line in handle if line.strip()]
