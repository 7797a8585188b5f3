"""The RL loop: rollout -> reward -> advantages -> train -> weight sync, repeated.

:class:`Run` is one ``miles run`` in this process;
:func:`miles_host.distributed.launcher.run_training` starts it (over trainer and engine
processes when the run needs them). Every component
comes from a registry that plugins fill (rollout backend, trainer, weight-sync
transport, reward, advantage estimator, corrections, loggers).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles_host.checkpoint import (
    fresh_start_note,
    has_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from miles_host.config_training_modes import trains_only
from miles_host import profiling
from miles_host.dashboard.samples import write_step_samples
from miles_host.data import PromptDataset
from miles_host.debug_rollout import (NoEngine, load_debug_rollout_data, rollout_data_template, save_debug_rollout_data,
                                      save_debug_train_data, train_data_template)
from miles_host.evaluation import load_eval_datasets, run_evals
from miles_host.health import RunStopped, TooManyFailedSamples, ZeroGradientWatch
from miles_host.logging_backends import tensorboard_dir
from miles_host.lr_schedule import resolve_lr_decay_iters
from miles_host.opd.teachers import build_teacher_scoring
from miles_host.phases import Phases
from miles_host.progress import Progress
from miles_host.protocols import MetricsLogger, RolloutBackend, Trainer, WeightSyncTransport, build
from miles_host.reward import RewardScorer
from miles_host.reward_post_process import apply_reward_post_process
from miles_host.rollout_function import FunctionRollout, resolve_rollout_function_path
from miles_host.rollout_manager import RolloutManager
from miles_host.run_control import SaveLock, Stopped, StopSignals, remove_partial_files
from miles_host.sample import Sample, Status
from miles_host.sample_filters import apply_rollout_sample_filter
from miles_host.tokenizer_loading import load_tokenizer
from miles_host.validation import validate
from miles_host.lora import save_checkpoint_adapter, save_hf_checkpoint
from miles_host.lora.sync import SyncSelection
from miles_host.validation.output_paths import save_hf_path


class NanLossError(RunStopped):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


def seed_everything(seed: int) -> None:
    """Python, numpy and torch RNGs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def num_rollouts(config: Any, dataset: PromptDataset) -> int:
    """``--num-rollout``, or ``--num-epoch`` passes over the prompts."""
    if config.num_rollout is not None:
        return config.num_rollout
    epochs = config.num_epoch or 1
    return max(1, math.ceil(epochs * len(dataset.prompts) / config.rollout_batch_size))


@dataclass
class RunState:
    """What the loop carries between steps."""

    rollout_id: int = 0
    history: list[dict] = field(default_factory=list)
    weight_version: int = 0


class Run:
    """One ``miles run``: components built from the registries, then the loop."""

    def __init__(self, config: Any, manager: Any):
        self.config = config
        self.manager = manager
        registries = manager.registries
        validate(config, registries, manager.hook)  # what --dry-run checks, for the Python API too
        self.stops = StopSignals()  # SIGINT / SIGTERM / SIGHUP: a checkpoint, then exit 128 + signal
        self.save_lock = SaveLock(config.save) if config.save else None  # one run per --save directory
        if config.save:
            for path in remove_partial_files(Path(config.save)):
                print(f"miles: removed {path}, left by a save that did not finish", file=sys.stderr)
        if config.output_dir is None:
            config.output_dir = str(Path("outputs") / time.strftime("%Y%m%d-%H%M%S"))
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        print(f"miles: output directory {config.output_dir}", file=sys.stderr)
        seed_everything(config.seed)
        self.tokenizer = load_tokenizer(config.hf_checkpoint)  # an empty tokenizer is refused here
        self.zero_gradients = ZeroGradientWatch(config)  # warns when the policy stops changing
        max_prompt = config.rollout_max_prompt_len
        self.dataset = PromptDataset.from_file(
            config.prompt_data,
            config.input_key,
            config.label_key,
            config.metadata_key,
            config.rollout_shuffle,
            config.rollout_seed,
            # a rollout function reads the records as they are (slime's SFT rollout: chat messages, no template)
            apply_chat_template=(config.apply_chat_template or None)
            if resolve_rollout_function_path(config.rollout_function_path) else config.apply_chat_template,
            tool_key=config.tool_key,
        )
        self.eval_datasets = load_eval_datasets(config)  # --eval-config or --eval-prompt-data
        #: --debug-train-only / --load-debug-rollout-data: no engine is started
        self.backend = NoEngine() if trains_only(config) else build(
            registries.rollout_backends, config.rollout_backend, RolloutBackend, config, manager)
        self.scorer = RewardScorer(config, registries.reward_functions)
        self.teacher = build_teacher_scoring(config)  # --use-opd: scores each step's samples
        self.rollout = RolloutManager(config, self.backend, self.tokenizer, self.scorer, self.dataset)
        #: --rollout-function-path (None: the built-in rollout manager generates)
        self.rollout_function = None
        if resolve_rollout_function_path(config.rollout_function_path) is not None:
            self.rollout_function = FunctionRollout(config, config.rollout_function_path, self.rollout)
        if max_prompt is not None:
            self.dataset.prompts = [
                p for p in self.dataset.prompts if len(self.rollout.prompt_ids(p.prompt, p.metadata.get("tools"))) <= max_prompt
            ]
            if not self.dataset.prompts:
                raise ValueError(f"every prompt is longer than --rollout-max-prompt-len {max_prompt}")
        self.loggers = [build(registries.loggers, record.name, MetricsLogger, config)
                        for record in registries.loggers if record.enabled(config)]
        self.state = RunState()
        self.total = num_rollouts(config, self.dataset)
        resolve_lr_decay_iters(config, self.total)  # before any trainer exists: they all read it
        # the resolved config (the schedule's length included): what this run trains with
        (Path(config.output_dir) / "config.json").write_text(json.dumps(config.to_dict(), indent=2, default=str))
        self.trainer = build(registries.train_backends, config.train_backend, Trainer, config, manager)
        self.transport = build(registries.weight_sync_transports, config.weight_sync, WeightSyncTransport, config)
        #: what each sync sends (--lora-sync adapter: the base once, then adapters only) and its size
        self.sync_selection = SyncSelection(config)
        self.phases = Phases.from_config(config, self.trainer, self.backend)  # --colocate, --offload-*
        self.training_started = False
        #: the trainer moved past the last logged rollout (a checkpoint written now would mix states)
        self.trained_unlogged = False
        #: the last rollout whose training finished
        self.trained_rollout = -1
        #: data and buffer positions where the step under way began (None between steps)
        self.step_start: dict | None = None
        #: --use-pytorch-profiler / --record-memory-history (made when the loop starts)
        self.profiler: profiling.RunProfiler | None = None

    # -- pieces of a step --------------------------------------------------------

    def sync_weights(self, version: int | None = None) -> float:
        """Push the trainer's weights to the engine as weight ``version`` (the number of
        training steps behind them; default: the next version); seconds taken."""
        start = time.perf_counter()
        version = self.state.weight_version + 1 if version is None else version
        self.state.weight_version = version
        if trains_only(self.config):  # no engine to push to
            return 0.0
        if getattr(self.trainer, "streams_weights", False) and not self.sync_selection.lora:
            # a sharded trainer gathers its weights bucket by bucket: each pushed as it comes
            tensors = nbytes = 0
            for bucket in self.trainer.weight_buckets(int(self.config.update_weight_buffer_size)):
                self.transport.push(bucket, self.backend, version)
                tensors, nbytes = tensors + len(bucket), nbytes + sum(t.numel() * t.element_size() for _, t in bucket)
            self.sync_selection.count(tensors, nbytes)
            return time.perf_counter() - start
        named = self.sync_selection.select(self.trainer.named_weights_for_rollout())
        self.transport.push(named, self.backend, version)
        return time.perf_counter() - start

    def checkpoint(self, rollout_id: int, positions: dict | None = None, stopping: bool = False) -> None:
        """Write a resumable checkpoint (``--save``) and HF weights (``--save-hf``).

        ``positions`` (data and rollout-buffer state) overrides the current ones: an
        interrupted step saves where that step began, so its prompts are not skipped.
        A stop signal that arrives meanwhile waits for the write (and, unless
        ``stopping``, stops the run after it)."""
        if not (self.config.save or self.config.save_hf):
            return
        where = " and ".join(str(p) for p in (self.config.save, self.config.save_hf) if p)
        print(f"miles: saving checkpoint of rollout {rollout_id} to {where} ...", file=sys.stderr, flush=True)
        with self.stops.saving(stopping):
            self._write_checkpoint(rollout_id, positions)

    def step_positions(self) -> dict:
        """Data and rollout-buffer positions where a step begins (a checkpoint of an
        interrupted step restores them, so its prompts are not skipped)."""
        return {"rollout": self.rollout.state_dict(), "data": self.dataset.state_dict()}

    def current_positions(self, positions: dict | None) -> dict:
        """The positions a checkpoint records: ``positions`` (from :meth:`step_positions`),
        or the current ones."""
        return positions or self.step_positions()

    def restore_positions(self, state: dict) -> None:
        """Undo :meth:`current_positions` from a checkpoint's state."""
        self.rollout.load_state_dict(state["rollout"])
        self.dataset.load_state_dict(state["data"])

    def _write_checkpoint(self, rollout_id: int, positions: dict | None) -> None:
        positions = self.current_positions(positions)
        if self.config.save:
            folder = save_checkpoint(
                self.config.save,
                rollout_id,
                {
                    "trainer": self.trainer.state_dict(),
                    "rollout": positions["rollout"],
                    "data": positions["data"],
                    "history": self.state.history,
                    "weight_version": self.state.weight_version,
                },
                write_shards=self.trainer.save_shards,
            )
            save_checkpoint_adapter(self.trainer, folder, self.config)  # a LoRA run's PEFT adapter beside it
            prune_checkpoints(self.config.save, rollout_id, self.config.save_retain_interval)
        if self.config.save_hf:
            path = save_hf_path(self.config.save_hf, rollout_id)
            save_hf_checkpoint(self.trainer, path, self.config)  # a LoRA run: its PEFT adapter (or merged weights)
            self.tokenizer.save_pretrained(path)

    def resume(self) -> None:
        """``--load``: restore everything and continue after the saved rollout."""
        state = load_checkpoint(self.config.load)
        self.trainer.load_state_dict(state["trainer"])
        self.restore_positions(state)
        self.state.history = list(state.get("history", []))
        self.state.weight_version = int(state.get("weight_version", 0))
        self.state.rollout_id = int(state["rollout_id"]) + 1
        print(f"miles: resumed from {self.config.load} after rollout {state['rollout_id']}", file=sys.stderr)

    def dump(self, rollout_id: int, samples: list[Sample]) -> None:
        """``--dump-rollouts``: the step's samples as JSONL."""
        path = Path(self.config.output_dir) / "rollouts" / f"rollout_{rollout_id:05d}.jsonl"
        try:
            path.parent.mkdir(exist_ok=True)
            with path.open("w") as handle:
                for sample in samples:
                    handle.write(json.dumps(sample.to_dict(), default=str) + "\n")
        except OSError as error:  # a dump is a copy for inspection: the run goes on without it
            with contextlib.suppress(OSError):
                path.unlink()
            print(f"miles: warning: --dump-rollouts could not write {path} ({error.strerror or error}); "
                  "rollout not dumped, the run continues", file=sys.stderr)

    def run_eval(self, rollout_id: int) -> dict[str, float]:
        """``--eval-config`` / ``--eval-prompt-data``: accuracy (mean reward) per named data set
        (and pass@k with ``--log-passrate``)."""
        start = time.perf_counter()
        metrics = run_evals(self.config, self.rollout, rollout_id, self.eval_datasets)
        if metrics:
            metrics["perf/eval_time_s"] = time.perf_counter() - start  # a phase of the dashboard's timeline
            print(
                f"miles: eval after {rollout_id} rollout(s): "
                + ", ".join(f"{k.split('/')[1]} accuracy {v:.1%}" for k, v in metrics.items() if k.endswith("/accuracy")),
                file=sys.stderr,
            )
        return metrics

    def generate(self, rollout_id: int) -> tuple[list[list[Sample]], Any]:
        """The step's groups and rollout counts: loaded (``--load-debug-rollout-data``), from the
        ``--rollout-function-path`` function, or from the built-in rollout manager."""
        config = self.config
        if config.load_debug_rollout_data:
            return load_debug_rollout_data(config.load_debug_rollout_data, rollout_id,
                                           config.load_debug_rollout_data_subsample)
        if self.rollout_function is not None:
            groups, stats = self.rollout_function.generate(rollout_id)
        else:
            groups, stats = self.rollout.generate(rollout_id)
            removed = apply_rollout_sample_filter(config, groups)  # --rollout-sample-filter-path
            if config.rollout_sample_filter_path:
                stats.extra.setdefault("metrics", {})["rollout/removed_samples"] = removed
        if config.custom_reward_post_process_path:  # (loaded debug data was saved after it)
            stats.extra.setdefault("metrics", {}).update(apply_reward_post_process(config, groups))
        return groups, stats

    def step(self, rollout_id: int) -> dict[str, Any]:
        """One RL step; its metrics."""
        step_start = time.perf_counter()
        self.scorer.pop_busy_time()  # scoring outside the rollout (evaluation) is not the step's
        groups, stats = self.generate(rollout_id)
        rollout_time = time.perf_counter() - step_start
        rollout_metrics = {
            "perf/rollout_time_s": rollout_time,
            "perf/reward_time_s": self.scorer.pop_busy_time(),  # scored while the rollout generates
            "perf/rollout_tok_per_s": stats.generated_tokens / rollout_time if rollout_time > 0 else 0.0,
            **stats.extra.get("metrics", {}),
            **getattr(self.backend, "step_metrics", dict)(),  # e.g. ft/engine_restarts
        }
        if self.config.debug_rollout_only:
            return self.rollout_only_step(rollout_id, groups, stats, step_start, rollout_metrics)
        return self.train_step(rollout_id, groups, stats, step_start, rollout_metrics)

    def rollout_only_step(self, rollout_id: int, groups: list[list[Sample]], stats: Any, step_start: float,
                          rollout_metrics: dict[str, Any]) -> dict[str, Any]:
        """``--debug-rollout-only``: the rollout saved and summarised; no training, no weight push."""
        samples = [s for group in groups for s in group]
        rollout_metrics.update(self.score_with_teacher(samples))
        self.save_rollout(rollout_id, groups, stats, samples)
        self.write_dashboard_samples(rollout_id, groups)
        metrics = {"rollout_id": rollout_id, **self.rollout_summary(samples, stats), **rollout_metrics}
        if self.config.eval_interval and (rollout_id + 1) % self.config.eval_interval == 0:
            metrics.update(self.run_eval(rollout_id + 1))
        metrics["perf/step_time_s"] = time.perf_counter() - step_start
        return metrics

    def score_with_teacher(self, samples: list[Sample]) -> dict[str, float]:
        """``--use-opd``: the teacher's log-probs of the step's samples, after generation and
        before they are saved or trained (:mod:`miles_host.opd.teachers`); its metrics."""
        return self.teacher.score(samples) if self.teacher is not None else {}

    def save_rollout(self, rollout_id: int, groups: list[list[Sample]], stats: Any, samples: list[Sample]) -> None:
        """``--save-debug-rollout-data`` (or ``--dump-details``) and ``--dump-rollouts``: the step's
        samples, before training."""
        template = rollout_data_template(self.config)
        if template:
            save_debug_rollout_data(template, rollout_id, groups, stats)
        if self.config.dump_rollouts:
            self.dump(rollout_id, samples)

    def write_dashboard_samples(self, rollout_id: int, groups: list[list[Sample]]) -> None:
        """``--use-miles-dashboard``: the step's first groups for the rollout browser (with the
        trainer's log-probs once it trained on them)."""
        if self.config.use_miles_dashboard:
            write_step_samples(self.config.output_dir, rollout_id, groups, self.tokenizer, self.scorer.scalar,
                               self.config.miles_dashboard_samples_per_step)

    def rollout_summary(self, samples: list[Sample], stats: Any) -> dict[str, Any]:
        """The ``rollout/*`` metrics of a step's samples and counts."""
        scored = [s for s in samples if s.status is not Status.FAILED]
        rewards = [self.scorer.scalar(s.reward) for s in scored]
        return {
            "rollout/reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
            "rollout/response_len_mean": float(np.mean([s.response_length for s in samples])) if samples else 0.0,
            "rollout/truncated_ratio": float(np.mean([s.status is Status.TRUNCATED for s in samples])) if samples else 0.0,
            "rollout/failed_samples": stats.failed_samples,
            "rollout/filtered_groups": stats.filtered_groups,
            "rollout/dropped_samples": stats.dropped_samples,
            "rollout/buffered_samples": stats.buffered_samples,
        }

    def weights_due(self, rollout_id: int) -> bool:
        """Whether the weights go to the engines after training rollout ``rollout_id``
        (every ``--update-weights-interval`` steps, and after the last)."""
        return (rollout_id + 1) % self.config.update_weights_interval == 0 or rollout_id + 1 == self.total

    def push_weights(self, rollout_id: int) -> float:
        """After training rollout ``rollout_id``: the new weights to the engines when due
        (version: the training steps behind them); seconds taken."""
        if not self.weights_due(rollout_id):
            return 0.0
        return self.sync_weights(version=rollout_id + 1)

    def train_step(self, rollout_id: int, groups: list[list[Sample]], stats: Any, step_start: float,
                   rollout_metrics: dict[str, Any]) -> dict[str, Any]:
        """Train on a rollout's groups, push the weights, evaluate when due; the step's metrics."""
        config = self.config
        samples = [s for group in groups for s in group]
        rollout_metrics.update(self.score_with_teacher(samples))
        self.save_rollout(rollout_id, groups, stats, samples)
        self.phases.to_train()
        train_start = time.perf_counter()
        self.training_started = self.trained_unlogged = True
        with profiling.region("train_actor"):
            train_metrics = self.trainer.train(samples)
        self.trained_rollout = rollout_id
        counters = self.rank_counters()
        train_time = time.perf_counter() - train_start
        train_tokens = sum(len(s.tokens) for s in samples if s.status is not Status.FAILED)
        template = train_data_template(self.config)
        if template:  # --save-debug-train-data / --dump-details, with the trainer's log-probs
            save_debug_train_data(template, rollout_id, samples, self.scorer.scalar)
        self.write_dashboard_samples(rollout_id, groups)  # with the trainer's log-probs
        if self.trainer.consecutive_nan_steps >= config.max_consecutive_nan_steps:
            self.checkpoint(rollout_id)
            raise NanLossError(
                f"{self.trainer.consecutive_nan_steps} optimizer steps in a row had a NaN/Inf loss or gradient; "
                "stopping (checkpoint written if --save). Lower --lr or check the data and rewards."
            )
        sync_time = self.phases.to_rollout(lambda: self.push_weights(rollout_id))
        metrics: dict[str, Any] = {
            "rollout_id": rollout_id,
            **self.rollout_summary(samples, stats),
            "rollout/weight_version": self.state.weight_version,
            **train_metrics,
            **rollout_metrics,
            "perf/train_time_s": train_time,
            "perf/weight_sync_time_s": sync_time,
            **self.sync_selection.pop_metrics(),  # perf/weight_sync_bytes, perf/weight_sync_tensors
            "perf/train_tok_per_s": train_tokens / train_time if train_time > 0 else 0.0,
        }
        if self.phases.plan.active:
            metrics["perf/phase_switch_time_s"] = self.phases.pop_switch_time()
        if config.eval_interval and (rollout_id + 1) % config.eval_interval == 0:
            metrics.update(self.run_eval(rollout_id + 1))
        self.zero_gradients.observe(metrics, groups, self.scorer.scalar)
        metrics["perf/step_time_s"] = time.perf_counter() - step_start
        failed = self.manager.call_isolated("miles_step_end", rollout_id=rollout_id, metrics=metrics, config=config,
                                            counters=counters)
        if failed:
            metrics["plugins/step_end_failures"] = len(failed)
        return metrics

    def rank_counters(self) -> dict[str, float]:
        """The step's plugin counters of every trainer process (a trainer group adds its ranks' up)."""
        return self.trainer.rank_counters()

    def log(self, metrics: dict, step: int) -> None:
        """Record the step's metrics; a logger that fails is warned about and dropped
        (metrics.jsonl of the jsonl logger is the record of last resort)."""
        self.state.history.append(metrics)
        self.trained_unlogged = False
        for logger in list(self.loggers):
            try:
                logger.log(metrics, step)
            except Exception as error:  # noqa: BLE001 - a logger never takes the run down
                if logger.required:
                    raise  # metrics.jsonl: the run does not go on unrecorded
                print(f"miles: warning: logger {type(logger).__name__} failed and is disabled: {error}", file=sys.stderr)
                self.loggers.remove(logger)

    # -- the loop -----------------------------------------------------------------

    def run(self) -> int:
        """Run every rollout; returns the process exit code. A stop signal ends it with
        a checkpoint (``run_control.Stopped``, a KeyboardInterrupt)."""
        try:
            with self.stops:
                return self._run()
        finally:
            self.release_save_lock()

    def close(self) -> None:
        """Release what the trainer holds (process groups, parallel state) and what the rollout
        backend holds (an in-process engine's device memory): the run's end, however it ended."""
        try:
            self.trainer.close()
        finally:
            self.backend.close()

    def release_save_lock(self) -> None:
        """Let another run use ``--save`` (idempotent)."""
        if self.save_lock is not None:
            self.save_lock.release()

    def _run(self) -> int:
        config = self.config
        if has_checkpoint(config.load):
            self.resume()
        elif config.load:
            print(f"miles: --load {config.load}: {fresh_start_note(config.load, self.trainer)}", file=sys.stderr)
        # the engine samples with exactly the trainer's weights from step one
        self.phases.to_rollout(lambda: self.sync_weights(version=self.state.rollout_id))
        self.phases.pop_switch_time()
        if self.state.rollout_id == 0 and config.eval_prompt_data:
            start_metrics = {"rollout_id": -1, **self.run_eval(0)}
            self.log(start_metrics, -1)
        progress = Progress(self.total, start=self.state.rollout_id, enabled=not config.no_progress)
        self.profiler = profiling.RunProfiler(config, tensorboard_dir(config), first_step=self.state.rollout_id)
        rollout_id = self.state.rollout_id
        try:
            last_logged = self.state.rollout_id - 1
            step_start = None
            for rollout_id in range(self.state.rollout_id, self.total):
                self.step_start = step_start = self.step_positions()
                self.training_started = False
                self.profiler.begin_step(rollout_id)
                metrics = self.step(rollout_id)
                self.log(metrics, rollout_id)
                self.profiler.end_step(rollout_id)
                last_logged, self.step_start = rollout_id, None
                progress.update(rollout_id + 1, metrics.get("rollout/reward_mean"))
                if config.save_interval and (rollout_id + 1) % config.save_interval == 0:
                    self.checkpoint(rollout_id)
        except TooManyFailedSamples:
            progress.close()
            saved = bool(config.save_interval) and rollout_id % config.save_interval == 0
            if config.save and last_logged == rollout_id - 1 >= 0 and not saved:
                # the failing rollout trained nothing: keep the last completed one, and redo this one on resume
                self.checkpoint(rollout_id - 1, step_start)
            raise
        except KeyboardInterrupt as stop:
            progress.close()
            reason = f"stopped by {stop.signal_name}" if isinstance(stop, Stopped) else "interrupted"
            if config.save and last_logged < 0 and last_logged != rollout_id:
                print(f"miles: {reason} in the first rollout; no rollout completed, no checkpoint written",
                      file=sys.stderr)
            elif config.save:
                if last_logged == rollout_id:
                    self.checkpoint(rollout_id, stopping=True)
                else:  # mid-step: resume at the step's first prompt, not after the prompts it consumed
                    self.checkpoint(rollout_id - 1, step_start, stopping=True)
                    if self.training_started:
                        print("miles: warning: interrupted during training: the saved weights include part "
                              f"of rollout {rollout_id}'s update, which a resumed run repeats", file=sys.stderr)
                print(f"miles: {reason}; checkpoint written to {config.save}", file=sys.stderr)
            raise
        progress.close()
        if config.save and not (config.save_interval and self.total % config.save_interval == 0):
            self.checkpoint(self.total - 1)
        elif config.save_hf and not config.save:
            self.checkpoint(self.total - 1)
        if config.eval_prompt_data and not (config.eval_interval and self.total % config.eval_interval == 0):
            self.log({"rollout_id": self.total, **self.run_eval(self.total)}, self.total)
        self.finish()
        return 0

    def finish(self) -> None:
        """Close the profilers and loggers and plot the curves."""
        if self.profiler is not None:
            self.profiler.close()
        for logger in self.loggers:
            logger.close()
        from miles_host.plotting import plot_history

        path = plot_history(self.state.history, Path(self.config.output_dir) / "curves.png")
        if path is not None:
            print(f"miles: curves written to {path}", file=sys.stderr)
        else:
            print("miles: no curves.png (pip install matplotlib to get one)", file=sys.stderr)
