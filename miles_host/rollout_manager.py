"""The rollout manager: prompts in, scored groups of samples out.

One call of :meth:`RolloutManager.generate` produces ``--rollout-batch-size``
groups of ``--n-samples-per-prompt`` samples:

- prompts are submitted ``--over-sampling-batch-size`` at a time; every group
  that finishes is scored, and the dynamic sampling filter (built-in: drop
  groups whose rewards all agree) decides whether it is kept;
- once enough groups are kept, whatever is still generating is aborted. With
  ``--partial-rollout`` the unfinished samples (and finished groups beyond the
  batch) go to a buffer and continue first in the next call, so nothing is lost
  or counted twice; without it they are dropped and counted in the metrics.

With ``--custom-generate-function-path`` the same happens with the function's
trajectories, run concurrently (:mod:`miles_host.custom_generate`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from miles_host.buffer_filter import take_buffered
from miles_host.custom_generate import EngineDriver, GenerateSession, TrajectoryRunner  # noqa: F401 - GenerateSession re-exported
from miles_host.data import PromptDataset, PromptRecord
from miles_host.health import check_failed_fraction
from miles_host.function_contracts import load_adapted
from miles_host.reward import RewardScorer
from miles_host.sample import Sample, Status, compact_expert_ids, output_token_versions


#: statuses of a sample that is done generating
FINAL = (Status.COMPLETED, Status.TRUNCATED, Status.FAILED)


def rewards_all_equal(group: list[Sample], scalar: Callable[[Any], float]) -> bool:
    """True when every sample of the group got the same reward (no signal)."""
    rewards = [scalar(s.reward) for s in group if s.status is not Status.FAILED]
    return len(set(rewards)) <= 1


def keep_group_with_signal(group: list[Sample], scalar: Callable[[Any], float]) -> bool:
    """The built-in dynamic sampling filter: keep groups whose rewards differ."""
    return not rewards_all_equal(group, scalar)


def sampling_seed(*parts: Any) -> int:
    """A stable 31-bit seed from the run seed and the sample's coordinates, so a
    resumed run samples exactly what an uninterrupted one would."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class RolloutStats:
    """Counts of one rollout call, for the metrics."""

    submitted_groups: int = 0
    filtered_groups: int = 0
    dropped_samples: int = 0
    buffered_samples: int = 0
    failed_samples: int = 0
    finished_samples: int = 0  # of groups that finished (kept or filtered): the failure rate's denominator
    first_failure: str | None = None
    generated_tokens: int = 0
    extra: dict = field(default_factory=dict)


class RolloutManager:
    """Drives a rollout backend to fill one batch of scored groups."""

    def __init__(self, config: Any, backend: Any, tokenizer: Any, scorer: RewardScorer, dataset: PromptDataset):
        self.config = config
        self.backend = backend
        self.tokenizer = tokenizer
        self.scorer = scorer
        self.dataset = dataset
        self.buffer: list[list[Sample]] = []  # groups carried to the next rollout (partial rollout)
        self.keep_group = keep_group_with_signal if config.over_sampling_batch_size else None
        if config.dynamic_sampling_filter_path:
            self.keep_group = load_adapted(config.dynamic_sampling_filter_path, "dynamic_sampling_filter_path", config)
        self.eos_ids = _eos_ids(tokenizer)
        self.next_group_index = 0
        self.custom_generate = None
        self.session_server = None  # started at the first custom rollout with --use-session-server
        if config.custom_generate_function_path:
            self.custom_generate = load_adapted(config.custom_generate_function_path, "custom_generate_function_path",
                                                config)

    # -- building requests --------------------------------------------------

    def prompt_ids(self, prompt: str | list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a prompt (the chat template when ``--apply-chat-template``, given the
        record's ``--tool-key`` ``tools`` and ``--apply-chat-template-kwargs``)."""
        if self.config.apply_chat_template:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            encoded = self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                         tokenize=True, **self.config.apply_chat_template_kwargs)
            if hasattr(encoded, "keys"):  # transformers 5 returns a BatchEncoding
                encoded = encoded["input_ids"]
            return [int(t) for t in encoded]
        if not isinstance(prompt, str):
            raise ValueError("a chat-format prompt (list of messages) needs --apply-chat-template")
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def sampling_params(self, max_new_tokens: int, seed: int, eval_mode: bool = False) -> dict:
        """SGLang-style sampling params from the rollout (or eval) flags."""
        config = self.config
        temperature = config.rollout_temperature
        top_p = config.rollout_top_p
        if eval_mode:
            temperature = config.eval_temperature if config.eval_temperature is not None else temperature
            top_p = config.eval_top_p if config.eval_top_p is not None else top_p
        params = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": config.rollout_top_k,
            "sampling_seed": seed,
            "n": 1,
        }
        if config.rollout_stop:
            params["stop"] = list(config.rollout_stop)
        if config.rollout_stop_token_ids:
            params["stop_token_ids"] = list(config.rollout_stop_token_ids)
        return params

    def _groups_to_continue(self, carried: Iterable[list[Sample]], kept: list[list[Sample]]) -> Iterator[list[Sample]]:
        """The groups buffered by the last rollout that still need generation; a surplus group
        already scored goes straight to ``kept``."""
        for group in carried:
            if all(s.status in FINAL for s in group):
                kept.append(group)
            else:
                yield group

    def _next_groups(self, rollout_id: int, chunk: int, stats: Any) -> Iterator[list[Sample]]:
        """New groups of the next ``chunk`` prompts, counted as submitted."""
        for record in self.dataset.next_batch(chunk):
            group = self.new_group(record, rollout_id)
            stats.submitted_groups += 1
            yield group

    def new_group(self, record: PromptRecord, rollout_id: int) -> list[Sample]:
        """``n`` fresh samples of one prompt (its ``--tool-key`` tools in ``metadata["tools"]``)."""
        group_index = self.next_group_index
        self.next_group_index += 1
        metadata = record.metadata
        tokens = self.prompt_ids(record.prompt, metadata.get("tools"))
        return [
            Sample(
                prompt=record.prompt,
                tokens=list(tokens),
                label=record.label,
                metadata={**metadata, "prompt_index": record.index, "rollout_id": rollout_id},
                group_index=group_index,
                index=group_index * self.config.n_samples_per_prompt + i,
                loss_mask=[],
                rollout_log_probs=[],
            )
            for i in range(self.config.n_samples_per_prompt)
        ]

    # -- one rollout ----------------------------------------------------------

    def generate(self, rollout_id: int) -> tuple[list[list[Sample]], RolloutStats]:
        """Fill a batch of ``--rollout-batch-size`` scored groups."""
        if self.custom_generate is not None:
            return asyncio.run(self._generate_custom(rollout_id))
        config = self.config
        stats = RolloutStats()
        target = config.rollout_batch_size
        chunk = config.over_sampling_batch_size or target
        kept: list[list[Sample]] = []
        in_flight: dict[str, tuple[list[Sample], int]] = {}  # rid -> (group, sample position)
        waiting: dict[int, list[Sample]] = {}  # group_index -> group with samples in flight
        carried, self.buffer = take_buffered(config, rollout_id, self.buffer)  # --buffer-filter-path
        for group in self._groups_to_continue(carried, kept):
            self.submit_group(group, rollout_id, in_flight, waiting, kept, stats)
        while len(kept) < target:
            self._check_progress(rollout_id, kept, stats)
            if not in_flight:
                for group in self._next_groups(rollout_id, chunk, stats):
                    self.submit_group(group, rollout_id, in_flight, waiting, kept, stats)
                if not in_flight:
                    continue  # every new group failed at submission (counted) or was kept
            for output in self.backend.step():
                self.absorb(output, in_flight, waiting, kept, stats)
        self._wind_down(kept[target:], in_flight, waiting, stats)
        self._check_failures(rollout_id, stats)
        return kept[:target], stats

    def _check_progress(self, rollout_id: int, kept: list, stats: RolloutStats) -> None:
        """Stop a rollout that cannot fill its batch: too many failed samples, or a dynamic
        sampling filter that drops nearly every group."""
        target = self.config.rollout_batch_size
        if stats.finished_samples >= target * self.config.n_samples_per_prompt:
            self._check_failures(rollout_id, stats)  # a filter dropping failed groups would resubmit forever
        if stats.submitted_groups > max(64 * target, 1024):
            raise RuntimeError(
                f"rollout {rollout_id}: {stats.submitted_groups} groups submitted but only {len(kept)} of "
                f"{target} kept ({stats.filtered_groups} filtered by dynamic sampling); the filter drops "
                "nearly everything: check the reward or the --dynamic-sampling-filter-path function"
            )

    def _check_failures(self, rollout_id: int, stats: RolloutStats) -> None:
        check_failed_fraction(rollout_id, stats.failed_samples, stats.finished_samples, stats.first_failure,
                              self.config.max_failed_sample_fraction)

    # -- custom generate functions ----------------------------------------------

    async def _generate_custom(self, rollout_id: int) -> tuple[list[list[Sample]], RolloutStats]:
        """:meth:`generate` with ``--custom-generate-function-path``: the trajectories of every
        group run concurrently (:mod:`miles_host.custom_generate`); a new chunk of prompts is
        started once none is running, as in the engine path. When the batch is full, running
        trajectories are aborted: with ``--partial-rollout`` their groups continue first in the
        next rollout (the function is called again on their ABORTED samples)."""
        config = self.config
        stats = RolloutStats()
        target = config.rollout_batch_size
        kept: list[list[Sample]] = []
        running: dict[asyncio.Task, list[Sample]] = {}
        carried, self.buffer = take_buffered(config, rollout_id, self.buffer)  # --buffer-filter-path
        async with EngineDriver(self.backend, config.rollout_return_routed_experts) as driver:
            runner = TrajectoryRunner(self, self.custom_generate, driver, config.sglang_server_concurrency,
                                      self.sessions())
            try:
                await self._run_custom_rollout(runner, driver, rollout_id, carried, kept, running, stats)
                surplus, unfinished = kept[target:], []
                await driver.abort()
                for task, group in running.items():
                    await task
                    if any(s.status is Status.ABORTED for s in group):
                        unfinished.append(group)
                    else:  # finished while the batch filled up: scored, kept for the next rollout
                        await asyncio.to_thread(self.finish_group, group, surplus, stats)
            except BaseException:
                # a stopped rollout (too many failures, Ctrl-C): answer every waiting request so worker
                # threads blocked in session.generate return, and end the trajectories still running
                await driver.abort()
                for task in running:
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)
                raise
            finally:
                runner.close()
            stats.generated_tokens = driver.generated_tokens
        self._carry_over(surplus, unfinished, stats)
        self._check_failures(rollout_id, stats)
        # trajectories finish in any order: the batch in prompt order, the same for the same groups
        return sorted(kept[:target], key=lambda group: group[0].group_index), stats

    def sessions(self):
        """The session server of ``--use-session-server`` (started on first use), else None."""
        if not self.config.use_session_server:
            return None
        if self.session_server is None:
            from miles_host.agentic.session_server import SessionServer
            from miles_host.agentic.tool_parsers import detect_tool_parser

            checkpoint = self.config.hf_checkpoint or "policy"
            parser = detect_tool_parser(_model_type(checkpoint), getattr(self.tokenizer, "chat_template", None))
            self.session_server = SessionServer(self.tokenizer, Path(checkpoint).name, parser,
                                                port=self.config.session_server_port).start()
            weakref.finalize(self, self.session_server.stop)  # with the manager, or at exit
        return self.session_server

    async def _run_custom_rollout(self, runner: TrajectoryRunner, driver: EngineDriver, rollout_id: int,
                                  carried: list, kept: list, running: dict, stats: RolloutStats) -> None:
        """Start groups (carried ones first) until ``kept`` holds the batch."""
        config = self.config
        target, chunk = config.rollout_batch_size, config.over_sampling_batch_size or config.rollout_batch_size
        for group in self._groups_to_continue(carried, kept):
            running[self.start_custom_group(runner, group, rollout_id)] = group
        while len(kept) < target:
            self._check_progress(rollout_id, kept, stats)
            if not running:
                for group in self._next_groups(rollout_id, chunk, stats):
                    running[self.start_custom_group(runner, group, rollout_id)] = group
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                await asyncio.to_thread(self.finish_group, running.pop(task), kept, stats)

    def start_custom_group(self, runner: TrajectoryRunner, group: list[Sample], rollout_id: int) -> asyncio.Task:
        """A task running the trajectories of the group's unfinished samples at once."""
        calls = []
        for position, sample in enumerate(group):
            if sample.status not in (Status.PENDING, Status.ABORTED):
                continue
            seed = sampling_seed(self.config.rollout_seed, rollout_id, sample.group_index, position,
                                 sample.response_length)
            params = self.sampling_params(max(self.config.rollout_max_response_len - sample.response_length, 1), seed)
            prefix = f"custom-r{rollout_id}-g{sample.group_index}-s{position}-{sample.response_length}"
            calls.append((position, runner.run(sample, params, prefix)))

        async def run_group() -> None:
            results = await asyncio.gather(*(call for _, call in calls))
            for (position, _), sample in zip(calls, results):
                group[position] = sample

        return asyncio.create_task(run_group())

    def run_custom_samples(self, samples: list[Sample], sampling_params: list[dict], rid_prefixes: list[str]) -> list[Sample]:
        """The custom generate function over ``samples`` at once (evaluation); the filled samples."""

        async def run_all() -> list[Sample]:
            async with EngineDriver(self.backend, self.config.rollout_return_routed_experts) as driver:
                runner = TrajectoryRunner(self, self.custom_generate, driver, self.config.sglang_server_concurrency,
                                          self.sessions())
                try:
                    return await asyncio.gather(*(runner.run(sample, params, prefix) for sample, params, prefix
                                                  in zip(samples, sampling_params, rid_prefixes)))
                finally:
                    runner.close()

        return asyncio.run(run_all())

    def submit_group(self, group, rollout_id, in_flight, waiting, kept=None, stats=None) -> None:
        """Submit a group's unfinished samples: a fresh group as one request with
        ``n`` samples (the prompt is prefilled once and shared), continued
        samples one request each."""
        pending = [i for i, s in enumerate(group) if s.status in (Status.PENDING, Status.ABORTED)]
        waiting[group[0].group_index] = group
        fresh = len(pending) == len(group) and all(group[i].response_length == 0 for i in pending)
        requests = [pending] if fresh else [[position] for position in pending]
        for positions in requests:
            sample = group[positions[0]]
            remaining = self.config.rollout_max_response_len - sample.response_length
            rid = f"r{rollout_id}-g{sample.group_index}-s{positions[0]}-{sample.response_length}"
            seed = sampling_seed(self.config.rollout_seed, rollout_id, sample.group_index, positions[0], sample.response_length)
            params = {**self.sampling_params(max(remaining, 1), seed), "n": len(positions)}
            try:
                self.backend.submit(rid, sample.tokens, params, self.config.rollout_return_routed_experts)
            except ValueError as error:  # a bad prompt fails alone
                for position in positions:
                    group[position].status = Status.FAILED
                    group[position].metadata["failure"] = f"rollout: {error}"
                continue
            for k, position in enumerate(positions):
                group[position].status = Status.PENDING
                in_flight[(rid, k)] = (group, position)
        if not any(s.status is Status.PENDING for s in group):
            # nothing could be submitted (every sample failed): the group is done, failures counted
            waiting.pop(group[0].group_index, None)
            if all(s.status is Status.FAILED for s in group) and kept is not None:
                self.finish_group(group, kept, stats)

    def absorb(self, output: dict, in_flight, waiting, kept, stats) -> None:
        """Apply an engine output to its sample; a group with no sample left generating is
        finished (scored, filtered, into ``kept``) unless one of its samples was aborted."""
        key = (output["meta_info"]["id"], output["meta_info"].get("index", 0))
        if key not in in_flight:  # not ours (e.g. a request of an earlier, aborted rollout)
            return
        group, position = in_flight.pop(key)
        sample = group[position]
        self.apply_output(sample, output)
        stats.generated_tokens += len(output["output_ids"])
        if all(s.status is not Status.PENDING for s in group) and group[0].group_index in waiting:
            waiting.pop(group[0].group_index)
            if any(s.status is Status.ABORTED for s in group):
                return
            self.finish_group(group, kept, stats)

    def apply_output(self, sample: Sample, output: dict) -> None:
        """Append an engine result to a sample (continuing a partial one)."""
        meta = output["meta_info"]
        new_ids = list(output["output_ids"])
        if meta.get("routed_experts") is not None:
            merge_routed_experts(sample, meta["routed_experts"])
        logprobs = [entry[0] for entry in meta.get("output_token_logprobs", [])]
        sample.tokens.extend(new_ids)
        sample.response_length += len(new_ids)
        sample.rollout_log_probs.extend(logprobs)
        sample.loss_mask.extend([1] * len(new_ids))
        sample.weight_versions.extend([meta.get("weight_version")] if new_ids else [])
        sample.token_weight_versions.extend(output_token_versions(meta, len(new_ids)))
        if self.config.mask_offpolicy_in_partial_rollout:
            mask_older_versions(sample)
        sample.spec_info.update({k: v for k, v in meta.items() if k.startswith("spec_")})
        sample.response = self.tokenizer.decode(sample.tokens[sample.prompt_length :], skip_special_tokens=True)
        reason = meta["finish_reason"] or {}
        kind = reason.get("type")
        if kind == "abort":
            message = reason.get("message", "")
            if message and message != "aborted":
                sample.status = Status.FAILED
                sample.metadata["failure"] = f"rollout: {message}"
            else:
                sample.status = Status.ABORTED
        elif kind == "length":
            sample.status = Status.TRUNCATED
        else:
            sample.status = Status.COMPLETED

    def finish_group(self, group: list[Sample], kept: list, stats: RolloutStats) -> None:
        """Score a finished group, count its failures, and keep it unless the dynamic sampling
        filter drops it."""
        self.scorer.score_group(group)
        failed = [s for s in group if s.status is Status.FAILED]
        stats.failed_samples += len(failed)
        stats.finished_samples += len(group)
        if failed and stats.first_failure is None:
            stats.first_failure = failed[0].metadata.get("failure", "no reason recorded")
        if self.keep_group is not None and not self.keep_group(group, self.scorer.scalar):
            stats.filtered_groups += 1
            return
        kept.append(group)

    def _wind_down(self, surplus: list[list[Sample]], in_flight, waiting, stats) -> None:
        for output in self.backend.abort_all():
            key = (output["meta_info"]["id"], output["meta_info"].get("index", 0))
            if key in in_flight:
                group, position = in_flight.pop(key)
                self.apply_output(group[position], output)
                if group[position].status is Status.COMPLETED:
                    group[position].status = Status.ABORTED
        unfinished = list(waiting.values())
        for group in unfinished:
            for sample in group:
                if sample.status is Status.PENDING:
                    sample.status = Status.ABORTED
        self._carry_over(surplus, unfinished, stats)

    def _carry_over(self, surplus: list[list[Sample]], unfinished: list[list[Sample]], stats: RolloutStats) -> None:
        """Groups beyond the batch and unfinished groups: buffered with ``--partial-rollout``,
        dropped (and counted) otherwise."""
        if self.config.partial_rollout:
            self.buffer = self.buffer + surplus + unfinished  # groups --buffer-filter-path left wait first
            stats.buffered_samples = sum(len(g) for g in self.buffer)
        else:
            stats.dropped_samples = sum(len(g) for g in surplus + unfinished)

    def state_dict(self) -> dict:
        """The partial-rollout buffer and counters, for checkpoints."""
        return {
            "buffer": [[s.to_dict() for s in group] for group in self.buffer],
            "next_group_index": self.next_group_index,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.buffer = [[Sample.from_dict(s) for s in group] for group in state["buffer"]]
        self.next_group_index = int(state["next_group_index"])


def mask_older_versions(sample: Sample) -> None:
    """``--mask-offpolicy-in-partial-rollout``: tokens generated by weights older than the
    sample's newest are not trained."""
    versions = sample.token_weight_versions
    known = [v for v in versions if v is not None]
    if not known:
        return
    newest = max(known)
    for i, version in enumerate(versions):
        if version is not None and version != newest:
            sample.loss_mask[i] = 0


def merge_routed_experts(sample: Sample, routed: Any) -> None:
    """Take the engine's ``[tokens - 1, moe_layers, topk]`` routes for a sample.

    A continued (partial-rollout) sample keeps the routes its earlier tokens were
    generated with; only rows of tokens new in this segment come from ``routed``.
    """
    import numpy as np

    if isinstance(routed, str):  # SGLang's HTTP form: base64 int32, reshaped by the caller's layout
        raise ValueError("base64 routed_experts must be decoded by the backend before reaching the manager")
    routed = np.asarray(routed)
    previous = sample.rollout_routed_experts
    if previous is None or previous.size == 0:
        sample.rollout_routed_experts = compact_expert_ids(routed)
        return
    keep = previous.shape[0]
    merged = np.concatenate([previous.astype(np.int64), routed[keep:].astype(np.int64)], axis=0)
    sample.rollout_routed_experts = compact_expert_ids(merged)


def _model_type(checkpoint: str) -> str | None:
    config = Path(checkpoint) / "config.json"
    return json.loads(config.read_text()).get("model_type") if config.is_file() else None


def _eos_ids(tokenizer: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else list(eos or [])
