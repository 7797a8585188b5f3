"""slime's reward hub: every ``--rm-type`` of ``slime.rollout.rm_hub`` with slime's semantics.

A reward type is one :data:`SCORERS` entry, ``scorer(response, label, metadata)``. The
type a sample is scored with is its ``metadata["rm_type"]`` when set (slime's per-sample,
per-eval-dataset override), else the configured one. ``boxed_<type>`` first replaces the
response with the content of its last ``\\boxed{}`` (empty when there is none), then scores
as ``<type>``. ``remote_rm`` POSTs ``{"prompt", "response", "label"}`` to ``--rm-url``;
``random`` is 0 or 1 at random; ``ifbench`` needs allenai's IFBench checker
(``evaluation_lib``), which is not on PyPI.
"""

from __future__ import annotations

import importlib
import random
from typing import Any, Callable

from miles_host.rewards import dapo, gpqa, math_grader
from miles_host.rewards.answers import normalize_answer

BOXED_PREFIX = "boxed_"


def f1_score(prediction: str | None, truth: Any) -> tuple[float, float, float]:
    """(f1, precision, recall) of the normalised tokens; (0, 0, 0) without overlap, for no
    prediction, or when either side is "yes", "no" or "noanswer" and they differ."""
    if prediction is None:
        return (0, 0, 0)
    predicted, gold = normalize_answer(prediction), normalize_answer(str(truth))
    if predicted != gold and (predicted in ("yes", "no", "noanswer") or gold in ("yes", "no", "noanswer")):
        return (0, 0, 0)
    predicted_tokens, gold_tokens = predicted.split(), gold.split()
    from collections import Counter

    same = sum((Counter(predicted_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return (0, 0, 0)
    precision, recall = same / len(predicted_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


IFBENCH_MISSING = (
    "--rm-type ifbench needs allenai's IFBench checker (its evaluation_lib module), which is not on PyPI: "
    "git clone https://github.com/allenai/IFBench, pip install -r IFBench/requirements.txt and add the "
    "clone to PYTHONPATH"
)


def ifbench_reward(response: str | None, label: Any, metadata: dict | None) -> float:
    """1.0 when the response follows every instruction of ``metadata["instruction_id_list"]``
    (with ``metadata["kwargs"]``, ``prompt_text``, ``record_id``) by IFBench's strict test."""
    try:
        evaluation_lib = importlib.import_module("evaluation_lib")
    except ImportError as error:
        raise ImportError(IFBENCH_MISSING) from error
    if metadata is None or response is None:
        return 0.0
    ids = [str(entry).strip() for entry in metadata.get("instruction_id_list") or [] if entry is not None and str(entry).strip()]
    if not ids:
        return 0.0
    raw = metadata.get("kwargs")
    if isinstance(raw, list):
        kwargs = [dict(entry) if isinstance(entry, dict) else {} for entry in raw]
    else:
        kwargs = [dict(raw) if isinstance(raw, dict) else {} for _ in ids]
    kwargs = (kwargs + [dict(kwargs[-1] if kwargs else {}) for _ in ids])[: len(ids)]
    kwargs = [{key: value for key, value in entry.items() if value is not None} for entry in kwargs]
    prompt = "" if metadata.get("prompt_text") is None else str(metadata["prompt_text"])
    example = evaluation_lib.InputExample(key=int(metadata.get("record_id") or 0), instruction_id_list=ids,
                                          prompt=prompt, kwargs=kwargs)
    return 1.0 if evaluation_lib.test_instruction_following_strict(example, {prompt: str(response)}).follow_all_instructions else 0.0


#: rm_type -> scorer(response, label, metadata)
SCORERS: dict[str, Callable[[Any, Any, dict], Any]] = {
    "deepscaler": lambda response, label, metadata: math_grader.deepscaler_reward(response, label),
    "dapo": lambda response, label, metadata: dapo.compute_score(response, label),
    "math": lambda response, label, metadata: int(math_grader.grade_answer_verl(response, label)),
    "f1": lambda response, label, metadata: f1_score(response, label)[0],
    "gpqa": lambda response, label, metadata: gpqa.compute_gpqa_reward(response, label, metadata=metadata),
    "ifbench": ifbench_reward,
    "random": lambda response, label, metadata: random.randint(0, 1),
}

#: slime's rm types besides :data:`SCORERS` (handled by :func:`score_sample`)
REMOTE = "remote_rm"


def rm_types() -> list[str]:
    """Every type name accepted, ``boxed_`` variants included."""
    base = [*SCORERS, REMOTE]
    return base + [BOXED_PREFIX + name for name in SCORERS]


def score(rm_type: str, response: str | None, label: Any, metadata: dict | None = None) -> Any:
    """The reward of ``response`` by ``rm_type`` (``boxed_`` prefix understood)."""
    rm_type = rm_type.strip()
    if rm_type.startswith(BOXED_PREFIX):
        response = math_grader.extract_answer(response) or ""
        rm_type = rm_type[len(BOXED_PREFIX):]
    if rm_type not in SCORERS:
        raise ValueError(f"rm_type {rm_type!r} is not a built-in reward; known: {', '.join(rm_types())}")
    return SCORERS[rm_type](response, label, metadata if metadata is not None else {})


def score_sample(sample: Any, config: Any, rm_type: str) -> Any:
    """The reward of one sample: its ``metadata["rm_type"]`` when set, else ``rm_type``;
    ``remote_rm`` asks ``--rm-url``."""
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    chosen = (metadata.get("rm_type") or rm_type or "").strip()
    if chosen == REMOTE:
        url = getattr(config, "rm_url", None)
        if not url:
            raise ValueError("--rm-type remote_rm needs --rm-url (the reward server's POST endpoint)")
        from miles_host.reward import remote_reward

        return remote_reward(url, config.rm_timeout, config.rm_max_retries)(sample, config)
    return score(chosen, sample.response, sample.label, metadata)
