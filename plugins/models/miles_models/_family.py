"""Builds a :class:`ModelFamily` record from a config parser and a weight map."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from miles_host.records import ModelFamily

from miles_models._config import hf_config_from_native
from miles_models._weights import WeightMap


def model_family(
    name: str,
    model_types: tuple[str, ...],
    config_from_hf: Callable[[Mapping[str, Any]], Any],
    weights: WeightMap,
    description: str = "",
    chat_defaults: Mapping[str, Any] | None = None,
) -> ModelFamily:
    """One family record whose weight conversion goes through ``weights``."""
    return ModelFamily(
        name=name,
        description=description,
        model_types=model_types,
        config_from_hf=config_from_hf,
        hf_to_native=weights.hf_to_native,
        native_to_hf=weights.native_to_hf,
        hf_config_from_native=hf_config_from_native,
        convert_hf_tensor=weights.convert_hf_tensor,
        convert_native_tensor=weights.convert_native_tensor,
        chat_defaults=dict(chat_defaults or {}),
    )

