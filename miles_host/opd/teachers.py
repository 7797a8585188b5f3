"""Where the OPD teacher runs (``--opd-type``) and how a step's samples get its log-probs.

:data:`TEACHER_TYPES` maps each ``--opd-type`` to a :class:`TeacherType` record: how
to build the teacher and whether it loads ``--opd-teacher-load`` (in-process) or calls
``--opd-teacher-urls`` (served). A teacher is any object with
``log_probs(samples) -> list[list[float]]`` (one entry per response token).

:class:`TeacherScoring` runs after generation and before training (the loop calls it for
every step's samples, generated or loaded): each sample that generated something and
has no ``teacher_log_probs`` yet gets them, so they travel with the sample into
checkpoints (partial-rollout buffers), ``--save-debug-rollout-data`` and
``--dump-rollouts``. A teacher that fails on a sample fails that sample (its reason in
``metadata['failure']``), as a failing reward does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from miles_host.sample import Sample, Status


@dataclass(frozen=True)
class TeacherType:
    """An ``--opd-type``: ``build(config) -> teacher``; ``loads_checkpoint``: the teacher
    comes from ``--opd-teacher-load`` (else from ``--opd-teacher-urls``)."""

    name: str
    description: str
    build: Callable[[Any], Any]
    loads_checkpoint: bool


def _embedded(config: Any) -> Any:
    from miles_host.opd.embedded import EmbeddedTeacher

    return EmbeddedTeacher(config)


def _served(config: Any) -> Any:
    from miles_host.opd.served import ServedTeacher

    return ServedTeacher(config)


TEACHER_TYPES: dict[str, TeacherType] = {
    record.name: record
    for record in (
        TeacherType("embedded", "a frozen model in this process from --opd-teacher-load", _embedded, True),
        TeacherType("megatron", "upstream's in-process teacher: the embedded one here", _embedded, True),
        TeacherType("sglang", "miles serve or SGLang at --opd-teacher-urls", _served, False),
    )
}


def needs_teacher_log_probs(sample: Sample) -> bool:
    """A sample the teacher scores: it generated something, did not fail, and has no
    teacher log-probs yet."""
    return (sample.status in (Status.COMPLETED, Status.TRUNCATED) and sample.response_length > 0
            and sample.teacher_log_probs is None)


class TeacherScoring:
    """The run's teacher (built once) and the scoring of each step's samples."""

    def __init__(self, config: Any):
        self.teacher = TEACHER_TYPES[config.opd_type].build(config)

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Set ``teacher_log_probs`` on the samples that need them; the step's ``perf/``
        metrics. A batch the teacher cannot score is retried one sample at a time, so a
        failing sample fails alone."""
        start = time.perf_counter()
        pending = [s for s in samples if needs_teacher_log_probs(s)]
        try:
            self._store(pending, self.teacher.log_probs(pending))
        except Exception as batch_error:  # noqa: BLE001 - find the failing samples one by one
            failures = 0
            for sample in pending:
                try:
                    self._store([sample], self.teacher.log_probs([sample]))
                except Exception as error:  # noqa: BLE001 - this sample fails alone
                    failures += 1
                    sample.status = Status.FAILED
                    sample.metadata["failure"] = f"OPD teacher: {type(error).__name__}: {error}"
            if failures == len(pending):  # the teacher itself is broken: nothing to train on
                raise RuntimeError(f"the OPD teacher (--opd-type) scored none of the step's {len(pending)} "
                                   f"samples: {type(batch_error).__name__}: {batch_error}") from batch_error
        return {"perf/opd_teacher_time_s": time.perf_counter() - start,
                "opd/teacher_scored_samples": float(len(pending))}

    @staticmethod
    def _store(samples: list[Sample], log_probs: list[list[float]]) -> None:
        if len(log_probs) != len(samples):
            raise ValueError(f"the teacher returned log-probs of {len(log_probs)} samples for {len(samples)}")
        for sample, values in zip(samples, log_probs):
            if len(values) != sample.response_length:
                raise ValueError(f"the teacher returned {len(values)} log-probs for {sample.response_length} "
                                 "response tokens")
            sample.teacher_log_probs = [float(v) for v in values]


def build_teacher_scoring(config: Any) -> TeacherScoring | None:
    """The run's :class:`TeacherScoring` with ``--use-opd``, else None."""
    return TeacherScoring(config) if config.use_opd else None
