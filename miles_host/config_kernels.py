"""The host's kernel switches as config data: each switch's name, default, choices and help.

One record per switch serves both sides: the kernel module that owns the switch declares it
from here (:func:`miles_host.kernels.switches.declare_host`), and :class:`~miles_host.config.TrainArgs`
makes it a ``miles run`` flag of the ``kernels`` group (:func:`switch_flag`), so the flag and
the declaration cannot disagree. Plugins declare theirs in their own modules
(``miles_fp8.kernel_switches``, ``miles_int4.kernel_switches``). Torch-free: the config imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_host.config_fields import flag


@dataclass(frozen=True)
class SwitchSpec:
    """One host kernel switch (``choices`` None: a count >= 0)."""

    name: str
    default: Any
    choices: tuple[Any, ...] | None
    help: str


HOST_SWITCHES: dict[str, SwitchSpec] = {spec.name: spec for spec in (
    SwitchSpec("split_k_reduce", "kernel", ("kernel", "torch"),
               "where split-K partials of the small-M GEMMs are summed: kernel, or torch (debugging)"),
    SwitchSpec("small_m_gemm", "triton", ("triton", "torch"),
               "the 16-bit linears of decode steps of at most 4 tokens: the split-K Triton GEMM, or torch (the "
               "module: cuBLAS)"),
    SwitchSpec("pdl", "on", ("on", "off"),
               "programmatic dependent launch of the decode kernels on Hopper and later GPUs (each kernel starts "
               "while the one before it finishes and prefetches its weights): on or off"),
    SwitchSpec("sampler_kernel", "triton", ("triton", "torch"),
               "the draw of graphed decode sampling without top-k/top-p/min-p: triton (two fused launches) or torch "
               "(the PyTorch sampler)"),
    SwitchSpec("moe_combine", "separate", ("separate", "epilogue"),
               "the fused MoE's top-k weighted sum: separate (its own launch) or epilogue (in the down projection's "
               "launch)"),
    SwitchSpec("moe_gemv_tokens", 1, None,
               "batches of at most this many tokens run the fused MoE's 16-bit experts by a CUDA-core GEMV per "
               "(token, slot) pair (0: never)"),
    SwitchSpec("mla_kv_cache", "latent", ("latent", "expanded"),
               "the engine's cache of DeepSeek MLA layers: latent (one normalized latent + rope key per token and "
               "layer, queries absorbed, as SGLang: 71x less KV memory for DeepSeek-V3; a quantized kv_b_proj is "
               "read dequantized) or expanded (keys and values per head); --true-on-policy and an adapted kv_b_proj "
               "always expand"),
    SwitchSpec("mla_prefill", "expanded", ("absorbed", "expanded"),
               "prefill steps of MLA layers cached as latents: expanded (each context's latents expanded by kv_b_proj "
               "to per-head keys and values, multi-head attention: SGLang's MHA prefill, fewer FLOPs; sequences in "
               "groups of at most 16,384 context tokens, a step with a longer context absorbed) or absorbed (the "
               "latent kernel, as decode)"),
    SwitchSpec("moe_invariant_decode", "batched", ("loop", "batched"),
               "the routed experts of a batch-invariant (--true-on-policy) decode step inside CUDA graphs: loop "
               "(per expert), or batched (one invariant GEMM per projection for all experts)"),
)}


def switch_flag(name: str) -> Any:
    """The ``kernels``-group config field of host switch ``name``."""
    spec = HOST_SWITCHES[name]
    return flag(spec.default, f"kernel switch: {spec.help}", type=type(spec.default),
                choices=list(spec.choices) if spec.choices is not None else None, group="kernels")


__all__ = ["HOST_SWITCHES", "SwitchSpec", "switch_flag"]
