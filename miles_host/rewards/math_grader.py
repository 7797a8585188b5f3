"""The Hendrycks-MATH answer grader that slime's ``math`` and ``deepscaler`` rewards use.

An answer is right when, after the normalisations below, it equals the ground truth as a
string (:func:`grade_answer_mathd`) or as a sympy expression (:func:`grade_answer_sympy`):

- :func:`last_boxed_only_string`: the last ``\\boxed{...}`` (else ``\\fbox{...}``) with
  balanced braces, wrapper included; :func:`remove_boxed` strips a ``\\boxed{`` wrapper
  (None when the text is not one).
- :func:`strip_string` (the "mathd" normalisation): drops ``\\left``/``\\right``, degrees,
  ``\\$``, ``\\%``, a trailing unit ``\\text{ ...}``, spaces; ``tfrac``/``dfrac`` become
  ``frac``; ``\\frac12`` becomes ``\\frac{1}{2}``, ``\\sqrt2`` ``\\sqrt{2}``; a leading ``.``
  gets a 0, ``0.5`` becomes ``\\frac{1}{2}``, ``a/b`` of integers ``\\frac{a}{b}``;
  ``x = v`` (a name of at most two characters) becomes ``v``.
- :func:`normalize_for_sympy`: units, ``$``/``%`` and words such as "million" handled,
  LaTeX turned into plain expressions, lower case; tuples and intervals are compared
  element by element, integer fractions only literally (``2/4`` is not ``1/2``), and an
  expression with more than two unknown letters or large powers is never simplified.
"""

from __future__ import annotations

import re

import sympy
from sympy.parsing import sympy_parser


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` (or, without one, ``\\fbox{...}``), braces balanced; None
    when there is none or it never closes."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    if start < 0:
        return None
    depth = 0
    for position in range(start, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start : position + 1]
    return None


def remove_boxed(text: str | None) -> str | None:
    """The content of ``\\boxed{content}``; None when ``text`` is not of that form."""
    prefix = "\\boxed{"
    if not isinstance(text, str) or not text.startswith(prefix) or not text.endswith("}"):
        return None
    return text[len(prefix) : -1]


def extract_boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{}``."""
    boxed = last_boxed_only_string(text)
    return None if boxed is None else remove_boxed(boxed)


def extract_answer(text: str | None) -> str | None:
    """:func:`extract_boxed_answer` when ``text`` holds ``\\boxed``, else None."""
    if not text or "\\boxed" not in text:
        return None
    return extract_boxed_answer(text)


# ---- the "mathd" string normalisation -------------------------------------------------

def _expand_fracs(text: str) -> str:
    parts = text.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{"):
            out += part
            continue
        if len(part) < 2:
            return text
        numerator, second, rest = part[0], part[1], part[2:]
        out += "{" + numerator + "}" + (second + rest if second == "{" else "{" + second + "}" + rest)
    return out


def _integer_slash(text: str) -> str:
    match = re.fullmatch(r"(-?\d+)/(-?\d+)", text)
    if match is None or text != f"{int(match.group(1))}/{int(match.group(2))}":
        return text
    return "\\frac{" + match.group(1) + "}{" + match.group(2) + "}"


def _expand_sqrt(text: str) -> str:
    parts = text.split("\\sqrt")
    out = parts[0]
    for part in parts[1:]:
        out += "\\sqrt" + (part if part.startswith("{") or not part else "{" + part[0] + "}" + part[1:])
    return out


def strip_string(text: str) -> str:
    """The mathd normalisation of an answer (see the module docstring)."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        text = text.replace(old, new)
    if "\\text{ " in text:  # a unit after the value
        pieces = text.split("\\text{ ")
        if len(pieces) != 2:
            raise ValueError("more than one unit")
        text = pieces[0]
    text = text.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text.startswith("."):
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        text = sides[1]
    text = _expand_sqrt(text).replace(" ", "")
    text = _expand_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _integer_slash(text)


def mathd_normalize_answer(answer: str | None) -> str | None:
    """``\\text{...}`` around the whole answer unwrapped, then :func:`strip_string`."""
    if answer is None:
        return None
    answer = answer.strip()
    whole_text = re.fullmatch(r"\\text\{(.+?)\}", answer)
    if whole_text is not None:
        answer = whole_text.group(1).strip()
    try:
        return strip_string(answer)
    except (ValueError, IndexError):
        return answer


def grade_answer_mathd(given: str, truth: str) -> bool:
    """Equal after :func:`mathd_normalize_answer`."""
    return mathd_normalize_answer(truth) == mathd_normalize_answer(given)


# ---- the sympy comparison -------------------------------------------------------------

_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week",
          "month", "year", "foot", "feet", "inch", "yard")
_TUPLE_CHARS = "()[]"


def _braced(text: str, start: int) -> tuple[str, int]:
    """The group ``{...}`` (or single character) at ``start``, and the index after it."""
    while start < len(text) and text[start] == " ":
        start += 1
    if start >= len(text):
        return "", start
    if text[start] != "{":
        return text[start], start + 1
    depth = 0
    for position in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[start + 1 : position], position + 1
    return text[start + 1 :], len(text)


def _simple(text: str) -> bool:
    return re.fullmatch(r"-?[\w.]+", text) is not None


def latex_to_plain(text: str) -> str:
    """A LaTeX answer as a plain expression: ``\\frac{a}{b}`` -> ``a/b`` (parenthesised
    when not a single number or name), ``\\sqrt{x}`` -> ``sqrt(x)``, ``\\pi`` -> ``pi``,
    ``\\cdot``/``\\times`` -> ``*``, ``\\infty`` -> ``inf``, ``\\cup`` -> ``U``; other
    commands lose their backslash."""
    out, position = [], 0
    while position < len(text):
        if text.startswith("\\frac", position):
            numerator, position = _braced(text, position + 5)
            denominator, position = _braced(text, position)
            numerator, denominator = latex_to_plain(numerator), latex_to_plain(denominator)
            wrap = lambda part: part if _simple(part) else f"({part})"  # noqa: E731
            out.append(f" {wrap(numerator)}/{wrap(denominator)}")
        elif text.startswith("\\sqrt", position):
            radicand, position = _braced(text, position + 5)
            out.append(f"sqrt({latex_to_plain(radicand)})")
        elif text[position] == "\\":
            match = re.match(r"\\([A-Za-z]+|.)", text[position:])
            name = match.group(1)
            position += len(match.group(0))
            out.append({"pi": "pi", "cdot": "*", "times": "*", "infty": "inf", "cup": "U", "left": "",
                        "right": "", "text": "", "mathrm": "", ",": "", "!": "", " ": " "}.get(name, name))
        else:
            out.append(text[position])
            position += 1
    return "".join(out).strip()


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _strip_thousands_commas(text: str) -> str:
    while True:
        updated = re.sub(r"(\d),(\d\d\d)($|\D)", r"\1\2\3", text)
        if updated == text:
            return text
        text = updated


def _str_is_int(text: str) -> bool:
    try:
        value = float(_strip_thousands_commas(text))
    except ValueError:
        return False
    return abs(value - round(value)) <= 1e-7


def normalize_for_sympy(expr: str | None) -> str | None:
    """The normalisation before the sympy comparison (see the module docstring)."""
    if expr is None:
        return None
    whole_text = re.fullmatch(r"\\text\{(.+?)\}", expr)
    if whole_text is not None:
        expr = whole_text.group(1)
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNITS:
        expr = re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_number(expr) and abs(float(expr) - round(float(expr))) <= 1e-7:
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        expr = latex_to_plain(expr)
    expr = re.sub("- *", "-", expr)
    expr = re.sub("([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number: 7 3/4 -> 7+3/4
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _str_is_int(expr):
        expr = str(int(float(_strip_thousands_commas(expr).replace(",", ""))))
    return expr


def _may_evaluate(expr: str) -> bool:
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr:
        return False
    return re.search(r"\^[0-9]+\^", expr) is None and re.search(r"\^[0-9][0-9]+", expr) is None


def are_equal_under_sympy(truth: str, given: str) -> bool:
    """Whether ``truth - given`` simplifies to 0 (False when it cannot be parsed)."""
    expr = f"({truth})-({given})"
    if not _may_evaluate(expr):
        return False
    names = {k: v for k, v in vars(sympy).items() if not k.startswith("_")}
    try:
        parsed = sympy_parser.parse_expr(
            expr.replace("^", "**"), local_dict={}, global_dict={"__builtins__": {}, **names},
            transformations=sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,),
        )
        return sympy.simplify(parsed) == 0
    except Exception:  # noqa: BLE001 - an unparsable answer is not equal
        return False


def _is_frac(text: str) -> bool:
    return re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", text) is not None


def _elements(expr: str) -> list[str]:
    expr = _strip_thousands_commas(expr)
    if not expr:
        return []
    inner = expr[1:-1]
    if len(expr) > 2 and expr[0] in _TUPLE_CHARS and expr[-1] in _TUPLE_CHARS and not any(c in inner for c in _TUPLE_CHARS):
        return [element.strip() for element in inner.split(",")]
    return [expr]


def grade_answer_sympy(given: str, truth: str) -> bool:
    """Equal after :func:`normalize_for_sympy`, as strings or element by element under sympy."""
    truth_norm, given_norm = normalize_for_sympy(truth), normalize_for_sympy(given)
    if truth_norm is None:
        return False
    if truth_norm == given_norm:
        return True
    if not given_norm:
        return False
    truth_elements, given_elements = _elements(truth_norm), _elements(given_norm)
    if len(truth_elements) > 1 and (truth_norm[0] != given_norm[0] or truth_norm[-1] != given_norm[-1]):
        return False  # ( versus [ of an interval
    if len(truth_elements) != len(given_elements):
        return False
    for truth_element, given_element in zip(truth_elements, given_elements):
        if _is_frac(truth_element) and _is_frac(given_element):
            equal = truth_element == given_element
        elif _str_is_int(truth_element) != _str_is_int(given_element):
            equal = False
        else:
            equal = are_equal_under_sympy(truth_element, given_element)
        if not equal:
            return False
    return True


def grade_answer_verl(solution: str | None, ground_truth) -> bool:
    """slime's ``math`` reward: the last boxed answer of ``solution`` against the ground truth
    (itself unboxed when it holds ``\\boxed``); False without a boxed answer or a truth."""
    if not ground_truth or solution is None:
        return False
    truth = str(ground_truth)
    if "\\boxed" in truth:
        truth = extract_answer(truth)
    given = extract_answer(solution)
    if given is None or truth is None:
        return False
    return grade_answer_mathd(given, truth) or grade_answer_sympy(given, truth)


def deepscaler_reward(response: str | None, label) -> int:
    """DeepScaleR: the boxed answer after ``</think>`` (or after the first ``###Response``)
    graded against the label; 0 without a marker, a boxed answer or a label."""
    if response is None:
        return 0
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0
    answer = extract_answer(solution)
    if answer is None or label == "" or label is None:
        return 0
    truth = str(label)
    if "\\boxed" in truth:
        truth = extract_answer(truth)
        if truth is None:
            return 0
    return int(grade_answer_mathd(answer, truth) or grade_answer_sympy(answer, truth))
