"""The calculator task: two-digit arithmetic (``37*45``), solved by calling a calculator tool.

Every prompt is ``A<op>B`` with two-digit ``A`` and ``B`` and ``op`` one of ``+ - *``; the
label is the exact result. The agent (:mod:`agent`) gives the model one tool,
``calculator(expression)``, and answers with the model's last reply. The model cannot
multiply two-digit numbers itself, so it is right only when it calls the calculator with
the right expression and copies the result.

The base policy (``make_policy.py``) was fine-tuned on conversations whose tool call
*confuses the operator* most of the time (``*`` written as ``+``, ``+`` as ``-``, ``-`` as
``*``): it knows the format, the tool and how to copy the answer, but usually computes the
wrong thing. RL with an exact-match reward teaches it to pass the operator it was given.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OPERATORS = "+-*"
#: the operator the base policy writes instead (with probability ``confuse_prob``)
CONFUSED = {"*": "+", "+": "-", "-": "*"}

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of two integers and + - or *.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}


def calculator(expression: str) -> str:
    """The tool: ``A<op>B`` -> the result as text, or an error message (never raises)."""
    text = expression.replace(" ", "")
    for position in range(1, len(text)):
        if text[position] in OPERATORS:
            left, op, right = text[:position], text[position], text[position + 1:]
            if left.lstrip("-").isdigit() and right.isdigit():
                a, b = int(left), int(right)
                return str({"+": a + b, "-": a - b, "*": a * b}[op])
    return f"error: cannot evaluate {expression!r}"


def problems(count: int, seed: int) -> list[tuple[int, str, int]]:
    """``count`` seeded problems ``(a, op, b)``."""
    rng = random.Random(seed)
    return [(rng.randint(10, 99), rng.choice(OPERATORS), rng.randint(10, 99)) for _ in range(count)]


def record(a: int, op: str, b: int) -> dict:
    """A data record: the prompt, the label and the tools (read by ``--tool-key tools``)."""
    return {"input": f"{a}{op}{b}", "label": calculator(f"{a}{op}{b}"), "tools": [CALCULATOR_TOOL]}


def write_data(directory: Path, n_train: int = 1000, n_eval: int = 100, seed: int = 0) -> tuple[Path, Path]:
    """``train.jsonl`` and ``eval.jsonl`` (disjoint seeds) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / "train.jsonl", directory / "eval.jsonl"
    for path, (count, offset) in zip(paths, ((n_train, 0), (n_eval, 1))):
        path.write_text("".join(json.dumps(record(*p)) + "\n" for p in problems(count, seed * 2 + offset)))
    return paths


if __name__ == "__main__":
    train, evaluation = write_data(Path(__file__).resolve().parent)
    print(f"wrote {train} and {evaluation}")
