"""Starting rollout servers when no URL is given.

``--rollout-backend sglang`` without ``--sglang-url`` or a router starts
``--rollout-num-gpus / --rollout-num-gpus-per-engine`` servers on loopback:
real SGLang (``python -m sglang.launch_server``, every host ``--sglang-*`` server
flag passed through) when it is importable, else ``miles serve`` (the embedded
engine behind the same API); ``--sglang-server-command`` forces one. The
servers are separate processes, stopped when the run ends.
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

#: host config fields passed to ``sglang.launch_server`` as ``--<name without sglang_>``
SGLANG_SERVER_FLAGS = {
    "sglang_mem_fraction_static": "--mem-fraction-static",
    "sglang_speculative_algorithm": "--speculative-algorithm",
    "sglang_speculative_num_steps": "--speculative-num-steps",
    "sglang_speculative_eagle_topk": "--speculative-eagle-topk",
    "sglang_speculative_num_draft_tokens": "--speculative-num-draft-tokens",
    "sglang_speculative_draft_model_path": "--speculative-draft-model-path",
    "sglang_speculative_token_map": "--speculative-token-map",
    "sglang_enable_draft_weights_cpu_backup": "--enable-draft-weights-cpu-backup",
}


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(config: Any, port: int, kind: str) -> list[str]:
    """The command line of one server on ``port``."""
    if kind == "sglang":
        command = [sys.executable, "-m", "sglang.launch_server", "--model-path", config.hf_checkpoint,
                   "--host", "127.0.0.1", "--port", str(port), "--tp", str(config.rollout_num_gpus_per_engine),
                   "--enable-return-routed-experts" if config.rollout_return_routed_experts else ""]
        for field_name, flag in SGLANG_SERVER_FLAGS.items():
            value = getattr(config, field_name, None)
            if value is True:
                command.append(flag)
            elif value not in (None, False):
                command += [flag, str(value)]
        return [part for part in command if part]
    command = [sys.executable, "-m", "miles_host.cli.main", "serve", "--hf-checkpoint", config.hf_checkpoint,
               "--port", str(port), "--dtype", config.dtype, "--device", config.device]
    if config.true_on_policy:
        command.append("--enable-deterministic-inference")
    if config.sglang_mem_fraction_static is not None:
        command += ["--mem-fraction-static", str(config.sglang_mem_fraction_static)]
    if config.rollout_max_context_len is not None:
        command += ["--context-length", str(config.rollout_max_context_len)]
    if config.sglang_api_key:
        command += ["--api-key", config.sglang_api_key]
    return command


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
    kind = config.sglang_server_command
    if kind == "auto":
        kind = "sglang" if importlib.util.find_spec("sglang") is not None else "miles"
    count = max(1, (config.rollout_num_gpus or 1) // max(1, config.rollout_num_gpus_per_engine))
    launched = LaunchedServers()
    atexit.register(launched.stop)
    for _ in range(count):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        process = subprocess.Popen(server_command(config, port, kind), env=dict(os.environ),
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
