"""A scripted rollout backend and manager for the agentic tests: each request emits one token
per step (``2 + i % 5``, log-prob -0.5) until its ``max_new_tokens``."""

from __future__ import annotations

import threading
import time

from miles_host.config import MilesConfig
from miles_host.data import PromptDataset, PromptRecord
from miles_host.records import RewardFunction
from miles_host.registry import Registry
from miles_host.reward import RewardScorer
from miles_host.rollout_manager import RolloutManager


class ScriptedBackend:
    """One token per step for every running request; ``step_s`` seconds a step. Records the
    thread of every call (the driver must make them all on one thread)."""

    weight_version = 3

    def __init__(self, step_s: float = 0.0):
        self.step_s = step_s
        self.running: dict[str, dict] = {}
        self.submitted: list[tuple[str, list[int], dict]] = []
        self.threads: set[int] = set()

    def submit(self, rid, input_ids, params, return_routed_experts=False):
        self.threads.add(threading.get_ident())
        if not input_ids:
            raise ValueError("empty prompt")
        self.running[rid] = {"budget": params["max_new_tokens"], "made": []}
        self.submitted.append((rid, list(input_ids), dict(params)))

    def _output(self, rid, kind):
        made = self.running.pop(rid)["made"]
        reason = {"type": kind, "message": "aborted"} if kind == "abort" else {"type": kind, "length": len(made)}
        return {"output_ids": made, "meta_info": {"id": rid, "index": 0, "finish_reason": reason,
                                                  "weight_version": self.weight_version,
                                                  "output_token_logprobs": [[-0.5, t, None] for t in made]}}

    def step(self):
        self.threads.add(threading.get_ident())
        time.sleep(self.step_s)
        done = []
        for rid, state in list(self.running.items()):
            state["made"].append(2 + len(state["made"]) % 5)
            if len(state["made"]) >= state["budget"]:
                done.append(self._output(rid, "length"))
        return done

    def has_unfinished(self):
        return bool(self.running)

    def abort_all(self):
        self.threads.add(threading.get_ident())
        return [self._output(rid, "abort") for rid in list(self.running)]


class CharTokenizer:
    eos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + (ord(c) % 10) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


def make_manager(generate_path: str, reward=lambda sample, config: float(sample.response_length), step_s=0.0,
                 **flags):
    """A rollout manager over :class:`ScriptedBackend` with the custom generate function at
    ``generate_path``; 100 prompts ``p0`` ... ``p99``."""
    flags = {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_max_response_len": 50,
             "rm_type": "scripted", "custom_generate_function_path": generate_path, **flags}
    config = MilesConfig(**flags)
    registry = Registry("reward function")
    registry.add(RewardFunction("scripted", fn=reward), "test", "test")
    prompts = [PromptRecord(f"p{i}", str(i), {}, i) for i in range(100)]
    backend = ScriptedBackend(step_s)
    manager = RolloutManager(config, backend, CharTokenizer(), RewardScorer(config, registry),
                             PromptDataset(prompts, False, 0))
    return manager, backend
