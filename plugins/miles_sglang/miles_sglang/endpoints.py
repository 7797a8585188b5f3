"""The endpoints of ``miles serve``, one function each: ``fn(handler, body)``.

Field names and response shapes are SGLang's (``managers/io_struct.py``,
``entrypoints/http_server.py``, ``docs/advanced_features/sglang_for_rl.md``).
A ``ValueError`` raised here is answered HTTP 400 ``{"error": {"message": ...}}``.
"""

from __future__ import annotations

import datetime
from http import HTTPStatus
from typing import Any

import torch

from miles_sglang import __version__
from miles_sglang.protocol import decode_tensor_payload, parse_dtype
from miles_sglang.service import GenerateJob
from miles_sglang.weights import load_named_tensors

_HEALTH_TIMEOUT_S = 20.0
_GROUP_TIMEOUT_S = 60.0


# ----------------------------------------------------------------------------
# /generate
# ----------------------------------------------------------------------------


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(handler, body: dict) -> tuple[list[list[int]], bool]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ValueError("give exactly one of 'text' or 'input_ids'")
    if text is not None:
        tokenizer = handler.state.worker.engine.tokenizer
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


def _flag(body: dict, name: str, default: Any, kind: type) -> Any:
    value = body.get(name, default)
    value = default if value is None else value
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"'{name}' must be {kind.__name__}, got {value!r}")
    return value


def generate(handler, body: dict) -> None:
    """POST /generate: one prompt (dict result; a list when n > 1) or a batch (flat list)."""
    state = handler.state
    if "weights" in state.released_tags:
        raise ValueError("the weights are released: call /resume_memory_occupation first")
    prompts, single = _prompts(handler, body)
    params = _per_prompt(body.get("sampling_params"), len(prompts), "sampling_params", {})
    if not all(isinstance(p, dict) for p in params):
        raise ValueError("'sampling_params' must be an object or a list of objects")
    params = [dict(p) for p in params]
    rid = body.get("rid")
    if isinstance(rid, list):
        rids = [str(r) for r in _per_prompt(rid, len(prompts), "rid", None)]
    elif rid is not None:
        rids = [str(rid)] if single else [f"{rid}-{i}" for i in range(len(prompts))]
    else:
        from miles_sglang.server import new_rid

        rids = [new_rid() for _ in prompts]
    if len(set(rids)) != len(rids):
        raise ValueError("request ids must be distinct within a batch")
    for name in ("return_logprob", "return_routed_experts"):
        if isinstance(body.get(name), list):
            raise ValueError(f"'{name}' must be one boolean for the whole request")
    keys = []
    for r, p in zip(rids, params):
        n = p.get("n", 1)
        keys.extend((r, k) for k in range(n if isinstance(n, int) and n >= 1 else 1))
    job = GenerateJob(
        keys=keys, prompts=dict(zip(rids, prompts)),
        return_logprob=_flag(body, "return_logprob", False, bool),
        return_routed_experts=_flag(body, "return_routed_experts", False, bool),
        logprob_start_len=_flag(body, "logprob_start_len", -1, int),
        stream=_flag(body, "stream", False, bool), incremental=state.incremental_streaming_output,
    )
    state.worker.submit(job, prompts, params, rids)
    if job.stream:
        _stream(handler, job)
        return
    _wait(handler, job)
    results = job.ordered_results()
    handler.send_json(results[0] if single and len(results) == 1 else results)


def _wait(handler, job: GenerateJob) -> None:
    while not job.done.wait(1.0):
        if not handler.state.worker.alive:
            raise RuntimeError("the engine thread stopped")


def _stream(handler, job: GenerateJob) -> None:
    import queue

    handler.start_sse()
    try:
        while True:
            try:
                chunk = job.chunks.get(timeout=1.0)
            except queue.Empty:
                if not handler.state.worker.alive:
                    break
                continue
            if chunk is None:
                break
            if len(job.keys) == 1:
                chunk.pop("index", None)
            handler.send_event(chunk)
        handler.send_event("[DONE]")
    except (BrokenPipeError, ConnectionResetError):
        for rid in job.prompts:  # the client went away: stop its generation
            handler.state.worker.abort(rid)
        raise


# ----------------------------------------------------------------------------
# control
# ----------------------------------------------------------------------------


def abort_request(handler, body: dict) -> None:
    """POST /abort_request ``{"rid": ...}`` or ``{"abort_all": true}``: 200, empty body."""
    if body.get("abort_all"):
        handler.state.worker.abort(None)
    elif body.get("rid"):
        handler.state.worker.abort(str(body["rid"]))
    handler.send_json(None)


def flush_cache(handler, body: dict) -> None:
    """GET/POST /flush_cache: the prefix cache (blocks in use stay)."""
    handler.state.worker.call(lambda engine: engine.flush_cache())
    handler.send_text("Cache flushed.\nPlease check backend logs for more details. "
                      "(When there are running or waiting requests, the operation will not be performed.)\n")


def health(handler, body: dict) -> None:
    """GET /health: 200 while the engine thread runs, else 503."""
    handler.send_text("", HTTPStatus.OK if handler.state.worker.alive else HTTPStatus.SERVICE_UNAVAILABLE)


def health_generate(handler, body: dict) -> None:
    """GET /health_generate: generate one token; 200 if it comes back in time."""
    from miles_sglang.server import new_rid

    rid = f"HEALTH_CHECK_{new_rid()}"
    job = GenerateJob(keys=[(rid, 0)], prompts={rid: [0]}, return_logprob=False, return_routed_experts=False,
                      logprob_start_len=-1, stream=False, incremental=False)
    try:
        handler.state.worker.submit(job, [[0]], [{"max_new_tokens": 1, "temperature": 0.0}], [rid])
    except (ValueError, RuntimeError):
        handler.send_text("", HTTPStatus.SERVICE_UNAVAILABLE)
        return
    ok = job.done.wait(_HEALTH_TIMEOUT_S) or handler.state.worker.engine.paused
    if not job.done.is_set():
        handler.state.worker.abort(rid)
    handler.send_text("", HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE)


def get_model_info(handler, body: dict) -> None:
    """GET /get_model_info."""
    state = handler.state
    handler.send_json({
        "model_path": state.model_path,
        "tokenizer_path": state.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.worker.engine.weight_version,
    })


def get_weight_version(handler, body: dict) -> None:
    """GET /get_weight_version."""
    handler.send_json({"weight_version": handler.state.worker.engine.weight_version})


def get_server_info(handler, body: dict) -> None:
    """GET /get_server_info: server args, engine limits, version."""
    state = handler.state
    engine = state.worker.engine
    internal = state.worker.call(lambda e: {
        "paused": e.paused, "has_unfinished": e.has_unfinished(), "weight_version": e.weight_version,
        "max_total_num_tokens": e.num_kv_cache_tokens, "released_tags": sorted(state.released_tags),
    })
    handler.send_json({
        **state.server_args,
        "max_total_num_tokens": engine.num_kv_cache_tokens,
        "max_running_requests": engine.config.max_num_seqs,
        "context_length": engine.config.max_model_len,
        "weight_version": engine.weight_version,
        "internal_states": [internal],
        "version": f"miles-serve {__version__}",
    })


def pause_generation(handler, body: dict) -> None:
    """POST /pause_generation ``{"mode": "abort" | "retract" | "in_place"}`` (default abort)."""
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        raise ValueError(f"mode must be abort, retract or in_place, got {mode!r}")

    def pause(engine):
        if mode == "abort":
            handler.state.worker.abort_here(None, "aborted")
        engine.pause()

    handler.state.worker.call(pause)
    handler.send_json({"message": "Generation paused successfully.", "status": "ok"})


def continue_generation(handler, body: dict) -> None:
    """POST /continue_generation."""
    handler.state.worker.call(lambda engine: engine.resume())
    handler.send_json({"message": "Generation continued successfully.", "status": "ok"})


def _memory_tags(body: dict) -> set[str]:
    tags = body.get("tags") or ["kv_cache", "weights"]
    if not isinstance(tags, list) or not set(tags) <= {"kv_cache", "weights"}:
        raise ValueError(f"tags must be a list of 'kv_cache' / 'weights', got {tags!r}")
    return set(tags)


def release_memory_occupation(handler, body: dict) -> None:
    """POST /release_memory_occupation ``{"tags": [...]}``: the engine must be idle.

    On CPU nothing is freed (the embedded engine keeps its tensors); generation
    is refused until the weights are resumed, as on a real server.
    """
    tags = _memory_tags(body)
    state = handler.state

    def release(engine):
        if engine.has_unfinished():
            raise ValueError("release_memory_occupation needs an idle engine: requests are in flight")
        engine.flush_cache()
        state.released_tags |= tags

    state.worker.call(release)
    handler.send_json(None)


def resume_memory_occupation(handler, body: dict) -> None:
    """POST /resume_memory_occupation ``{"tags": [...]}``."""
    tags = _memory_tags(body)
    handler.state.worker.call(lambda engine: handler.state.released_tags.difference_update(tags))
    handler.send_json(None)


# ----------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------


def _apply_weights(handler, named: list, body: dict) -> None:
    state = handler.state
    flush = _flag(body, "flush_cache", True, bool)
    version = body.get("weight_version")

    def apply(engine):
        if body.get("abort_all_requests"):
            state.worker.abort_here(None, "aborted")
        load_named_tensors(engine.model, named, state.family)
        if flush:
            engine.flush_cache()
        if version is not None:
            engine.weight_version = version

    state.worker.call(apply)


def _weights_response(handler, work, success_message: str, **extra: Any) -> None:
    try:
        work()
    except ValueError as error:
        handler.send_json({"success": False, "message": str(error), **extra}, HTTPStatus.BAD_REQUEST)
        return
    version = handler.state.worker.engine.weight_version
    handler.send_json({"success": True, "message": f"{success_message} Weight version is {version}.", **extra})


def update_weights_from_tensor(handler, body: dict) -> None:
    """POST /update_weights_from_tensor: ``serialized_named_tensors[tp_rank]`` (see
    :mod:`miles_sglang.protocol` for the accepted encodings), ``load_format``,
    ``flush_cache``, ``abort_all_requests``, ``weight_version``."""
    def work():
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not payloads:
            raise ValueError("'serialized_named_tensors' must be a non-empty list (one entry per TP rank)")
        named = decode_tensor_payload(payloads[0], body.get("load_format"))
        _apply_weights(handler, named, body)

    _weights_response(handler, work, "Succeeded to update model weights.")


def update_weights_from_disk(handler, body: dict) -> None:
    """POST /update_weights_from_disk ``{"model_path", "weight_version", ...}``."""
    from miles_host.models.loading import iter_safetensors, safetensors_files

    def work():
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise ValueError("'model_path' (a directory of safetensors weights) is required")
        try:
            named = list(iter_safetensors(safetensors_files(path)))
        except FileNotFoundError as error:
            raise ValueError(str(error)) from error
        _apply_weights(handler, named, body)

    _weights_response(handler, work, "Succeeded to update model weights.", num_paused_requests=0)


def init_weights_update_group(handler, body: dict) -> None:
    """POST /init_weights_update_group: join the trainer's group as rank ``rank_offset``
    (gloo on CPU; nccl needs CUDA). Blocks until every rank has joined."""
    import torch.distributed as dist

    def work():
        try:
            address, port = str(body["master_address"]), int(body["master_port"])
            rank, world = int(body["rank_offset"]), int(body["world_size"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"master_address, master_port, rank_offset and world_size are required: {error}") from error
        backend, name = body.get("backend", "nccl"), body.get("group_name", "weight_update_group")
        timeout = datetime.timedelta(seconds=_GROUP_TIMEOUT_S)
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA, and this server runs on CPU: use backend 'gloo'")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        try:
            store = dist.TCPStore(address, port, world, is_master=False, timeout=timeout)
            group_class = dist.ProcessGroupGloo if backend == "gloo" else dist.ProcessGroupNCCL
            group = group_class(store, rank, world, timeout)
        except (RuntimeError, OSError) as error:
            raise ValueError(f"could not join the weight update group at {address}:{port}: {error}") from error
        handler.state.weight_groups[name] = (group, backend)

    _weights_response(handler, work, "Succeeded to initialize custom process group.")


def update_weights_from_distributed(handler, body: dict) -> None:
    """POST /update_weights_from_distributed ``{"names", "dtypes", "shapes", ...}``:
    receive each tensor by broadcast from rank 0 of the group, then load them."""
    import torch.distributed as dist

    def work():
        name = body.get("group_name", "weight_update_group")
        if name not in handler.state.weight_groups:
            raise ValueError(f"no weight update group {name!r}: call /init_weights_update_group first")
        if body.get("load_format") not in (None,):
            raise ValueError("load_format 'flattened_bucket' is not supported by update_weights_from_distributed here")
        group, backend = handler.state.weight_groups[name]
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) or not (
            len(names) == len(dtypes) == len(shapes)
        ):
            raise ValueError("'names', 'dtypes' and 'shapes' must be lists of one length")
        device = "cuda" if backend == "nccl" else "cpu"
        named = []
        for weight_name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty([int(s) for s in shape], dtype=parse_dtype(dtype), device=device)
            options = dist.BroadcastOptions()
            options.rootRank = 0
            group.broadcast([tensor], options).wait()
            named.append((str(weight_name), tensor))
        _apply_weights(handler, named, body)

    _weights_response(handler, work, "Succeeded to update parameter online from distributed.")


def destroy_weights_update_group(handler, body: dict) -> None:
    """POST /destroy_weights_update_group ``{"group_name"}``."""
    def work():
        name = body.get("group_name", "weight_update_group")
        if handler.state.weight_groups.pop(name, None) is None:
            raise ValueError(f"no weight update group {name!r}")

    _weights_response(handler, work, "Succeeded to destroy custom process group.")


#: path -> (HTTP methods, handler)
ROUTES = {
    "/generate": (("POST", "PUT"), generate),
    "/abort_request": (("POST",), abort_request),
    "/flush_cache": (("GET", "POST"), flush_cache),
    "/health": (("GET",), health),
    "/health_generate": (("GET",), health_generate),
    "/get_model_info": (("GET",), get_model_info),
    "/get_weight_version": (("GET",), get_weight_version),
    "/get_server_info": (("GET",), get_server_info),
    "/pause_generation": (("POST",), pause_generation),
    "/continue_generation": (("POST",), continue_generation),
    "/release_memory_occupation": (("GET", "POST"), release_memory_occupation),
    "/resume_memory_occupation": (("GET", "POST"), resume_memory_occupation),
    "/update_weights_from_tensor": (("POST",), update_weights_from_tensor),
    "/update_weights_from_disk": (("POST",), update_weights_from_disk),
    "/init_weights_update_group": (("POST",), init_weights_update_group),
    "/update_weights_from_distributed": (("POST",), update_weights_from_distributed),
    "/destroy_weights_update_group": (("POST",), destroy_weights_update_group),
}
