"""slime's ``dapo`` reward: DAPO's math scorer (Minerva-style answer matching).

Only the last 300 characters of the response are read. By default the answer is the text
after the last ``Answer:`` (up to the line end), normalised by :func:`normalize_final_answer`
and compared with the normalised label read as an integer (DAPO's answers are integers);
with ``strict_box_verify`` it is the last ``\\boxed{}`` of the last 100 characters, compared
literally. The reward is ``{"score": 1.0 | -1.0, "acc": bool, "pred": str}``.
"""

from __future__ import annotations

import re


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` with balanced braces (no ``\\fbox`` fallback), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for position in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if text[position] == "}" and depth == 0:
            return text[start : position + 1]
    return None


def remove_boxed(text: str) -> str:
    """The content of ``\\boxed{content}``; AssertionError ("box error") otherwise."""
    prefix = "\\boxed{"
    assert text[: len(prefix)] == prefix and text[-1:] == "}", f"box error: {text}"
    return text[len(prefix) : -1]


#: replaced in order before the removals
SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
#: units, words and end-of-text markers deleted from the answer
REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
    "<|im_end|>", "<|endoftext|>",
)


def normalize_final_answer(answer) -> str:
    """The part after the last ``=``, substitutions and removals applied, the inside of
    ``$...$``, ``\\text{}``, ``\\textbf{}``, ``\\overline{}``, ``\\boxed{}`` kept,
    ``fracab`` -> ``frac{a}{b}``, ``sqrta`` -> ``sqrt{a}``, thousands commas of an
    integer dropped."""
    answer = str(answer).split("=")[-1]
    for old, new in SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for removed in REMOVED_EXPRESSIONS:
        answer = answer.replace(removed, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", answer)
    for command in ("text", "textbf", "overline"):
        answer = re.sub(rf"(\\{command}\{{)(.*?)(\}})", r"\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def is_correct_minerva(solution: str, truth, truth_needs_extract: bool = False,
                       answer_pattern: str = r"(?i)Answer\s*:\s*([^\n]+)") -> tuple[bool, str]:
    """(correct, normalised prediction): the last ``Answer: ...`` against the integer label."""
    matches = re.findall(answer_pattern, solution)
    predicted = normalize_final_answer(matches[-1] if matches else "[INVALID]")
    truth = str(truth)
    if truth_needs_extract:
        truth = remove_boxed(last_boxed_only_string(truth))
    truth = str(int(float(normalize_final_answer(truth))))
    return predicted == truth, predicted


def is_correct_strict_box(prediction: str, truth, pause_tokens_index: list[int] | None = None) -> tuple[int, str | None]:
    """(1 or -1, boxed prediction): the last boxed answer of the final 100 characters (from
    100 before the last pause token when given) equal to the label."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index holds 4 indices, got {pause_tokens_index}")
        prediction = prediction[pause_tokens_index[-1] - 100 :]
    else:
        prediction = prediction[-100:]
    boxed = last_boxed_only_string(prediction)
    extracted = remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == truth else -1), extracted


def verify(solution: str, answer, strict_box_verify: bool = False,
           pause_tokens_index: list[int] | None = None) -> tuple[bool, str | None]:
    """(correct, prediction) by the strict-box or the Minerva rule."""
    if strict_box_verify:
        score, predicted = is_correct_strict_box(solution, answer, pause_tokens_index)
        return score == 1, predicted
    return is_correct_minerva(solution, answer)


def compute_score(solution: str | None, truth, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict:
    """``{"score": 1.0 or -1.0, "acc": correct, "pred": prediction}`` from the last 300 characters."""
    correct, predicted = verify((solution or "")[-300:], truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": predicted}
