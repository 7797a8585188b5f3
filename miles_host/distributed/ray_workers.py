"""Workers as Ray actors (``--use-ray``, or several nodes): the same worker entry
points and request/reply protocol as the multiprocessing launcher, over a TCP
connection (``multiprocessing.connection``) instead of an inherited pipe.

Each worker is one actor of a placement group (one bundle per worker: 1 CPU and,
on GPU clusters, 1 GPU), ``PACK`` on one node and ``SPREAD`` across nodes.
Process groups still rendezvous at the driver's ``TCPStore``.
"""

from __future__ import annotations

import secrets
import socket
import threading
from multiprocessing.connection import Listener
from typing import Any

from miles_host.distributed.placement import num_engines, num_trainers

_GROUP = None
_STARTED_HERE = False


def driver_address() -> str:
    """An address of this host that workers on other nodes reach (loopback when alone)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - not in a Ray cluster
        return socket.gethostbyname(socket.gethostname())


def rendezvous_address(config: Any) -> str:
    """Where process groups meet (the driver's TCP store): an address of this host that
    workers on other nodes reach when the run spans nodes, loopback otherwise."""
    return driver_address() if int(config.actor_num_nodes) > 1 else "127.0.0.1"


def ensure_ray(config: Any) -> None:
    """Connect to the Ray cluster in ``RAY_ADDRESS`` or start a local one."""
    try:
        import ray
    except ImportError as error:
        raise ValueError("--use-ray / several nodes need ray: pip install ray") from error
    global _STARTED_HERE
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False,
                 num_cpus=None if ray_address_given() else max(4, _workers(config) + 1))
        _STARTED_HERE = True


def shutdown() -> None:
    """Remove the run's placement group; stop the local cluster if this run started it."""
    global _GROUP, _STARTED_HERE
    try:
        import ray
    except ImportError:
        return
    if _GROUP is not None and ray.is_initialized():
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(_GROUP)
    _GROUP = None
    if _STARTED_HERE and ray.is_initialized():
        ray.shutdown()
    _STARTED_HERE = False


def ray_address_given() -> bool:
    import os

    return bool(os.environ.get("RAY_ADDRESS"))


def _workers(config: Any) -> int:
    return num_trainers(config) + max(1, num_engines(config))


def placement_group(config: Any):
    """One bundle per worker process of the run, created once."""
    global _GROUP
    if _GROUP is None:
        import ray
        from ray.util.placement_group import placement_group as make_group

        gpus = 1 if config.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= _workers(config) else 0
        bundles = [{"CPU": 1, **({"GPU": gpus} if gpus else {})} for _ in range(_workers(config))]
        _GROUP = make_group(bundles, strategy="PACK" if config.actor_num_nodes == 1 else "SPREAD")
        ray.get(_GROUP.ready(), timeout=120)
    return _GROUP


class RayProcess:
    """The bits of ``multiprocessing.Process`` that :class:`WorkerHandle` uses."""

    def __init__(self, actor, done_ref, name: str):
        self.actor, self.done_ref, self.name = actor, done_ref, name
        self.pid = name
        self.exitcode = None

    def is_alive(self) -> bool:
        import ray

        ready, _ = ray.wait([self.done_ref], timeout=0)
        if not ready:
            return True
        try:
            ray.get(self.done_ref)
            self.exitcode = 0
        except Exception:  # noqa: BLE001 - the actor died or its entry raised
            self.exitcode = 1
        return False

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self.done_ref], timeout=timeout)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    release = kill  # the actor outlives its entry point: end it when the worker stops


def _worker_class():
    import ray

    @ray.remote(num_cpus=1)
    class Worker:
        """Runs one worker entry point, talking to the driver over TCP."""

        def run(self, target, args, address, authkey):
            from multiprocessing.connection import Client

            conn = Client(tuple(address), authkey=authkey)
            target(*args, conn)

    return Worker


def spawn_ray(target, name: str, args: tuple, timeout_s: float, config: Any, index: int):
    """Start ``target(*args, conn)`` in a Ray actor; returns ``(RayProcess, conn)``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ensure_ray(config)
    group = placement_group(config)
    authkey = secrets.token_bytes(16)
    listener = Listener((driver_address() if config.actor_num_nodes > 1 else "127.0.0.1", 0), authkey=authkey)
    accepted: dict = {}
    thread = threading.Thread(target=lambda: accepted.setdefault("conn", listener.accept()), daemon=True)
    thread.start()
    strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)
    actor = _worker_class().options(scheduling_strategy=strategy, name=None).remote()
    done = actor.run.remote(target, args, listener.address, authkey)
    thread.join(timeout_s)
    listener.close()
    if "conn" not in accepted:
        import ray

        ray.kill(actor, no_restart=True)
        raise RuntimeError(f"Ray worker {name} did not connect within {timeout_s:g} s")
    return RayProcess(actor, done, name), accepted["conn"]
