"""Evaluation: accuracy (mean reward) of the current policy on a prompt set.

The backend is stepped only while it has unfinished work, and at most
:func:`step_budget` times: a backend that stops reporting work before every request
came back, or never finishes, ends the evaluation with a ``RuntimeError`` instead
of a hang.
"""

from __future__ import annotations

from typing import Any

from miles_host.data import PromptDataset
from miles_host.rollout_manager import sampling_seed
from miles_host.sample import Sample, Status


def load_eval_data(config: Any, path: str) -> PromptDataset:
    """One ``--eval-prompt-data`` file, every record checked (at start, not at the first eval)."""
    return PromptDataset.from_file(path, config.input_key, config.label_key, config.metadata_key, False, 0,
                                   apply_chat_template=config.apply_chat_template, flag="--eval-prompt-data",
                                   tool_key=config.tool_key)


def evaluate(config: Any, rollout: Any, path: str, rollout_id: int, dataset: PromptDataset | None = None) -> float:
    """Generate ``--n-samples-per-eval-prompt`` answers per prompt of ``path`` (``dataset``:
    the file already loaded) and return the mean reward (failed samples count as 0).
    With ``--custom-generate-function-path`` the function generates them, as in training."""
    if dataset is None:
        dataset = load_eval_data(config, path)
    max_new = config.eval_max_response_len or config.rollout_max_response_len
    if config.custom_generate_function_path:
        return mean_score(rollout, evaluate_custom(config, rollout, dataset, rollout_id, max_new))
    samples = {}
    for record in dataset.prompts:
        tokens = prompt_ids(rollout, record)
        for k in range(config.n_samples_per_eval_prompt):
            sample = eval_sample(record, tokens)
            rid = f"eval-{rollout_id}-{record.index}-{k}"
            params = rollout.sampling_params(max_new, sampling_seed("eval", config.rollout_seed, record.index, k), eval_mode=True)
            try:
                rollout.backend.submit(rid, sample.tokens, params)
                samples[rid] = sample
            except ValueError as error:
                sample.status = Status.FAILED
                sample.metadata["failure"] = str(error)
                samples[rid] = sample
    pending = {rid for rid, s in samples.items() if s.status is not Status.FAILED}
    collect(rollout, samples, pending, step_budget([samples[rid] for rid in pending], max_new), path)
    return mean_score(rollout, list(samples.values()))


def prompt_ids(rollout: Any, record: Any) -> list[int]:
    """The prompt's token ids (its ``--tool-key`` tools given to the chat template)."""
    tools = record.metadata.get("tools")
    return rollout.prompt_ids(record.prompt, tools) if tools else rollout.prompt_ids(record.prompt)


def eval_sample(record: Any, tokens: list[int]) -> Sample:
    """A fresh sample of an eval prompt (``tokens``: the prompt's ids)."""
    return Sample(prompt=record.prompt, tokens=list(tokens), label=record.label, metadata=dict(record.metadata),
                  loss_mask=[], rollout_log_probs=[])


def evaluate_custom(config: Any, rollout: Any, dataset: PromptDataset, rollout_id: int, max_new: int) -> list[Sample]:
    """The eval samples filled by the ``--custom-generate-function-path`` function (all
    trajectories at once, as in training)."""
    samples, params, prefixes = [], [], []
    for record in dataset.prompts:
        tokens = prompt_ids(rollout, record)
        for k in range(config.n_samples_per_eval_prompt):
            samples.append(eval_sample(record, tokens))
            seed = sampling_seed("eval", config.rollout_seed, record.index, k)
            params.append(rollout.sampling_params(max_new, seed, eval_mode=True))
            prefixes.append(f"eval-{rollout_id}-{record.index}-{k}")
    return rollout.run_custom_samples(samples, params, prefixes)


def mean_score(rollout: Any, samples: list[Sample]) -> float:
    """Score each sample that did not fail; the mean reward, failed samples counted as 0."""
    scores = []
    for sample in samples:
        if sample.status is not Status.FAILED:
            rollout.scorer.score_group([sample])
        scores.append(0.0 if sample.status is Status.FAILED else rollout.scorer.scalar(sample.reward))
    return sum(scores) / max(1, len(scores))


#: steps allowed per token the requests can hold, and a constant on top (see :func:`step_budget`)
STEPS_PER_TOKEN = 2
EXTRA_STEPS = 1000


def step_budget(samples: list[Sample], max_new_tokens: int) -> int:
    """How many backend steps the requests of ``samples`` may take: a working engine computes
    at least one token (prefill or decode) per step, so twice the tokens they can hold
    (prompt plus ``max_new_tokens`` each) plus :data:`EXTRA_STEPS` is far more than it needs."""
    tokens = sum(len(sample.tokens) + max_new_tokens for sample in samples)
    return STEPS_PER_TOKEN * tokens + EXTRA_STEPS


def collect(rollout: Any, samples: dict[str, Sample], pending: set[str], max_steps: int, path: str) -> None:
    """Step the backend until every request id in ``pending`` came back (applied to its sample).

    Raises ``RuntimeError`` when the backend reports no unfinished work while requests are
    still missing (it lost them), or after ``max_steps`` steps without all of them."""
    steps = 0
    while pending:
        if not rollout.backend.has_unfinished():
            raise RuntimeError(
                f"evaluation of {path}: the rollout backend has nothing unfinished but {len(pending)} "
                f"request(s) never came back (e.g. {min(pending)}); the backend dropped them"
            )
        if steps >= max_steps:
            raise RuntimeError(
                f"evaluation of {path}: {len(pending)} request(s) still unfinished after {steps} backend steps "
                "(a working engine needs far fewer); the backend makes no progress (paused or stuck?)"
            )
        steps += 1
        for output in rollout.backend.step():
            rid = output["meta_info"]["id"]
            if rid in pending:
                rollout.apply_output(samples[rid], output)
                pending.discard(rid)
