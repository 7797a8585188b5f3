"""The served OPD teacher (``--opd-type sglang``): ``miles serve`` or SGLang at
``--opd-teacher-urls``, asked for the log-probs of the sample's own tokens.

Each sample is one ``/generate`` request, as upstream's ``on_policy_distillation.reward_func``
sends it: ``input_ids`` = the sample's tokens, ``max_new_tokens`` 0, ``return_logprob``
with ``logprob_start_len`` 0. SGLang answers ``meta_info.input_token_logprobs``, one
``[logprob, token id, text]`` entry per input token, the first without a log-prob; the
last ``response_length`` entries are the teacher's log-probs of the response tokens.
Those are log-softmaxes of the raw logits (temperature 1), as SGLang computes input
log-probs.

``--opd-teacher-urls`` is one URL, or ``NAME=URL`` pairs: a sample goes to the teacher
named by ``sample.metadata[--opd-teacher-key]``, else to ``default``.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from miles_host.sample import Sample

#: the routing name of the fallback teacher (upstream's reserved name)
DEFAULT_TEACHER = "default"
#: requests in flight at once
CONCURRENCY = 16
#: seconds one scoring request may take (a long prefill of a large teacher included)
REQUEST_TIMEOUT_S = 600.0
#: attempts per request on network errors
ATTEMPTS = 3


def generate_url(url: str) -> str:
    """``url`` with the ``/generate`` path (given or not)."""
    url = url.rstrip("/")
    return url if url.endswith("/generate") else url + "/generate"


def parse_teacher_urls(values: list[str] | None) -> dict[str, str]:
    """``--opd-teacher-urls`` as ``{name: generate URL}``: a lone URL is the ``default``
    teacher; ``NAME=URL`` pairs name theirs. ValueError for a malformed entry or a
    duplicate name."""
    values = list(values or [])
    if len(values) == 1 and not _is_pair(values[0]):
        return {DEFAULT_TEACHER: generate_url(values[0].strip())}
    routes: dict[str, str] = {}
    for value in values:
        if not _is_pair(value):
            raise ValueError(f"--opd-teacher-urls entry {value!r}: give NAME=URL pairs (or one URL alone)")
        name, _, url = value.partition("=")
        name = name.strip()
        if name in routes:
            raise ValueError(f"--opd-teacher-urls names teacher {name!r} twice")
        routes[name] = generate_url(url.strip())
    return routes


def _is_pair(value: str) -> bool:
    """``NAME=URL``: a name (no ``:`` or ``/``, so not a URL's start) before the first ``=``."""
    name, sep, url = value.partition("=")
    return bool(sep and name.strip() and url.strip()) and not any(c in name for c in ":/")


def teacher_url_for(sample: Sample, routes: dict[str, str], key: str) -> str:
    """The URL that scores ``sample``: its metadata's teacher name, else ``default``."""
    name = (sample.metadata or {}).get(key)
    if name is not None and str(name) in routes:
        return routes[str(name)]
    if DEFAULT_TEACHER in routes:
        return routes[DEFAULT_TEACHER]
    wanted = f"metadata[{key!r}] = {name!r}" if name is not None else f"no metadata[{key!r}]"
    raise ValueError(f"--opd-teacher-urls: sample {sample.index} has {wanted}, which names none of "
                     f"{sorted(routes)}, and there is no 'default' teacher")


def score_payload(tokens: list[int]) -> dict[str, Any]:
    """The ``/generate`` request of a sample's teacher log-probs."""
    return {
        "input_ids": list(tokens),
        "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }


def response_log_probs(result: dict[str, Any], tokens: list[int], response_length: int) -> list[float]:
    """The last ``response_length`` input log-probs of a ``/generate`` result; ValueError
    when the server returned something else (no field, other token ids)."""
    entries = (result.get("meta_info") or {}).get("input_token_logprobs")
    if entries is None:
        raise ValueError("the teacher's /generate answer has no meta_info.input_token_logprobs (does the server "
                         "support return_logprob with logprob_start_len?)")
    if len(entries) <= response_length:  # the first input position has no log-prob
        raise ValueError(f"the teacher returned {len(entries)} input log-probs for {len(tokens)} tokens, "
                         f"{response_length} of them the response")
    tail = entries[len(entries) - response_length:] if response_length else []
    ids = [int(entry[1]) for entry in tail]
    if ids != tokens[len(tokens) - response_length:]:
        raise ValueError("the teacher's input log-probs are of other token ids than the sample's (a teacher with "
                         "another tokenizer?)")
    return [float(entry[0]) for entry in tail]


def post_json(url: str, payload: dict[str, Any]) -> dict[str, Any]:
    """POST ``payload``; the decoded answer. Retries network errors; an HTTP error status is
    raised at once with the server's message."""
    data = json.dumps(payload).encode()
    last: Exception | None = None
    for attempt in range(ATTEMPTS):
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return json.loads(response.read().decode())
        except urllib.error.HTTPError as error:
            body = error.read().decode(errors="replace")[:500]
            raise RuntimeError(f"OPD teacher {url} answered HTTP {error.code}: {body}") from error
        except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
            last = error
            time.sleep(min(0.5 * 2**attempt, 4.0))
    raise RuntimeError(f"OPD teacher {url} did not answer after {ATTEMPTS} attempts: {last}")


class ServedTeacher:
    """Teacher log-probs from ``/generate`` of a served model."""

    def __init__(self, config: Any):
        self.routes = parse_teacher_urls(config.opd_teacher_urls)
        self.key = config.opd_teacher_key

    def log_probs(self, samples: list[Sample]) -> list[list[float]]:
        """Per sample, the served teacher's log-prob of each response token."""

        def one(sample: Sample) -> list[float]:
            result = post_json(teacher_url_for(sample, self.routes, self.key), score_payload(sample.tokens))
            if isinstance(result, list):  # a batch-shaped answer to one request
                result = result[0]
            return response_log_probs(result, sample.tokens, sample.response_length)

        with ThreadPoolExecutor(max_workers=min(CONCURRENCY, max(1, len(samples)))) as pool:
            return list(pool.map(one, samples))
