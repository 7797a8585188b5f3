"""Small helpers over raw process groups and pipes.

Process groups are built directly from a ``TCPStore`` (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on GPU), not through ``init_process_group``: a process can then
sit in two groups (the trainers' data-parallel group and the weight-sync group with
the rollout engines) and nothing global is left behind in the driver (tests run
several launches in one pytest process)."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from miles_host.distributed.errors import WorkerFailed


def free_port() -> int:
    """A TCP port that was free a moment ago on this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))  # free on every interface (the store may be reached from other nodes)
        return sock.getsockname()[1]


def new_group(
    address: str, port: int, rank: int, world: int, backend: str, timeout_s: float, as_default: bool = False
):
    """Join (rank 0: host) a process group of ``world`` ranks; returns the group.

    ``as_default``: make it this process's default group (``init_process_group``),
    which FSDP2's device mesh needs; other groups (weight sync) stay private.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA; use gloo on CPU")
    store = tcp_store(address, port, world, rank == 0, timeout)
    if as_default:
        if dist.is_initialized():
            raise RuntimeError("this process already has a default process group; one sharded trainer per process")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        global _OWNS_DEFAULT_GROUP
        _OWNS_DEFAULT_GROUP = True
        return dist.distributed_c10d._get_default_group()
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, options)


_OWNS_DEFAULT_GROUP = False


def loopback_ip(address: str) -> str | None:
    """The IPv4 address ``address`` (a name or an IP) resolves to when it means this host
    only (127.0.0.0/8), else None."""
    try:
        resolved = socket.gethostbyname(address)
        return resolved if ipaddress.ip_address(resolved).is_loopback else None
    except (OSError, ValueError):
        return None


def tcp_store(address: str, port: int, world: int, is_master: bool, timeout: datetime.timedelta) -> dist.TCPStore:
    """A ``TCPStore`` at ``address:port``. The master of a store at a loopback address
    listens on loopback only: torch's own server listens on every interface, and the
    store takes no password, so a one-node run must not be reachable from other hosts."""
    local = loopback_ip(address) if is_master else None
    if local is None:
        return dist.TCPStore(address, port, world, is_master=is_master, timeout=timeout, wait_for_workers=False)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((local, port))
        listener.listen(max(world, 1) * 2)
    except OSError:
        listener.close()
        raise
    # the store owns the listening socket from here on (detach: Python must not close it)
    return dist.TCPStore(address, port, world, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def leave_default_group() -> None:
    """Destroy the default process group if :func:`new_group` created it."""
    global _OWNS_DEFAULT_GROUP
    if _OWNS_DEFAULT_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWNS_DEFAULT_GROUP = False


def _on_group_device(group, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a collective of ``group`` can take: NCCL moves CUDA tensors only, so a host
    tensor (metric sums, counts) goes through the current GPU."""
    if tensor.is_cuda or group.name().lower() != "nccl":
        return tensor
    return tensor.to(torch.device("cuda", torch.cuda.current_device()))


def allreduce_sum_(group, tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum over ``group``."""
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    work = _on_group_device(group, tensor)
    group.allreduce([work], options).wait()
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def broadcast_(group, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
    """In-place broadcast from ``root`` over ``group``. One-byte float types (FP8 weights)
    travel as their bytes: gloo has no FP8 types."""
    if tensor.dtype.is_floating_point and tensor.element_size() == 1:
        broadcast_(group, tensor.view(torch.uint8), root)
        return tensor
    options = dist.BroadcastOptions()
    options.rootRank = root
    work = _on_group_device(group, tensor)
    group.broadcast([work], options).wait()
    if work is not tensor:
        tensor.copy_(work)
    return tensor


class WorkerHandle:
    """The driver's end of one worker: its process and a request/reply pipe.

    Every wait polls the pipe in short slices and checks that the process is still
    alive, so a dead worker is reported at once and a hung one after ``timeout_s``."""

    def __init__(self, name: str, process, conn, timeout_s: float, heartbeat=None):
        self.name = name
        self.process = process
        self.conn = conn
        self.timeout_s = timeout_s
        #: the worker's :class:`~miles_host.distributed.heartbeat.Heartbeat` (None: none is checked)
        self.heartbeat = heartbeat

    def send(self, method: str, *args: Any) -> None:
        self._check_alive()
        try:
            self.conn.send((method, args))
        except (BrokenPipeError, ConnectionError, EOFError) as error:
            raise WorkerFailed(self.name, f"(pid {self.process.pid}) is unreachable: {error}", "died") from error

    def recv(self, what: str = "a reply", timeout_s: float | None = None) -> Any:
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while True:
            try:
                ready = self.conn.poll(0.05)
            except (EOFError, OSError, ConnectionError):
                ready = False
                self._check_alive(grace=True)
            if ready:
                try:
                    status, payload = self.conn.recv()
                except (EOFError, ConnectionError, OSError) as error:
                    self._check_alive(grace=True)
                    raise WorkerFailed(self.name, f"(pid {self.process.pid}) closed its pipe: {error}", "died") from error
                if status == "error":
                    raise WorkerFailed(self.name, f"raised an error:\n{payload}")
                return payload
            self._check_alive()
            silent = self.heartbeat.silent_for() if self.heartbeat is not None else None
            if silent is not None:
                raise WorkerFailed(self.name, f"(pid {self.process.pid}) {self.heartbeat.describe(silent)}", "hung")
            if time.monotonic() > deadline:
                within = f"--worker-timeout {limit:g} s" if timeout_s is None else f"{limit:g} s"
                raise WorkerFailed(
                    self.name, f"(pid {self.process.pid}) did not answer {what} within {within} (hung or stopped?)", "hung"
                )

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        self.send(method, *args)
        return self.recv(f"'{method}'", timeout_s)

    def _check_alive(self, grace: bool = False) -> None:
        if grace:
            self.process.join(0.5)
        if not self.process.is_alive():
            code = self.process.exitcode
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            raise WorkerFailed(self.name, f"(pid {self.process.pid}) {how}", "died")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to exit; kill it if it does not."""
        if self.process.is_alive():
            try:
                self.conn.send(("stop", ()))
            except (BrokenPipeError, ConnectionError, EOFError, OSError):
                pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        release = getattr(self.process, "release", None)  # Ray actors outlive their entry point
        if release is not None:
            release()
        self.conn.close()


def serve(conn, target: Any) -> None:
    """Worker side: answer ``(method, args)`` requests on ``conn`` by calling
    ``target.<method>(*args)`` until ``stop``; errors go back as text."""
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, ConnectionError, OSError):
            return  # the driver went away
        if method == "stop":
            conn.send(("ok", None))
            return
        try:
            result = getattr(target, method)(*args)
            conn.send(("ok", result))
        except Exception:  # noqa: BLE001 - reported to the driver, which stops the run
            conn.send(("error", traceback.format_exc()))


def rebuild_manager(config: Any):
    """The plugin manager of a worker process: the driver's active plugins again, their
    process state set from the driver's config (``miles_process_start``)."""
    from miles_host.plugin_manager import MilesPluginManager

    manager = MilesPluginManager()
    manager.discover()
    manager.activate(selected=list(config.plugins or []))
    manager.registries
    manager.hook.miles_process_start(config=config)
    return manager
