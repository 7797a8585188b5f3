"""SGLang-shaped results of finished (or aborted, or rejected) requests.

``text`` is detokenized as SGLang's detokenizer does it: with the request's
``skip_special_tokens`` / ``spaces_between_special_tokens`` passed to ``tokenizer.decode``
(transformers 5's tokenizers ignore the latter, in SGLang too), and with the matched stop
removed unless ``no_stop_trim`` (a stop token or EOS is left out of the decoded ids, a
stop string is cut where it starts; ``output_ids`` always keep every token). A
``stop_regex`` match is cut where the match starts (SGLang looks the pattern up as a
literal string there, so its text keeps a regex match).

Logprobs beyond the sampled tokens' come back raw in ``output["logprobs"]``
(``(token id, logprob)`` pairs, see :func:`logprob_details`);
:func:`sglang_logprob_meta` renders them in SGLang's ``meta_info`` layout.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from miles_host.rollout.sequence import Sequence


def routed_experts_array(seq: Sequence) -> np.ndarray | None:
    """``[prompt + completion - 1, moe_layers, top_k]`` int32 expert ids (SGLang's layout)
    from ``seq.routed_expert_chunks`` (the engine keeps a sequence's routes there when it
    gives up its KV blocks; otherwise they are read from the route store).

    Every token but the last was forwarded once (or again after a preemption:
    later captures overwrite earlier ones). Chunks are numpy arrays or tensors.
    Chunks that continue each other are joined and placed with one copy.
    """
    if not seq.routed_expert_chunks:
        return None
    num_rows = len(seq) - 1
    starts = [start for start, _ in seq.routed_expert_chunks]
    arrays = [chunk.cpu().numpy() if isinstance(chunk, torch.Tensor) else chunk
              for _, chunk in seq.routed_expert_chunks]
    out = np.zeros((num_rows, *arrays[0].shape[1:]), dtype=np.int32)

    def place(start: int, run: list[np.ndarray]) -> None:
        rows = (run[0] if len(run) == 1 else np.concatenate(run))[: max(0, num_rows - start)]
        out[start:start + rows.shape[0]] = rows

    run_start, run_end, run = starts[0], starts[0] + arrays[0].shape[0], [arrays[0]]
    for start, chunk in zip(starts[1:], arrays[1:]):
        if start != run_end:  # a gap or an overlap (a preempted sequence forwarded again)
            place(run_start, run)
            run_start, run = start, []
        run.append(chunk)
        run_end = start + chunk.shape[0]
    place(run_start, run)
    return out


def sequence_output(
    seq: Sequence,
    *,
    weight_version: Any,
    return_logprob: bool,
    return_routed_experts: bool,
    tokenizer: Any | None,
    routed_experts: np.ndarray | None = None,
) -> dict[str, Any]:
    """The result dict of one sample, shaped like SGLang's ``/generate`` response;
    ``routed_experts`` (the engine's, read from its route store) is returned when
    ``return_routed_experts``, else the sequence's own chunks (:func:`routed_experts_array`)."""
    output_ids = list(seq.output_ids)
    meta: dict[str, Any] = {
        "id": seq.rid,
        "index": seq.sample_index,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": seq.num_prompt_tokens,
        "completion_tokens": len(output_ids),
        "cached_tokens": seq.num_prompt_cached_tokens,
        "weight_version": weight_version,
        # which weights generated which tokens (several spans when the weights changed mid-request)
        "weight_version_spans": [list(span) for span in seq.weight_version_spans],
    }
    meta.update(seq.spec_info)
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.output_logprobs, output_ids)]
    if return_routed_experts:
        meta["routed_experts"] = routed_experts if routed_experts is not None else routed_experts_array(seq)
    result: dict[str, Any] = {"output_ids": output_ids, "meta_info": meta}
    if tokenizer is not None:
        result["text"] = output_text(seq, tokenizer)
    if return_logprob and seq.logprob_options is not None:
        result["logprobs"] = logprob_details(seq)
    return result


def output_text(seq: Sequence, tokenizer: Any) -> str:
    """The decoded output, its matched stop trimmed unless ``no_stop_trim`` (SGLang's
    ``DetokenizerManager.trim_matched_stop``)."""
    params = seq.params
    reason = seq.finish_reason or {}
    matched = reason.get("matched") if reason.get("type") == "stop" else None
    ids = list(seq.output_ids)
    if isinstance(matched, int) and not params.no_stop_trim and ids:
        ids = ids[:-1]  # the stop token / EOS is the last one
    text = tokenizer.decode(
        ids, skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
    )
    if not isinstance(matched, str):
        return text
    if matched in params.stop:
        start = text.find(matched)
        end = start + len(matched)
    else:  # a stop_regex pattern
        found = re.search(matched, text)
        start, end = (found.start(), found.end()) if found else (-1, -1)
    if start == -1:
        return text
    return text[:end] if params.no_stop_trim else text[:start]


def logprob_details(seq: Sequence) -> dict[str, Any]:
    """The raw logprob extras of a sample (plain lists, JSON-safe), keys present when asked:

    ``output_top_logprobs`` / ``output_token_ids_logprobs``: per generated token, a list of
    ``[token id, logprob]`` (the top ``top_logprobs_num``, or the ``token_ids_logprob`` ids);
    ``input_token_ids`` (the prompt from ``logprob_start_len``), ``input_token_logprobs``
    (one per such token, the first ``None``) and ``input_top_logprobs`` /
    ``input_token_ids_logprobs`` (per such token, the first ``None``).
    """
    options = seq.logprob_options
    details: dict[str, Any] = {}
    if options.top_logprobs_num > 0:
        details["output_top_logprobs"] = [_pairs(p) for p in seq.output_extras.top_logprobs]
    if options.token_ids_logprob is not None:
        details["output_token_ids_logprobs"] = [_pairs(p) for p in seq.output_extras.token_ids_logprobs]
    if options.wants_input:
        source = seq.input_logprobs or (seq.parent.input_logprobs if seq.parent is not None else None)
        if source is not None:
            details["input_token_ids"] = list(source.token_ids)
            details["input_token_logprobs"] = list(source.token_logprobs)
            if source.top_logprobs is not None:
                details["input_top_logprobs"] = [_pairs(p) for p in source.top_logprobs]
            if source.token_ids_logprobs is not None:
                details["input_token_ids_logprobs"] = [_pairs(p) for p in source.token_ids_logprobs]
    return details


def _pairs(pairs) -> list[list] | None:
    return None if pairs is None else [[token, logprob] for token, logprob in pairs]


def sglang_logprob_meta(output: dict[str, Any], tokenizer: Any | None, return_text: bool) -> dict[str, Any]:
    """The logprob fields of SGLang's ``meta_info`` for one engine output (a pure function).

    ``output_token_logprobs`` / ``input_token_logprobs``: ``[[logprob, token id, text], ...]``;
    ``output_top_logprobs`` / ``input_top_logprobs`` (when ``top_logprobs_num`` was asked) and
    ``output_token_ids_logprobs`` / ``input_token_ids_logprobs`` (when ``token_ids_logprob``
    was): per position ``[[logprob, token id, text], ...]`` or ``None``. ``text`` is each
    token decoded alone when ``return_text`` (SGLang's ``return_text_in_logprobs``), else
    ``None``. An output without logprobs gives ``{}``.
    """
    meta = output.get("meta_info", {})
    if "output_token_logprobs" not in meta:
        return {}
    if return_text and tokenizer is None:
        raise ValueError("return_text_in_logprobs needs a tokenizer, and the checkpoint has none")
    text_of = _token_texts(tokenizer) if return_text else (lambda ids: [None] * len(ids))
    details = output.get("logprobs") or {}
    values = [entry[0] for entry in meta["output_token_logprobs"]]
    result = {
        "output_token_logprobs": _triples(values, output["output_ids"][:len(values)], text_of),
        "input_token_logprobs": _triples(
            details.get("input_token_logprobs", []), details.get("input_token_ids", []), text_of
        ),
    }
    for side in ("top_logprobs", "token_ids_logprobs"):
        if f"output_{side}" in details:
            result[f"input_{side}"] = _positions(details.get(f"input_{side}", []), text_of)
            result[f"output_{side}"] = _positions(details[f"output_{side}"], text_of)
    return result


def _token_texts(tokenizer: Any):
    return lambda ids: tokenizer.batch_decode([[token] for token in ids]) if ids else []


def _triples(values: list, ids: list[int], text_of) -> list[list]:
    return [[value, token, text] for value, token, text in zip(values, ids, text_of(list(ids)))]


def _positions(rows: list, text_of) -> list:
    return [
        None if not row else _triples([lp for _, lp in row], [token for token, _ in row], text_of)
        for row in rows
    ]


def rejected_output(rid: str, message: str, num_prompt_tokens: int, weight_version: Any) -> dict[str, Any]:
    """The result of a request that failed validation: nothing generated, the reason in ``finish_reason``."""
    return {
        "output_ids": [],
        "meta_info": {
            "id": rid,
            "index": 0,
            "finish_reason": {"type": "abort", "message": message},
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "weight_version": weight_version,
            "output_token_logprobs": [],
        },
    }
