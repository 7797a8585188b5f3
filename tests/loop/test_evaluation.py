"""Evaluation steps the backend only while it has work, and never forever."""

from __future__ import annotations

import json

import pytest

from miles_host.config import MilesConfig
from miles_host.evaluation import evaluate, step_budget


class ScriptedBackend:
    """Answers each request with its label after ``delay`` steps; ``drop`` request ids never
    come back; ``stuck``: reports unfinished work forever and returns nothing."""

    def __init__(self, delay=0, drop=(), stuck=False):
        self.delay, self.drop, self.stuck = delay, set(drop), stuck
        self.requests: dict[str, int] = {}
        self.steps = 0

    def submit(self, rid, input_ids, sampling_params, return_routed_experts=False):
        self.requests[rid] = 0

    def has_unfinished(self):
        return self.stuck or bool(self.requests)

    def step(self):
        assert self.has_unfinished(), "stepped with nothing unfinished"
        self.steps += 1
        if self.stuck:
            return []
        outputs = []
        for rid in list(self.requests):
            self.requests[rid] += 1
            if self.requests[rid] > self.delay:
                del self.requests[rid]
                if rid not in self.drop:
                    outputs.append({"meta_info": {"id": rid, "finish_reason": {"type": "stop"}}, "output_ids": [7]})
        return outputs


class Rollout:
    """The parts of RolloutManager that evaluation uses; every answer scores 1."""

    def __init__(self, backend):
        self.backend = backend
        self.scorer = self

    def prompt_ids(self, prompt):
        return [1, 2, 3]

    def sampling_params(self, max_new_tokens, seed, eval_mode=False):
        return {"max_new_tokens": max_new_tokens}

    def apply_output(self, sample, output):
        sample.tokens.extend(output["output_ids"])
        sample.response_length += len(output["output_ids"])

    def score_group(self, samples):
        for sample in samples:
            sample.reward = 1.0

    def scalar(self, reward):
        return reward


@pytest.fixture
def eval_file(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(3)))
    return str(path)


CONFIG = dict(label_key="label", n_samples_per_eval_prompt=2, rollout_max_response_len=4)


def test_a_backend_that_finishes_everything_is_stepped_until_then_only(eval_file):
    backend = ScriptedBackend(delay=2)
    assert evaluate(MilesConfig(**CONFIG), Rollout(backend), eval_file, 0) == 1.0
    assert backend.steps == 3 and not backend.requests


def test_a_backend_that_drops_a_request_is_an_error_not_a_hang(eval_file):
    backend = ScriptedBackend(drop={"eval-0-1-0"})
    with pytest.raises(RuntimeError, match="1 request.*never came back.*eval-0-1-0"):
        evaluate(MilesConfig(**CONFIG), Rollout(backend), eval_file, 0)
    assert backend.steps == 1


def test_a_backend_without_progress_is_an_error_after_the_step_budget(eval_file):
    backend = ScriptedBackend(stuck=True)
    with pytest.raises(RuntimeError, match="6 request.*still unfinished.*no progress"):
        evaluate(MilesConfig(**CONFIG), Rollout(backend), eval_file, 0)
    # 6 requests of a 3-token prompt and up to 4 new tokens
    assert backend.steps == step_budget([_sample(3)] * 6, 4) == 2 * 6 * 7 + 1000


def _sample(prompt_length):
    from miles_host.sample import Sample

    return Sample(tokens=[0] * prompt_length)
