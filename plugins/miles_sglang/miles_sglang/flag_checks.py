"""Validation of the SGLang server flags under ``--rollout-backend sglang``.

Servers miles launches take tensor parallel size ``--rollout-num-gpus-per-engine`` (real SGLang
only: ``miles serve`` runs one GPU per server) and the given ``--sglang-*`` flags; servers at
``--sglang-url`` or behind ``--sglang-router-ip`` were started by someone else, so the flags do
not reach them. miles starts no SGLang router, so ``--router-*`` flags configure nothing. Each
such case is one warning naming the flags; a setting that cannot be honoured is refused.
"""

from __future__ import annotations

import sys
from typing import Any

from miles_host.config_sglang import given_router_flags, given_server_args

_warned: set[str] = set()


def _warn_once(flags: list[str], why: str, stream: Any = None) -> list[str]:
    new = [flag for flag in flags if flag not in _warned]
    if new:
        _warned.update(new)
        print(f"miles: warning: accepted, {why}: {' '.join(new)}", file=stream or sys.stderr)
    return new


def launches_servers(config: Any) -> bool:
    """True when the run starts its own servers (no ``--sglang-url``, no router address)."""
    return not getattr(config, "sglang_url", None) and getattr(config, "sglang_router_ip", None) is None


def check_server_flags(config: Any, stream: Any = None) -> list[str]:
    """Refuse what the servers cannot honour; warn once about flags that reach no server.
    Returns the flags warned about now."""
    from miles_sglang.launcher import server_kind

    per_engine, gpus = config.rollout_num_gpus_per_engine, config.rollout_num_gpus
    if per_engine < 1:
        raise ValueError(f"--rollout-num-gpus-per-engine must be >= 1, got {per_engine}")
    if gpus and gpus % per_engine:
        raise ValueError(f"--rollout-num-gpus {gpus} is not a multiple of --rollout-num-gpus-per-engine {per_engine} "
                         "(GPUs per SGLang server); give a multiple")
    if config.sglang_config is not None:
        raise ValueError("--sglang-config: slime's server-group YAML is not supported; miles launches one group of "
                         "identical servers from the --sglang-* flags (give those instead), or point --sglang-url at "
                         "servers started your way")
    warned = _warn_once(given_router_flags(config), "miles starts no SGLang router (it spreads requests over the "
                        "servers itself)", stream)
    given = ["--sglang-" + arg.name for arg, _ in given_server_args(config)]
    if not launches_servers(config):
        return warned + _warn_once(given, "the servers at --sglang-url / --sglang-router-ip were started outside "
                                   "miles, so these server flags do not reach them", stream)
    if server_kind(config) == "miles":
        from miles_sglang.serve_cli import SGLANG_OPTIONS

        if per_engine != 1:
            raise ValueError(
                f"--rollout-num-gpus-per-engine {per_engine}: the servers are miles serve (SGLang is not installed, or "
                "--sglang-server-command miles), which runs on one GPU per server; install SGLang for "
                "tensor-parallel servers, or use 1")
        ignored = [flag for flag in given if flag[len("--sglang-"):] not in SGLANG_OPTIONS]
        return warned + _warn_once(ignored, "no meaning for miles serve (the embedded engine behind SGLang's API); "
                                   "install SGLang to have them honoured", stream)
    return warned


def check_colocated_servers(config: Any, stream: Any = None) -> list[str]:
    """``--colocate`` / ``--offload-rollout`` with servers at ``--sglang-url`` or behind a router:
    their memory is released through SGLang's memory endpoints, which free GPU memory only on
    servers started with ``--enable-memory-saver`` (miles starts its own with it); one warning.
    Returns the flags warned about now."""
    flags = [flag for flag, on in (("--colocate", config.colocate), ("--offload-rollout", config.offload_rollout))
             if on and flag not in _warned]
    if not flags or launches_servers(config):
        return []
    _warned.update(flags)
    print(f"miles: warning: {' '.join(flags)}: the servers at --sglang-url / --sglang-router-ip free GPU memory "
          "between phases only if they were started with --enable-memory-saver", file=stream or sys.stderr)
    return flags
