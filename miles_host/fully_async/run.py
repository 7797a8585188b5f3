""":class:`FullyAsyncRun`: ``miles run --fully-async`` (slime's ``train_async.py``).

The loop of :class:`miles_host.loop.Run` with the rollout taken out of the step: a
:class:`~miles_host.fully_async.producer.RolloutProducer` generates on its own thread
from the first step to the last, the trainer takes each batch from the finished-group
buffer (waiting only when the producer is behind), trains, and every
``--update-weights-interval`` steps pushes its weights through the producer, which
applies them between two engine steps (``--pause-generation-mode``).

Each token's weight version travels with its sample; the trainer uses the rollout
log-probs as the behaviour policy (``--use-tis`` and the other off-policy corrections
apply across the version gap), and a group older than ``--max-weight-staleness`` is not
trained. A checkpoint holds the finished and unfinished groups and the prompts to
generate again, so a resumed run trains every generated group once.
"""

from __future__ import annotations

import time
from typing import Any

from miles_host.fully_async.buffer import FinishedGroups, TakeReport
from miles_host.fully_async.custom_producer import CustomGenerateProducer
from miles_host.fully_async.producer import RolloutProducer
from miles_host.health import check_failed_fraction
from miles_host.loop import Run
from miles_host.sample import Sample

#: ``Run.step_start`` while a step is under way: its batch goes back to the buffer in a checkpoint
MID_STEP = {"fully_async": "mid-step"}


def pause_mode(config: Any) -> str:
    """``--pause-generation-mode``, its default resolved (in_place for generate functions,
    whose requests cannot be continued behind their back; retract otherwise)."""
    if config.pause_generation_mode:
        return config.pause_generation_mode
    return "in_place" if config.custom_generate_function_path else "retract"


class FullyAsyncRun(Run):
    """A run whose rollout never waits for training (``--fully-async``)."""

    def __init__(self, config: Any, manager: Any):
        super().__init__(config, manager)
        self.pause_mode = pause_mode(config)
        if self.pause_mode == "in_place" and not getattr(self.backend, "reports_token_weight_versions", False):
            raise ValueError(
                f"--pause-generation-mode in_place: the rollout backend {config.rollout_backend!r} does not say "
                "which weights generated each token of a request that spans a weight update, so staleness and "
                "the off-policy correction would be wrong; use --pause-generation-mode retract")
        capacity = int(config.async_data_buffer_capacity_factor * config.rollout_batch_size)
        self.finished = FinishedGroups(capacity, config.max_weight_staleness, self._stale)
        producer_class = CustomGenerateProducer if self.rollout.custom_generate is not None else RolloutProducer
        self.producer = producer_class(self.rollout, self.finished, config)
        #: the groups of the step under way (taken from the buffer, not yet trained)
        self.batch: list[list[Sample]] = []
        self._last_take: float | None = None

    def _stale(self, group: list[Sample]) -> None:
        self.producer.recycle(group, "stale")

    # -- the step ---------------------------------------------------------------------

    def step(self, rollout_id: int) -> dict[str, Any]:
        step_start = time.perf_counter()
        self.producer.version = self.state.weight_version
        self.producer.start()
        report = TakeReport()
        self.batch = []
        self.finished.take(self.config.rollout_batch_size, rollout_id, report, self.batch)
        stats = self.producer.pop_stats()
        taken_at = time.perf_counter()
        check_failed_fraction(rollout_id, stats.failed_samples, stats.finished_samples, stats.first_failure,
                              self.config.max_failed_sample_fraction)
        # the producer's counts cover the time since the last take (this step's wait, the last one's training)
        produced_for = max(taken_at - (step_start if self._last_take is None else self._last_take), 1e-9)
        self._last_take = taken_at
        rollout_metrics = {
            **report.metrics(),
            "rollout/fully_async/buffer_groups": len(self.finished),
            "rollout/fully_async/in_flight_samples": self.producer.samples_in_flight(),
            "perf/rollout_time_s": report.wait_s,  # what the trainer waited for its batch
            "perf/trainer_idle_time_s": report.wait_s,
            "perf/engine_idle_time_s": stats.extra.get("engine_idle_s", 0.0),
            "perf/engine_idle_fraction": min(1.0, stats.extra.get("engine_idle_s", 0.0) / produced_for),
            "perf/rollout_tok_per_s": stats.generated_tokens / produced_for,
        }
        groups = sorted(self.batch, key=lambda group: group[0].group_index)
        metrics = self.train_step(rollout_id, groups, stats, step_start, rollout_metrics)
        self.batch = []
        return metrics

    def sync_weights(self, version: int | None = None) -> float:
        """The push runs on the producer's thread between two engine steps (requests in
        flight handled by ``--pause-generation-mode``); new requests get ``version``."""
        start = time.perf_counter()
        version = self.state.weight_version + 1 if version is None else version

        def push() -> None:
            Run.sync_weights(self, version)
            self.producer.version = version

        self.producer.call(push, self.pause_mode)
        return time.perf_counter() - start

    def run_eval(self, rollout_id: int) -> dict[str, float]:
        """Evaluation uses the engines between two producer steps, its requests retracted."""
        return self.producer.call(lambda: Run.run_eval(self, rollout_id), "retract")

    # -- checkpoints ----------------------------------------------------------------------

    def step_positions(self) -> dict:
        return MID_STEP

    def current_positions(self, positions: dict | None) -> dict:
        """What a checkpoint restores: the producer's groups (the step's batch first when
        ``positions`` is :data:`MID_STEP`: it was not trained) and the data position."""
        batch = list(self.batch) if positions is MID_STEP else []

        def snapshot() -> dict:
            state = self.producer.state_dict()
            state["finished"] = [[s.to_dict() for s in g] for g in batch] + state["finished"]
            return {"rollout": {"fully_async": state}, "data": self.dataset.state_dict()}

        return self.producer.call(snapshot, "retract")

    def restore_positions(self, state: dict) -> None:
        rollout = state["rollout"]
        if "fully_async" not in rollout:  # a synchronous run's checkpoint: its partial-rollout buffer continues
            self.rollout.load_state_dict(rollout)
            self.producer.to_continue.extend(self.rollout.buffer)
            self.rollout.buffer = []
        else:
            self.producer.load_state_dict(rollout["fully_async"])
        self.dataset.load_state_dict(state["data"])

    def close(self) -> None:
        self.producer.stop()
        super().close()

    def finish(self) -> None:
        self.producer.stop()
        super().finish()
