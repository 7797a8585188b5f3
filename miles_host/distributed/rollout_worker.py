"""The embedded engine in its own process, driven over a pipe.

:class:`RolloutProcess` is the worker side; :class:`RolloutClient` implements the
rollout-backend interface (``submit / step / has_unfinished / abort_all /
update_weights / weight_version``) on the driver side, and :class:`RolloutRouter`
spreads requests over several engines behind the same interface.

Weight updates, whichever the transport: the engine pauses, loads (bucket by bucket
for the broadcast), flushes its prefix cache (``Engine.update_weights`` does) and
resumes.
"""

from __future__ import annotations

import io
import os
from typing import Any, Mapping

import torch

from miles_host.distributed.comm import WorkerHandle, broadcast_, new_group, rebuild_manager, serve
from miles_host.protocols import RolloutBackendBase


def parse_dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


class RolloutProcess:
    """Worker side: one :class:`EmbeddedRolloutBackend` and the weight-receiving ends."""

    def __init__(self, config: Any, index: int, incarnation: int = 0):
        from miles_host.rollout_backend import EmbeddedRolloutBackend

        self.index = index
        #: 0 for the engine the run started, k for its k-th restart (--use-fault-tolerance)
        self.incarnation = incarnation
        self.backend = EmbeddedRolloutBackend(config, rebuild_manager(config))
        self.engine = self.backend.engine
        self.weight_group = None
        #: weight updates received (the initial sync included)
        self.syncs = 0

    # -- the backend interface ------------------------------------------------------

    def submit(self, rid, input_ids, sampling_params, return_routed_experts=False):
        return self.backend.submit(rid, input_ids, sampling_params, return_routed_experts)

    def step(self):
        return self.backend.step()

    def has_unfinished(self):
        return self.backend.has_unfinished()

    def abort_all(self):
        return self.backend.abort_all()

    def weight_version(self):
        return self.backend.weight_version

    def ping(self):
        return os.getpid()

    def release_memory_occupation(self, tags):
        """Free the idle engine's memory for a colocated trainer (``torch.cuda.empty_cache`` included)."""
        self.engine.release_memory_occupation(tags)
        return sorted(self.engine.released_tags)

    def resume_memory_occupation(self, tags):
        self.engine.resume_memory_occupation(tags)
        return sorted(self.engine.released_tags)

    # -- weights ------------------------------------------------------------------

    def _load(self, buckets, weight_version):
        """Pause, load every bucket, flush the prefix cache, resume."""
        self.syncs += 1
        self.engine.pause()
        try:
            version = self.engine.update_weights([], weight_version=weight_version)
            for named in buckets:
                version = self.engine.update_weights(named, weight_version=weight_version)
        finally:
            self.engine.resume()
        return version

    def load_serialized(self, payload: bytes, weight_version):
        """Tensors serialised with ``torch.save`` (the copy-through-bytes path)."""
        named = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        return self._load([list(named.items())], weight_version)

    def load_shared(self, named, weight_version):
        """Tensors shared by handle (CUDA IPC on GPU, shared memory on CPU)."""
        version = self._load([named], weight_version)
        del named
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
        return version

    def init_weight_group(self, address: str, port: int, rank: int, world: int, backend: str, timeout_s: float):
        self.weight_group = new_group(address, port, rank, world, backend, timeout_s)
        self.weight_backend = backend
        return True

    def receive_broadcast(self, buckets_meta, weight_version):
        """Receive each bucket (one flat tensor per bucket) from rank 0 of the weight group."""
        if self.weight_group is None:
            raise RuntimeError("receive_broadcast before init_weight_group")
        self.syncs += 1
        device = self.engine.device if self.weight_backend == "nccl" else torch.device("cpu")
        self.engine.pause()
        try:
            version = self.engine.weight_version
            for dtype_name, entries in buckets_meta:
                dtype = parse_dtype(dtype_name)
                total = sum(numel for _, _, numel in entries)
                flat = torch.empty(total, dtype=dtype, device=device)
                broadcast_(self.weight_group, flat, 0)
                named, offset = [], 0
                for name, shape, numel in entries:
                    named.append((name, flat[offset : offset + numel].view(shape)))
                    offset += numel
                version = self.engine.update_weights(named, weight_version=weight_version)
            if not buckets_meta:
                version = self.engine.update_weights([], weight_version=weight_version)
        finally:
            self.engine.resume()
        return version

    def log_probs(self, token_ids: list[int], start: int):
        """Log-probs of ``token_ids[start:]`` under the engine's weights (prefill of
        the whole sequence, teacher-forced): for checking a sync."""
        model = self.engine.model
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.engine.device)
        return packed_log_probs(model, ids, start)


def packed_log_probs(model, ids: torch.Tensor, start: int) -> list[float]:
    """Teacher-forced log-probs of ``ids[start:]`` with the shared packed forward."""
    from miles_host.models import PackedAttention
    from miles_host.models.context import ForwardContext

    n = ids.numel()
    cu = torch.tensor([0, n], dtype=torch.int32, device=ids.device)
    positions = torch.arange(n, device=ids.device)
    targets = torch.cat([ids[1:], ids.new_zeros(1)])
    with torch.no_grad():
        log_probs, _ = model.packed_log_probs(ids, positions, cu, targets, ctx=ForwardContext(attention=PackedAttention(cu)))
    return log_probs[start - 1 : n - 1].float().cpu().tolist()


def rollout_main(config: Any, index: int, conn, num_threads: int, heartbeat=None, incarnation: int = 0) -> None:
    """Entry point of a rollout engine process (``heartbeat``: beat from a thread of this
    process once the engine is up, so a slow start-up is judged by ``--worker-timeout``
    alone; ``incarnation``: how many times this engine was restarted)."""
    from miles_host.loop import seed_everything

    torch.set_num_threads(num_threads)
    seed_everything(config.seed)
    if str(config.device).startswith("cuda:") and torch.cuda.is_available():
        torch.cuda.set_device(torch.device(config.device))  # Triton launches on the current device
    try:
        worker = RolloutProcess(config, index, incarnation)
    except Exception:  # noqa: BLE001
        import traceback

        conn.send(("error", traceback.format_exc()))
        return
    if heartbeat is not None:
        heartbeat.start_beating()
    conn.send(("ok", os.getpid()))
    serve(conn, worker)


def serialize(named_tensors) -> bytes:
    """``torch.save`` bytes of ``(name, tensor)`` pairs or a mapping (on CPU)."""
    if isinstance(named_tensors, Mapping):
        named_tensors = named_tensors.items()
    buffer = io.BytesIO()
    torch.save({name: t.detach().contiguous().cpu() for name, t in named_tensors}, buffer)
    return buffer.getvalue()


class RolloutClient:
    """Driver side of one engine process: the rollout-backend interface over RPC."""

    def __init__(self, handle: WorkerHandle):
        self.handle = handle
        self._version: Any = 0

    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def weight_version(self) -> Any:
        return self._version

    def submit(self, rid, input_ids, sampling_params, return_routed_experts=False):
        return self.handle.call("submit", rid, list(input_ids), dict(sampling_params), return_routed_experts)

    def step(self):
        return self.handle.call("step")

    def has_unfinished(self):
        return self.handle.call("has_unfinished")

    def abort_all(self):
        return self.handle.call("abort_all")

    def log_probs(self, token_ids, start):
        return self.handle.call("log_probs", list(token_ids), start)

    def update_weights(self, named_tensors, weight_version=None):
        """The serialising path: ``torch.save`` to bytes, through the pipe, ``torch.load``."""
        self._version = self.handle.call("load_serialized", serialize(named_tensors), weight_version)
        return self._version


class RolloutRouter(RolloutBackendBase):
    """Several engine processes behind one rollout backend: each request goes to the
    engine with the fewest samples in flight; ``step`` steps all of them at once."""

    releases_memory = True
    reports_token_weight_versions = True

    def __init__(self, clients: list[RolloutClient], processes=None):
        self.clients = clients
        self.load = [0] * len(clients)
        self.owner: dict[str, int] = {}
        self._version: Any = 0
        self.weight_group = None

    @property
    def weight_version(self) -> Any:
        return self._version

    def submit(self, rid, input_ids, sampling_params, return_routed_experts=False):
        index = min(range(len(self.clients)), key=lambda i: (self.load[i], i))
        self.clients[index].submit(rid, input_ids, sampling_params, return_routed_experts)
        self.owner[rid] = index
        self.load[index] += int(sampling_params.get("n", 1) or 1)

    def _all(self, method: str, *args) -> list:
        for client in self.clients:
            client.handle.send(method, *args)
        return [client.handle.recv(f"'{method}'") for client in self.clients]

    def step(self):
        outputs = []
        for index, finished in enumerate(self._all("step")):
            self.load[index] -= len(finished)
            outputs.extend(finished)
        return outputs

    def has_unfinished(self):
        return any(self._all("has_unfinished"))

    def abort_all(self):
        outputs = [o for part in self._all("abort_all") for o in part]
        self.load = [0] * len(self.clients)
        return outputs

    def log_probs(self, token_ids, start, engine: int = 0):
        return self.clients[engine].log_probs(token_ids, start)

    def update_weights(self, named_tensors, weight_version=None):
        """Serialised once, loaded by every engine."""
        self._version = self._all("load_serialized", serialize(named_tensors), weight_version)[0]
        return self._version

    def release_memory_occupation(self, tags=None) -> list:
        """Every engine frees its memory (``tags``: ``kv_cache``, ``weights``; default both);
        the tags now released, per engine."""
        return self._all("release_memory_occupation", None if tags is None else list(tags))

    def resume_memory_occupation(self, tags=None) -> list:
        return self._all("resume_memory_occupation", None if tags is None else list(tags))

    def update_weights_shared(self, named_tensors, weight_version=None):
        self._version = self._all("load_shared", list(named_tensors), weight_version)[0]
        return self._version

    def stop(self) -> None:
        for client in self.clients:
            client.handle.stop()
