"""Weight-sync transports to rollout engines in other processes.

- ``broadcast``: flat buckets of at most ``--update-weight-buffer-size`` bytes
  (one dtype per bucket), broadcast from trainer rank 0 over a group of
  {trainer rank 0, every engine}: NCCL on GPU, gloo on CPU. The engines learn the
  bucket layout (names, shapes) from one RPC sent before the broadcasts.
- ``cuda_ipc``: the tensors' CUDA memory handles go through the pipe
  (``torch.multiprocessing`` reductions); the engine copies straight from the
  trainer's memory: no serialisation, no host round trip. Without CUDA it falls
  back to one copy into a persistent shared-memory buffer (same protocol), so it
  can be tested on CPU.
- the host's ``inprocess`` / ``disk`` transports call ``backend.update_weights``,
  which for an engine process serialises the tensors (``torch.save`` bytes through
  the pipe): the baseline of ``bench/weight_sync.py``.

Each transport sends the trainer's weights after the precision's conversion
(``named_weights_for_rollout``), so precision plugins convert on the way.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from miles_host.distributed.comm import broadcast_, free_port, new_group
from miles_host.distributed.failures import failed_worker
from miles_host.distributed.placement import worker_timeout
from miles_host.distributed.ray_workers import rendezvous_address
from miles_host.distributed.rollout_worker import RolloutRouter

logger = logging.getLogger(__name__)


def bucketize(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[tuple[torch.dtype, list]]:
    """Consecutive runs of one dtype, cut at ``bucket_bytes`` (a tensor larger than
    a bucket gets a bucket of its own)."""
    buckets: list[tuple[torch.dtype, list]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or buckets[-1][0] != tensor.dtype or (buckets[-1][1] and size + nbytes > bucket_bytes):
            buckets.append((tensor.dtype, []))
            size = 0
        buckets[-1][1].append((name, tensor))
        size += nbytes
    return buckets


def _engines(backend: Any) -> RolloutRouter:
    if not isinstance(backend, RolloutRouter):
        raise TypeError(
            f"this weight-sync transport needs rollout engines in separate processes (--rollout-backend process), "
            f"got {type(backend).__name__}"
        )
    return backend


class BroadcastTransport:
    """Bucketed broadcast over {trainer rank 0, engines}."""

    #: a push is one collective of every engine: one that fails leaves the others' ends broken
    collective = True

    def __init__(self, config: Any):
        self.config = config
        self.bucket_bytes = int(config.update_weight_buffer_size)
        self.timeout_s = worker_timeout(config)
        self.backend_name = "nccl" if torch.cuda.is_available() and str(config.device) != "cpu" else "gloo"
        self.group = None
        #: the engine processes the group was formed with (a restarted engine needs a new group)
        self.members: list = []

    def _ensure_group(self, router) -> None:
        members = [client.handle for client in router.clients]
        if self.group is not None and members == self.members:  # the same processes (handles compare by identity)
            return
        self.members = members
        address, port, world = rendezvous_address(self.config), free_port(), len(router.clients) + 1
        for rank, client in enumerate(router.clients, start=1):
            client.handle.send("init_weight_group", address, port, rank, world, self.backend_name, self.timeout_s)
        handles = [client.handle for client in router.clients]
        try:
            self.group = new_group(address, port, 0, world, self.backend_name, self.timeout_s)
        except RuntimeError as error:  # DistStoreError: an engine never joined
            raise failed_worker(handles, "'init_weight_group'", error, "the weight-sync group") from error
        for handle in handles:
            handle.recv("'init_weight_group'")

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], backend: Any, weight_version: Any) -> Any:
        router = _engines(backend)
        self._ensure_group(router)
        named = [(name, t.detach()) for name, t in named_tensors]
        buckets = bucketize(named, self.bucket_bytes)
        meta = [
            (str(dtype).replace("torch.", ""), [(name, tuple(t.shape), t.numel()) for name, t in entries])
            for dtype, entries in buckets
        ]
        for client in router.clients:
            client.handle.send("receive_broadcast", meta, weight_version)
        device = torch.device("cuda") if self.backend_name == "nccl" else torch.device("cpu")
        try:
            for dtype, entries in buckets:
                flat = torch.cat([t.reshape(-1).to(device) for _, t in entries])
                broadcast_(self.group, flat, 0)
        except RuntimeError as error:  # an engine died or stopped under the broadcast (gloo / NCCL error)
            handles = [client.handle for client in router.clients]
            raise failed_worker(handles, "'receive_broadcast'", error, "trainer-0 (weight sync)") from error
        versions = [client.handle.recv("'receive_broadcast'") for client in router.clients]
        router._version = versions[0]
        return versions[0]


class IpcTransport:
    """Share memory handles (CUDA IPC; shared memory on CPU) through the pipe."""

    def __init__(self, config: Any):
        self.config = config
        self.cuda = torch.cuda.is_available() and str(config.device) != "cpu"
        self._shm: dict[str, torch.Tensor] = {}
        if not self.cuda:
            logger.warning("--weight-sync cuda_ipc without CUDA: sharing through CPU shared memory (one copy)")

    def _shareable(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        if self.cuda:
            torch.cuda.synchronize()  # the engine reads these bytes from another process
            return [(name, t if t.is_cuda else t.cuda()) for name, t in named]
        out = []
        for name, tensor in named:
            buffer = self._shm.get(name)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = torch.empty_like(tensor, device="cpu").share_memory_()
                self._shm[name] = buffer
            buffer.copy_(tensor)
            out.append((name, buffer))
        return out

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], backend: Any, weight_version: Any) -> Any:
        router = _engines(backend)
        named = self._shareable([(name, t.detach()) for name, t in named_tensors])
        return router.update_weights_shared(named, weight_version)
