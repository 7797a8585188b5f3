"""Run-setting checks that depend on a family's model (the plugins' ``miles_validate`` hooks)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from miles_host.models.loading import read_hf_config
from miles_host.validation.host_checks import model_config


def refuse_true_on_policy(config: Any, model_types: Iterable[str], reason_of: Callable[[Any], str | None]) -> None:
    """``--true-on-policy`` on a checkpoint of ``model_types`` whose blocks the batch-invariant mode
    cannot compute (``reason_of(native config)``, None when it can): ValueError with the reason."""
    if not getattr(config, "true_on_policy", False) or not getattr(config, "hf_checkpoint", None):
        return
    if read_hf_config(config.hf_checkpoint)["model_type"] not in set(model_types):
        return
    reason = reason_of(model_config(config))
    if reason is not None:
        raise ValueError(reason)
