"""Run directories for the dashboard tests, written by the writers a run uses: metrics.jsonl by
the jsonl logger, the sample files by :func:`miles_host.dashboard.samples.write_step_samples`."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from miles_host.config import MilesConfig
from miles_host.dashboard.samples import EXPERT_AGREEMENT_KEY, TRAIN_LOG_PROBS_KEY, write_step_samples
from miles_host.logging_backends import JsonlLogger
from miles_host.sample import Sample, Status

#: the metrics a synthetic step logs: one of each kind the dashboard draws
STEP_METRICS = ("rollout/reward_mean", "train/loss", "train/kl_loss", "train/pg_clipfrac",
                "train/train_rollout_logprob_abs_diff", "r3/expert_agreement", "spec/accept_rate",
                "perf/rollout_tok_per_s")
VOCAB = "0123456789+= abcdefghijklmnopqrstuvwxyz"


def char_tokenizer():
    """A character-level fast tokenizer (ids 2.. for VOCAB)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")


def step_record(rollout_id: int, rng: random.Random) -> dict:
    """One step's metrics: every STEP_METRICS key, the phase timings, an eval every other step."""
    record = {"rollout_id": rollout_id, **{key: rng.uniform(-1, 1) for key in STEP_METRICS}}
    phases = {"perf/rollout_time_s": rng.uniform(1, 2), "perf/reward_time_s": rng.uniform(0.1, 0.3),
              "perf/train_time_s": rng.uniform(1, 3), "perf/weight_sync_time_s": rng.uniform(0.05, 0.2)}
    if rollout_id % 2:
        record["eval/gsm8k/accuracy"] = rng.random()
        record["eval/math/accuracy"] = rng.random()
        phases["perf/eval_time_s"] = rng.uniform(0.2, 0.5)
    record.update(phases)
    # the step: the rollout (rewards scored inside it), training, the sync, evaluation, and the loop's own work
    record["perf/step_time_s"] = sum(v for k, v in phases.items() if k != "perf/reward_time_s") + rng.uniform(0.01, 0.1)
    if rollout_id == 2:
        record["train/grad_norm"] = math.nan  # written as "nan": not a point of any curve
    return record


def make_samples(rollout_id: int, tokenizer, rng: random.Random, groups: int = 2, per_group: int = 2) -> list[list[Sample]]:
    """Scored groups with rollout and training log-probs, a loss mask and expert agreement."""
    out = []
    for g in range(groups):
        prompt = f"{g}+{rollout_id}="
        group = []
        for k in range(per_group):
            response = "".join(rng.choice("0123456789 abc") for _ in range(rng.randint(5, 9)))
            prompt_ids, response_ids = tokenizer(prompt)["input_ids"], tokenizer(response)["input_ids"]
            rollout_lp = [-rng.uniform(0.01, 3) for _ in response_ids]
            sample = Sample(prompt=prompt, tokens=prompt_ids + response_ids, response=response, reward=float(k % 2),
                            loss_mask=[0 if i == 1 else 1 for i in range(len(response_ids))],
                            rollout_log_probs=rollout_lp, response_length=len(response_ids),
                            group_index=g, index=g * per_group + k, status=Status.COMPLETED, weight_versions=[rollout_id])
            sample.metadata[TRAIN_LOG_PROBS_KEY] = [lp + rng.uniform(-0.2, 0.2) for lp in rollout_lp]
            sample.metadata[EXPERT_AGREEMENT_KEY] = [rng.choice((0.0, 0.5, 1.0)) for _ in response_ids]
            group.append(sample)
        out.append(group)
    return out


class RunWriter:
    """A run directory written step by step: config.json, metrics.jsonl through the jsonl logger,
    sample files of ``sample_steps``."""

    def __init__(self, path: Path, tokenizer=None, sample_steps: tuple = (), seed: int = 0):
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({"hf_checkpoint": "tiny", "lr": 1e-6}))
        self.path, self.tokenizer, self.sample_steps = path, tokenizer, sample_steps
        self.logger = JsonlLogger(MilesConfig(output_dir=str(path)))
        self.rng = random.Random(seed)
        self.records: list[dict] = []

    def write_steps(self, steps: range) -> list[dict]:
        """Log these steps' records (and their sample files); the records."""
        records = [step_record(i, self.rng) for i in steps]
        for record in records:
            self.logger.log(record, record["rollout_id"])
            if record["rollout_id"] in self.sample_steps:
                groups = make_samples(record["rollout_id"], self.tokenizer, self.rng)
                write_step_samples(self.path, record["rollout_id"], groups, self.tokenizer, float, limit=4)
        self.records += records
        return records


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl as a run wrote it (non-finite numbers are the strings "nan", "inf")."""
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()
