"""Starting rollout servers when no URL is given.

``--rollout-backend sglang`` without ``--sglang-url`` or a router starts
``--rollout-num-gpus / --rollout-num-gpus-per-engine`` servers on loopback:
real SGLang (``python -m sglang.launch_server``) when it is importable, else ``miles serve``
(the embedded engine behind the same API); ``--sglang-server-command`` forces one. The
servers are separate processes, stopped when the run ends.

Real SGLang gets tensor parallel size ``--rollout-num-gpus-per-engine`` (``--tp-size``),
``--enable-memory-saver`` under ``--colocate`` / ``--offload-rollout`` (the memory endpoints
free GPU memory only with it), and every ``--sglang-*`` server flag the user gave
(:func:`miles_host.config_sglang.server_flags`);
with ``--rollout-num-gpus`` server ``i`` starts at GPU ``trainers + i * per_engine``
(``--base-gpu-id``). ``miles serve`` gets the SGLang options it has
(:data:`miles_sglang.serve_cli.SGLANG_OPTIONS`); it runs one GPU per server.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from miles_host.config_sglang import server_flags

#: addresses a server binds to that a client reaches on loopback
_ANY_ADDRESS = ("", "0.0.0.0", "::", "[::]")


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bind_host(config: Any) -> str:
    """The address the servers bind to: ``--sglang-host`` (SGLang's default 127.0.0.1)."""
    return getattr(config, "sglang_host", None) or "127.0.0.1"


def client_host(config: Any) -> str:
    """The address the run reaches its servers at."""
    host = bind_host(config)
    return "127.0.0.1" if host in _ANY_ADDRESS else host


def server_kind(config: Any) -> str:
    """``sglang`` or ``miles``: ``--sglang-server-command``, where ``auto`` is real SGLang when importable."""
    kind = config.sglang_server_command
    if kind == "auto":
        kind = "sglang" if importlib.util.find_spec("sglang") is not None else "miles"
    return kind


def base_gpu_id(config: Any, index: int) -> int | None:
    """First GPU of server ``index`` when ``--rollout-num-gpus`` places the servers: after the
    trainers' GPUs, ``--rollout-num-gpus-per-engine`` each. None: SGLang's own choice."""
    if not getattr(config, "rollout_num_gpus", None):
        return None
    trainers = getattr(config, "actor_num_nodes", 1) * getattr(config, "actor_num_gpus_per_node", 1)
    return trainers + index * config.rollout_num_gpus_per_engine


def server_command(config: Any, port: int, kind: str, index: int = 0) -> list[str]:
    """The command line of server ``index`` on ``port``."""
    if kind == "sglang":
        command = [sys.executable, "-m", "sglang.launch_server", "--model-path", config.hf_checkpoint,
                   "--host", bind_host(config), "--port", str(port),
                   "--tp-size", str(config.rollout_num_gpus_per_engine)]
        if config.rollout_return_routed_experts:
            command.append("--enable-return-routed-experts")
        if getattr(config, "colocate", False) or getattr(config, "offload_rollout", False):
            command.append("--enable-memory-saver")  # release_memory_occupation frees memory only with it
        first_gpu = base_gpu_id(config, index)
        if first_gpu is not None:
            command += ["--base-gpu-id", str(first_gpu)]
        return command + server_flags(config, exclude=("host",))
    from miles_sglang.serve_cli import SGLANG_OPTIONS

    if config.rollout_num_gpus_per_engine != 1:
        raise ValueError(
            f"--rollout-num-gpus-per-engine {config.rollout_num_gpus_per_engine}: miles serve (the embedded engine "
            "behind SGLang's API) runs on one GPU per server; install SGLang for tensor-parallel servers, or use 1")
    command = [sys.executable, "-m", "miles_host.cli.main", "serve", "--hf-checkpoint", config.hf_checkpoint,
               "--host", bind_host(config), "--port", str(port), "--dtype", config.dtype, "--device", config.device]
    exclude = {"host"}  # the host flags below replace the SGLang options of the same knob
    if config.true_on_policy:
        command.append("--enable-deterministic-inference")
        exclude.add("enable-deterministic-inference")
    if config.rollout_max_context_len is not None:
        command += ["--context-length", str(config.rollout_max_context_len)]
        exclude.add("context-length")
    if getattr(config, "rollout_max_num_seqs", None) is not None:
        command += ["--max-running-requests", str(config.rollout_max_num_seqs)]
        exclude.add("max-running-requests")
    return command + server_flags(config, only=SGLANG_OPTIONS, exclude=exclude)


@dataclass
class LaunchedServers:
    """Server processes started for a run; ``stop()`` ends them (also at exit)."""

    processes: list[subprocess.Popen] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


def _wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"rollout server {url} exited with code {process.returncode} while starting: "
                               f"{' '.join(process.args)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    process.terminate()
    raise RuntimeError(f"rollout server {url} did not become healthy within {timeout:.0f} s")


def launch_servers(config: Any) -> LaunchedServers:
    """Start the run's rollout servers and wait until each answers /health."""
    kind = server_kind(config)
    count = max(1, (config.rollout_num_gpus or 1) // max(1, config.rollout_num_gpus_per_engine))
    launched = LaunchedServers()
    atexit.register(launched.stop)
    for index in range(count):
        port = free_port()
        url = f"http://{client_host(config)}:{port}"
        process = subprocess.Popen(server_command(config, port, kind, index), env=dict(os.environ),
                                   stdout=subprocess.DEVNULL)
        launched.processes.append(process)
        launched.urls.append(url)
    try:
        for url, process in zip(launched.urls, launched.processes):
            _wait_healthy(url, process, config.sglang_server_start_timeout)
    except Exception:
        launched.stop()
        raise
    return launched
