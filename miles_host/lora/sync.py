"""How the rollout engine applies a LoRA run's adapters: ``--lora-sync``.

- ``merged`` (the default): the engine keeps a plain model; every weight sync sends
  ``W + scaling * B @ A`` under the native names (:func:`~miles_host.lora.export.merged_state_dict`),
  so decode runs plain GEMMs and the whole model moves at each sync.
- ``adapter``: the engine's model carries the trainer's :class:`~miles_host.lora.layers.LoraLinear`
  layers (eval mode, no dropout), so every forward computes ``W x + scaling * B (A x)`` over
  base weights that stay untouched (the engine's layers keep the adapters fused:
  :meth:`~miles_host.lora.layers.LoraAdapters.fuse_adapters`, two GEMMs per linear). With a
  quantized ``--precision`` (``int4``, ``fp8``; adapter mode only) the base linears are the
  recipe's quantized modules and the adapters sit next to them. The first sync sends the unmerged state (base and
  adapters, under the model's own names), every later one only the ``lora_A`` / ``lora_B``
  tensors; the engine copies them in place (``copy_``), so CUDA graphs captured over the
  adapter parameters stay valid.

:class:`SyncSelection` picks what each sync sends and records its size
(``perf/weight_sync_bytes``, ``perf/weight_sync_tensors`` of each step; the run's first
sync, before any step, goes to stderr).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from miles_host.lora.export import merged_state_dict

#: rollout backends whose engine is this host's model code, where adapters can be injected
ADAPTER_ENGINE_BACKENDS = ("embedded", "process")


def is_adapter_tensor(name: str) -> bool:
    """Whether ``name`` is a LoRA matrix (``...lora_A.<part>`` / ``...lora_B.<part>``)."""
    return ".lora_A." in name or ".lora_B." in name


def _unmerged_state(model: torch.nn.Module, state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The state as the model holds it: base weights and adapters under their own names."""
    return state if state is not None else model.state_dict()


@dataclass(frozen=True)
class SyncMode:
    """A ``--lora-sync`` value: whether the engine's model carries adapter layers, and
    ``export(model, state)``: the trainer's state as that engine loads it."""

    name: str
    engine_adapters: bool
    export: Callable[[torch.nn.Module, dict[str, torch.Tensor] | None], dict[str, torch.Tensor]]


MODES: dict[str, SyncMode] = {
    "merged": SyncMode("merged", False, merged_state_dict),
    "adapter": SyncMode("adapter", True, _unmerged_state),
}


def sync_mode(config: Any) -> SyncMode:
    """The run's :class:`SyncMode` (``merged`` when LoRA is off: a plain model exports as it is)."""
    name = getattr(config, "lora_sync", "merged") if getattr(config, "lora_rank", 0) else "merged"
    if name not in MODES:
        raise ValueError(f"--lora-sync {name!r}: choose one of {', '.join(MODES)}")
    return MODES[name]


def rollout_state(model: torch.nn.Module, state: dict[str, torch.Tensor] | None, config: Any) -> dict[str, torch.Tensor]:
    """The trainer's weights (``state``, default ``model.state_dict()``) under the names and
    in the form the run's rollout engine loads them (merged, or base + adapters)."""
    return sync_mode(config).export(model, state)


def prepare_engine_model(model: torch.nn.Module, config: Any) -> torch.nn.Module:
    """With ``--lora-sync adapter``: the trainer's LoRA layers into the engine's ``model``
    (same modules and names, ``--lora-adapter-path`` loaded, no dropout, eval mode), before
    the engine sizes its KV cache and captures CUDA graphs. Unchanged otherwise."""
    if not sync_mode(config).engine_adapters:
        return model
    from miles_host.lora.inject import apply_lora

    from miles_host.lora.modules import lora_modules

    engine_config = copy.copy(config)
    engine_config.lora_dropout = 0.0  # the engine samples: never drops the adapters' input
    apply_lora(model, engine_config)
    for layer in lora_modules(model).values():  # two GEMMs per adapted linear at decode
        layer.fuse_adapters()
    return model.eval()


@dataclass(frozen=True)
class SyncSize:
    """Tensors and bytes of one weight sync."""

    tensors: int = 0
    bytes: int = 0

    def metrics(self) -> dict[str, float]:
        return {"perf/weight_sync_tensors": float(self.tensors), "perf/weight_sync_bytes": float(self.bytes)}


def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3f} MiB"


class SyncSelection:
    """What each weight sync of a run sends: everything the trainer exports, except that
    with ``--lora-sync adapter`` only the first sync carries the base (later ones carry
    the adapter tensors alone). Records the size of each sync."""

    def __init__(self, config: Any):
        self.lora = bool(getattr(config, "lora_rank", 0))
        self.mode = sync_mode(config)
        self.adapter_only_after_first = self.lora and self.mode.engine_adapters
        self.syncs = 0
        #: the last sync's size
        self.last = SyncSize()
        #: what the syncs since the last :meth:`pop_metrics` sent together
        self.pending = SyncSize()
        self._first = SyncSize()

    def select(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The ``(name, tensor)`` pairs (or mapping) of this sync that it sends, recorded in :attr:`last`."""
        named = list(named.items() if isinstance(named, Mapping) else named)
        if self.adapter_only_after_first and self.syncs > 0:
            named = [(name, tensor) for name, tensor in named if is_adapter_tensor(name)]
        self.count(len(named), sum(t.numel() * t.element_size() for _, t in named))
        self._report()
        return named

    def count(self, tensors: int, nbytes: int) -> None:
        """Record a sync of ``tensors`` tensors, ``nbytes`` bytes (what :meth:`select` chose, or a
        trainer's whole weights streamed bucket by bucket)."""
        self.last = SyncSize(tensors, nbytes)
        if self.syncs > 0:  # the run's first sync comes before any step: reported on stderr only
            self.pending = SyncSize(self.pending.tensors + self.last.tensors, self.pending.bytes + self.last.bytes)
        self.syncs += 1

    def _report(self) -> None:
        """A LoRA run: one stderr line for the first sync and, in adapter mode, for the first
        adapter-only one."""
        if not self.lora or self.syncs > 2:
            return
        if self.syncs == 1:
            self._first = self.last
            what = "the base and adapters" if self.adapter_only_after_first else "the merged weights"
            print(f"miles: --lora-sync {self.mode.name}: first weight sync sent {what} "
                  f"({self.last.tensors} tensors, {_megabytes(self.last.bytes)})", file=sys.stderr)
        elif self.adapter_only_after_first:
            share = self.last.bytes / self._first.bytes if self._first.bytes else 0.0
            print(f"miles: --lora-sync adapter: later weight syncs send the adapters only ({self.last.tensors} "
                  f"tensors, {_megabytes(self.last.bytes)}, {100 * share:.2f}% of the first)", file=sys.stderr)

    def pop_metrics(self) -> dict[str, float]:
        """What the syncs since the last call sent, as metrics (a step that synced nothing logs 0)."""
        out, self.pending = self.pending.metrics(), SyncSize()
        return out
