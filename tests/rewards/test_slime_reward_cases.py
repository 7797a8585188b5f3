"""slime's reward test cases (its tests/test_rm_*.py), written as data, run on miles' rewards."""

from __future__ import annotations

import pytest

from miles_host.rewards import dapo, gpqa, hub, math_grader as mg

# ---- math_utils -----------------------------------------------------------------------
LAST_BOXED = [
    (r"first attempt \boxed{wrong}, final \boxed{42}", r"\boxed{42}"),
    (r"answer: \boxed{\frac{1}{2}}", r"\boxed{\frac{1}{2}}"),
    (r"answer: \fbox{7}", r"\fbox{7}"),
    ("plain text, no box", None),
    (r"start \boxed{never closes", None),
]
REMOVE_BOXED = [(r"\boxed{x+1}", "x+1"), (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"), ("not boxed at all", None), (None, None)]
STRIP_STRING = [
    (r"\frac12", r"\frac{1}{2}"), (r"\tfrac{1}{2}", r"\frac{1}{2}"), (r"\left(1\right)", "(1)"),
    (r"45^{\circ}", "45"), (r"45^\circ", "45"), (".7", "0.7"), ("0.5", r"\frac{1}{2}"), (".5", r"\frac{1}{2}"),
    ("3/4", r"\frac{3}{4}"), ("1 + 1", "1+1"),
]
MATHD_EQUAL = [(r"\frac{1}{2}", "0.5"), (r"\frac12", r"\frac{1}{2}"), (r"45^\circ", "45"), ("3/4", r"\frac{3}{4}")]
VERL = [(r"answer: \boxed{42}", r"\boxed{42}", True), ("just 42", "42", False), (r"\boxed{42}", "", False)]


@pytest.mark.parametrize("text,expected", LAST_BOXED)
def test_last_boxed_only_string(text, expected):
    assert mg.last_boxed_only_string(text) == expected


@pytest.mark.parametrize("text,expected", REMOVE_BOXED)
def test_remove_boxed_returns_none_on_malformed(text, expected):
    assert mg.remove_boxed(text) == expected


def test_extract_answer():
    assert mg.extract_boxed_answer(r"Solution: \boxed{42}") == "42"
    assert mg.extract_answer("just 42") is None


@pytest.mark.parametrize("raw,expected", STRIP_STRING)
def test_strip_string(raw, expected):
    assert mg.strip_string(raw) == expected


def test_mathd_normalize():
    assert mg.mathd_normalize_answer(r"\text{42}") == "42"
    assert mg.mathd_normalize_answer(None) is None


@pytest.mark.parametrize("given,truth", MATHD_EQUAL)
def test_grade_answer_mathd(given, truth):
    assert mg.grade_answer_mathd(given, truth) is True


def test_grade_answer_mathd_and_sympy_reject_and_accept():
    assert mg.grade_answer_mathd("42", "43") is False
    assert mg.grade_answer_sympy("x+1", "1+x") is True
    assert mg.grade_answer_sympy(r"\frac{2}{4}", r"\frac{1}{2}") is False  # integer fractions only literally


@pytest.mark.parametrize("solution,truth,expected", VERL)
def test_grade_answer_verl(solution, truth, expected):
    assert mg.grade_answer_verl(solution, truth) is expected


# ---- deepscaler -----------------------------------------------------------------------
DEEPSCALER = [
    (r"Let me reconsider. \boxed{99}</think>Final: \boxed{42}", "42", 1),
    (r"Scratch work \boxed{wrong}###Response\boxed{42}", "42", 1),
    (r"\boxed{42}", "42", 0),
    ("plain</think>no box here", "42", 0),
    (r"</think>\boxed{42}", "", 0),
    (r"</think>\boxed{42}", 42, 1),
    (r"</think>\boxed{42}", r"\boxed{42}", 1),
    (r"</think>\boxed{43}", "42", 0),
    (r"</think>\boxed{\frac{1}{2}}", "0.5", 1),
]


@pytest.mark.parametrize("response,label,expected", DEEPSCALER)
def test_deepscaler(response, label, expected):
    assert mg.deepscaler_reward(response, label) == expected
    assert hub.score("deepscaler", response, label) == expected


# ---- f1 -------------------------------------------------------------------------------
NORMALIZE = [("The Quick Brown Fox.", "quick brown fox"), ("An apple, a day", "apple day"), ("HELLO   WORLD", "hello world"),
             ("a.b,c!", "abc"), ("", ""), ("the", "")]
F1 = [
    ("Paris is the capital", "Paris is the capital", (1.0, 1.0, 1.0)),
    ("apple banana", "carrot date", (0, 0, 0)),
    (None, "anything", (0, 0, 0)),
    ("yes", "yes", (1.0, 1.0, 1.0)),
    *[(special, "some other phrase", (0, 0, 0)) for special in ("yes", "no", "noanswer")],
    *[("some other phrase", special, (0, 0, 0)) for special in ("yes", "no", "noanswer")],
]


@pytest.mark.parametrize("raw,expected", NORMALIZE)
def test_normalize_answer(raw, expected):
    from miles_host.rewards.answers import normalize_answer

    assert normalize_answer(raw) == expected


@pytest.mark.parametrize("prediction,truth,expected", F1)
def test_f1_score(prediction, truth, expected):
    assert hub.f1_score(prediction, truth) == expected


def test_f1_partial_overlap():
    f1, precision, recall = hub.f1_score("the brown fox", "a quick brown fox")
    assert (precision, recall) == pytest.approx((1.0, 2 / 3))
    assert f1 == pytest.approx(2 * 1.0 * (2 / 3) / (1.0 + 2 / 3))
    assert hub.score("f1", "the brown fox", "a quick brown fox") == pytest.approx(f1)


# ---- math_dapo_utils -------------------------------------------------------------------
DAPO_NORMALIZE = [("x = 42", "42"), ("an answer", "answer"), ("42 square", "42"), ("100 dollars", "100"),
                  (r"\text{hello}", "hello"), (r"\boxed{42}", "42"), ("1,234,567", "1234567"), ("a b c", "bc"),
                  ("42<|endoftext|>", "42"), ("42<|im_end|>", "42")]


def test_dapo_boxes():
    assert dapo.last_boxed_only_string(r"\boxed{first}, then \boxed{42}") == r"\boxed{42}"
    assert dapo.last_boxed_only_string(r"\boxed{\frac{1}{2}}") == r"\boxed{\frac{1}{2}}"
    assert dapo.last_boxed_only_string("no box") is None
    assert dapo.last_boxed_only_string(r"\boxed{never closes") is None
    assert dapo.remove_boxed(r"\boxed{42}") == "42"
    with pytest.raises(AssertionError, match="box error"):
        dapo.remove_boxed("not boxed")


@pytest.mark.parametrize("raw,expected", DAPO_NORMALIZE)
def test_dapo_normalize_final_answer(raw, expected):
    assert dapo.normalize_final_answer(raw) == expected


def test_dapo_strict_box_and_minerva():
    assert dapo.is_correct_strict_box("long preamble … \\boxed{42}", "42") == (1, "42")
    assert dapo.is_correct_strict_box(r"\boxed{43}", "42") == (-1, "43")
    assert dapo.is_correct_strict_box("plain 42", "42") == (-1, None)
    assert dapo.is_correct_minerva("Long solution. Answer: 42", "42") == (True, "42")
    assert dapo.is_correct_minerva("Answer: 41 was a wrong guess.\nAnswer: 42", "42")[0] is True
    assert dapo.is_correct_minerva("just a number 42", "42")[0] is False
    assert dapo.verify(r"\boxed{42}", "42", strict_box_verify=True) == (True, "42")
    assert dapo.verify("Answer: 42", "42")[0] is True


def test_dapo_compute_score():
    assert dapo.compute_score(r"\boxed{42}", "42", strict_box_verify=True) == {"score": 1.0, "acc": True, "pred": "42"}
    wrong = dapo.compute_score(r"\boxed{43}", "42", strict_box_verify=True)
    assert (wrong["score"], wrong["acc"]) == (-1.0, False)
    assert dapo.compute_score(r"\boxed{42}" + " filler" * 60, "42", strict_box_verify=True)["score"] == -1.0
    assert hub.score("dapo", "Answer: 42", "42")["score"] == 1.0


# ---- gpqa -----------------------------------------------------------------------------
LETTERS = [("The answer is B.", "B"), ("Answer: C", "C"), ("My choice is D", "D"), ("A is correct here", "A"),
           ("E is the correct option", "E"), ("Final answer: B", "B"), ("the final option is C", "C"),
           ("we ruled out A, then B, settled on C", "C"),
           ("Let me think… Answer: A is wrong.</think>The answer is B.", "B"),
           ("no idea, sorry", None), ("", None), (None, None)]
GPQA = [
    ("The answer is C.", "C", None, 1.0),
    ("The answer is C.", "D", None, 0.0),
    ("Answer: C", 2, {"choices": ["alpha", "beta", "gamma", "delta"]}, 1.0),
    ("Answer: B", 1, {"choices": {"a": "first", "b": "second", "c": "third"}}, 1.0),
    ("I think the answer is B.", "capital of france", {"choices": ["London", "Capital of France", "Berlin"]}, 1.0),
    ("Definitely paris.", "Paris", {"choices": ["London", "Paris", "Berlin"]}, 1.0),
    ("Answer: A", "anything", {"correct_letter": "a"}, 1.0),
    (None, "A", None, 0.0),
    ("random text", "some answer", None, 0.0),
]


@pytest.mark.parametrize("response,expected", LETTERS)
def test_gpqa_extract_letter(response, expected):
    assert gpqa.extract_letter(response, gpqa.DEFAULT_VALID_LETTERS) == expected


def test_gpqa_valid_letters_restrict():
    assert gpqa.extract_letter("Answer: C, but actually A was right, no wait B.", ["A", "B"]) == "B"


@pytest.mark.parametrize("response,label,metadata,expected", GPQA)
def test_gpqa_reward(response, label, metadata, expected):
    assert gpqa.compute_gpqa_reward(response, label, metadata=metadata) == expected
    assert hub.score("gpqa", response, label, metadata) == expected


# ---- the hub's dispatch ---------------------------------------------------------------
def test_boxed_prefix_scores_the_boxed_content():
    assert hub.score("boxed_f1", r"blah \boxed{Paris}", "paris") == 1.0
    assert hub.score("f1", r"blah \boxed{Paris}", "paris") < 1.0
    assert hub.score("boxed_f1", "no box", "paris") == 0


def test_random_is_zero_or_one_and_unknown_types_are_named():
    assert {hub.score("random", "x", None) for _ in range(64)} == {0, 1}
    with pytest.raises(ValueError, match="nope"):
        hub.score("nope", "x", "y")


def test_ifbench_without_its_checker_says_what_to_install():
    with pytest.raises(ImportError, match="IFBench"):
        hub.score("ifbench", "x", None, {"instruction_id_list": ["a"]})


def test_per_sample_rm_type_and_registry():
    from types import SimpleNamespace

    from miles_host.builtin.rewards import miles_register_reward_functions
    from miles_host.sample import Sample

    records = {record.name: record for record in miles_register_reward_functions()}
    assert {"dapo", "deepscaler", "math", "f1", "gpqa", "ifbench", "random", "remote_rm", "boxed_math"} <= set(records)
    config = SimpleNamespace(rm_url=None, rm_timeout=1.0, rm_max_retries=0)
    sample = Sample(prompt="p", response=r"\boxed{4}", label="4", metadata={})
    assert records["math"].fn(sample, config) == 1
    sample.metadata["rm_type"] = "f1"  # slime: the sample's own rm_type wins
    assert records["math"].fn(sample, config) == 0
    with pytest.raises(ValueError, match="--rm-url"):
        records["remote_rm"].fn(Sample(prompt="p", response="r", label="l", metadata={}), config)
