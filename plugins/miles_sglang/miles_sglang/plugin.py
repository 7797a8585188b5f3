"""miles-sglang (entry point ``sglang``): SGLang as the rollout backend.

Activated by ``--rollout-backend sglang`` (or ``--weight-sync sglang_*``, or
``--plugins sglang``). Also offers ``miles serve`` whether active or not.
"""

from __future__ import annotations

from miles_host.records import Command, RolloutBackend, WeightSyncTransport


def miles_add_arguments(parser):
    """Where the servers are and how to talk to them (slime's spellings where it has them)."""
    group = parser.add_argument_group("sglang (plugin)")
    group.add_argument("--sglang-url", "--rollout-server-url", dest="sglang_url", nargs="+", default=None,
                       help="SGLang server URL(s); several are used round-robin")
    group.add_argument("--sglang-router-ip", default=None, help="SGLang router address (slime)")
    group.add_argument("--sglang-router-port", type=int, default=None, help="SGLang router port (slime)")
    group.add_argument("--sglang-request-timeout", type=float, default=600.0, help="seconds per HTTP request")
    group.add_argument("--sglang-max-retries", type=int, default=3, help="retries of a refused connection or HTTP 5xx")
    group.add_argument("--sglang-retry-backoff", type=float, default=0.5, help="first retry delay, doubled each time")
    group.add_argument("--sglang-health-retries", type=int, default=20, help="/health polls at start-up")
    group.add_argument("--sglang-concurrency", type=int, default=64, help="generate requests in flight at once")
    group.add_argument("--sglang-weight-names", choices=["hf", "native"], default="hf",
                       help="weight names sent at weight sync: hf (what SGLang loads) or miles' native names")
    group.add_argument("--sglang-server-command", choices=["auto", "sglang", "miles"], default="auto",
                       help="servers started when no --sglang-url is given: real SGLang if importable (auto), or miles serve")
    group.add_argument("--sglang-server-start-timeout", type=float, default=300.0,
                       help="seconds for a started server to answer /health")
    group.add_argument("--sglang-weight-encoding", choices=["safetensors", "cuda_ipc"], default="safetensors",
                       help="update_weights_from_tensor payload: safetensors (miles serve, CPU) or CUDA IPC (colocated SGLang)")


def miles_activate(args):
    """``--rollout-backend sglang`` or an sglang weight-sync transport switches the plugin on."""
    return getattr(args, "rollout_backend", None) == "sglang" or str(getattr(args, "weight_sync", "")).startswith("sglang")


def miles_configure(config):
    """With the sglang backend, the default in-process sync means the tensor endpoint."""
    if config.rollout_backend == "sglang" and config.weight_sync == "inprocess":
        config.weight_sync = "sglang_tensor"


def _backend(config, manager):
    from miles_sglang.backend import SGLangRolloutBackend

    return SGLangRolloutBackend(config, manager)


def _tensor_transport(config):
    from miles_sglang.transport import TensorTransport

    return TensorTransport(config)


def _disk_transport(config):
    from miles_sglang.transport import DiskTransport

    return DiskTransport(config)


def check_sglang_backend(config, registries):
    """``RolloutBackend.validate``: the server flags (:func:`miles_sglang.flag_checks.check_server_flags`);
    colocated, servers started outside miles are told to need ``--enable-memory-saver``
    (:func:`miles_sglang.flag_checks.check_colocated_servers`)."""
    from miles_sglang.flag_checks import check_colocated_servers, check_server_flags

    check_server_flags(config)
    check_colocated_servers(config)


def miles_register_rollout_backends():
    """The SGLang HTTP client."""
    return [RolloutBackend("sglang", "SGLang servers (or `miles serve`) over their HTTP API", factory=_backend,
                           validate=check_sglang_backend, fault_tolerant=True)]


def miles_register_weight_sync_transports():
    """Tensor buckets over HTTP, or a checkpoint on disk."""
    return [
        WeightSyncTransport("sglang_tensor", "buckets through /update_weights_from_tensor", factory=_tensor_transport),
        WeightSyncTransport("sglang_disk", "HF checkpoint + /update_weights_from_disk", factory=_disk_transport),
        WeightSyncTransport("sglang_distributed", "broadcast over a process group the servers join",
                            factory=_distributed_transport),
    ]


def _distributed_transport(config):
    from miles_sglang.transport import DistributedTransport

    return DistributedTransport(config)


def _serve_arguments(parser):
    from miles_sglang.serve_cli import add_arguments

    add_arguments(parser)


def _serve(args):
    from miles_sglang.serve_cli import run

    return run(args)


def miles_register_commands():
    """``miles serve``."""
    return [Command("serve", "serve a checkpoint with the embedded engine over SGLang's HTTP API",
                    add_arguments=_serve_arguments, run=_serve)]
