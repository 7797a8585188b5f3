"""``--rollout-function-path``: a slime-contract rollout function instead of the built-in manager.

slime's contract (``slime/ray/rollout.py``, ``slime/rollout/base_types.py``): the run calls
``generate_rollout(args, rollout_id, data_source, evaluation=False)`` once per step; it
returns the step's samples as groups (``list[list[Sample]]``; a flat ``list[Sample]`` is
grouped by ``group_index``), or an object with ``samples`` and ``metrics`` (slime's
``RolloutFnTrainOutput``). Each sample has at least ``tokens``, ``response_length``,
``reward`` and ``status`` set; a missing ``loss_mask`` trains every response token (as
slime's conversion does). ``args`` is the run's config (slime's field names);
``data_source`` is a :class:`PromptDataSource`.

slime's and upstream miles' module paths of the built-in rollouts resolve here
(:data:`ROLLOUT_FUNCTION_ALIASES`): their SFT rollout is :func:`miles_host.sft.generate_rollout`,
their default SGLang rollout is the built-in rollout manager.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from miles_host.reward import load_function
from miles_host.rollout_manager import RolloutManager, RolloutStats
from miles_host.sample import Sample, Status

#: a slime / upstream-miles rollout function path -> ours (None: the built-in rollout manager)
ROLLOUT_FUNCTION_ALIASES: dict[str, str | None] = {
    "slime.rollout.sft_rollout.generate_rollout": "miles_host.sft.generate_rollout",
    "miles.rollout.sft_rollout.generate_rollout": "miles_host.sft.generate_rollout",
    "slime.rollout.sglang_rollout.generate_rollout": None,
    "miles.rollout.sglang_rollout.generate_rollout": None,
}

FLAG = "--rollout-function-path"


def resolve_rollout_function_path(path: str | None) -> str | None:
    """The function ``--rollout-function-path`` names (None: the built-in rollout manager)."""
    if path is None:
        return None
    return ROLLOUT_FUNCTION_ALIASES.get(path, path)


def load_rollout_function(path: str | None) -> Callable | None:
    """The rollout function of ``--rollout-function-path`` (None: the built-in manager);
    ValueError naming the flag when it does not import."""
    resolved = resolve_rollout_function_path(path)
    return None if resolved is None else load_function(resolved, FLAG)


class PromptDataSource:
    """slime's data source over the run's prompts: ``get_samples(n)`` gives ``n`` groups of
    ``--n-samples-per-prompt`` fresh samples (groups put back with ``add_samples`` first).

    Its position is the run's: the prompt data set's epoch and offset, and the rollout
    manager's group counter and buffer, which checkpoints already record."""

    def __init__(self, config: Any, manager: RolloutManager):
        self.config = config
        self.manager = manager

    def __len__(self) -> int:
        return len(self.manager.dataset.prompts)

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """The next ``num_samples`` groups."""
        buffered = self.manager.buffer[:num_samples]
        self.manager.buffer = self.manager.buffer[num_samples:]
        records = self.manager.dataset.next_batch(num_samples - len(buffered)) if num_samples > len(buffered) else []
        return buffered + [self._group(record) for record in records]

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Groups to hand out again before new prompts (slime's buffered data source)."""
        self.manager.buffer.extend(samples)

    def save(self, rollout_id: int) -> None:
        """Nothing to do: the run's checkpoints hold the position."""

    def load(self, rollout_id: int | None = None) -> None:
        """Nothing to do: ``--load`` restores the position."""

    def _group(self, record: Any) -> list[Sample]:
        manager, config = self.manager, self.config
        group_index = manager.next_group_index
        manager.next_group_index += 1
        metadata = record.metadata
        prompt = record.prompt
        if config.apply_chat_template:  # slime's data set hands out the rendered prompt text
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            prompt = manager.tokenizer.apply_chat_template(messages, tools=metadata.get("tools") or None,
                                                           add_generation_prompt=True, tokenize=False,
                                                           **config.apply_chat_template_kwargs)
        return [
            Sample(prompt=copy.deepcopy(prompt), label=record.label,
                   metadata={**metadata, "prompt_index": record.index},
                   group_index=group_index, index=group_index * config.n_samples_per_prompt + i)
            for i in range(config.n_samples_per_prompt)
        ]


def as_groups(output: Any, path: str) -> tuple[list[list[Sample]], dict]:
    """A rollout function's output as ``(groups, metrics)``: a list of groups, a flat list of
    samples (grouped by ``group_index``), or an object with ``samples`` (and ``metrics``)."""
    metrics: dict = {}
    if hasattr(output, "samples") and not isinstance(output, list):
        metrics = dict(getattr(output, "metrics", None) or {})
        output = output.samples
    if not isinstance(output, list):
        raise ValueError(f"{FLAG} {path}: returned {type(output).__name__}; return a list of groups of samples")
    groups: list[list[Sample]] = []
    by_index: dict[Any, list[Sample]] = {}
    for item in output:
        if isinstance(item, Sample):
            key = item.group_index if item.group_index is not None else ("sample", id(item))
            if key not in by_index:
                by_index[key] = []
                groups.append(by_index[key])
            by_index[key].append(item)
        elif isinstance(item, list):
            groups.append(_flatten(item, path))
        else:
            raise ValueError(f"{FLAG} {path}: returned a list holding {type(item).__name__}; return groups of "
                             "miles_host.sample.Sample")
    for group in groups:
        for sample in group:
            _check_sample(sample, path)
    return groups, metrics


def _flatten(items: list, path: str) -> list[Sample]:
    out: list[Sample] = []
    for item in items:
        if isinstance(item, list):
            out.extend(_flatten(item, path))
        elif isinstance(item, Sample):
            out.append(item)
        else:
            raise ValueError(f"{FLAG} {path}: a group holds {type(item).__name__}; groups hold "
                             "miles_host.sample.Sample")
    return out


def _check_sample(sample: Sample, path: str) -> None:
    """slime's conversion defaults (every response token trained when no loss mask), then
    the sample's own checks, naming the function."""
    if sample.loss_mask is None:
        sample.loss_mask = [1] * sample.response_length
    if sample.status in (Status.COMPLETED, Status.TRUNCATED) and sample.reward is None:
        raise ValueError(f"{FLAG} {path}: sample {sample.index} has no reward; the rollout function sets "
                         "sample.reward (slime's contract)")
    try:
        sample.validate()
    except ValueError as error:
        raise ValueError(f"{FLAG} {path}: sample {sample.index}: {error}") from None


class FunctionRollout:
    """A step's groups from a rollout function, in the rollout manager's shape ``(groups, stats)``."""

    def __init__(self, config: Any, path: str, manager: RolloutManager):
        self.config = config
        self.path = path
        self.function = load_rollout_function(path)
        if self.function is None:
            raise ValueError(f"{FLAG} {path} is the built-in rollout; leave {FLAG} unset")
        self.data_source = PromptDataSource(config, manager)

    def generate(self, rollout_id: int) -> tuple[list[list[Sample]], RolloutStats]:
        """Call the function for ``rollout_id``; its groups and counts (its metrics in
        ``stats.extra["metrics"]``)."""
        output = self.function(self.config, rollout_id, self.data_source, evaluation=False)
        groups, metrics = as_groups(output, self.path)
        samples = [s for group in groups for s in group]
        stats = RolloutStats(
            submitted_groups=len(groups),
            finished_samples=len(samples),
            failed_samples=sum(s.status is Status.FAILED for s in samples),
            generated_tokens=sum(len(s.rollout_log_probs or []) for s in samples),
        )
        stats.extra["metrics"] = {key if "/" in key else f"rollout/{key}": value for key, value in metrics.items()}
        return groups, stats
