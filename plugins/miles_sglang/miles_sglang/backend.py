"""Rollout backend ``sglang``: the rollout manager's interface over SGLang's HTTP API.

``submit`` posts ``/generate`` from a thread pool (many requests in flight, the
server batches them) with the body slime's rollout sends, and reads the answer as
slime does (:mod:`miles_sglang.client`); ``step`` hands back whatever finished; ``abort_all`` calls
``/abort_request`` and collects the partial outputs; ``update_weights`` pushes
buckets through ``/update_weights_from_tensor``. A request that fails (server
error after retries, malformed answer) comes back as an output with
``finish_reason {"type": "abort", "message": ...}``: that sample is FAILED and
the run carries on. With ``--use-fault-tolerance`` a server that stops answering is
dropped and its requests go to the others (:mod:`miles_sglang.failover`).

Colocated (``--colocate``, ``--offload-rollout``), the servers give their GPU memory to the
trainer between rollouts as slime's do: ``release_memory_occupation`` flushes the cache and
posts ``/release_memory_occupation {"tags": [...]}`` (SGLang's tags: ``kv_cache`` with the
``cuda_graph`` memory over it, and ``weights`` under ``--offload-rollout``);
``resume_memory_occupation`` posts ``/resume_memory_occupation`` one tag at a time in
slime's order: ``weights`` before the weight push, ``cuda_graph`` then ``kv_cache`` after it
(:class:`miles_host.phases.Phases` calls the two). Servers miles launches get
``--enable-memory-saver`` for it (:mod:`miles_sglang.launcher`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any

import numpy as np
from miles_host.protocols import RolloutBackendBase

from miles_sglang.client import SGLangClient, SGLangHTTPError, response_tokens
from miles_sglang.failover import ServerPool
from miles_sglang.protocol import decode_routed_experts, encode_cuda_ipc_payload, encode_tensor_payload
from miles_sglang.weights import family_and_config, native_to_hf

logger = logging.getLogger(__name__)

_STEP_WAIT_S = 0.05
_ABORT_WAIT_S = 30.0
_FLUSH_TRIES = 60
_FLUSH_WAIT_S = 0.5

#: the host's memory tags (:class:`miles_host.phases.PhasePlan`) -> SGLang's: the decode CUDA graphs
#: are captured over the KV cache, so they go and come with it (slime releases both)
SGLANG_MEMORY_TAGS: dict[str, tuple[str, ...]] = {"kv_cache": ("kv_cache", "cuda_graph"), "weights": ("weights",)}
#: the order slime resumes SGLang's memory in: weights (before the weight push), CUDA graphs, KV cache
RESUME_ORDER = ("weights", "cuda_graph", "kv_cache")


def server_urls(config: Any) -> list[str]:
    """``--sglang-url`` (one or more), else ``--sglang-router-ip/--sglang-router-port``."""
    urls = list(getattr(config, "sglang_url", None) or [])
    ip, port = getattr(config, "sglang_router_ip", None), getattr(config, "sglang_router_port", None)
    if not urls and ip and port:
        urls = [f"http://{ip}:{port}"]
    if not urls:
        raise ValueError("--rollout-backend sglang needs --sglang-url URL (or --sglang-router-ip and --sglang-router-port)")
    return [u if "://" in u else f"http://{u}" for u in urls]


def failed_output(rid: str, index: int, message: str, num_prompt_tokens: int, weight_version: Any = None) -> dict:
    """An output for a request that produced nothing usable; the sample becomes FAILED."""
    return {
        "output_ids": [],
        "meta_info": {
            "id": rid, "index": index, "finish_reason": {"type": "abort", "message": message},
            "prompt_tokens": num_prompt_tokens, "completion_tokens": 0, "output_token_logprobs": [],
            "weight_version": weight_version,
        },
    }


class SGLangRolloutBackend(RolloutBackendBase):
    """A client of one or more SGLang (or ``miles serve``) servers; colocated, the servers
    release their memory between rollouts through SGLang's memory endpoints."""

    releases_memory = True

    def __init__(self, config: Any, manager: Any = None):
        self.config = config
        self.launched = None
        if not getattr(config, "sglang_url", None) and getattr(config, "sglang_router_ip", None) is None:
            from miles_sglang.launcher import launch_servers

            self.launched = launch_servers(config)
            config.plugin_args["sglang_url"] = list(self.launched.urls)
        urls = server_urls(config)
        self.clients = [
            SGLangClient(url, api_key=config.sglang_api_key, timeout=config.sglang_request_timeout,
                         max_retries=config.sglang_max_retries, backoff=config.sglang_retry_backoff)
            for url in urls
        ]
        for client in self.clients:
            client.wait_healthy(attempts=config.sglang_health_retries)
        #: the live servers (``self.clients`` is its list: a dropped server leaves both)
        self.pool = ServerPool(self.clients, config)
        self.family, self.model_config = family_and_config(config.hf_checkpoint)
        moe = getattr(self.model_config, "moe", None)
        self.top_k = getattr(moe, "top_k", None)
        self._pool = concurrent.futures.ThreadPoolExecutor(config.sglang_concurrency, thread_name_prefix="sglang-generate")
        self._ready: "queue.Queue[tuple[int, list[dict]]]" = queue.Queue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._epoch = 0  # bumped by abort_all: results of older requests that arrive later are dropped
        self._weight_version: Any = None
        self._released: set[str] = set()  # SGLang memory tags the servers hold released

    # -- the rollout backend interface ----------------------------------------------

    @property
    def weight_version(self) -> Any:
        """Version of the weights last pushed (None before the first sync)."""
        return self._weight_version

    def submit(self, rid: str, input_ids: list[int], sampling_params: dict, return_routed_experts: bool = False) -> None:
        """Post ``/generate`` for ``sampling_params["n"]`` samples; returns at once."""
        if not input_ids:
            raise ValueError("the prompt is empty: input_ids must contain at least one token")
        if return_routed_experts and self.top_k is None:
            raise ValueError("routed experts were asked for, but the model has no MoE layers")
        n = int(sampling_params.get("n", 1))
        client = self.pool.pick()
        with self._lock:
            self._in_flight += 1
            epoch = self._epoch
        self._pool.submit(self._generate, client, rid, list(input_ids), dict(sampling_params), n,
                          return_routed_experts, epoch)

    def step(self) -> list[dict]:
        """Outputs finished since the last call (waits briefly when none is ready)."""
        batches = []
        if self.has_unfinished():
            try:
                batches.append(self._ready.get(timeout=_STEP_WAIT_S))
            except queue.Empty:
                return []
        while True:
            try:
                batches.append(self._ready.get_nowait())
            except queue.Empty:
                break
        return [o for epoch, outputs in batches if epoch == self._epoch for o in outputs]

    def has_unfinished(self) -> bool:
        """True while a request is in flight or a result waits for :meth:`step`."""
        return self._in_flight > 0 or not self._ready.empty()

    def abort_all(self) -> list[dict]:
        """Abort everything on every server; the outputs of all outstanding requests."""
        with self._lock:
            epoch, self._epoch = self._epoch, self._epoch + 1
        deadline = time.monotonic() + _ABORT_WAIT_S
        while True:
            for client in self.clients:  # again each round: catches requests that were still in transit
                try:
                    client.request("POST", "/abort_request", {"rid": "", "abort_all": True}, timeout=10.0, retries=1)
                except Exception as error:  # noqa: BLE001 - the results say what happened
                    logger.warning("abort_request to %s failed: %s", client.url, error)
            wait_until = min(deadline, time.monotonic() + 1.0)
            while self._in_flight > 0 and time.monotonic() < wait_until:
                time.sleep(0.01)
            if self._in_flight == 0 or time.monotonic() >= deadline:
                break
        if self._in_flight:
            logger.warning("%d sglang requests did not return within %.0fs of abort; they are dropped",
                           self._in_flight, _ABORT_WAIT_S)
        outputs = []
        while True:
            try:
                tagged, batch = self._ready.get_nowait()
            except queue.Empty:
                break
            if tagged == epoch:
                outputs.extend(batch)
        return outputs

    def update_weights(self, named_tensors, weight_version: Any = None) -> Any:
        """Push weights in ``--update-weight-buffer-size`` buckets to every server."""
        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        if self.config.sglang_weight_names == "hf":
            named = native_to_hf(named, self.family, self.model_config)
        buckets = split_buckets(named, self.config.update_weight_buffer_size)
        version = None if weight_version is None else str(weight_version)
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            if self.config.sglang_weight_encoding == "cuda_ipc":
                payload = encode_cuda_ipc_payload(bucket)
            else:
                payload = encode_tensor_payload(bucket, "flattened_bucket")
            body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket",
                    "flush_cache": last, "weight_version": version if last else None}
            for client in self.clients:
                answer = client.request("POST", "/update_weights_from_tensor", body)
                if isinstance(answer, dict) and answer.get("success") is False:
                    raise RuntimeError(f"{client.url}/update_weights_from_tensor failed: {answer.get('message')}")
        self._weight_version = weight_version
        return weight_version

    def release_memory_occupation(self, tags: list[str] | None = None) -> list[str]:
        """Every server releases the memory of the host ``tags`` (None: KV cache and weights),
        after its cache is flushed (no request may be in flight); returns the SGLang tags
        released now (those released already are not asked for again: SGLang refuses that)."""
        wanted = [t for host_tag in (tags or SGLANG_MEMORY_TAGS) for t in _sglang_tags(host_tag)]
        release = [t for t in RESUME_ORDER if t in wanted and t not in self._released]
        if not release:
            return []
        if self._in_flight:
            raise RuntimeError(f"release_memory_occupation with {self._in_flight} sglang requests in flight; finish "
                               "or abort them first")
        for client in self.clients:
            _flush_cache(client)
            client.request("POST", "/release_memory_occupation", {"tags": release}, retries=0)
        self._released.update(release)
        return release

    def resume_memory_occupation(self, tags: list[str] | None = None) -> list[str]:
        """Every server takes back the memory of the host ``tags`` (None: everything released), one
        SGLang tag per request in slime's order (:data:`RESUME_ORDER`); returns the tags resumed."""
        wanted = self._released if tags is None else {t for host_tag in tags for t in _sglang_tags(host_tag)}
        resume = [t for t in RESUME_ORDER if t in wanted and t in self._released]
        for tag in resume:
            for client in self.clients:
                client.request("POST", "/resume_memory_occupation", {"tags": [tag]}, retries=0)
            self._released.discard(tag)
        return resume

    def step_metrics(self) -> dict:
        """``ft/dropped_servers`` under ``--use-fault-tolerance``: servers dropped from the router so far."""
        return {"ft/dropped_servers": len(self.pool.dropped)} if self.pool.fault_tolerant else {}

    def shutdown(self) -> None:
        """Stop the request threads (in-flight requests are abandoned)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.pool.close()

    # -- one request ----------------------------------------------------------------------

    def _generate(self, client, rid, input_ids, sampling_params, n, return_routed_experts, epoch) -> None:
        try:
            outputs = self._request_outputs(client, rid, input_ids, sampling_params, n, return_routed_experts, epoch)
        except Exception as error:  # noqa: BLE001 - one request never takes the run down
            logger.exception("sglang request %s failed", rid)
            outputs = [failed_output(rid, k, f"sglang: {type(error).__name__}: {error}", len(input_ids)) for k in range(n)]
        with self._lock:
            self._ready.put((epoch, outputs))
            self._in_flight -= 1

    def _request_outputs(self, client, rid, input_ids, sampling_params, n, return_routed_experts, epoch) -> list[dict]:
        if epoch != self._epoch:  # aborted before it was sent
            return [failed_output(rid, k, "aborted", len(input_ids)) for k in range(n)]
        try:
            answer = self.pool.call(lambda server: server.generate(input_ids, sampling_params, return_routed_experts),
                                    client)
        except SGLangHTTPError as error:
            return [failed_output(rid, k, f"sglang /generate: HTTP {error.status}: {error.message}", len(input_ids))
                    for k in range(n)]
        results = answer if isinstance(answer, list) else [answer]
        if len(results) != n:
            raise ValueError(f"/generate returned {len(results)} results for n={n}")
        aborted_by_us = epoch != self._epoch
        return [self._normalise(result, rid, k, input_ids, return_routed_experts, aborted_by_us)
                for k, result in enumerate(results)]

    def _normalise(self, result: Any, rid: str, index: int, input_ids: list[int], want_routes: bool,
                   aborted_by_us: bool) -> dict:
        """Check the fields the manager reads; ids rewritten to ours; routes decoded."""
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"malformed /generate response: {field} {why}")

        if not isinstance(result, dict):
            raise bad("result", f"is {type(result).__name__}, not an object")
        meta = result.get("meta_info")
        if not isinstance(meta, dict):
            raise bad("meta_info", "is missing")
        meta = dict(meta)
        reason = meta.get("finish_reason")
        if not isinstance(reason, dict) or "type" not in reason:
            raise bad("meta_info.finish_reason", f"is {reason!r}, not an object with a 'type'")
        if "output_token_logprobs" not in meta and result.get("output_ids"):
            raise bad("meta_info.output_token_logprobs", "is missing though return_logprob was set")
        output_ids, _ = response_tokens(result)  # as slime: the ids are the logprob entries' item[1]
        sent_ids = result.get("output_ids")
        if sent_ids is not None and list(sent_ids) != output_ids:
            raise bad("output_ids", "disagree with the token ids of meta_info.output_token_logprobs")
        if reason["type"] == "abort" and aborted_by_us:
            reason = {"type": "abort", "message": "aborted"}  # our abort: the sample continues later
        routes = meta.get("routed_experts")
        if want_routes:
            if routes is None:
                raise bad("meta_info.routed_experts", "is missing though return_routed_experts was set")
            rows = len(input_ids) + len(output_ids) - 1
            routes = decode_routed_experts(routes, rows, self.top_k) if isinstance(routes, str) else np.asarray(routes)
        meta.setdefault("output_token_logprobs", [])
        meta.update(id=rid, index=index, finish_reason=reason, routed_experts=routes if want_routes else None)
        return {**result, "output_ids": output_ids, "meta_info": meta}


def _sglang_tags(host_tag: str) -> tuple[str, ...]:
    if host_tag not in SGLANG_MEMORY_TAGS:
        raise ValueError(f"unknown memory tag {host_tag!r}; the tags are {sorted(SGLANG_MEMORY_TAGS)}")
    return SGLANG_MEMORY_TAGS[host_tag]


def _flush_cache(client: SGLangClient) -> None:
    """``/flush_cache`` until it succeeds (SGLang answers 400 while requests are still queued)."""
    for attempt in range(_FLUSH_TRIES):
        try:
            client.request("GET", "/flush_cache")
            return
        except SGLangHTTPError as error:
            if error.status != 400 or attempt == _FLUSH_TRIES - 1:
                raise
            time.sleep(_FLUSH_WAIT_S)


def split_buckets(named: list, max_bytes: int) -> list[list]:
    """Consecutive groups of at most ``max_bytes`` (a larger tensor gets its own bucket)."""
    buckets, current, size = [], [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
