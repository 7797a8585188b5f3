"""The weight endpoints of ``miles serve``: updates from tensors, disk and a process
group, and the group's lifecycle. Same calling convention as
:mod:`miles_sglang.endpoints`; answers are SGLang's ``{"success", "message"}``
(HTTP 400 with ``success: false`` when the update is refused).

Heavy work stays off the event loop: decoding payloads and reading files run in
the thread pool, loading into the model runs in the engine thread, joining a
process group runs in a thread of its own bounded by the request's ``timeout``.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import socket
import threading
import time
from http import HTTPStatus
from pathlib import Path
from typing import Any, Awaitable, Callable

import torch
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from miles_sglang.endpoints import flag
from miles_sglang.protocol import decode_tensor_payload, parse_dtype
from miles_sglang.service import ServerState
from miles_sglang.weights import load_named_tensors

logger = logging.getLogger(__name__)

#: how long /init_weights_update_group may take when the request names no ``timeout``
DEFAULT_GROUP_TIMEOUT_S = 60.0


async def _apply_weights(state: ServerState, named: list, body: dict) -> None:
    flush = flag(body, "flush_cache", True, bool)
    version = body.get("weight_version")
    abort = bool(body.get("abort_all_requests"))

    def apply(engine):
        if abort:
            state.worker.abort_here(None, "aborted")
        load_named_tensors(engine.model, named, state.family)
        if flush:
            engine.flush_cache()
        if version is not None:
            engine.weight_version = str(version)

    await state.worker.call_async(apply)


async def _weights_response(state: ServerState, work: Callable[[], Awaitable[None]], success_message: str,
                            **extra: Any) -> Any:
    try:
        await work()
    except ValueError as error:
        return JSONResponse({"success": False, "message": str(error), **extra}, status_code=HTTPStatus.BAD_REQUEST)
    return {"success": True, "message": f"{success_message} Weight version is {state.weight_version}.", **extra}


async def update_weights_from_tensor(state: ServerState, request, body: dict) -> Any:
    """POST /update_weights_from_tensor: ``serialized_named_tensors[tp_rank]`` (see
    :mod:`miles_sglang.protocol` for the accepted encodings), ``load_format``,
    ``flush_cache``, ``abort_all_requests``, ``weight_version``."""
    async def work():
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not payloads:
            raise ValueError("'serialized_named_tensors' must be a non-empty list (one entry per TP rank)")
        named = await run_in_threadpool(decode_tensor_payload, payloads[0], body.get("load_format"))
        await _apply_weights(state, named, body)

    return await _weights_response(state, work, "Succeeded to update model weights.")


def contained_shards(directory: str) -> list[Path]:
    """The safetensors files of ``directory``, each checked to resolve inside it: an index
    entry such as ``../x.safetensors`` or a symlink pointing out is refused (ValueError),
    so a request can only make the server read weights under the directory it names."""
    from miles_host.models.loading import safetensors_files

    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"model_path {directory!r} is not a directory of safetensors weights")
    root = root.resolve()

    def refuse_outside(paths: list[Path]) -> None:
        outside = [f"{p} -> {p.resolve()}" for p in paths if not p.resolve().is_relative_to(root)]
        if outside:
            raise ValueError(f"refusing weight files that resolve outside {root}: {outside} "
                             "(index entries and symlinks must stay inside model_path)")

    index = root / "model.safetensors.index.json"
    if index.exists():  # checked before anything it names is even looked at
        refuse_outside([index])
        try:
            shard_names = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as error:
            raise ValueError(f"{index} is not a valid safetensors index: {error}") from error
        refuse_outside([root / str(name) for name in shard_names])
    try:
        files = safetensors_files(root)
    except FileNotFoundError as error:
        raise ValueError(str(error)) from error
    refuse_outside(files)
    return files


async def update_weights_from_disk(state: ServerState, request, body: dict) -> Any:
    """POST /update_weights_from_disk ``{"model_path", "weight_version", ...}``: every shard
    must resolve inside ``model_path`` (:func:`contained_shards`)."""
    from miles_host.models.loading import iter_safetensors

    async def work():
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise ValueError("'model_path' (a directory of safetensors weights) is required")
        named = await run_in_threadpool(lambda: list(iter_safetensors(contained_shards(path))))
        await _apply_weights(state, named, body)

    return await _weights_response(state, work, "Succeeded to update model weights.", num_paused_requests=0)


def _in_own_thread(fn: Callable[[], Any]) -> "asyncio.Future[Any]":
    """``fn()`` in a daemon thread of its own, as an awaitable. torch's store client can
    hang past its timeout (a port that accepts and never answers), so it must not hold a
    pool thread; awaiting with a deadline bounds the answer, the thread ends or is left."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(setter, value) -> None:
        if not future.done():
            setter(value)

    def run() -> None:
        try:
            result = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting side
            loop.call_soon_threadsafe(settle, future.set_exception, error)
        else:
            loop.call_soon_threadsafe(settle, future.set_result, result)

    threading.Thread(target=run, name="miles-serve-group-join", daemon=True).start()
    return future


def _group_request(body: dict) -> tuple[str, int, int, int, str, str, float]:
    try:
        address, port = str(body["master_address"]), int(body["master_port"])
        rank, world = int(body["rank_offset"]), int(body["world_size"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"master_address, master_port, rank_offset and world_size are required: {error}") from error
    backend, name = body.get("backend", "nccl"), body.get("group_name", "weight_update_group")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, and this server runs on CPU: use backend 'gloo'")
    timeout = body.get("timeout", DEFAULT_GROUP_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
        raise ValueError(f"'timeout' must be seconds in (0, 3600], got {timeout!r}")
    return address, port, rank, world, backend, str(name), float(timeout)


def _join_group(address: str, port: int, rank: int, world: int, backend: str, deadline: float) -> Any:
    """Dial the trainer's store, then join its group; every step gets what is left of the deadline."""
    import torch.distributed as dist

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the deadline passed")
        return remaining

    try:  # a plain dial first: 'nobody listens' is answered at once, not after torch's retries
        socket.create_connection((address, port), timeout=left()).close()
    except OSError as error:
        raise ValueError(f"could not reach the weight update group's store at {address}:{port}: {error}") from error
    try:
        store = dist.TCPStore(address, port, world, is_master=False, timeout=datetime.timedelta(seconds=left()))
        group_class = dist.ProcessGroupGloo if backend == "gloo" else dist.ProcessGroupNCCL
        return group_class(store, rank, world, datetime.timedelta(seconds=left()))
    except (RuntimeError, OSError, TimeoutError) as error:
        raise ValueError(f"could not join the weight update group at {address}:{port}: {error}") from error


async def init_weights_update_group(state: ServerState, request, body: dict) -> Any:
    """POST /init_weights_update_group: join the trainer's group as rank ``rank_offset``
    (gloo on CPU; nccl needs CUDA). The whole call, dialling included, is bounded by
    ``timeout`` seconds (default 60): past it the answer is a 400 naming the address."""
    async def work():
        address, port, rank, world, backend, name, timeout = _group_request(body)
        deadline = time.monotonic() + timeout
        joining = _in_own_thread(lambda: _join_group(address, port, rank, world, backend, deadline))
        try:
            group = await asyncio.wait_for(asyncio.shield(joining), timeout)
        except asyncio.TimeoutError:
            joining.add_done_callback(lambda late: late.cancelled() or late.exception())  # outcome dropped
            logger.warning("joining the weight update group at %s:%s overran %.1fs; left behind", address, port, timeout)
            raise ValueError(f"could not join the weight update group at {address}:{port} within {timeout:g}s "
                             "(pass a larger 'timeout' if the trainer is slow to start)") from None
        state.weight_groups[name] = (group, backend)

    return await _weights_response(state, work, "Succeeded to initialize custom process group.")


async def update_weights_from_distributed(state: ServerState, request, body: dict) -> Any:
    """POST /update_weights_from_distributed ``{"names", "dtypes", "shapes", ...}``:
    receive each tensor by broadcast from rank 0 of the group, then load them."""
    import torch.distributed as dist

    async def work():
        name = body.get("group_name", "weight_update_group")
        if name not in state.weight_groups:
            raise ValueError(f"no weight update group {name!r}: call /init_weights_update_group first")
        if body.get("load_format") not in (None,):
            raise ValueError("load_format 'flattened_bucket' is not supported by update_weights_from_distributed here")
        group, backend = state.weight_groups[name]
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) or not (
            len(names) == len(dtypes) == len(shapes)
        ):
            raise ValueError("'names', 'dtypes' and 'shapes' must be lists of one length")
        device = "cuda" if backend == "nccl" else "cpu"

        def receive() -> list:
            named = []
            for weight_name, dtype, shape in zip(names, dtypes, shapes):
                tensor = torch.empty([int(s) for s in shape], dtype=parse_dtype(dtype), device=device)
                options = dist.BroadcastOptions()
                options.rootRank = 0
                group.broadcast([tensor], options).wait()
                named.append((str(weight_name), tensor))
            return named

        await _apply_weights(state, await run_in_threadpool(receive), body)

    return await _weights_response(state, work, "Succeeded to update parameter online from distributed.")


async def destroy_weights_update_group(state: ServerState, request, body: dict) -> Any:
    """POST /destroy_weights_update_group ``{"group_name"}``."""
    async def work():
        name = body.get("group_name", "weight_update_group")
        if state.weight_groups.pop(name, None) is None:
            raise ValueError(f"no weight update group {name!r}")

    return await _weights_response(state, work, "Succeeded to destroy custom process group.")


#: path -> (HTTP methods, endpoint)
ROUTES = {
    "/update_weights_from_tensor": (("POST",), update_weights_from_tensor),
    "/update_weights_from_disk": (("POST",), update_weights_from_disk),
    "/init_weights_update_group": (("POST",), init_weights_update_group),
    "/update_weights_from_distributed": (("POST",), update_weights_from_distributed),
    "/destroy_weights_update_group": (("POST",), destroy_weights_update_group),
}
