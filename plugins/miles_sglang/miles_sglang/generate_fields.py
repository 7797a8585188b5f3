"""What ``/generate`` does with each field of SGLang's ``GenerateReqInput``.

Every field of SGLang's request dataclass (``sglang/srt/managers/io_struct.py``) has
a record here, so a request written for SGLang is never half-understood:

- ``SERVED``: read and honoured (prompts, sampling, logprobs, streaming, routed experts);
- ``NO_EFFECT``: accepted, and without effect on what is generated or returned on one
  embedded engine (logging, tracing, routing hints of a multi-server deployment);
- ``UNSUPPORTED``: a feature the embedded engine does not have (multimodal inputs,
  LoRA, hidden states, custom logit processors, disaggregation). Its SGLang default
  (``null``, ``false``, ``0``, an empty or all-``null`` list) is accepted; any other
  value is a ``ValueError`` (HTTP 400) that names the key and says why.

A key that is not a field of ``GenerateReqInput`` is a ``ValueError`` naming it (a
misspelt ``sampling_param`` would otherwise be dropped silently).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SERVED = "served"
NO_EFFECT = "no_effect"
UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class RequestField:
    """One ``GenerateReqInput`` field: how ``/generate`` handles it, and why."""

    name: str
    handling: str
    why: str = ""


def _records(handling: str, why: str, *names: str) -> dict[str, RequestField]:
    return {name: RequestField(name, handling, why) for name in names}


_MULTIMODAL = "the embedded engine serves text-only models"
_DISAGG = "prefill/decode disaggregation needs separate SGLang servers"

#: field name -> record, for every field of SGLang's GenerateReqInput
GENERATE_FIELDS: dict[str, RequestField] = {
    **_records(SERVED, "", "rid", "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
               "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream",
               "return_routed_experts", "routed_experts_start_len"),
    **_records(NO_EFFECT, "metrics, logs and traces of SGLang's own", "log_metrics", "no_logs", "custom_labels",
               "external_trace_header", "received_time"),
    **_records(NO_EFFECT, "a routing or scheduling hint; this server has one engine and schedules first come first served",
               "routing_key", "conversation_id", "priority", "http_worker_ipc"),
    **_records(NO_EFFECT, "this server has one data-parallel rank", "routed_dp_rank", "data_parallel_rank",
               "disagg_prefill_dp_rank"),
    **_records(UNSUPPORTED, _MULTIMODAL, "image_data", "video_data", "audio_data", "input_embeds", "mm_hashes",
               "mm_content_hashes", "use_audio_in_video", "video_config", "modalities", "need_wait_for_mm_inputs",
               "num_items_assigned", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch",
               "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config", "mm_processor_kwargs",
               "positional_embed_overrides"),
    **_records(UNSUPPORTED, _DISAGG, "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
               "decode_tp_size", "kv_hints"),
    **_records(UNSUPPORTED, "LoRA adapters are not loaded by the embedded engine", "lora_path", "lora_id"),
    **_records(UNSUPPORTED, "custom logit processors (serialized Python) are not run by the embedded engine",
               "custom_logit_processor"),
    **_records(UNSUPPORTED, "the engine does not return hidden states", "return_hidden_states"),
    **_records(UNSUPPORTED, "the engine has no sparse-attention indexer", "return_indexer_topk"),
    **_records(UNSUPPORTED, "SGLang's stateful sessions (/open_session) are not served", "session_id",
               "session_params"),
    **_records(UNSUPPORTED, "watermarking is not implemented", "watermark"),
    **_records(UNSUPPORTED, "the prefix cache is shared by all requests (no per-request cache keys)", "extra_key",
               "cache_salt"),
    **_records(UNSUPPORTED, "the engine reports the sampled tokens' logprobs, top and requested-id logprobs only",
               "return_sampling_mask", "sampling_logprobs_mode", "return_flat_raw_top_logprobs",
               "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64", "return_entropy"),
    **_records(UNSUPPORTED, "reasoning budgets are not enforced by the engine", "require_reasoning",
               "max_thinking_tokens"),
    **_records(UNSUPPORTED, "responses are JSON only", "return_bytes"),
    **_records(UNSUPPORTED, "the prompt ids are not echoed back (the caller has them)", "return_prompt_token_ids"),
    **_records(UNSUPPORTED, "background requests are not queued by this server", "background"),
    **_records(UNSUPPORTED, "multi-item scoring and pooling are not served", "multi_item_delimiter_indices",
               "token_indices_to_pool"),
}


def is_default(value: Any) -> bool:
    """Whether ``value`` is SGLang's 'unset' for a field: null, false, 0, empty, or a list of those."""
    if isinstance(value, list):
        return all(is_default(v) for v in value)
    return value is None or value is False or (isinstance(value, (int, float)) and value == 0) or value in ("", {})


def check_request_fields(body: dict) -> None:
    """``ValueError`` for an unknown key or an unsupported feature asked for (naming each)."""
    unknown = sorted(set(body) - set(GENERATE_FIELDS))
    if unknown:
        raise ValueError(
            f"unknown /generate field(s) {unknown}: not fields of SGLang's GenerateReqInput; "
            "sampling settings go inside 'sampling_params'"
        )
    for name, value in body.items():
        record = GENERATE_FIELDS[name]
        if record.handling == UNSUPPORTED and not is_default(value):
            raise ValueError(f"'{name}' is not supported by miles serve ({record.why}): drop the key or leave it null")
