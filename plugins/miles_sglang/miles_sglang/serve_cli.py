"""The ``miles serve`` command: build the embedded engine and serve SGLang's API."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from types import SimpleNamespace
from typing import Any

from miles_host.config_sglang import KIND_TYPES, MILES_SETS, SERVER_ARGS_BY_FIELD, readable_int, server_field
from miles_host.sglang_args_data import SERVER_ARGS
from miles_host.sglang_embedded import ENGINE_KNOBS, engine_kwargs_from_options
from miles_sglang.limits import ServerLimits

DEFAULT_PORT = 30000  # SGLang's default


def build_engine(model_path: str, dtype: str = "auto", device: str = "auto", **engine_kwargs: Any) -> Any:
    """The embedded engine for ``model_path``, capturing MoE routes on request."""
    from miles_host.rollout import Engine
    from miles_host.rollout_backend import resolve_device, resolve_dtype
    from miles_sglang.service import capture_routing_hooks

    flags = SimpleNamespace(device=device, dtype=dtype)
    resolved = resolve_device(flags)
    return Engine.from_pretrained(
        model_path, dtype=resolve_dtype(flags, resolved), device=str(resolved),
        routing_hooks=capture_routing_hooks(), **{k: v for k, v in engine_kwargs.items() if v is not None},
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``miles serve`` (SGLang's spellings where SGLang has them)."""
    parser.add_argument("--hf-checkpoint", "--model-path", dest="hf_checkpoint", required=True,
                        help="HF-format model directory to serve")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (a non-loopback one needs --api-key)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--kv-cache-tokens", type=int, default=None, help="KV cache size on CPU, tokens")
    parser.add_argument("--mem-fraction-static", type=float, default=None, help="GPU memory share for weights + KV cache")
    parser.add_argument("--max-running-requests", type=int, default=None, help="max concurrent sequences")
    parser.add_argument("--context-length", type=readable_int, default=None, help="max prompt + output tokens")
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="batch-invariant kernels (results independent of batch composition)")
    for knob in ENGINE_KNOBS:  # the other SGLang options the engine honours, as SGLang reads them
        if "--" + knob.name not in parser._option_string_actions:
            arg = SERVER_ARGS_BY_FIELD[server_field(knob.name)]
            kind = KIND_TYPES[arg.kind]
            if kind is None:
                parser.add_argument("--" + knob.name, action="store_true", help=f"SGLang's: {arg.help}")
            else:
                parser.add_argument("--" + knob.name, type=kind, nargs=arg.nargs, default=arg.default,
                                    help=f"SGLang's: {arg.help}")
    parser.add_argument("--incremental-streaming-output", action="store_true",
                        help="stream chunks carry only new tokens (default: cumulative, as SGLang)")
    parser.add_argument("--weight-version", default="default", help="the weight version reported before any update (SGLang's)")
    limits = ServerLimits()
    parser.add_argument("--timeout-keep-alive", type=float, default=limits.timeout_keep_alive_s,
                        help="seconds an idle keep-alive connection stays open (uvicorn's)")
    parser.add_argument("--max-request-body-mb", type=float, default=limits.max_body_bytes / 2**20,
                        help="largest request body, MiB (larger ones are refused with 413 before they are read)")
    parser.add_argument("--max-weight-request-body-mb", type=float, default=limits.max_weight_body_bytes / 2**20,
                        help="largest body of the weight-update endpoints, MiB (they carry whole weight buckets)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id of the OpenAI API (/v1/models; default: the checkpoint path)")
    parser.add_argument("--tool-call-parser", default=None,
                        help="tool-call format of /v1/chat/completions (qwen25, llama3, deepseekv3, ...; "
                             "default: detected from the chat template / model type)")


def engine_kwargs_of(args: argparse.Namespace) -> dict[str, Any]:
    """The engine kwargs of the SGLang options given to ``miles serve`` (those left at SGLang's
    default, such as ``--max-prefill-tokens 16384``, leave the engine's own default)."""
    options = {}
    for knob in ENGINE_KNOBS:
        value = getattr(args, knob.name.replace("-", "_"), None)
        if value != SERVER_ARGS_BY_FIELD[server_field(knob.name)].default:
            options[knob.name] = value
    kwargs, _ = engine_kwargs_from_options(options)
    return kwargs


def _sglang_options() -> frozenset[str]:
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    ours = {option[2:] for option in parser._option_string_actions if option.startswith("--")}
    sglang = {arg.name for arg in SERVER_ARGS}
    # the launcher passes --hf-checkpoint, --port, --host, --dtype and --device from miles' own flags
    return frozenset((ours & sglang) - set(MILES_SETS) - {"host", "dtype", "device"})


def run(args: argparse.Namespace) -> int:
    """Start the server and block until Ctrl-C."""
    from miles_sglang.server import start_server, wait_forever

    engine = build_engine(args.hf_checkpoint, args.dtype, args.device, kv_cache_tokens=args.kv_cache_tokens,
                          **engine_kwargs_of(args))
    server_args = {k: v for k, v in vars(args).items() if k != "api_key"}
    limits = dataclasses.replace(
        ServerLimits(), timeout_keep_alive_s=args.timeout_keep_alive, max_body_bytes=int(args.max_request_body_mb * 2**20),
        max_weight_body_bytes=int(args.max_weight_request_body_mb * 2**20),
    )
    handle = start_server(engine, args.hf_checkpoint, args.host, args.port, args.api_key,
                          args.incremental_streaming_output, server_args, limits=limits)
    print(f"miles serve: {args.hf_checkpoint} at {handle.url} (SGLang HTTP API; Ctrl-C stops)", file=sys.stderr)
    wait_forever(handle)
    return 0


#: SGLang server options ``miles serve`` takes with SGLang's spelling (what the launcher forwards to it)
SGLANG_OPTIONS = _sglang_options()
