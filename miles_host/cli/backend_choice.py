"""The backends of a slime launch script that did not name them.

slime always trains with Megatron and rolls out with SGLang: its scripts give model
parallelism (``--tensor-model-parallel-size 2``, ``--sequence-parallel``, ...) and
multi-GPU engines (``--rollout-num-gpus-per-engine 4``) but no ``--train-backend`` or
``--rollout-backend``. miles' defaults (the native trainer, the embedded engine) have
neither, so when the user chose no backend and asks for what only a plugin backend does,
the run uses that backend, saying so in one line; without its plugin the error says
what to install. A backend given on the command line or in ``--config`` is kept (and the
backend's own validation refuses what it cannot do).

Each such choice is one :class:`ImpliedBackend` record in :data:`IMPLIED_BACKENDS`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

from miles_host.config_fields import flag_name

#: model-parallel sizes that ask for the Megatron backend when above 1
MODEL_PARALLEL_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "context_parallel_size",
)


def model_parallel_request(args: Any) -> list[str]:
    """The flags of ``args`` that ask for Megatron model parallelism, as the user spelled them."""
    asked = [f"{flag_name(name)} {getattr(args, name)}" for name in MODEL_PARALLEL_SIZES
             if getattr(args, name, 1) not in (None, 1)]
    if getattr(args, "sequence_parallel", False):
        asked.append("--sequence-parallel")
    return asked


def engine_parallel_request(args: Any) -> list[str]:
    """``--rollout-num-gpus-per-engine N`` with N > 1 (tensor-parallel SGLang engines), as given."""
    gpus = getattr(args, "rollout_num_gpus_per_engine", 1)
    return [f"--rollout-num-gpus-per-engine {gpus}"] if gpus not in (None, 1) else []


@dataclass(frozen=True)
class ImpliedBackend:
    """A backend that flags ask for when its backend flag was not given."""

    #: the config field that names the backend (``train_backend``)
    dest: str
    #: the backend chosen, also the plugin's entry-point name (``megatron``)
    backend: str
    #: the distribution that installs the plugin (``miles-megatron``)
    distribution: str
    #: what the flags ask for, in words (``model parallelism``)
    what: str
    #: what it does with the backend (``trains``: "model parallelism trains with --train-backend megatron")
    verb: str
    #: the flags of the parsed arguments that ask for it (empty: nothing asked)
    request: Callable[[Any], list[str]]
    #: how to do without the plugin (the end of the error when it is not installed)
    otherwise: str


MEGATRON_TRAINING = ImpliedBackend(
    "train_backend", "megatron", "miles-megatron", "model parallelism", "trains", model_parallel_request,
    "or drop these flags to train with the native backend")
SGLANG_ROLLOUT = ImpliedBackend(
    "rollout_backend", "sglang", "miles-sglang", "tensor-parallel rollout engines", "roll out", engine_parallel_request,
    "or give --rollout-num-gpus-per-engine 1 to roll out with the embedded engine (one GPU per engine)")
#: every automatic choice, applied in this order
IMPLIED_BACKENDS: tuple[ImpliedBackend, ...] = (MEGATRON_TRAINING, SGLANG_ROLLOUT)


def choose_backend(choice: ImpliedBackend, args: Any, given: set[str], installed: set[str],
                   stream: Any = None) -> str | None:
    """Set ``args.<choice.dest>`` to ``choice.backend`` when the user gave no such flag and
    the arguments ask for it; returns the backend chosen (None: nothing changed).
    ``installed``: the plugin names found. ValueError when the plugin is not installed."""
    if choice.dest in given:
        return None
    asked = choice.request(args)
    if not asked:
        return None
    flag = flag_name(choice.dest)
    if choice.backend not in installed:
        raise ValueError(
            f"{', '.join(asked)}: {choice.what} {choice.verb} with {flag} {choice.backend}, whose plugin is not "
            f"installed (pip install {choice.distribution}); {choice.otherwise}"
        )
    setattr(args, choice.dest, choice.backend)
    print(f"miles: note: {choice.what} ({', '.join(asked)}) {choice.verb} with {flag} {choice.backend} (plugin "
          f"{choice.distribution}), chosen because no {flag} was given", file=stream or sys.stderr)
    return choice.backend


def choose_backends(args: Any, given: set[str], installed: set[str], stream: Any = None) -> dict[str, str]:
    """Every :data:`IMPLIED_BACKENDS` choice over ``args``: ``{field: backend}`` for those made."""
    chosen = {}
    for choice in IMPLIED_BACKENDS:
        backend = choose_backend(choice, args, given, installed, stream)
        if backend is not None:
            chosen[choice.dest] = backend
    return chosen


def choose_train_backend(args: Any, given: set[str], installed: set[str], stream: Any = None) -> str | None:
    """The Megatron choice alone (:data:`MEGATRON_TRAINING`)."""
    return choose_backend(MEGATRON_TRAINING, args, given, installed, stream)
