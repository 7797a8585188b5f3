"""Evaluation data sets: slime's ``--eval-config`` YAML, or the ``--eval-prompt-data`` pairs.

The YAML holds an ``eval`` mapping (or is that mapping) with ``datasets`` (a list of
mappings, or a mapping keyed by name) and optional ``defaults``. Each data set needs
``name`` and ``path``; every other setting is taken from the data set, else from
``defaults``, else from the flags (:data:`SETTINGS` names them, in order):

=============================  ==========================================================
``n_samples_per_eval_prompt``  ``--n-samples-per-eval-prompt``
``temperature``                ``--eval-temperature``, ``--rollout-temperature``
``top_p``                      ``--eval-top-p``, ``--rollout-top-p``
``top_k``                      ``--eval-top-k``, ``--rollout-top-k``
``max_response_len``           ``--eval-max-response-len``, ``--rollout-max-response-len``
``input_key`` / ``label_key``  ``--eval-input-key`` / ``--eval-label-key``, then ``--input-key`` / ``--label-key``
``tool_key``                   ``--eval-tool-key``, ``--tool-key``
``metadata_key``               ``--metadata-key``
``apply_chat_template``        ``--apply-chat-template``
``stop`` / ``stop_token_ids``  ``--rollout-stop`` / ``--rollout-stop-token-ids``
=============================  ==========================================================

slime's other data-set keys (:data:`UNSUPPORTED_KEYS`) are refused by name.

``rm_type`` (a built-in reward) and ``custom_rm_path`` score that data set's samples
(``--custom-rm-path`` still wins over ``rm_type``, as in slime); ``rm_type`` and
``metadata_overrides`` go into each sample's metadata.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: data-set setting -> the flags (config attributes) it falls back to, first set wins
SETTINGS: dict[str, tuple[str, ...]] = {
    "n_samples_per_eval_prompt": ("n_samples_per_eval_prompt",),
    "temperature": ("eval_temperature", "rollout_temperature"),
    "top_p": ("eval_top_p", "rollout_top_p"),
    "top_k": ("eval_top_k", "rollout_top_k"),
    "max_response_len": ("eval_max_response_len", "rollout_max_response_len"),
    "input_key": ("eval_input_key", "input_key"),
    "label_key": ("eval_label_key", "label_key"),
    "tool_key": ("eval_tool_key", "tool_key"),
    "metadata_key": ("metadata_key",),
    "apply_chat_template": ("apply_chat_template",),
    "stop": ("rollout_stop",),
    "stop_token_ids": ("rollout_stop_token_ids",),
}
#: slime data-set keys that have no meaning here: refused by name rather than ignored
UNSUPPORTED_KEYS = ("multimodal_keys", "apply_chat_template_kwargs", "min_new_tokens", "repetition_penalty",
                    "skip_special_tokens", "no_stop_trim", "custom_generate_function_path", "app_service",
                    "eval_task_timeout", "min_eval_samples", "eval_early_stop_remaining",
                    "eval_early_stop_idle_timeout", "message_processor", "reward_model", "remote_environment")
#: data-set keys that only the data set (or defaults) sets
OWN_KEYS = ("rm_type", "custom_rm_path", "metadata_overrides")


@dataclass
class EvalDataset:
    """One evaluation data set with every setting resolved."""

    name: str
    path: str
    n_samples_per_eval_prompt: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_len: int | None = None
    input_key: str = "input"
    label_key: str | None = None
    tool_key: str | None = None
    metadata_key: str | None = None
    apply_chat_template: bool = False
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    rm_type: str | None = None
    custom_rm_path: str | None = None
    metadata_overrides: dict[str, Any] = field(default_factory=dict)

    def sample_metadata(self, metadata: dict) -> dict:
        """A sample's metadata with this data set's ``rm_type`` and ``metadata_overrides``."""
        merged = dict(metadata)
        if self.rm_type is not None:
            merged["rm_type"] = self.rm_type
        merged.update(self.metadata_overrides)
        return merged


_KNOWN = {f.name for f in dataclasses.fields(EvalDataset)}


def _from_flags(config: Any, attributes: tuple[str, ...]) -> Any:
    for attribute in attributes:
        value = getattr(config, attribute, None)
        if value is not None:
            return value
    return None


def resolve(config: Any, entry: dict, defaults: dict, where: str) -> EvalDataset:
    """An :class:`EvalDataset` from one data-set mapping, the defaults and the flags."""
    unsupported = sorted((set(entry) | set(defaults)) & set(UNSUPPORTED_KEYS))
    if unsupported:
        raise ValueError(f"{where}: slime's data-set key(s) {unsupported} are not supported by miles' evaluation; "
                         "remove them")
    unknown = sorted(set(entry) - _KNOWN) + sorted(set(defaults) - _KNOWN)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(_KNOWN)}")
    missing = [key for key in ("name", "path") if not entry.get(key)]
    if missing:
        raise ValueError(f"{where}: each data set needs {' and '.join(missing)}")
    values: dict[str, Any] = {"name": str(entry["name"]), "path": str(entry["path"])}
    for setting, attributes in SETTINGS.items():
        value = entry.get(setting, defaults.get(setting))
        values[setting] = _from_flags(config, attributes) if value is None else value
    for key in OWN_KEYS:
        value = entry.get(key, defaults.get(key))
        if value is not None:
            values[key] = value
    rm_type = values.get("rm_type")
    if rm_type is not None:
        from miles_host.rewards.hub import rm_types

        if str(rm_type).strip() not in rm_types():
            raise ValueError(f"{where} {values['name']}: rm_type {rm_type!r} is not one of slime's: {', '.join(rm_types())}")
    if not isinstance(values.get("metadata_overrides", {}), dict):
        raise ValueError(f"{where} {values['name']}: metadata_overrides must be a mapping")
    if int(values["n_samples_per_eval_prompt"]) < 1:
        raise ValueError(f"{where} {values['name']}: n_samples_per_eval_prompt must be >= 1")
    return EvalDataset(**{key: value for key, value in values.items() if value is not None})


def load_eval_config(config: Any) -> list[EvalDataset]:
    """The data sets of ``--eval-config`` (ValueError naming the file and the problem)."""
    import yaml

    path = Path(config.eval_config)
    where = f"--eval-config {path}"
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ValueError(f"{where}: cannot read it ({error.strerror or error})") from error
    except yaml.YAMLError as error:
        raise ValueError(f"{where}: not valid YAML ({error})") from error
    if not isinstance(document, dict):
        raise ValueError(f"{where} must hold a mapping at the root")
    section = document.get("eval", document)
    if not isinstance(section, dict):
        raise ValueError(f"{where} must define an `eval` mapping or be one")
    defaults = section.get("defaults") or {}
    datasets = section.get("datasets")
    if isinstance(datasets, dict):
        datasets = [{"name": name, **(body or {})} for name, body in datasets.items()]
    if not datasets or not isinstance(datasets, list) or not all(isinstance(d, dict) for d in datasets):
        raise ValueError(f"{where} defines no data sets under eval.datasets (a list of mappings with name and path)")
    if not isinstance(defaults, dict):
        raise ValueError(f"{where}: eval.defaults must be a mapping")
    resolved = [resolve(config, entry, defaults, where) for entry in datasets]
    names = [dataset.name for dataset in resolved]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: data set names repeat: {names}")
    return resolved


def eval_datasets(config: Any) -> list[EvalDataset]:
    """The evaluation data sets: ``--eval-config``'s, else one per ``--eval-prompt-data`` pair."""
    if getattr(config, "eval_config", None):
        return load_eval_config(config)
    pairs = config.eval_prompt_data or []
    return [resolve(config, {"name": name, "path": path}, {}, "--eval-prompt-data")
            for name, path in zip(pairs[::2], pairs[1::2])]
