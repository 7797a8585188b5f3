"""Evaluation: accuracy (mean reward) of the current policy on each evaluation data set.

The data sets come from ``--eval-config`` or ``--eval-prompt-data``
(:mod:`miles_host.eval_config`), each with its own samples per prompt, sampling settings,
data keys and reward (``rm_type`` / ``custom_rm_path``). With ``--log-passrate`` each also
reports pass@k (:func:`pass_at_k`).

The backend is stepped only while it has unfinished work, and at most
:func:`step_budget` times: a backend that stops reporting work before every request
came back, or never finishes, ends the evaluation with a ``RuntimeError`` instead
of a hang.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from miles_host.data import PromptDataset
from miles_host.eval_config import EvalDataset, eval_datasets
from miles_host.rollout_manager import sampling_seed
from miles_host.sample import Sample, Status


def load_eval_data(config: Any, path: str, spec: EvalDataset | None = None) -> PromptDataset:
    """One evaluation file, every record checked (at start, not at the first eval); the keys
    are ``spec``'s (the flags' without one)."""
    if spec is None:
        spec = EvalDataset(**{**_flag_settings(config), "name": path, "path": path})
    return PromptDataset.from_file(path, spec.input_key, spec.label_key, spec.metadata_key, False, 0,
                                   apply_chat_template=spec.apply_chat_template, flag="--eval-prompt-data",
                                   tool_key=spec.tool_key)


def _flag_settings(config: Any) -> dict:
    from miles_host.eval_config import resolve

    resolved = resolve(config, {"name": "-", "path": "-"}, {}, "flags")
    return {key: value for key, value in vars(resolved).items() if key not in ("name", "path")}


def load_eval_datasets(config: Any) -> dict[str, tuple[EvalDataset, PromptDataset]]:
    """Every evaluation data set, by name: its settings and its loaded prompts."""
    return {spec.name: (spec, load_eval_data(config, spec.path, spec)) for spec in eval_datasets(config)}


def run_evals(config: Any, rollout: Any, rollout_id: int,
              datasets: dict[str, tuple[EvalDataset, PromptDataset]]) -> dict[str, float]:
    """``eval/<name>/accuracy`` of every data set, and ``eval/<name>/pass@k`` with ``--log-passrate``."""
    metrics: dict[str, float] = {}
    for name, (spec, dataset) in datasets.items():
        samples = generate_eval_samples(config, rollout, spec, dataset, rollout_id)
        rewards = score_samples(config, rollout, spec, samples)
        metrics[f"eval/{name}/accuracy"] = sum(rewards) / max(1, len(rewards))
        if getattr(config, "log_passrate", False):
            for k, value in pass_at_k(rewards, spec.n_samples_per_eval_prompt).items():
                metrics[f"eval/{name}/pass@{k}"] = value
    return metrics


def evaluate(config: Any, rollout: Any, path: str, rollout_id: int, dataset: PromptDataset | None = None,
             spec: EvalDataset | None = None) -> float:
    """The mean reward (failed samples count as 0) of ``spec``'s samples per prompt of ``path``
    (``dataset``: the file already loaded; ``spec``: the flags' settings without one)."""
    if spec is None:
        spec = EvalDataset(**{**_flag_settings(config), "name": path, "path": path})
    if dataset is None:
        dataset = load_eval_data(config, path, spec)
    rewards = score_samples(config, rollout, spec, generate_eval_samples(config, rollout, spec, dataset, rollout_id))
    return sum(rewards) / max(1, len(rewards))


def eval_params(config: Any, rollout: Any, spec: EvalDataset, seed: int) -> dict:
    """The rollout's eval sampling params with the data set's length, temperature, top-p, top-k
    and stop strings / token ids."""
    max_new = spec.max_response_len or config.rollout_max_response_len
    params = rollout.sampling_params(max_new, seed, eval_mode=True)
    params.update(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k)
    for key in ("stop", "stop_token_ids"):
        value = getattr(spec, key)
        if value:
            params[key] = list(value)
        else:
            params.pop(key, None)
    return params


def generate_eval_samples(config: Any, rollout: Any, spec: EvalDataset, dataset: PromptDataset,
                          rollout_id: int) -> list[Sample]:
    """``spec.n_samples_per_eval_prompt`` answers per prompt, in prompt order (a prompt's
    samples together). With ``--custom-generate-function-path`` the function generates them,
    as in training."""
    max_new = spec.max_response_len or config.rollout_max_response_len
    tag = "eval" if spec.name == spec.path else f"eval-{spec.name}"
    if config.custom_generate_function_path:
        return evaluate_custom(config, rollout, dataset, rollout_id, max_new, spec)
    samples = {}
    for record in dataset.prompts:
        tokens = prompt_ids(rollout, record)
        for k in range(spec.n_samples_per_eval_prompt):
            sample = eval_sample(record, tokens, spec)
            rid = f"{tag}-{rollout_id}-{record.index}-{k}"
            params = eval_params(config, rollout, spec, sampling_seed("eval", config.rollout_seed, record.index, k))
            try:
                rollout.backend.submit(rid, sample.tokens, params)
            except ValueError as error:
                sample.status = Status.FAILED
                sample.metadata["failure"] = str(error)
            samples[rid] = sample
    pending = {rid for rid, s in samples.items() if s.status is not Status.FAILED}
    collect(rollout, samples, pending, step_budget([samples[rid] for rid in pending], max_new), spec.path)
    return list(samples.values())


def prompt_ids(rollout: Any, record: Any) -> list[int]:
    """The prompt's token ids (its ``--tool-key`` tools given to the chat template)."""
    tools = record.metadata.get("tools")
    return rollout.prompt_ids(record.prompt, tools) if tools else rollout.prompt_ids(record.prompt)


def eval_sample(record: Any, tokens: list[int], spec: EvalDataset | None = None) -> Sample:
    """A fresh sample of an eval prompt (``tokens``: the prompt's ids; ``spec``'s rm_type and
    metadata overrides in its metadata)."""
    metadata = dict(record.metadata) if spec is None else spec.sample_metadata(record.metadata)
    return Sample(prompt=record.prompt, tokens=list(tokens), label=record.label, metadata=metadata,
                  loss_mask=[], rollout_log_probs=[])


def evaluate_custom(config: Any, rollout: Any, dataset: PromptDataset, rollout_id: int, max_new: int,
                    spec: EvalDataset | None = None) -> list[Sample]:
    """The eval samples filled by the ``--custom-generate-function-path`` function (all
    trajectories at once, as in training)."""
    samples, params, prefixes = [], [], []
    for record in dataset.prompts:
        tokens = prompt_ids(rollout, record)
        for k in range(config.n_samples_per_eval_prompt if spec is None else spec.n_samples_per_eval_prompt):
            samples.append(eval_sample(record, tokens, spec))
            seed = sampling_seed("eval", config.rollout_seed, record.index, k)
            params.append(rollout.sampling_params(max_new, seed, eval_mode=True) if spec is None
                          else eval_params(config, rollout, spec, seed))
            prefixes.append(f"eval-{rollout_id}-{record.index}-{k}")
    return rollout.run_custom_samples(samples, params, prefixes)


def mean_score(rollout: Any, samples: list[Sample], scorer: Any = None) -> float:
    """Score each sample that did not fail; the mean reward, failed samples counted as 0."""
    rewards = sample_rewards(scorer or rollout.scorer, samples)
    return sum(rewards) / max(1, len(rewards))


def sample_rewards(scorer: Any, samples: list[Sample]) -> list[float]:
    """Each sample scored (unless it failed) with ``scorer``; its reward, 0 for a failed one."""
    scores = []
    for sample in samples:
        if sample.status is not Status.FAILED:
            scorer.score_group([sample])
        scores.append(0.0 if sample.status is Status.FAILED else scorer.scalar(sample.reward))
    return scores


def dataset_scorer(config: Any, rollout: Any, spec: EvalDataset) -> Any:
    """The scorer of a data set: its ``custom_rm_path``, else (without ``--custom-rm-path``)
    its built-in ``rm_type``, else the run's; ``--eval-reward-key`` picks the number from a
    dict reward instead of ``--reward-key``."""
    base = rollout.scorer
    if getattr(config, "eval_reward_key", None):
        base = copy.copy(base)
        base.config = copy.copy(base.config)
        base.config.reward_key = config.eval_reward_key
    if spec.custom_rm_path:
        from miles_host.function_contracts import load_adapted

        scorer = copy.copy(base)
        scorer.function = load_adapted(spec.custom_rm_path, "custom_rm_path", config)
        scorer.source = f"--eval-config {spec.name} custom_rm_path {spec.custom_rm_path}"
        scorer.group = False
        scorer.timeout_s = config.rm_timeout
        return scorer
    if spec.rm_type and not config.custom_rm_path:
        from miles_host.builtin.rewards import hub_reward

        scorer = copy.copy(base)
        scorer.function = hub_reward(spec.rm_type)
        scorer.source = f"--eval-config {spec.name} rm_type {spec.rm_type}"
        scorer.group = False
        scorer.timeout_s = config.rm_timeout
        return scorer
    return base


def score_samples(config: Any, rollout: Any, spec: EvalDataset, samples: list[Sample]) -> list[float]:
    """The data set's rewards of ``samples`` (0 for a failed one), in order."""
    return sample_rewards(dataset_scorer(config, rollout, spec), samples)


def pass_at_k(rewards: list[float], group_size: int) -> dict[int, float]:
    """slime's pass@k, k = 1, 2, 4, ... up to ``group_size``: per prompt (``group_size``
    consecutive rewards, ``c`` of them equal to 1) the unbiased estimate
    1 - C(n - c, k) / C(n, k), averaged over the prompts."""
    if group_size < 1 or not rewards or len(rewards) % group_size:
        return {}
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    result = {}
    k = 1
    while k <= group_size:
        estimates = []
        for group in groups:
            n, c = len(group), sum(1 for reward in group if reward == 1)
            # 1 - C(n-c, k)/C(n, k) as a product, stable for large n
            estimates.append(1.0 if n - c < k else 1.0 - math.prod(1.0 - k / m for m in range(n - c + 1, n + 1)))
        result[k] = sum(estimates) / len(estimates)
        k *= 2
    return result


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
