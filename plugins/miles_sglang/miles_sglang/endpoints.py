"""The generation, control and information endpoints of ``miles serve``.

Each endpoint is ``async fn(state, request, body)``: ``state`` the
:class:`~miles_sglang.service.ServerState`, ``request`` the Starlette request,
``body`` the decoded JSON object. It returns a Starlette ``Response``, or a
payload answered as JSON with HTTP 200. A ``ValueError`` is answered HTTP 400
``{"error": {"message": ...}}`` (:mod:`miles_sglang.app`). Nothing here blocks
the event loop: engine work runs in the engine thread and is awaited.

Field names and response shapes are SGLang's (``managers/io_struct.py``,
``entrypoints/http_server.py``, ``entrypoints/v1_loads.py``,
``docs/advanced_features/sglang_for_rl.md``). The weight endpoints are in
:mod:`miles_sglang.weight_endpoints`.
"""

from __future__ import annotations

import asyncio
import datetime
import json
from http import HTTPStatus
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

from miles_sglang import __version__
from miles_sglang.generate_fields import check_request_fields
from miles_sglang.service import GenerateJob, LogprobRequest, ServerState, iter_chunks, new_rid, wait_job

_HEALTH_TIMEOUT_S = 20.0
_FLUSH_MESSAGE = ("Cache flushed.\nPlease check backend logs for more details. "
                  "(When there are running or waiting requests, the operation will not be performed.)\n")


def flag(body: dict, name: str, default: Any, kind: type) -> Any:
    """``body[name]`` checked to be ``kind`` (``None`` or absent: ``default``)."""
    value = body.get(name, default)
    value = default if value is None else value
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"'{name}' must be {kind.__name__}, got {value!r}")
    return value


# ----------------------------------------------------------------------------
# /generate
# ----------------------------------------------------------------------------


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(state: ServerState, body: dict) -> tuple[list[list[int]], bool]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ValueError("give exactly one of 'text' or 'input_ids'")
    if text is not None:
        tokenizer = state.worker.engine.tokenizer
        if tokenizer is None:
            raise ValueError("'text' needs a tokenizer, and the checkpoint has none: send 'input_ids'")
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError("'text' must be a string or a list of strings")
        return [list(tokenizer(t)["input_ids"]) for t in texts], single
    single = _is_ids(input_ids)
    prompts = [input_ids] if single else input_ids
    if not isinstance(prompts, list) or not prompts or not all(_is_ids(p) for p in prompts):
        raise ValueError("'input_ids' must be a list of token ids or a list of such lists")
    return prompts, single


def _per_prompt(value: Any, count: int, field: str, default: Any) -> list:
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"'{field}' has {len(value)} entries for {count} prompts")
        return value
    return [default if value is None else value] * count


def _request_ids(body: dict, count: int, single: bool) -> list[str]:
    rid = body.get("rid")
    if isinstance(rid, list):
        rids = [str(r) for r in _per_prompt(rid, count, "rid", None)]
    elif rid is not None:
        rids = [str(rid)] if single else [f"{rid}-{i}" for i in range(count)]
    else:
        rids = [new_rid() for _ in range(count)]
    if len(set(rids)) != len(rids):
        raise ValueError("request ids must be distinct within a batch")
    return rids


#: the logprob fields a batch may give per prompt (SGLang's list forms), with their defaults and types
_PER_PROMPT_LOGPROB_FIELDS = (("return_logprob", False, bool), ("logprob_start_len", -1, int),
                              ("top_logprobs_num", 0, int))


def _logprob_requests(body: dict, rids: list[str], single: bool) -> tuple[dict, dict[str, LogprobRequest]]:
    """The job-wide logprob fields and, where a batch gives lists, each prompt's own."""
    job_wide, lists = {}, {}
    for name, default, kind in _PER_PROMPT_LOGPROB_FIELDS:
        value = body.get(name)
        if isinstance(value, list):
            values = _per_prompt(value, len(rids), name, default)
            lists[name] = [flag({name: v}, name, default, kind) for v in values]
            job_wide[name] = default
        else:
            job_wide[name] = flag(body, name, default, kind)
    ids = body.get("token_ids_logprob")
    if ids is not None and not single and ids and all(isinstance(row, list) or row is None for row in ids):
        lists["token_ids_logprob"] = _per_prompt(ids, len(rids), "token_ids_logprob", None)
        job_wide["token_ids_logprob"] = None
    else:
        job_wide["token_ids_logprob"] = ids
    per_prompt = {}
    if lists:
        for i, rid in enumerate(rids):
            fields = {name: (lists[name][i] if name in lists else job_wide[name]) for name in job_wide}
            per_prompt[rid] = LogprobRequest(**fields)
    return job_wide, per_prompt


def build_generate_job(state: ServerState, body: dict) -> tuple[GenerateJob, list[list[int]], list[dict], list[str], bool]:
    """A ``/generate`` body checked and turned into a job: ``(job, prompts, sampling
    params, rids, single)``. Every key must be a ``GenerateReqInput`` field
    (:mod:`miles_sglang.generate_fields`); ``sampling_params`` pass through to the engine
    unchanged (it validates them); ValueError names what is wrong."""
    check_request_fields(body)
    if state.released_tags:
        raise ValueError(f"memory {sorted(state.released_tags)} is released: call /resume_memory_occupation first")
    prompts, single = _prompts(state, body)
    params = _per_prompt(body.get("sampling_params"), len(prompts), "sampling_params", {})
    if not all(isinstance(p, dict) for p in params):
        raise ValueError("'sampling_params' must be an object or a list of objects")
    params = [dict(p) for p in params]
    rids = _request_ids(body, len(prompts), single)
    for name in ("return_routed_experts", "return_text_in_logprobs", "stream"):
        if isinstance(body.get(name), list):
            raise ValueError(f"'{name}' must be one boolean for the whole request")
    logprobs, per_prompt = _logprob_requests(body, rids, single)
    keys = []
    for r, p in zip(rids, params):
        n = p.get("n", 1)
        keys.extend((r, k) for k in range(n if isinstance(n, int) and n >= 1 else 1))
    start = flag(body, "routed_experts_start_len", 0, int)
    if start < 0:
        raise ValueError(f"'routed_experts_start_len' must be >= 0, got {start}")
    job = GenerateJob(
        keys=keys, prompts=dict(zip(rids, prompts)),
        return_routed_experts=flag(body, "return_routed_experts", False, bool),
        stream=flag(body, "stream", False, bool), incremental=state.incremental_streaming_output,
        return_text_in_logprobs=flag(body, "return_text_in_logprobs", False, bool),
        routed_experts_start_len=start, per_prompt=per_prompt, **logprobs,
    )
    return job, prompts, params, rids, single


async def generate(state: ServerState, request, body: dict) -> Any:
    """POST /generate: one prompt (dict result; a list when n > 1) or a batch (flat list);
    ``stream: true`` answers server-sent events ``data: {json}`` ending ``data: [DONE]``."""
    if body.get("text") is not None:  # tokenizing is CPU work: keep it off the event loop
        job, prompts, params, rids, single = await run_in_threadpool(build_generate_job, state, body)
    else:
        job, prompts, params, rids, single = build_generate_job(state, body)
    event = job.bind_loop(asyncio.get_running_loop())
    await state.worker.submit_async(job, prompts, params, rids)
    if job.stream:
        return StreamingResponse(_sse(job, state, event), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    results = await wait_job(job, state.worker, event, request.is_disconnected)
    return results[0] if single and len(results) == 1 else results


async def _sse(job: GenerateJob, state: ServerState, event: asyncio.Event):
    async for chunk in iter_chunks(job, state.worker, event):
        if len(job.keys) == 1:
            chunk.pop("index", None)
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


# ----------------------------------------------------------------------------
# control
# ----------------------------------------------------------------------------


async def abort_request(state: ServerState, request, body: dict) -> Any:
    """POST /abort_request ``{"rid": ...}`` or ``{"abort_all": true}``: 200, ``null``."""
    if body.get("abort_all"):
        await state.worker.call_async(lambda engine: state.worker.abort_here(None, "aborted"))
    elif body.get("rid"):
        rid = str(body["rid"])
        await state.worker.call_async(lambda engine: state.worker.abort_here(rid, "aborted"))
    return None


async def flush_cache(state: ServerState, request, body: dict) -> Any:
    """GET/POST /flush_cache: the prefix cache (blocks in use stay)."""
    await state.worker.call_async(lambda engine: engine.flush_cache())
    return Response(_FLUSH_MESSAGE, media_type="text/plain; charset=utf-8")


async def health(state: ServerState, request, body: dict) -> Any:
    """GET /health: 200 while the engine thread runs, else 503."""
    return Response(status_code=HTTPStatus.OK if state.worker.alive else HTTPStatus.SERVICE_UNAVAILABLE)


async def health_generate(state: ServerState, request, body: dict) -> Any:
    """GET /health_generate: generate one token; 200 if it comes back in time."""
    rid = f"HEALTH_CHECK_{new_rid()}"
    job = GenerateJob(keys=[(rid, 0)], prompts={rid: [0]}, return_logprob=False, return_routed_experts=False,
                      logprob_start_len=-1, stream=False, incremental=False)
    event = job.bind_loop(asyncio.get_running_loop())
    try:
        await state.worker.submit_async(job, [[0]], [{"max_new_tokens": 1, "temperature": 0.0}], [rid])
        await asyncio.wait_for(wait_job(job, state.worker, event), _HEALTH_TIMEOUT_S)
        ok = True
    except (ValueError, RuntimeError, asyncio.TimeoutError):
        ok = state.worker.alive and state.worker.engine.paused
    return Response(status_code=HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE)


async def get_model_info(state: ServerState, request, body: dict) -> Any:
    """GET /get_model_info (alias /model_info)."""
    return {
        "model_path": state.model_path,
        "tokenizer_path": state.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.weight_version,
    }


async def get_weight_version(state: ServerState, request, body: dict) -> Any:
    """GET /get_weight_version."""
    return {"weight_version": state.weight_version}


async def update_weight_version(state: ServerState, request, body: dict) -> Any:
    """POST /update_weight_version ``{"new_version": str, "abort_all_requests": bool}``."""
    new_version = body.get("new_version")
    if not isinstance(new_version, str) or not new_version:
        raise ValueError(f"'new_version' must be a non-empty string, got {new_version!r}")
    abort = flag(body, "abort_all_requests", False, bool)

    def update(engine):
        if abort:
            state.worker.abort_here(None, "aborted")
        engine.weight_version = new_version

    await state.worker.call_async(update)
    return {"success": True, "message": f"Weight version updated to {new_version}", "new_version": new_version}


async def get_server_info(state: ServerState, request, body: dict) -> Any:
    """GET /get_server_info (alias /server_info): server args, engine limits, version."""
    engine = state.worker.engine
    internal = await state.worker.call_async(lambda e: {
        "paused": e.paused, "has_unfinished": e.has_unfinished(), "weight_version": state.weight_version,
        "max_total_num_tokens": e.num_kv_cache_tokens, "released_tags": sorted(state.released_tags),
    })
    return {
        **state.server_args,
        "max_total_num_tokens": engine.num_kv_cache_tokens,
        "max_running_requests": engine.config.max_num_seqs,
        "context_length": engine.config.max_model_len,
        "weight_version": state.weight_version,
        "internal_states": [internal],
        "version": f"miles-serve {__version__}",
    }


_LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


async def get_loads(state: ServerState, request, body: dict) -> Any:
    """GET /v1/loads (``?include=core,queues``, ``?dp_rank=0``): SGLang's load report,
    one entry for the one data-parallel rank: running and waiting requests, KV tokens in use."""
    include = [s.strip() for s in request.query_params.get("include", "all").split(",") if s.strip()]
    unknown = sorted(set(include) - set(_LOAD_SECTIONS))
    if unknown:
        raise ValueError(f"unknown include sections {unknown}: choose from {list(_LOAD_SECTIONS)}")
    dp_rank = request.query_params.get("dp_rank")
    if dp_rank not in (None, "0"):
        raise ValueError(f"dp_rank {dp_rank!r} does not exist: this server has one rank, 0")
    load = await state.worker.call_async(lambda engine: state.worker.load())
    total = load["max_total_num_tokens"]
    entry = {
        "dp_rank": 0,
        "num_running_reqs": load["num_running_reqs"],
        "num_waiting_reqs": load["num_waiting_reqs"],
        "num_total_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
        "num_used_tokens": load["num_used_tokens"],
        "num_total_tokens": load["num_used_tokens"],
        "max_total_num_tokens": total,
        "token_usage": round(load["num_used_tokens"] / total, 4) if total else 0.0,
        "max_running_requests": load["max_running_requests"],
        "utilization": round(load["num_running_reqs"] / load["max_running_requests"], 4),
    }
    if {"queues", "all"} & set(include):
        entry["queues"] = {"waiting": load["num_waiting_reqs"], "grammar": 0,
                           "paused": load["num_running_reqs"] if load["paused"] else 0, "retracted": 0}
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "version": f"miles-serve {__version__}",
        "dp_rank_count": 1,
        "loads": [entry],
        "aggregate": {
            "total_running_reqs": entry["num_running_reqs"], "total_waiting_reqs": entry["num_waiting_reqs"],
            "total_reqs": entry["num_total_reqs"], "total_used_tokens": entry["num_used_tokens"],
            "total_tokens": entry["num_total_tokens"], "avg_token_usage": entry["token_usage"],
            "avg_utilization": entry["utilization"],
        },
    }


async def pause_generation(state: ServerState, request, body: dict) -> Any:
    """POST /pause_generation ``{"mode": "abort" | "retract" | "in_place"}`` (default abort)."""
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        raise ValueError(f"mode must be abort, retract or in_place, got {mode!r}")

    def pause(engine):
        if mode == "abort":
            state.worker.abort_here(None, "aborted")
        engine.pause()

    await state.worker.call_async(pause)
    return {"message": "Generation paused successfully.", "status": "ok"}


async def continue_generation(state: ServerState, request, body: dict) -> Any:
    """POST /continue_generation."""
    await state.worker.call_async(lambda engine: engine.resume())
    return {"message": "Generation continued successfully.", "status": "ok"}


#: SGLang's memory tags (``GPU_MEMORY_ALL_TYPES``), in the order a resume brings them back
MEMORY_TAGS = ("weights", "cuda_graph", "kv_cache")
#: the tags that name memory of the embedded engine; its decode CUDA graphs go and come with its KV
#: cache, so ``cuda_graph`` is only recorded (and must be released before it is resumed, as in SGLang)
ENGINE_MEMORY_TAGS = frozenset({"weights", "kv_cache"})


def _memory_tags(body: dict) -> list[str]:
    """``body["tags"]`` checked; absent, null or empty: every tag (SGLang's meaning)."""
    tags = body.get("tags") or list(MEMORY_TAGS)
    if not isinstance(tags, list) or not set(tags) <= set(MEMORY_TAGS):
        raise ValueError(f"tags must be a list of {', '.join(repr(t) for t in MEMORY_TAGS)}, got {tags!r}")
    return [tag for tag in MEMORY_TAGS if tag in tags]


async def release_memory_occupation(state: ServerState, request, body: dict) -> Any:
    """POST /release_memory_occupation ``{"tags": [...]}`` (SGLang's ``ReleaseMemoryOccupationReqInput``):
    the engine, which must be idle, frees its KV cache (``kv_cache``) or moves its weights to host
    memory (``weights``) (:meth:`miles_host.rollout.Engine.release_memory_occupation`). A tag already
    released is refused, as SGLang does. Generation is refused until every tag is resumed."""
    tags = _memory_tags(body)

    def release(engine):
        again = sorted(set(tags) & state.released_tags)
        if again:
            raise ValueError(f"memory {again} is released already: resume it first")
        if engine.has_unfinished():
            raise ValueError("release_memory_occupation needs an idle engine: requests are in flight")
        engine.release_memory_occupation(sorted(set(tags) & ENGINE_MEMORY_TAGS))
        state.released_tags |= set(tags)

    await state.worker.call_async(release)
    return None


async def resume_memory_occupation(state: ServerState, request, body: dict) -> Any:
    """POST /resume_memory_occupation ``{"tags": [...]}`` (SGLang's ``ResumeMemoryOccupationReqInput``;
    absent: every tag): the released tags come back (weights to the device, a new KV cache; the
    decode graphs are captured again once nothing is released). A tag not released is refused, as
    SGLang does (its scheduler removes each tag from the released set)."""
    tags = _memory_tags(body)

    def resume(engine):
        missing = [tag for tag in tags if tag not in state.released_tags]
        if missing:
            raise ValueError(f"memory {missing} is not released: release_memory_occupation first "
                             f"(released now: {sorted(state.released_tags)})")
        engine.resume_memory_occupation(sorted(set(tags) & ENGINE_MEMORY_TAGS))
        state.released_tags -= set(tags)

    await state.worker.call_async(resume)
    return None


#: path -> (HTTP methods, endpoint); the weight endpoints are in weight_endpoints.ROUTES
ROUTES = {
    "/generate": (("POST", "PUT"), generate),
    "/abort_request": (("POST",), abort_request),
    "/flush_cache": (("GET", "POST"), flush_cache),
    "/health": (("GET",), health),
    "/health_generate": (("GET",), health_generate),
    "/get_model_info": (("GET",), get_model_info),
    "/model_info": (("GET",), get_model_info),
    "/get_weight_version": (("GET",), get_weight_version),
    "/update_weight_version": (("POST",), update_weight_version),
    "/get_server_info": (("GET",), get_server_info),
    "/server_info": (("GET",), get_server_info),
    "/v1/loads": (("GET",), get_loads),
    "/pause_generation": (("POST",), pause_generation),
    "/continue_generation": (("POST",), continue_generation),
    "/release_memory_occupation": (("GET", "POST"), release_memory_occupation),
    "/resume_memory_occupation": (("GET", "POST"), resume_memory_occupation),
}
