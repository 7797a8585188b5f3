"""slime's ``gpqa`` reward: multiple choice, 1.0 when the chosen option is the right one.

The right letter comes from ``metadata["correct_letter"]``, else a one-letter label, an
integer label (index into the valid letters), or a label equal (letters and digits,
lower case) to one of ``metadata["choices"]`` (a list or a dict's values). The valid letters
are ``metadata["valid_letters"]``, else A.. for the number of choices, else A-J. The chosen
letter is read from the text after the last ``</think>``: "answer/option/choice (is|:) X",
"X is (the) correct", "final answer/option (is|:) X", else the last standalone valid capital.
Without a letter to compare, a response containing the right answer's text scores 1.
"""

from __future__ import annotations

import re
import string
from typing import Any, Iterable

DEFAULT_VALID_LETTERS = list(string.ascii_uppercase[:10])
_PATTERNS = (
    r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])",
    r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)",
    r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])",
)


def strip_chain_of_thought(text: str | None) -> str:
    """The text after the last ``</think>`` (all of it without one)."""
    return (text or "").rsplit("</think>", 1)[-1]


def normalize_text(text: str) -> str:
    """Lower case, runs of anything but letters and digits as one space."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def extract_letter(response: str | None, valid_letters: Iterable[str]) -> str | None:
    """The option letter the response chose, or None."""
    if not response:
        return None
    text = strip_chain_of_thought(response)
    valid = {letter.upper() for letter in valid_letters}
    for pattern in _PATTERNS:
        match = re.search(pattern, text, flags=re.IGNORECASE)
        if match and match.group(1).upper() in valid:
            return match.group(1).upper()
    for letter in reversed(re.findall(r"\b([A-Z])\b", text)):
        if letter in valid:
            return letter
    return None


def compute_gpqa_reward(response: str | None, label: Any, metadata: dict | None = None) -> float:
    """1.0 or 0.0 (see the module docstring)."""
    if response is None:
        return 0.0
    metadata = metadata if metadata is not None else {}
    choices = metadata.get("choices")
    choices = list(choices.values()) if isinstance(choices, dict) else (list(choices) if choices is not None else None)
    if metadata.get("valid_letters"):
        valid = [str(letter).upper() for letter in metadata["valid_letters"]]
    else:
        valid = list(string.ascii_uppercase[: len(choices)]) if choices else DEFAULT_VALID_LETTERS
    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None
    label_text = None
    if isinstance(label, str):
        label_text = label.strip()
        if len(label_text) == 1 and label_text.upper() in valid and not correct:
            correct = label_text.upper()
    elif isinstance(label, (int, float)) and not isinstance(label, bool) and 0 <= int(label) < len(valid):
        correct = valid[int(label)]
    if not correct and choices and label_text:
        for index, choice in enumerate(choices):
            if normalize_text(str(choice)) == normalize_text(label_text):
                correct = valid[index]
                metadata.setdefault("correct_answer", choice)
                break
    chosen = extract_letter(response, valid)
    if chosen and correct:
        return float(chosen == correct)
    targets = []
    if correct and choices and correct in valid and valid.index(correct) < len(choices):
        targets.append(str(choices[valid.index(correct)]))
    targets += [str(metadata[key]) for key in ("correct_answer", "answer_text") if metadata.get(key)]
    if label_text:
        targets.append(label_text)
    said = normalize_text(strip_chain_of_thought(response))
    if any(normalize_text(target) and normalize_text(target) in said for target in targets):
        return 1.0
    if chosen and not correct and label_text:
        return float(chosen == label_text.upper())
    return 0.0
