"""The training backend of a slime launch script that did not name one.

slime always trains with Megatron: its scripts give model parallelism
(``--tensor-model-parallel-size 2``, ``--sequence-parallel``, ...) and no
``--train-backend``. miles' default backend has no model parallelism, so when the user
chose no backend and asks for it, the run trains with the Megatron backend (plugin
miles-megatron), saying so in one line; without that plugin the error says what to
install. A ``--train-backend`` given on the command line or in ``--config`` is kept.
"""

from __future__ import annotations

import sys
from typing import Any

from miles_host.config_fields import flag_name

#: the plugin (entry-point name) and distribution of the backend slime scripts train with
MODEL_PARALLEL_BACKEND = "megatron"
MODEL_PARALLEL_DISTRIBUTION = "miles-megatron"
#: model-parallel sizes that ask for it when above 1
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


def choose_train_backend(args: Any, given: set[str], installed: set[str], stream: Any = None) -> str | None:
    """Set ``args.train_backend`` to the Megatron backend when the user chose none and asks for
    model parallelism; returns the backend chosen (None: nothing changed). ``installed``: the
    plugin names found. ValueError when the plugin is not installed."""
    if "train_backend" in given:
        return None
    asked = model_parallel_request(args)
    if not asked:
        return None
    if MODEL_PARALLEL_BACKEND not in installed:
        raise ValueError(
            f"{', '.join(asked)}: model parallelism trains with --train-backend {MODEL_PARALLEL_BACKEND}, whose "
            f"plugin is not installed (pip install {MODEL_PARALLEL_DISTRIBUTION}); or drop these flags to train "
            "with the native backend"
        )
    args.train_backend = MODEL_PARALLEL_BACKEND
    print(f"miles: note: model parallelism ({', '.join(asked)}) trains with --train-backend "
          f"{MODEL_PARALLEL_BACKEND} (plugin {MODEL_PARALLEL_DISTRIBUTION}), chosen because no --train-backend "
          "was given", file=stream or sys.stderr)
    return MODEL_PARALLEL_BACKEND
