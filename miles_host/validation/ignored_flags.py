"""The one list of flags accepted only so that slime scripts parse.

Every other flag is honoured by some code path or refused by the validation stage.
A flag here is parsed, recorded in the run's ``config.json``, and warned about once
when the user sets it; nothing else reads it.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

from miles_host.config_fields import flag_name
from miles_host.config_megatron import MEGATRON_IGNORED
from miles_host.config_optim_logging import TRACKING_IGNORED
from miles_host.validation.plugin_settings import user_set_fields

#: field name -> what miles does instead (the warning's text)
ACCEPTED_AND_IGNORED: dict[str, str] = {
    "num_gpus_per_node": (
        "miles places trainers by --actor-num-nodes x --actor-num-gpus-per-node and engines by "
        "--rollout-num-gpus, and checks them against the GPUs it finds"
    ),
    "model_name": "the model is --hf-checkpoint; the name is only recorded in config.json",
    **MEGATRON_IGNORED,
    **TRACKING_IGNORED,
}

_warned: set[str] = set()


def warn_ignored_flags(config: Any, stream: Any = None, honoured: Iterable[str] = ()) -> list[str]:
    """Print one warning (per process) for each accepted-and-ignored flag the user set;
    returns the flags warned about now. ``honoured``: flags of the list that the selected
    training backend reads (``TrainBackend.honoured_flags``): no warning for those."""
    stream = stream or sys.stderr
    given = user_set_fields(config) - set(honoured)
    warned = []
    for name, instead in ACCEPTED_AND_IGNORED.items():
        if name in given and name not in _warned:
            _warned.add(name)
            warned.append(flag_name(name))
            print(f"miles: warning: {flag_name(name)} is accepted for slime compatibility and ignored: {instead}",
                  file=stream)
    return warned
