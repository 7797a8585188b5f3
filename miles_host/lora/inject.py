"""Put LoRA layers into a loaded model: ``--lora-rank``, ``--lora-alpha``, ``--lora-dropout``,
``--target-modules``, ``--exclude-modules``, ``--lora-adapter-path``.

The chosen linears become :class:`~miles_host.lora.layers.LoraLinear` (same parameter names
for the base weights, which are frozen: no gradients, no optimizer state); a precision
recipe's quantized linears (``--precision int4`` / ``fp8``, which need ``--lora-sync adapter``)
keep their own forward and state and get the adapters next to them, in the model's dtype
(:func:`~miles_host.lora.layers.adapt_in_place`). Routed experts picked by name (``experts``,
``experts.gate_up_proj``, ...) become :class:`~miles_host.lora.experts.LoraExperts`. Every other
parameter of the model is frozen too, so the optimizer the trainer builds next holds the adapters only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from miles_host.lora.experts import adapt_experts
from miles_host.models.loading import default_family_lookup, model_class, native_config, read_hf_config
from miles_host.routing import NO_ROUTING_HOOKS
from miles_host.lora.layers import LoraLinear, LoraPart, adapt_in_place
from miles_host.lora.peft_io import adapter_modules, adapter_shape, load_adapter, read_adapter_config
from miles_host.lora.targets import (ALL_LINEAR, Candidate, available_names, candidates_of, quantized_linears, select,
                                     split_names)


@dataclass(frozen=True)
class LoraSummary:
    """What :func:`apply_lora` did: adapted HF linears and the parameter counts."""

    adapted_modules: int
    trainable_params: int
    total_params: int

    def metrics(self) -> dict[str, float]:
        """``lora/*`` metrics logged with every training step."""
        return {
            "lora/trainable_params": float(self.trainable_params),
            "lora/total_params": float(self.total_params),
            "lora/trainable_fraction": self.trainable_params / self.total_params,
        }


def _targets(config: Any, candidates: list[Candidate]) -> list[str]:
    """``--target-modules`` (default all-linear); with ``--lora-adapter-path`` and no
    ``--target-modules``, the modules the adapter holds."""
    if config.target_modules is None and config.lora_adapter_path:
        held = adapter_modules(config.lora_adapter_path, {c.part.hf_module for c in candidates if c.experts})
        foreign = [name for name in held if not any(c.picked_by(name) for c in candidates)]
        if foreign:
            raise ValueError(f"--lora-adapter-path {config.lora_adapter_path} adapts {len(foreign)} modules miles "
                             f"cannot carry adapters on: {', '.join(foreign[:4])}{' ...' if len(foreign) > 4 else ''} "
                             "(a MoE router's `gate`, which PEFT >= 0.22's all-linear adapts, is one; miles has no "
                             f"router adapters); {available_names(candidates)}. Train the adapter on a target_modules "
                             "list without them (e.g. q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj) to "
                             "load it here")
        return held
    return split_names(config.target_modules) or [ALL_LINEAR]


def refuse_expert_dropout(experts: list[str], config: Any) -> None:
    """``--lora-dropout`` > 0 cannot act on adapters of the routed experts (``experts``: the chosen
    expert stacks): ValueError saying what to change."""
    if experts and config.lora_dropout:
        raise ValueError(f"--lora-dropout {config.lora_dropout:g} with adapters on the routed experts "
                         f"({experts[0]}, ...): their update is a weight delta W + B A (PEFT's "
                         "target_parameters), so no dropout can act on its input; give --lora-dropout 0 or "
                         "--exclude-modules experts")


def checkpoint_candidates(config: Any) -> list[Candidate]:
    """The modules the LoRA flags choose in ``--hf-checkpoint``'s model, built on the meta device
    (no weights read): what the validation stage checks before anything loads."""
    hf = read_hf_config(config.hf_checkpoint)
    native = native_config(hf, default_family_lookup(hf["model_type"]))
    with torch.device("meta"):
        model = model_class(native)(native, NO_ROUTING_HOOKS)
    candidates = candidates_of(model)
    return select(candidates, _targets(config, candidates), split_names(config.exclude_modules))


def check_adapter_shape(config: Any) -> None:
    """``--lora-adapter-path``'s rank and alpha must be the run's: a silent mismatch would
    rescale the adapter (alpha / r) or not fit its matrices."""
    adapter = read_adapter_config(config.lora_adapter_path)
    if (adapter.get("r"), adapter.get("lora_alpha")) != (config.lora_rank, config.lora_alpha):
        raise ValueError(
            f"--lora-adapter-path {config.lora_adapter_path} has r={adapter.get('r')}, "
            f"lora_alpha={adapter.get('lora_alpha')}, the run --lora-rank {config.lora_rank} --lora-alpha "
            f"{config.lora_alpha:g}; give --lora-rank {adapter.get('r')} --lora-alpha {adapter.get('lora_alpha')}"
        )


def stack_shapes(chosen: list[Candidate], config: Any) -> dict[str, dict[str, tuple[int, float]]]:
    """Native experts module -> {stack key: (rank, alpha)} for the stacks ``--lora-adapter-path``'s
    ``rank_pattern`` / ``alpha_pattern`` give another shape than the run's (none without an adapter).
    ValueError for a linear they would give one: each linear adapter has the run's rank."""
    if not config.lora_adapter_path:
        return {}
    adapter = read_adapter_config(config.lora_adapter_path)
    default = (config.lora_rank, config.lora_alpha)
    out: dict[str, dict[str, tuple[int, float]]] = {}
    for candidate in chosen:
        shape = adapter_shape(adapter, candidate.part.hf_module)
        if shape == default:
            continue
        if not candidate.experts:
            raise ValueError(f"--lora-adapter-path {config.lora_adapter_path}: rank_pattern / alpha_pattern give "
                             f"{candidate.part.hf_module} r={shape[0]}, lora_alpha={shape[1]:g} (the adapter's r="
                             f"{default[0]}, lora_alpha={default[1]:g}): per-module ranks are read for routed-expert "
                             "stacks only; re-save the adapter with one rank and alpha for its linears")
        out.setdefault(candidate.native, {})[candidate.part.key] = shape
    return out


def _buffer_weights(model: torch.nn.Module, quantized: list[str]) -> int:
    """Weights the quantized linears hold as buffers (the engine's INT4 / FP8 modules), counted
    as parameters of the model: ``in_features * out_features`` each."""
    modules = (model.get_submodule(name) for name in quantized)
    return sum(m.in_features * m.out_features for m in modules if "weight" not in m._parameters)


def _activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The model's dtype (its first floating-point parameter, the embedding): the dtype of the
    adapters put next to quantized linears, whose weights are INT4 / FP8."""
    for parameter in model.parameters():
        if parameter.is_floating_point() and parameter.element_size() > 1:
            return parameter.dtype
    return torch.get_default_dtype()


def apply_lora(model: torch.nn.Module, config: Any) -> LoraSummary | None:
    """Adapt ``model`` in place as the LoRA flags say (None: ``--lora-rank 0``, LoRA off)."""
    if not config.lora_rank:
        return None
    if config.lora_adapter_path:
        check_adapter_shape(config)
    quantized = quantized_linears(model)
    if quantized and getattr(config, "lora_sync", "merged") != "adapter":
        raise ValueError(f"--lora-rank {config.lora_rank} --lora-sync {getattr(config, 'lora_sync', 'merged')}: "
                         f"{len(quantized)} linears of the model are {type(model.get_submodule(quantized[0])).__name__} "
                         f"modules (--precision {config.precision}); adapters over a quantized base run as separate "
                         "low-rank GEMMs: give --lora-sync adapter")
    candidates = candidates_of(model)
    if not candidates:
        raise ValueError(f"--lora-rank {config.lora_rank}: no module of this model can carry an adapter (the model "
                         "family maps none of its linears to HF modules)")
    chosen = select(candidates, _targets(config, candidates), split_names(config.exclude_modules))
    if not chosen:
        raise ValueError(f"--exclude-modules {config.exclude_modules} leaves no module of --target-modules "
                         f"{config.target_modules or ALL_LINEAR} to adapt; {available_names(candidates)}")
    experts = {c.native for c in chosen if c.experts}
    refuse_expert_dropout(sorted(experts), config)
    shapes = stack_shapes(chosen, config)
    model.requires_grad_(False)
    by_native: dict[str, list[LoraPart]] = {}
    for candidate in chosen:
        by_native.setdefault(candidate.native, []).append(candidate.part)
    adapter_dtype = _activation_dtype(model)
    for native, parts in by_native.items():
        parent_name, _, attribute = native.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, attribute)
        if native in experts:
            adapt_experts(base, parts, config.lora_rank, config.lora_alpha, shapes.get(native))
        elif native in quantized:
            adapt_in_place(base, parts, config.lora_rank, config.lora_alpha, config.lora_dropout, adapter_dtype)
        else:
            setattr(parent, attribute, LoraLinear(base, parts, config.lora_rank, config.lora_alpha,
                                                  config.lora_dropout))
    if config.lora_adapter_path:
        load_adapter(model, config.lora_adapter_path)
    summary = LoraSummary(
        adapted_modules=len(chosen),
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        total_params=sum(p.numel() for p in model.parameters()) + _buffer_weights(model, quantized),
    )
    print(f"miles: LoRA rank {config.lora_rank}, alpha {config.lora_alpha:g} on {summary.adapted_modules} modules: "
          f"{summary.trainable_params:,} trainable of {summary.total_params:,} parameters "
          f"({100 * summary.trainable_params / summary.total_params:.2f}%)", file=sys.stderr)
    return summary
