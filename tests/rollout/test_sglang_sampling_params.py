"""SGLang's full ``sampling_params`` set and its logprob request fields in the embedded engine.

References: SGLang 0.5.23's own key list (pinned below), its penalty formulas written out
in float64 plain Python, its stop trimming rules, and transformers' logits (float64
``log_softmax``) for every returned logprob.
"""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch

from miles_host.rollout import logprobs as logprobs_module
from miles_host.rollout.outputs import sglang_logprob_meta
from miles_host.rollout.penalties import LogitsProcessing
from miles_host.rollout.sampling_params import KNOWN_KEYS, SamplingParams
from tests.rollout.conftest import VOCAB, make_engine

transformers = pytest.importorskip("transformers")

#: the request-facing fields of ``SamplingParams`` in SGLang 0.5.23
#: (python/sglang/srt/sampling/sampling_params.py; its internal fields stop_strs,
#: stop_regex_strs, stop_str_max_len, stop_regex_max_len, is_normalized and
#: ebnf_full_assistant are filled by SGLang itself and not part of the API)
SGLANG_0_5_23_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
    "custom_params", "watermark",
)

#: a value of each key that the engine runs (grammar keys: see the constrained tests)
WORKING_VALUES = {
    "max_new_tokens": 8, "stop": ["x"], "stop_token_ids": [3], "stop_regex": ["a+b"], "temperature": 0.7,
    "top_p": 0.9, "top_k": 20, "min_p": 0.05, "frequency_penalty": 0.5, "presence_penalty": -0.5,
    "repetition_penalty": 1.2, "min_new_tokens": 2, "n": 2, "beam_width": 1, "ignore_eos": True,
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "no_stop_trim": True,
    "stream_interval": 4, "logit_bias": {"5": 1.5}, "sampling_seed": 3, "custom_params": {"a": 1},
    "json_schema": '{"type": "integer"}', "regex": "[a-c]+", "ebnf": 'root ::= "a" "b"?',
    "structural_tag": '{"structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}],'
                      ' "triggers": ["<f>"]}',
}

#: values the engine refuses, with what the message names
REFUSED_VALUES = {"beam_width": (4, "beam_width"), "watermark": ({"key": 1}, "watermark")}


def char_tokenizer():
    """A 128-id character tokenizer matching the tiny models' vocabulary: ``<pad>``, ``<bos>``,
    one character per id (ASCII, then Greek letters), ``<eos>`` = 127."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<bos>": 1}
    for code in [*range(33, 127), *range(0x3B1, 0x3B1 + VOCAB - 97)]:
        vocab[chr(code)] = len(vocab)
    vocab["<eos>"] = VOCAB - 1
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>"
    )


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def engine(qwen3_dense, tokenizer):
    _, path = qwen3_dense
    return make_engine(path, tokenizer=tokenizer)


PROMPT = [5, 9, 17, 33, 2, 8, 40]


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """float64 logits of transformers at every position of ``ids``."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].double()


# ----------------------------------------------------------------------------- the key set


def test_the_pinned_sglang_keys_are_exactly_the_accepted_keys():
    assert set(SGLANG_0_5_23_KEYS) == KNOWN_KEYS


@pytest.mark.parametrize("key", SGLANG_0_5_23_KEYS)
def test_every_sglang_key_is_accepted_as_null_and_means_the_default(key):
    assert SamplingParams.from_any({key: None}) == SamplingParams()


@pytest.mark.parametrize("key", SGLANG_0_5_23_KEYS)
def test_every_sglang_key_works_or_is_a_clear_value_error(engine, key):
    if key in REFUSED_VALUES:
        value, named = REFUSED_VALUES[key]
        with pytest.raises(ValueError, match=named):
            engine.add_request(None, PROMPT, {key: value})
        return
    if key in ("json_schema", "regex", "ebnf", "structural_tag"):
        pytest.importorskip("xgrammar")  # without it: test_constrained_decoding_without_xgrammar_...
    params = {"max_new_tokens": 4, key: WORKING_VALUES[key]}
    outputs = engine.generate(PROMPT, params)
    assert all(o["meta_info"]["finish_reason"]["type"] != "abort" for o in outputs), outputs


def test_slimes_default_request_keys_are_accepted(engine):
    """slime's rollout always sends these three; SGLang's defaults are True, True, False."""
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 4, "stop": None,
              "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
              "spaces_between_special_tokens": False, "sampling_seed": 1}
    (output,) = engine.generate(PROMPT, params)
    assert output["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("bad, named", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"stop_regex": ["("]}, "stop_regex"),
    ({"regex": "a", "json_schema": "{}"}, "only one of"),
    ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
])
def test_bad_values_name_their_key(bad, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        SamplingParams.from_any(bad)


def test_a_temperature_below_sglangs_epsilon_is_greedy(engine):
    assert SamplingParams(temperature=5e-7).greedy and not SamplingParams(temperature=1e-6).greedy
    tiny, greedy = (engine.generate(PROMPT, {"temperature": t, "max_new_tokens": 6})[0] for t in (1e-7, 0))
    assert tiny["output_ids"] == greedy["output_ids"]
    assert tiny["meta_info"]["output_token_logprobs"] == greedy["meta_info"]["output_token_logprobs"]


def test_a_logit_bias_outside_the_vocabulary_fails_alone(engine):
    outputs = engine.generate([PROMPT, PROMPT], [{"max_new_tokens": 2}, {"logit_bias": {str(VOCAB): 1.0}}])
    assert outputs[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert "logit_bias" in outputs[1]["meta_info"]["finish_reason"]["message"]


# ----------------------------------------------------------------------------- penalties


def reference_processed_logits(logits: list[float], outputs: list[int], frequency: float, presence: float,
                               repetition: float, bias: dict[int, float]) -> list[float]:
    """SGLang's penalizers and logit_bias, one float64 token at a time."""
    result = []
    for token, value in enumerate(logits):
        count = outputs.count(token)
        value = value - frequency * count - (presence if count else 0.0)
        if count and repetition != 1.0:
            value = value * repetition if value < 0 else value / repetition
        result.append(value + bias.get(token, 0.0))
    return result


def log_softmax64(values: list[float]) -> list[float]:
    top = max(values)
    total = math.log(sum(math.exp(v - top) for v in values)) + top
    return [v - total for v in values]


def test_penalties_match_the_float64_formulas():
    torch.manual_seed(0)
    vocab = 40
    logits_BV = torch.randn(4, vocab) * 2
    outputs = [[1, 1, 5, 7, 1], [], [3, 3, 3, 0], [9, 2]]
    settings = [dict(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.4),
                dict(frequency_penalty=1.0, logit_bias={"4": 2.5}),
                dict(repetition_penalty=0.6, logit_bias={"3": -1.0, "39": 0.5}),
                dict()]
    params = [SamplingParams(**s) for s in settings]
    processing = LogitsProcessing.build(params, outputs, vocab, torch.device("cpu"))
    got_BV = processing.apply(logits_BV)
    for row, (p, out) in enumerate(zip(params, outputs)):
        expected = reference_processed_logits(
            logits_BV[row].double().tolist(), out, p.frequency_penalty, p.presence_penalty,
            p.repetition_penalty, p.logit_bias or {},
        )
        assert torch.allclose(got_BV[row].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5)
    assert torch.equal(got_BV[3], logits_BV[3])  # a row without penalties is untouched, bit for bit


def test_no_penalties_build_nothing():
    params = [SamplingParams(frequency_penalty=0.0, logit_bias=None), SamplingParams()]
    assert LogitsProcessing.build(params, [[1, 2], [3]], 16, torch.device("cpu")) is None


PENALISED = dict(frequency_penalty=0.8, presence_penalty=0.5, repetition_penalty=1.5,
                 logit_bias={"12": 1.5, "40": -2.0}, max_new_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_penalties_and_logprobs_follow_transformers(qwen3_dense, engine, temperature):
    """Each step: transformers' float64 logits, SGLang's penalties over the tokens generated so
    far, then (greedy) the argmax and log_softmax, or (sampled) log_softmax(. / T); the top-3
    logprobs are of the same distribution."""
    hf_model, _ = qwen3_dense
    params = {**PENALISED, "temperature": temperature, "sampling_seed": 11}
    (output,) = engine.generate(PROMPT, params, top_logprobs_num=3)
    (plain,) = engine.generate(PROMPT, {"temperature": temperature, "sampling_seed": 11, "max_new_tokens": 10,
                                        "ignore_eos": True})
    assert output["output_ids"] != plain["output_ids"]  # the penalties changed something
    ids = output["output_ids"]
    logits = hf_logits(hf_model, PROMPT + ids)
    bias = {int(k): v for k, v in PENALISED["logit_bias"].items()}
    for step, token in enumerate(ids):
        processed = reference_processed_logits(
            logits[len(PROMPT) - 1 + step].tolist(), ids[:step], PENALISED["frequency_penalty"],
            PENALISED["presence_penalty"], PENALISED["repetition_penalty"], bias,
        )
        if temperature == 0.0:
            assert token == max(range(VOCAB), key=processed.__getitem__)
        else:
            processed = [v / temperature for v in processed]
        reference = log_softmax64(processed)
        assert abs(output["meta_info"]["output_token_logprobs"][step][0] - reference[token]) < 1e-4
        top = output["logprobs"]["output_top_logprobs"][step]
        assert [t for t, _ in top] == sorted(range(VOCAB), key=lambda t: -reference[t])[:3]
        assert all(abs(lp - reference[t]) < 1e-4 for t, lp in top)


def test_a_penalised_row_leaves_its_neighbours_bit_exact(engine):
    """The same batch with and without penalties on its second row: the first row's tokens and
    logprobs are equal bit for bit (the forward's batch shape is the same in both)."""
    plain = {"temperature": 1.0, "sampling_seed": 5, "max_new_tokens": 8, "ignore_eos": True}
    unpenalised = engine.generate([PROMPT, PROMPT[:4]], [plain, plain])
    mixed = engine.generate([PROMPT, PROMPT[:4]], [plain, {**plain, **PENALISED}])
    assert mixed[1]["output_ids"] != unpenalised[1]["output_ids"]
    assert mixed[0]["output_ids"] == unpenalised[0]["output_ids"]
    assert mixed[0]["meta_info"]["output_token_logprobs"] == unpenalised[0]["meta_info"]["output_token_logprobs"]


def test_penalties_are_refused_in_true_on_policy_mode(qwen3_dense):
    _, path = qwen3_dense
    engine = make_engine(path, batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant"):
        engine.add_request(None, PROMPT, {"presence_penalty": 0.5})


def test_logit_bias_and_min_new_tokens_place_eos(engine):
    """A large EOS bias makes EOS the argmax; min_new_tokens holds it back three tokens."""
    (output,) = engine.generate(PROMPT, {"temperature": 0, "min_new_tokens": 3, "max_new_tokens": 10,
                                         "logit_bias": {str(VOCAB - 1): 100.0}})
    assert output["output_ids"][3] == VOCAB - 1 and len(output["output_ids"]) == 4
    assert output["meta_info"]["finish_reason"] == {"type": "stop", "matched": VOCAB - 1}


# ----------------------------------------------------------------------------- stop trimming


GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def greedy_ids(engine):
    (output,) = engine.generate(PROMPT, GREEDY)
    return output["output_ids"]


def first_stop(ids: list[int], tokenizer, found) -> int:
    """How many tokens are generated until ``found(decoded text)`` (SGLang checks after each token)."""
    return next(k for k in range(1, len(ids) + 1) if found(tokenizer.decode(ids[:k])))


def test_a_stop_string_is_trimmed_unless_no_stop_trim(engine, greedy_ids, tokenizer):
    ids = greedy_ids
    stop = tokenizer.decode(ids[4:6])
    length = first_stop(ids, tokenizer, lambda text: stop in text)
    text = tokenizer.decode(ids[:length], skip_special_tokens=True)  # SGLang's default
    (trimmed,) = engine.generate(PROMPT, {**GREEDY, "stop": [stop]})
    (kept,) = engine.generate(PROMPT, {**GREEDY, "stop": stop, "no_stop_trim": True})
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert trimmed["output_ids"] == kept["output_ids"] == ids[:length]  # the ids keep the stop
    assert trimmed["text"] == text[:text.find(stop)]
    assert kept["text"] == text[:text.find(stop) + len(stop)]


def test_a_stop_token_is_trimmed_from_text_not_from_output_ids(engine, greedy_ids, tokenizer):
    ids = greedy_ids
    stop_token = ids[5]
    first = ids.index(stop_token)
    (trimmed,) = engine.generate(PROMPT, {**GREEDY, "stop_token_ids": [stop_token]})
    (kept,) = engine.generate(PROMPT, {**GREEDY, "stop_token_ids": [stop_token], "no_stop_trim": True})
    assert trimmed["output_ids"] == kept["output_ids"] == ids[:first + 1]
    assert trimmed["text"] == tokenizer.decode(ids[:first])
    assert kept["text"] == tokenizer.decode(ids[:first + 1])


def test_eos_text_and_skip_special_tokens(engine, tokenizer):
    eos_first = {"temperature": 0, "min_new_tokens": 2, "max_new_tokens": 6, "logit_bias": {str(VOCAB - 1): 100.0}}
    (trimmed,) = engine.generate(PROMPT, {**eos_first, "skip_special_tokens": False})
    (kept,) = engine.generate(PROMPT, {**eos_first, "skip_special_tokens": False, "no_stop_trim": True})
    (skipped,) = engine.generate(PROMPT, {**eos_first, "no_stop_trim": True})
    ids = kept["output_ids"]
    assert ids[-1] == VOCAB - 1
    assert trimmed["text"] == tokenizer.decode(ids[:-1])
    assert kept["text"] == tokenizer.decode(ids) and kept["text"].endswith("<eos>")
    assert skipped["text"] == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_regex_stops_and_is_trimmed(engine, greedy_ids, tokenizer):
    ids = greedy_ids
    pattern = re.escape(tokenizer.decode(ids[3:4])) + "." + re.escape(tokenizer.decode(ids[5:6]))
    length = first_stop(ids, tokenizer, lambda text: re.search(pattern, text))
    text = tokenizer.decode(ids[:length], skip_special_tokens=True)
    match = re.search(pattern, text)
    (trimmed,) = engine.generate(PROMPT, {**GREEDY, "stop_regex": pattern})
    (kept,) = engine.generate(PROMPT, {**GREEDY, "stop_regex": [pattern], "no_stop_trim": True})
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert trimmed["output_ids"] == ids[:length]
    assert trimmed["text"] == text[:match.start()]
    assert kept["text"] == text[:match.end()]


# ----------------------------------------------------------------------------- logprob fields


def test_top_and_requested_token_logprobs_match_transformers(qwen3_dense, engine, tokenizer):
    hf_model, _ = qwen3_dense
    (output,) = engine.generate(PROMPT, {"temperature": 0.7, "sampling_seed": 2, "max_new_tokens": 5},
                                top_logprobs_num=4, token_ids_logprob=[3, 60, 127])
    ids = output["output_ids"]
    logits = hf_logits(hf_model, PROMPT + ids)
    details = output["logprobs"]
    for step, token in enumerate(ids):
        reference = torch.log_softmax(logits[len(PROMPT) - 1 + step] / 0.7, dim=-1)
        top_ids = reference.topk(4).indices.tolist()
        assert [t for t, _ in details["output_top_logprobs"][step]] == top_ids
        for t, lp in details["output_top_logprobs"][step] + details["output_token_ids_logprobs"][step]:
            assert abs(lp - reference[t].item()) < 1e-5
        assert [t for t, _ in details["output_token_ids_logprobs"][step]] == [3, 60, 127]
    meta = sglang_logprob_meta(output, tokenizer, return_text=True)
    assert meta["output_token_logprobs"] == [
        [lp, t, tokenizer.decode([t])] for (lp, t, _), t in zip(output["meta_info"]["output_token_logprobs"], ids)
    ]
    assert meta["output_top_logprobs"][0][0] == [details["output_top_logprobs"][0][0][1],
                                                 details["output_top_logprobs"][0][0][0],
                                                 tokenizer.decode([details["output_top_logprobs"][0][0][0]])]
    assert [row[-1][1] for row in meta["output_token_ids_logprobs"]] == [127] * len(ids)
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []


@pytest.mark.parametrize("start, chunk", [(0, 128), (3, 2)])
def test_input_logprobs_from_logprob_start_len_match_transformers(qwen3_dense, engine, tokenizer, start, chunk,
                                                                  monkeypatch):
    """SGLang's layout: the prompt from ``logprob_start_len`` on, the first entry without a logprob
    (also when the prompt's logits are taken a few rows at a time)."""
    monkeypatch.setattr(logprobs_module, "INPUT_CHUNK", chunk)
    hf_model, _ = qwen3_dense
    outputs = engine.generate(PROMPT, {"temperature": 1.0, "max_new_tokens": 2, "n": 2},
                              logprob_start_len=start, top_logprobs_num=2, token_ids_logprob=[7])
    reference = torch.log_softmax(hf_logits(hf_model, PROMPT), dim=-1)
    for output in outputs:  # every sample of the request carries the prompt's logprobs
        details = output["logprobs"]
        assert details["input_token_ids"] == PROMPT[start:]
        assert details["input_token_logprobs"][0] is None and details["input_top_logprobs"][0] is None
        for i, token in enumerate(PROMPT[start + 1:], start=start + 1):
            row = reference[i - 1]
            assert abs(details["input_token_logprobs"][i - start] - row[token].item()) < 1e-5
            assert [t for t, _ in details["input_top_logprobs"][i - start]] == row.topk(2).indices.tolist()
            assert abs(details["input_token_ids_logprobs"][i - start][0][1] - row[7].item()) < 1e-5
        meta = sglang_logprob_meta(output, tokenizer, return_text=False)
        assert meta["input_token_logprobs"] == [[lp, t, None] for lp, t in zip(
            details["input_token_logprobs"], PROMPT[start:])]
        assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(PROMPT) - start


def test_prompt_logprobs_alone_with_max_new_tokens_zero_and_a_cached_prefix(qwen3_dense, engine):
    """A 40-token prompt whose first blocks are in the prefix cache: the request that scores it
    (``max_new_tokens`` 0, SGLang's prompt scoring) still forwards every token."""
    hf_model, _ = qwen3_dense
    prompt = [(7 * i + 3) % (VOCAB - 1) for i in range(40)]
    engine.generate(prompt, {"max_new_tokens": 1})
    (again,) = engine.generate(prompt, {"max_new_tokens": 1})
    assert again["meta_info"]["cached_tokens"] == 32
    (output,) = engine.generate(prompt, {"max_new_tokens": 0}, logprob_start_len=0)
    assert output["output_ids"] == [] and output["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert output["meta_info"]["cached_tokens"] == 0
    reference = torch.log_softmax(hf_logits(hf_model, prompt), dim=-1)
    expected = [reference[i - 1, t].item() for i, t in enumerate(prompt) if i > 0]
    assert output["logprobs"]["input_token_logprobs"][0] is None
    assert torch.allclose(torch.tensor(output["logprobs"]["input_token_logprobs"][1:]),
                          torch.tensor(expected).float(), atol=1e-5)


def test_logprob_request_fields_are_checked(engine):
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.add_request(None, PROMPT, {}, logprob_start_len=len(PROMPT) + 1)
    with pytest.raises(ValueError, match="token_ids_logprob"):
        engine.add_request(None, PROMPT, {}, token_ids_logprob=[VOCAB])
    with pytest.raises(ValueError, match="top_logprobs_num"):
        engine.add_request(None, PROMPT, {}, top_logprobs_num=-1)


def test_without_return_logprob_there_are_no_logprobs(engine):
    (output,) = engine.generate(PROMPT, {"max_new_tokens": 2}, return_logprob=False, top_logprobs_num=3)
    assert "logprobs" not in output and sglang_logprob_meta(output, None, False) == {}


# ----------------------------------------------------------------------------- constrained decoding


def test_constrained_decoding_without_xgrammar_is_a_clear_error(engine, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    with pytest.raises(ValueError, match=r"constrained decoding \(`regex`\) needs xgrammar: pip install xgrammar"):
        engine.add_request(None, PROMPT, {"regex": "[0-9]+"})


@pytest.mark.parametrize("key, spec, check", [
    ("regex", r"[0-9]{2}\+[a-c]{1,3}", lambda text: re.fullmatch(r"[0-9]{2}\+[a-c]{1,3}", text)),
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],'
                    ' "additionalProperties": false}',
     lambda text: isinstance(__import__("json").loads(text)["a"], int)),
    ("ebnf", 'root ::= "x" [0-9] [0-9]? "!"', lambda text: re.fullmatch(r"x[0-9]{1,2}!", text)),
])
def test_constrained_decoding_through_xgrammar(engine, key, spec, check):
    pytest.importorskip("xgrammar")
    outputs = engine.generate(PROMPT, {key: spec, "temperature": 1.0, "max_new_tokens": 40, "n": 3, "sampling_seed": 4})
    for output in outputs:
        assert output["meta_info"]["finish_reason"]["type"] == "stop", output
        assert check(output["text"]), output["text"]


def test_any_json_starts_a_json_value(engine, tokenizer):
    """SGLang's ``json_schema: "$$ANY$$"`` (any JSON value): every sample opens one (the tokenizer
    has no whitespace, so its first character does)."""
    pytest.importorskip("xgrammar")
    outputs = engine.generate(PROMPT, {"json_schema": "$$ANY$$", "max_new_tokens": 3, "n": 8, "sampling_seed": 1})
    for output in outputs:
        assert output["text"][:1] in set('{["-0123456789tfn'), output["text"]


def test_a_grammar_that_min_new_tokens_blocks_stops_its_request_alone(engine):
    """The regex ``ab`` is complete after two tokens, when only EOS may follow, but min_new_tokens
    holds EOS back: that request stops with an abort that says why; its neighbour runs on."""
    pytest.importorskip("xgrammar")
    blocked, plain = engine.generate([PROMPT, PROMPT], [{"regex": "ab", "min_new_tokens": 4, "max_new_tokens": 8},
                                                        {"max_new_tokens": 3}])
    assert blocked["output_ids"][:2] == [66, 67]  # "a", "b"
    assert blocked["meta_info"]["finish_reason"]["type"] == "abort"
    assert "min_new_tokens" in blocked["meta_info"]["finish_reason"]["message"]
    assert plain["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_an_invalid_grammar_is_a_value_error(engine):
    pytest.importorskip("xgrammar")
    with pytest.raises(ValueError, match="json_schema"):
        engine.add_request(None, PROMPT, {"json_schema": "{not json"})


# ----------------------------------------------------------------------------- on a GPU


def run_requests(engine, requests: dict[str, tuple[list[int], dict, dict]]) -> dict[str, dict]:
    """Queue ``{rid: (prompt, sampling_params, logprob fields)}`` together; step until all finish."""
    for rid, (prompt, params, fields) in requests.items():
        engine.add_request(rid, prompt, params, **fields)
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output["meta_info"]["id"]] = output
    return outputs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gpu_engine_gives_what_the_cpu_engine_gives(qwen3_dense, tokenizer):
    """CUDA graphs and overlapped decode on, every feature in one batch: penalties, logit_bias,
    top / requested-id / prompt logprobs and a grammar give the CPU engine's tokens and logprobs."""
    from miles_host.rollout import Engine
    from tests.rollout.conftest import load

    _, path = qwen3_dense
    gpu = Engine(load(path).cuda(), tokenizer=tokenizer, max_num_seqs=8, mem_fraction_static=0.3,
                 max_kv_cache_tokens=4096, block_size=4)
    assert gpu.runner.graphs is not None and gpu.config.overlap_schedule
    cpu = make_engine(path, tokenizer=tokenizer, block_size=4)
    long_prompt = [(7 * i + 3) % (VOCAB - 1) for i in range(40)]
    greedy = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    requests = {
        "plain": (PROMPT, {**greedy, "max_new_tokens": 24}, {}),
        "penalised": (PROMPT[:5], {**PENALISED, "temperature": 0}, {"top_logprobs_num": 3, "token_ids_logprob": [5, 9]}),
        "prompt": (long_prompt, greedy, {"logprob_start_len": 2, "top_logprobs_num": 2}),
        "sampled": (PROMPT[2:], {**greedy, "temperature": 0.8, "sampling_seed": 3, "presence_penalty": 1.0}, {}),
    }
    try:
        import xgrammar  # noqa: F401

        requests["grammar"] = (PROMPT, {**greedy, "regex": r"[0-9]{3}\+[a-c]{2}", "ignore_eos": False}, {})
    except ImportError:
        pass
    got, expected = run_requests(gpu, requests), run_requests(cpu, requests)
    alone = run_requests(gpu, {"plain": requests["plain"]})["plain"]
    assert got["plain"]["output_ids"] == alone["output_ids"]
    for rid, output in got.items():
        reference = expected[rid]
        assert output["output_ids"] == reference["output_ids"], rid
        assert output.get("text") == reference.get("text"), rid
        values = [entry[0] for entry in output["meta_info"]["output_token_logprobs"]]
        reference_values = [entry[0] for entry in reference["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(values, reference_values)) < 1e-4, rid
        details, reference_details = output.get("logprobs", {}), reference.get("logprobs", {})
        assert details.keys() == reference_details.keys(), rid
        for key, rows in details.items():
            for row, reference_row in zip(rows, reference_details[key]):
                if key in ("input_token_ids", "input_token_logprobs"):
                    assert (row is None) == (reference_row is None), (rid, key)
                    assert row is None or abs(row - reference_row) < 1e-4, (rid, key)
                elif row is not None:
                    assert [t for t, _ in row] == [t for t, _ in reference_row], (rid, key)
                    assert max(abs(a - b) for (_, a), (_, b) in zip(row, reference_row)) < 1e-4, (rid, key)
