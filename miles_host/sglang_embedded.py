"""What the embedded engine makes of SGLang's server flags.

The embedded engine (``--rollout-backend embedded`` or ``process``, and ``miles serve``)
honours the SGLang server options that name one of its own knobs (:data:`ENGINE_KNOBS`:
memory fraction, context length, prefill budget, running requests, KV pool size, CUDA
graphs and their batch sizes, prefix cache, deterministic inference, the overlap schedule, a KV cache in the model's dtype). Every
other given ``--sglang-*`` flag, and every ``--router-*`` flag, is accepted and named in one
warning (:func:`warn_unhonoured_flags`). The engine runs on one GPU, so
``--rollout-num-gpus-per-engine`` above 1 is refused here (:func:`check_engine_sglang_args`,
the engine backends' validation) with the backend that has tensor parallelism named.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from miles_host.config_sglang import given_router_flags, given_server_args, server_field
from miles_host.devices import resolve_device, resolve_dtype

#: SGLang's --kv-cache-dtype values the engine stores, in a model of that dtype (fp8 / fp4 pools it does not have)
KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineKnob:
    """One SGLang server option the engine honours: ``engine_kwargs(value)`` is what it
    passes to :class:`miles_host.rollout.Engine` (None: this value has no meaning here)."""

    name: str
    engine_kwargs: Callable[[Any], dict[str, Any] | None]


def _prefill_budget(value: int) -> dict[str, Any]:
    # SGLang's -1 turns chunking off (no budget); prompts longer than the budget run alone
    return {"max_num_batched_tokens": value} if value > 0 else {}


def _kv_cache_dtype(value: str) -> dict[str, Any] | None:
    # the engine keeps its KV cache in the model's dtype: auto, or bf16 with a bf16 model (checked in validation)
    return {} if value == "auto" or value in KV_CACHE_DTYPES else None


def _graph_backend(value: str) -> dict[str, Any] | None:
    return {"enforce_eager": True} if value == "disabled" else None


def _graph_max_bs(value: int) -> dict[str, Any]:
    from miles_host.rollout.cuda_graphs import graph_batch_sizes

    return {"cuda_graph_batch_sizes": graph_batch_sizes(value)}  # the engine's ladder up to it


def _merge_graph_sizes(first: list[int], second: list[int]) -> list[int]:
    # an explicit list and a maximum (SGLang's --cuda-graph-bs with --cuda-graph-max-bs): both lists' sizes up to
    # the smaller maximum
    limit = min(max(first, default=0), max(second, default=0))
    return sorted(s for s in {*first, *second} if s <= limit)


ENGINE_KNOBS: tuple[EngineKnob, ...] = (
    EngineKnob("mem-fraction-static", lambda v: {"mem_fraction_static": v}),
    EngineKnob("context-length", lambda v: {"max_model_len": v}),
    EngineKnob("max-running-requests", lambda v: {"max_num_seqs": v}),
    EngineKnob("chunked-prefill-size", _prefill_budget),
    EngineKnob("max-prefill-tokens", _prefill_budget),
    EngineKnob("max-total-tokens", lambda v: {"kv_cache_tokens": v, "max_kv_cache_tokens": v}),
    EngineKnob("disable-cuda-graph", lambda v: {"enforce_eager": True}),
    EngineKnob("cuda-graph-bs", lambda v: {"cuda_graph_batch_sizes": sorted(v)}),
    EngineKnob("cuda-graph-bs-decode", lambda v: {"cuda_graph_batch_sizes": sorted(v)}),
    EngineKnob("cuda-graph-max-bs", _graph_max_bs),
    EngineKnob("cuda-graph-max-bs-decode", _graph_max_bs),
    EngineKnob("cuda-graph-backend-decode", _graph_backend),
    EngineKnob("disable-radix-cache", lambda v: {"enable_prefix_caching": False}),
    EngineKnob("kv-cache-dtype", _kv_cache_dtype),
    EngineKnob("enable-deterministic-inference", lambda v: {"batch_invariant": True}),
    EngineKnob("disable-overlap-schedule", lambda v: {"overlap_schedule": False}),
)
KNOBS_BY_NAME = {knob.name: knob for knob in ENGINE_KNOBS}

#: server options the host reads elsewhere (the speculative decoding strategy, its checks)
READ_ELSEWHERE = frozenset({
    "speculative-algorithm", "speculative-num-steps", "speculative-eagle-topk", "speculative-num-draft-tokens",
    "speculative-draft-model-path", "speculative-token-map", "enable-draft-weights-cpu-backup",
})

#: engine kwarg -> how two SGLang options setting it combine (upper bounds: the smaller holds)
_COMBINE: dict[str, Callable[[Any, Any], Any]] = {
    "max_num_batched_tokens": min, "kv_cache_tokens": min, "max_kv_cache_tokens": min,
    "cuda_graph_batch_sizes": _merge_graph_sizes,
}

#: host flag -> the SGLang option that sets the same engine knob
_SAME_KNOB = {"rollout_max_context_len": "context-length", "rollout_max_num_seqs": "max-running-requests"}


def engine_kwargs_from_options(options: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``{SGLang option name: value}`` -> (engine kwargs, the option names with no meaning for
    the engine). Switches count only when on; None values are skipped."""
    kwargs: dict[str, Any] = {}
    unhonoured: list[str] = []
    for name, value in options.items():
        if value is None or value is False or name in READ_ELSEWHERE:
            continue
        knob = KNOBS_BY_NAME.get(name)
        produced = knob.engine_kwargs(value) if knob is not None else None
        if produced is None:
            unhonoured.append(name)
            continue
        for key, item in produced.items():
            kwargs[key] = _COMBINE[key](kwargs[key], item) if key in _COMBINE and key in kwargs else item
    return kwargs, unhonoured


def engine_kwargs_from_config(config: Any) -> dict[str, Any]:
    """The engine kwargs the run's ``--sglang-*`` flags (and ``--rollout-max-context-len`` /
    ``--rollout-max-num-seqs``, the same knobs) ask for."""
    kwargs, _ = engine_kwargs_from_options({arg.name: value for arg, value in given_server_args(config)})
    if config.rollout_max_context_len is not None:
        kwargs["max_model_len"] = config.rollout_max_context_len
    if config.rollout_max_num_seqs is not None:
        kwargs["max_num_seqs"] = config.rollout_max_num_seqs
    return kwargs


def engine_max_num_seqs(config: Any, default: int) -> int:
    """Sequences the engine runs at once: ``--rollout-max-num-seqs`` or ``--sglang-max-running-requests``."""
    return config.rollout_max_num_seqs or getattr(config, "sglang_max_running_requests", None) or default


def unhonoured_flags(config: Any) -> list[str]:
    """The given ``--sglang-*`` and ``--router-*`` flags the embedded engine has no use for."""
    _, names = engine_kwargs_from_options({arg.name: value for arg, value in given_server_args(config)})
    flags = ["--sglang-" + name for name in names]
    if getattr(config, "sglang_config", None) is not None:
        flags.append("--sglang-config")
    return flags + given_router_flags(config)


_warned: set[str] = set()


def warn_unhonoured_flags(config: Any, stream: Any = None) -> list[str]:
    """One warning (per process) naming the given flags with no meaning for the embedded
    engine; returns the flags named now."""
    flags = [f for f in unhonoured_flags(config) if f not in _warned]
    if flags:
        _warned.update(flags)
        print(f"miles: warning: accepted, no meaning for the embedded engine: {' '.join(flags)} (SGLang server "
              "and router flags; --rollout-backend sglang passes the server flags to the SGLang servers it "
              "launches)", file=stream or sys.stderr)
    return flags


def check_engine_sglang_args(config: Any) -> None:
    """Validation of the engine backends: one GPU per engine, no two flags for one knob with
    different values, and the warning about the flags the engine ignores."""
    gpus = config.rollout_num_gpus_per_engine
    if gpus != 1:
        raise ValueError(
            f"--rollout-num-gpus-per-engine {gpus}: the embedded engine (--rollout-backend "
            f"{config.rollout_backend}) runs on one GPU, without tensor parallelism; use --rollout-backend sglang "
            f"(SGLang servers with tensor parallel size {gpus}), or 1")
    for host_name, option in _SAME_KNOB.items():
        host_value, sglang_value = getattr(config, host_name), getattr(config, server_field(option))
        if host_value is not None and sglang_value is not None and host_value != sglang_value:
            raise ValueError(
                f"--{host_name.replace('_', '-')} {host_value} and --sglang-{option} {sglang_value} set the same "
                "engine limit; give one of them")
    check_kv_cache_dtype(config)
    warn_unhonoured_flags(config)


def check_kv_cache_dtype(config: Any) -> None:
    """``--sglang-kv-cache-dtype bf16`` is the engine's KV cache only when the model runs in bf16."""
    value = getattr(config, "sglang_kv_cache_dtype", "auto")
    if value in KV_CACHE_DTYPES:
        model_dtype = resolve_dtype(config, resolve_device(config))
        if model_dtype != KV_CACHE_DTYPES[value]:
            raise ValueError(
                f"--sglang-kv-cache-dtype {value} with a {str(model_dtype).removeprefix('torch.')} model: the embedded "
                "engine keeps its KV cache in the model's dtype; give --dtype bfloat16, or drop the flag")
