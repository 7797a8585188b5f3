"""/generate against SGLang's own request classes: every field of ``GenerateReqInput`` and
every ``SamplingParams`` key (SGLang's lists pinned in ``data/sglang_fields.json``, read
from its source by :mod:`tests.plugins.sglang.sglang_fields`) is accepted over the wire,
or refused with HTTP 400 naming the key where :mod:`miles_sglang.generate_fields` says
the feature is unsupported."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from miles_host.rollout.sampling_params import KNOWN_KEYS
from miles_sglang.generate_fields import GENERATE_FIELDS, NO_EFFECT, SERVED, UNSUPPORTED
from tests.plugins.sglang.conftest import http
from tests.plugins.sglang.sglang_fields import extract, pinned

PINNED = pinned()
PROMPT = [2, 3, 12, 4, 13]
BASE = {"input_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 3}}

#: a value each served / no-effect field is sent with (the rest are SGLang's defaults anyway)
SENT_VALUES = {
    "rid": "fields-rid", "text": "1+2=", "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2},
    "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2, "token_ids_logprob": [3, 4],
    "return_text_in_logprobs": True, "stream": True, "return_routed_experts": False, "routed_experts_start_len": 0,
    "log_metrics": False, "no_logs": True, "custom_labels": {"team": "rl"}, "external_trace_header": {"a": "b"},
    "received_time": 1.5, "routing_key": "k", "conversation_id": "c", "priority": 3, "http_worker_ipc": None,
    "routed_dp_rank": 0, "data_parallel_rank": 0, "disagg_prefill_dp_rank": 0,
}

#: a non-default value of each unsupported field (others: true)
REFUSED_VALUES = {
    "image_data": ["data:image/png;base64,iVBORw0KGgo="], "lora_path": "my-adapter", "lora_id": "a1",
    "custom_logit_processor": '{"callable": "..."}', "return_hidden_states": True, "session_id": "s1",
    "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "input_embeds": [[0.1, 0.2]], "cache_salt": "salt",
}

#: a value of each SamplingParams key that the engine runs (grammar keys match this model's digits)
SAMPLING_VALUES = {
    "max_new_tokens": 4, "stop": ["9"], "stop_token_ids": [3], "stop_regex": ["1+2"], "temperature": 0.7,
    "top_p": 0.9, "top_k": 5, "min_p": 0.05, "frequency_penalty": 0.5, "presence_penalty": -0.5,
    "repetition_penalty": 1.2, "min_new_tokens": 2, "n": 2, "beam_width": 1, "ignore_eos": True,
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "no_stop_trim": True,
    "stream_interval": 4, "logit_bias": {"5": 1.5}, "sampling_seed": 3, "custom_params": {"a": 1},
    "json_schema": '{"type": "integer"}', "regex": "[0-9]+", "ebnf": 'root ::= "1" [0-9]?',
    "structural_tag": '{"structures": [{"begin": "1=", "schema": {"type": "integer"}, "end": "+"}], "triggers": ["1"]}',
}
#: SamplingParams keys the engine refuses (documented in miles_host.rollout.sampling_params)
SAMPLING_REFUSED = {"beam_width": 4, "watermark": {"key": 1}}
GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")


def test_every_generate_req_input_field_has_a_record():
    assert set(GENERATE_FIELDS) == set(PINNED["GenerateReqInput"])
    assert all(r.handling in (SERVED, NO_EFFECT, UNSUPPORTED) for r in GENERATE_FIELDS.values())
    assert all(r.why for r in GENERATE_FIELDS.values() if r.handling == UNSUPPORTED)


def test_the_engine_knows_every_sampling_params_key():
    assert KNOWN_KEYS == set(PINNED["SamplingParams"])


def _sglang_source() -> Path | None:
    if os.environ.get("MILES_SGLANG_SOURCE"):
        return Path(os.environ["MILES_SGLANG_SOURCE"])
    spec = importlib.util.find_spec("sglang")
    return Path(spec.origin).parent.parent if spec is not None and spec.origin else None


def test_pinned_lists_are_sglangs_own():
    """Re-read the lists from an SGLang source tree (``MILES_SGLANG_SOURCE`` or an installed
    sglang); a newer SGLang shows up here as the fields it added or dropped."""
    root = _sglang_source()
    if root is None:
        pytest.skip("no SGLang source: set MILES_SGLANG_SOURCE to an unpacked sglang wheel to re-check the pinned lists")
    fresh = extract(root)
    for name in ("GenerateReqInput", "SamplingParams"):
        added, dropped = set(fresh[name]) - set(PINNED[name]), set(PINNED[name]) - set(fresh[name])
        assert not added and not dropped, (
            f"{name} differs from the pinned SGLang {PINNED['sglang_version']}: added {sorted(added)}, "
            f"dropped {sorted(dropped)}; run `python -m tests.plugins.sglang.sglang_fields {root} VERSION` "
            "and give each new field a record in miles_sglang.generate_fields"
        )


@pytest.mark.parametrize("name", [n for n, r in GENERATE_FIELDS.items() if r.handling != UNSUPPORTED])
def test_served_fields_are_accepted(server, name):
    body = {k: v for k, v in BASE.items() if not (name == "text" and k == "input_ids")}
    body[name] = SENT_VALUES[name]
    status, answer = http(server.url, "/generate", body)
    assert status == 200, answer


@pytest.mark.parametrize("name", [n for n, r in GENERATE_FIELDS.items() if r.handling == UNSUPPORTED])
def test_unsupported_fields_are_a_400_naming_them_unless_left_default(server, name):
    status, answer = http(server.url, "/generate", {**BASE, name: REFUSED_VALUES.get(name, True)})
    assert status == 400 and f"'{name}'" in answer["error"]["message"], answer
    assert "not supported" in answer["error"]["message"]
    status, answer = http(server.url, "/generate", {**BASE, name: None})
    assert status == 200, answer


def test_unknown_fields_are_a_400_naming_them(server):
    status, answer = http(server.url, "/generate", {**BASE, "sampling_param": {"n": 2}})
    assert status == 400 and "sampling_param" in answer["error"]["message"]


@pytest.mark.parametrize("key", PINNED["SamplingParams"])
def test_every_sampling_params_key_runs_or_is_a_400_naming_it(server, key):
    if key in SAMPLING_REFUSED:
        status, answer = http(server.url, "/generate", {**BASE, "sampling_params": {key: SAMPLING_REFUSED[key]}})
        assert status == 400 and key in answer["error"]["message"]
        return
    if key in GRAMMAR_KEYS:
        pytest.importorskip("xgrammar")
    params = {"max_new_tokens": 4, key: SAMPLING_VALUES[key]}
    status, answer = http(server.url, "/generate", {**BASE, "sampling_params": params})
    assert status == 200, answer
    results = answer if isinstance(answer, list) else [answer]
    assert all(r["meta_info"]["finish_reason"]["type"] in ("stop", "length") for r in results), results
