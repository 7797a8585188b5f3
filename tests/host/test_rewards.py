"""Built-in rewards: answer extraction and comparison."""

from __future__ import annotations

import pytest

from miles_host.rewards.answers import (
    deepscaler_reward,
    exact_reward,
    f1_reward,
    last_boxed,
    math_equal,
    math_reward,
)


def test_last_boxed_handles_nested_braces():
    assert last_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed("no box here") is None
    assert last_boxed(r"\boxed{unclosed") is None


@pytest.mark.parametrize(
    "response, label, expected",
    [
        (r"The answer is \boxed{42}.", "42", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0),
        (r"\boxed{41}", "42", 0.0),
        ("42", "42", 0.0),  # no boxed answer: no reward
    ],
)
def test_math_reward(response, label, expected):
    assert math_reward(response, label) == expected


def test_math_equal_symbolic():
    assert math_equal("2x+1", "1+2x")
    assert not math_equal("2x+2", "1+2x")


def test_deepscaler_needs_the_think_block_closed():
    assert deepscaler_reward(r"<think>maybe \boxed{3}</think> \boxed{4}", "4") == 1.0
    assert deepscaler_reward(r"<think>\boxed{4}", "4") == 0.0


def test_f1_and_exact_against_hand_computed_values():
    # response tokens: the cat sat -> normalised "cat sat"; label "a cat sat down" -> "cat sat down"
    precision, recall = 2 / 2, 2 / 3
    assert f1_reward("The cat sat", "a cat sat down") == pytest.approx(2 * precision * recall / (precision + recall))
    assert f1_reward("dog", "cat") == 0.0
    assert exact_reward("  The Answer! ", "answer") == 1.0
    assert exact_reward("answer 2", "answer") == 0.0


def test_fbox_is_the_fallback_of_boxed():
    """slime's last_boxed_only_string: ``\\fbox`` counts when there is no ``\\boxed``."""
    assert last_boxed(r"answer: \fbox{7}") == "7"
    assert last_boxed(r"\fbox{1} and later \boxed{2}") == "2"  # \boxed wins wherever it is
    assert math_reward(r"so \fbox{\frac{1}{2}}", "0.5") == 1.0


def test_deepscaler_recognises_the_response_separator():
    """DeepScaleR's second format: the solution follows ``###Response``; what precedes it
    is not graded, and without any marker there is no reward."""
    assert deepscaler_reward(r"Scratch work \boxed{wrong}###Response\boxed{42}", "42") == 1.0
    assert deepscaler_reward(r"Scratch \boxed{42}###Response\boxed{41}", "42") == 0.0
    assert deepscaler_reward(r"\boxed{42}", "42") == 0.0
    assert deepscaler_reward(r"</think>\boxed{}", "") == 0.0  # an empty label never matches


def test_no_response_scores_zero():
    assert f1_reward(None, "cat") == 0.0
    assert exact_reward(None, "cat") == 0.0
    assert math_reward(None, "1") == 0.0
    assert deepscaler_reward(None, "1") == 0.0
