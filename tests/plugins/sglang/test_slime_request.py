"""The request slime's default rollout sends to SGLang's /generate, and slime's way of
reading the answer, against ``miles serve``.

Re-implemented from reading THUDM/slime: ``slime/rollout/sglang_rollout.py``
(``GenerateState.__init__`` builds the sampling params, ``generate`` the payload and
the token / logprob lists) and ``slime/utils/types.py`` (``Sample.append_response_tokens``
and ``_apply_meta_info``: text, routed experts as base64 int32 with
``routed_experts_start_len``, prefix-cache counts, ``weight_version``, the status from
``finish_reason["type"]``). No slime code is imported or copied.
"""

from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.plugins.sglang.conftest import http, serve

PROMPT = [2, 3, 12, 4, 13]


def slime_args(**overrides) -> SimpleNamespace:
    """The slime flags ``generate`` reads (slime's defaults, a short response)."""
    return SimpleNamespace(**{
        "rollout_temperature": 1.0, "rollout_top_p": 1.0, "rollout_top_k": -1, "rollout_max_response_len": 6,
        "rollout_stop": None, "rollout_stop_token_ids": None, "rollout_skip_special_tokens": False,
        "use_rollout_routing_replay": False, "num_layers": None, "moe_router_topk": None, **overrides,
    })


def slime_sampling_params(args) -> dict:
    """``GenerateState.__init__``: the sampling params of every rollout request."""
    params = dict(
        temperature=args.rollout_temperature, top_p=args.rollout_top_p, top_k=args.rollout_top_k,
        max_new_tokens=args.rollout_max_response_len, stop=args.rollout_stop,
        stop_token_ids=args.rollout_stop_token_ids, skip_special_tokens=args.rollout_skip_special_tokens,
        no_stop_trim=True, spaces_between_special_tokens=False,
    )
    if args.rollout_top_p != 1.0:
        params["custom_params"] = {"return_top_p_token_ids": True}
    return params


def slime_payload(args, prompt_ids: list[int], sampling_params: dict) -> dict:
    """``generate``: the /generate body of a text-only sample."""
    payload = {"sampling_params": sampling_params, "return_logprob": True}
    if args.use_rollout_routing_replay:
        payload["return_routed_experts"] = True
    payload["input_ids"] = prompt_ids
    return payload


def slime_parse(args, prompt_ids: list[int], output: dict) -> SimpleNamespace:
    """``generate`` + ``Sample.append_response_tokens`` / ``_apply_meta_info`` on one answer."""
    meta = output["meta_info"]
    if "output_token_logprobs" in meta:
        tokens = [item[1] for item in meta["output_token_logprobs"]]
        log_probs = [item[0] for item in meta["output_token_logprobs"]]
    else:
        tokens, log_probs = [], []
    assert len(log_probs) == len(tokens)
    sample = SimpleNamespace(tokens=prompt_ids + tokens, response=output["text"], rollout_log_probs=log_probs,
                             response_length=len(tokens), routed_experts=None, weight_versions=[], status=None)
    if meta.get("routed_experts") is not None:
        routes = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
        start = int(meta.get("routed_experts_start_len", 0) or 0)
        rows = max(0, len(sample.tokens) - 1 - start)
        assert routes.size == rows * args.num_layers * args.moe_router_topk
        sample.routed_experts = routes.reshape(rows, args.num_layers, args.moe_router_topk)
    sample.prefix_cache = (meta["cached_tokens"], meta["prompt_tokens"])  # PrefixCacheInfo.add reads these
    if tokens and "weight_version" in meta:
        sample.weight_versions.append(meta["weight_version"])
    sample.status = {"length": "TRUNCATED", "abort": "ABORTED", "stop": "COMPLETED"}[meta["finish_reason"]["type"]]
    return sample


@pytest.fixture(scope="module")
def hf_logprobs(dense_model):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(dense_model).double().eval()

    def logprobs(ids: list[int], temperature: float = 1.0) -> np.ndarray:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0] / temperature, -1).numpy()

    return logprobs


def test_slime_default_request_and_parsing(server, hf_logprobs, dense_model):
    import transformers

    args = slime_args()
    payload = slime_payload(args, PROMPT, slime_sampling_params(args))
    assert set(payload) == {"sampling_params", "return_logprob", "input_ids"}
    status, output = http(server.url, "/generate", payload)
    assert status == 200, output
    sample = slime_parse(args, PROMPT, output)
    generated = sample.tokens[len(PROMPT):]
    assert generated == output["output_ids"] and sample.status in ("TRUNCATED", "COMPLETED")
    expected = hf_logprobs(sample.tokens)[len(PROMPT) - 1:-1][np.arange(len(generated)), generated]
    np.testing.assert_allclose(sample.rollout_log_probs, expected, atol=1e-4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(dense_model)
    assert sample.response == tokenizer.decode(generated, skip_special_tokens=False)  # no_stop_trim: all kept
    assert isinstance(sample.weight_versions[0], str) and sample.prefix_cache[1] == len(PROMPT)


def test_slime_request_with_top_p_stop_and_eos(server):
    """top_p < 1 adds ``custom_params``; stop strings / ids come from --rollout-stop*."""
    args = slime_args(rollout_top_p=0.9, rollout_stop=["="], rollout_stop_token_ids=[1],
                      rollout_skip_special_tokens=True, rollout_max_response_len=20)
    params = slime_sampling_params(args)
    assert params["custom_params"] == {"return_top_p_token_ids": True}
    for seed in range(4):
        status, output = http(server.url, "/generate", slime_payload(args, PROMPT, {**params, "sampling_seed": seed}))
        assert status == 200, output
        sample = slime_parse(args, PROMPT, output)
        reason = output["meta_info"]["finish_reason"]
        if reason["type"] == "stop":  # SGLang's FINISH_MATCHED_STR / FINISH_MATCHED_TOKEN
            assert sample.status == "COMPLETED" and reason["matched"] in ("=", 1)
            if reason["matched"] == "=":
                assert sample.response.endswith("=")  # no_stop_trim keeps the stop string


def test_slime_routing_replay_request(moe_model):
    args = slime_args(use_rollout_routing_replay=True, num_layers=2, moe_router_topk=2)
    handle = serve(moe_model)
    try:
        status, output = http(handle.url, "/generate", slime_payload(args, PROMPT, slime_sampling_params(args)))
    finally:
        handle.shutdown()
    assert status == 200, output
    sample = slime_parse(args, PROMPT, output)
    assert sample.routed_experts.shape == (len(sample.tokens) - 1, 2, 2)
    assert ((sample.routed_experts >= 0) & (sample.routed_experts < 8)).all()
