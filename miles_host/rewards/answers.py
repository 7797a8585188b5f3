"""Answer extraction and comparison for the built-in rewards.

- ``math``: the last ``\\boxed{...}`` of the response (``\\fbox{...}`` when there is no
  ``\\boxed``, as slime's ``last_boxed_only_string``), checked against the label with
  the math-verify package when installed (symbolic equivalence), else by a
  normalised string comparison.
- ``deepscaler``: the solution after ``</think>``, or else after the first
  ``###Response`` (up to the next one), DeepScaleR's two formats as slime reads them;
  then as math. No marker, or an empty label: 0.
- ``f1``: token-level F1 between response and label (SQuAD style).
- ``exact``: normalised exact match of the stripped response.

A response of ``None`` (a custom generate function that produced no text) scores 0.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

try:  # optional: symbolic equivalence
    import math_verify
except ImportError:  # pragma: no cover - exercised where math-verify is absent
    math_verify = None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), else of the last
    ``\\fbox{...}``, or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for position in range(brace, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : position]
    return None


_DROP_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation, articles and extra spaces (SQuAD's rule); linear
    in the length of ``text``."""
    text = text.lower().translate(_DROP_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _normalize_math(text: str) -> str:
    text = text.strip().strip("$").replace(" ", "").replace("\\!", "")
    text = re.sub(r"\\text\{(.*?)\}", r"\1", text)
    text = text.replace("\\left", "").replace("\\right", "").replace("dfrac", "frac")
    return text.rstrip(".")


def math_equal(predicted: str, label: Any) -> bool:
    """True when ``predicted`` equals the label mathematically."""
    label_text = str(label)
    if _normalize_math(predicted) == _normalize_math(label_text):
        return True
    if math_verify is not None:
        try:
            gold = math_verify.parse(f"${label_text}$")
            answer = math_verify.parse(f"${predicted}$")
            return bool(gold) and bool(answer) and bool(math_verify.verify(gold, answer))
        except Exception:  # math-verify raises on unparsable input: not equal
            return False
    return False


def math_reward(response: str | None, label: Any) -> float:
    """1.0 when the last boxed answer equals the label, else 0.0."""
    if response is None:
        return 0.0
    answer = last_boxed(response)
    return float(answer is not None and math_equal(answer, label))


def deepscaler_reward(response: str | None, label: Any) -> float:
    """DeepScaleR: math on the part after ``</think>``, or else on the part after the first
    ``###Response``; 0 without either marker or with an empty label."""
    if response is None or str(label) == "":
        return 0.0
    if "</think>" in response:
        return math_reward(response.split("</think>")[-1], label)
    if "###Response" in response:
        return math_reward(response.split("###Response")[1], label)
    return 0.0


def f1_reward(response: str | None, label: Any) -> float:
    """Token F1 between the normalised response and label (0 for no response)."""
    if response is None:
        return 0.0
    predicted = normalize_answer(response).split()
    gold = normalize_answer(str(label)).split()
    common = Counter(predicted) & Counter(gold)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(predicted), overlap / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_reward(response: str | None, label: Any) -> float:
    """1.0 when the normalised response equals the normalised label."""
    if response is None:
        return 0.0
    return float(normalize_answer(response) == normalize_answer(str(label)))
