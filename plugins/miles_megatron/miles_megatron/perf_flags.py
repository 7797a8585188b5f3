"""Megatron's ``PERF_ARGS`` flags that reach this backend's ``TransformerConfig``.

:data:`miles_host.config_megatron.MEGATRON_BACKEND_FIELDS` names them (miles field ->
``TransformerConfig`` field); :func:`transformer_config_overrides` turns a run's values
into the keyword arguments :func:`miles_megatron.policy.transformer_config` applies
over its local settings. What this backend cannot run is kept at the local setting
and said once (:func:`dispatcher_note`):

- ``--moe-token-dispatcher-type flex`` needs DeepEP (not used here): alltoall instead;
- on CPU the dispatcher stays ``allgather`` (gloo has no all-to-all);
- under TP/EP/PP it stays ``allgather``: the expert-gradient reduction of
  :mod:`miles_megatron.parallel` counts the batch copies that dispatcher delivers.

Every other ``PERF_ARGS`` flag is the same for all backends (accepted and ignored with
one warning, accepted as what miles does, or refused by the validation stage: see
:mod:`miles_host.validation.megatron_args`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from miles_host.config_megatron import MEGATRON_BACKEND_FIELDS

logger = logging.getLogger(__name__)

#: dispatchers this backend builds (Megatron-Core's own, no DeepEP)
DISPATCHERS = ("allgather", "alltoall")


def dispatcher_for(requested: str, device: torch.device, model_parallel: bool = False) -> str:
    """The token dispatcher this backend runs for ``--moe-token-dispatcher-type`` (``model_parallel``:
    TP/EP/PP above 1)."""
    if torch.device(device).type != "cuda" or model_parallel:
        return "allgather"
    return requested if requested in DISPATCHERS else "alltoall"


def dispatcher_note(requested: str, device: torch.device, model_parallel: bool = False) -> str | None:
    """Why the dispatcher differs from the one asked for (None: it does not)."""
    chosen = dispatcher_for(requested, device, model_parallel)
    if chosen == requested:
        return None
    if torch.device(device).type != "cuda":
        return (f"--moe-token-dispatcher-type {requested}: the megatron backend on CPU dispatches tokens with "
                "allgather (gloo has no all-to-all)")
    if model_parallel:
        return (f"--moe-token-dispatcher-type {requested}: under TP/EP/PP the megatron backend dispatches tokens "
                "with allgather (its expert-gradient reduction counts that dispatcher's batch copies)")
    return (f"--moe-token-dispatcher-type {requested} needs DeepEP, which the megatron backend does not use: "
            f"tokens are dispatched with {chosen}")


def transformer_config_overrides(config: Any, device: torch.device, model_parallel: bool = False) -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments from the run's Megatron flags (the ``moe_*`` ones
    apply to MoE models only: :func:`miles_megatron.policy.transformer_config` drops them otherwise;
    ``model_parallel``: TP/EP/PP above 1)."""
    values = {field: getattr(config, name) for name, field in MEGATRON_BACKEND_FIELDS.items()}
    overrides: dict[str, Any] = {
        "attention_softmax_in_fp32": bool(values["attention_softmax_in_fp32"]),
        "moe_token_dispatcher_type": dispatcher_for(values["moe_token_dispatcher_type"], device, model_parallel),
    }
    if values["moe_router_dtype"] is not None:
        overrides["moe_router_dtype"] = values["moe_router_dtype"]
    return overrides


def log_dispatcher_note(config: Any, device: torch.device, model_parallel: bool = False) -> None:
    """One log line when the dispatcher differs from ``--moe-token-dispatcher-type``."""
    note = dispatcher_note(getattr(config, "moe_token_dispatcher_type"), device, model_parallel)
    if note is not None:
        logger.warning(note)
