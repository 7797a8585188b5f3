"""Teacher log-probs: the embedded teacher against transformers' float64 log-softmax of the
same tokens, a miles --save directory as teacher, the served teacher (``miles serve``)
against the embedded one, and the scoring of a step's samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles_host.config import MilesConfig
from miles_host.opd.embedded import EmbeddedTeacher
from miles_host.opd.teachers import TEACHER_TYPES, TeacherScoring
from miles_host.sample import Sample, Status

transformers = pytest.importorskip("transformers")

# (prompt, response) token ids of the character vocabulary (2..13 digits and + =, 1 eos)
PAIRS = [([5, 12, 7, 13], [3, 11, 1]), ([2, 12, 2, 13], [2]), ([9, 12, 9, 13], [3, 10, 4, 6, 1])]


def samples_of(pairs=PAIRS) -> list[Sample]:
    return [Sample(tokens=p + r, response_length=len(r), status=Status.COMPLETED, index=i, group_index=0)
            for i, (p, r) in enumerate(pairs)]


def reference_log_probs(model_dir, pairs=PAIRS, temperature: float = 1.0) -> list[np.ndarray]:
    """transformers' float64 log-prob of each response token given the tokens before it."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).double().eval()
    out = []
    with torch.no_grad():
        for prompt, response in pairs:
            ids = prompt + response
            logits = model(torch.tensor([ids])).logits[0] / temperature
            log_probs = torch.log_softmax(logits, -1)
            positions = range(len(prompt) - 1, len(ids) - 1)
            out.append(np.array([log_probs[t, ids[t + 1]].item() for t in positions]))
    return out


def embedded_config(student, teacher_load, **overrides) -> MilesConfig:
    values = dict(hf_checkpoint=str(student), use_opd=True, opd_type="embedded", opd_teacher_load=str(teacher_load),
                  device="cpu", micro_batch_size=2)
    return MilesConfig(**{**values, **overrides})


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_embedded_teacher_matches_transformers(opd_task, temperature):
    student, teacher, _ = opd_task
    have = EmbeddedTeacher(embedded_config(student, teacher, rollout_temperature=temperature)).log_probs(samples_of())
    for row, want in zip(have, reference_log_probs(teacher, temperature=temperature)):
        np.testing.assert_allclose(row, want, atol=2e-5)


def test_megatron_spelling_is_the_embedded_teacher():
    from miles_host.config_opd import OPD_TYPES

    assert tuple(TEACHER_TYPES) == OPD_TYPES  # the flag's choices are the records
    assert TEACHER_TYPES["megatron"].build is TEACHER_TYPES["embedded"].build
    assert TEACHER_TYPES["megatron"].loads_checkpoint and not TEACHER_TYPES["sglang"].loads_checkpoint


def test_save_directory_teacher_at_a_step_or_the_latest(opd_task, tmp_path):
    """A miles --save directory: the trainer weights of --opd-teacher-ckpt-step (else the latest)
    in the student's architecture."""
    from miles_host.checkpoint import save_checkpoint
    from miles_host.models import load_pretrained

    student, teacher, _ = opd_task
    save = tmp_path / "save"
    save_checkpoint(str(save), 3, {"trainer": {"model": load_pretrained(teacher).state_dict()}})
    save_checkpoint(str(save), 5, {"trainer": {"model": load_pretrained(student).state_dict()}})
    at_3 = EmbeddedTeacher(embedded_config(student, save, opd_teacher_ckpt_step=3)).log_probs(samples_of())
    latest = EmbeddedTeacher(embedded_config(student, save)).log_probs(samples_of())
    for row, want in zip(at_3, reference_log_probs(teacher)):
        np.testing.assert_allclose(row, want, atol=2e-5)
    for row, want in zip(latest, reference_log_probs(student)):
        np.testing.assert_allclose(row, want, atol=2e-5)


def test_served_teacher_matches_the_embedded_one(opd_task):
    """``miles serve`` of the teacher: its prefill's input log-probs are the embedded teacher's."""
    pytest.importorskip("miles_sglang")
    from miles_host.opd.served import ServedTeacher
    from tests.plugins.sglang.conftest import serve

    student, teacher, _ = opd_task
    handle = serve(teacher)
    try:
        served = ServedTeacher(MilesConfig(use_opd=True, opd_type="sglang", opd_teacher_urls=[handle.url]))
        have = served.log_probs(samples_of())
        routed = ServedTeacher(MilesConfig(use_opd=True, opd_type="sglang",
                                           opd_teacher_urls=[f"math={handle.url}/generate"]))
        tagged = samples_of()
        for sample in tagged:
            sample.metadata["opd_teacher"] = "math"
        have_routed = routed.log_probs(tagged)
    finally:
        handle.shutdown()
    embedded = EmbeddedTeacher(embedded_config(student, teacher)).log_probs(samples_of())
    for row, routed_row, want in zip(have, have_routed, embedded):
        np.testing.assert_allclose(row, want, atol=1e-4)
        assert routed_row == row


def test_teacher_urls_parse_and_route():
    from miles_host.opd.served import parse_teacher_urls, teacher_url_for

    assert parse_teacher_urls(["http://h:1"]) == {"default": "http://h:1/generate"}
    routes = parse_teacher_urls(["math=http://a:1/generate", "default=http://b:2"])
    assert routes == {"math": "http://a:1/generate", "default": "http://b:2/generate"}
    sample = Sample(metadata={"opd_teacher": "code"}, index=7)
    assert teacher_url_for(sample, routes, "opd_teacher") == "http://b:2/generate"
    with pytest.raises(ValueError, match="sample 7 has metadata\\['opd_teacher'\\] = 'code'"):
        teacher_url_for(sample, {"math": "http://a:1/generate"}, "opd_teacher")
    with pytest.raises(ValueError, match="twice"):
        parse_teacher_urls(["a=http://x", "a=http://y"])
    with pytest.raises(ValueError, match="NAME=URL"):
        parse_teacher_urls(["http://x", "http://y"])


class _ListTeacher:
    """Log-probs -1 per token; fails on the sample whose index is ``fail_index``."""

    def __init__(self, fail_index=None):
        self.fail_index = fail_index
        self.seen: list[int] = []

    def log_probs(self, samples):
        self.seen.extend(s.index for s in samples)
        if any(s.index == self.fail_index for s in samples):
            raise RuntimeError("teacher down for this one")
        return [[-1.0] * s.response_length for s in samples]


def _scoring(teacher) -> TeacherScoring:
    scoring = TeacherScoring.__new__(TeacherScoring)
    scoring.teacher = teacher
    return scoring


def test_scoring_skips_failed_empty_and_already_scored_samples():
    samples = samples_of()
    samples[0].teacher_log_probs = [-0.5] * samples[0].response_length  # loaded with its teacher log-probs
    samples[1].status = Status.FAILED
    extra = Sample(tokens=[5, 6], response_length=0, status=Status.TRUNCATED, index=9)
    teacher = _ListTeacher()
    metrics = _scoring(teacher).score(samples + [extra])
    assert teacher.seen == [2] and metrics["opd/teacher_scored_samples"] == 1.0
    assert samples[0].teacher_log_probs == [-0.5] * 3 and samples[1].teacher_log_probs is None
    assert samples[2].teacher_log_probs == [-1.0] * samples[2].response_length


def test_a_failing_sample_fails_alone_and_a_broken_teacher_stops_the_run():
    samples = samples_of()
    _scoring(_ListTeacher(fail_index=1)).score(samples)
    assert samples[1].status is Status.FAILED and "teacher down" in samples[1].metadata["failure"]
    assert samples[0].teacher_log_probs is not None and samples[2].teacher_log_probs is not None
    with pytest.raises(RuntimeError, match="scored none of the step's 1 samples"):
        _scoring(_ListTeacher(fail_index=0)).score(samples_of()[:1])


def test_served_answer_checks():
    """The response tokens' entries are the last ones (SGLang: ``[logprob, id, text]``, the
    first input position without a log-prob); a wrong answer is named."""
    from miles_host.opd.served import response_log_probs

    tokens = [5, 12, 7, 3, 11]
    entries = [[None, 5, None], [-1.0, 12, None], [-2.0, 7, None], [-0.5, 3, None], [-0.25, 11, None]]
    assert response_log_probs({"meta_info": {"input_token_logprobs": entries}}, tokens, 2) == [-0.5, -0.25]
    with pytest.raises(ValueError, match="no meta_info.input_token_logprobs"):
        response_log_probs({"meta_info": {}}, tokens, 2)
    with pytest.raises(ValueError, match="other token ids"):
        response_log_probs({"meta_info": {"input_token_logprobs": entries}}, [5, 12, 7, 3, 4], 2)
    with pytest.raises(ValueError, match="2 input log-probs for 5 tokens"):
        response_log_probs({"meta_info": {"input_token_logprobs": entries[-2:]}}, tokens, 2)
