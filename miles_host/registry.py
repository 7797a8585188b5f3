"""Registries that plugins fill through the ``miles_register_*`` hooks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Iterator, TypeVar

from miles_host.records import ModelFamily, Record

R = TypeVar("R", bound=Record)


class DuplicateNameError(ValueError):
    """Two plugins registered a record of one kind under the same name."""


@dataclass(frozen=True)
class Entry(Generic[R]):
    """A record and who registered it."""

    record: R
    plugin: str
    distribution: str


class Registry(Generic[R]):
    """Name -> record for one kind of record (``kind`` is e.g. ``"reward function"``)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry[R]] = {}

    def add(self, record: R, plugin: str, distribution: str) -> None:
        """Add ``record``; a second record with the same name is an error unless it
        sets ``override=True`` and the first one is a host built-in."""
        if not isinstance(record, Record) or not record.name:
            raise TypeError(
                f"plugin {plugin!r} ({distribution}) registered {record!r} as a {self.kind}; "
                "registration hooks must return records from miles_host.records with a non-empty name"
            )
        missing = [name for name in record.required if not callable(getattr(record, name))]
        if missing:
            raise TypeError(
                f"plugin {plugin!r} ({distribution}) registered the {self.kind} {record.name!r} without "
                f"{' and '.join(missing)}: give {type(record).__name__}({', '.join(f'{m}=...' for m in missing)}) "
                "a callable (see miles_host.records and miles_host.protocols)"
            )
        existing = self._entries.get(record.name)
        if existing is not None:
            if record.override and existing.distribution == "miles-host":
                self._entries[record.name] = Entry(record, plugin, distribution)
                return
            raise DuplicateNameError(
                f"two plugins register a {self.kind} named {record.name!r}: "
                f"{existing.plugin!r} from distribution {existing.distribution!r} and "
                f"{plugin!r} from distribution {distribution!r}. Uninstall or disable one "
                f"(miles run -p no:NAME), or rename it."
            )
        self._entries[record.name] = Entry(record, plugin, distribution)

    def get(self, name: str) -> R:
        """The record called ``name``; a ValueError listing the known names otherwise."""
        entry = self._entries.get(name)
        if entry is None:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise ValueError(f"unknown {self.kind} {name!r}; known: {known}")
        return entry.record

    def entry(self, name: str) -> Entry[R]:
        """The :class:`Entry` (record + registering plugin) called ``name``."""
        self.get(name)
        return self._entries[name]

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[R]:
        return iter(entry.record for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)


class ModelFamilyRegistry(Registry[ModelFamily]):
    """Model families, also indexed by the HF ``model_type``s they claim."""

    def __init__(self, kind: str = "model family"):
        super().__init__(kind)
        self._by_type: dict[str, Entry[ModelFamily]] = {}

    def add(self, record: ModelFamily, plugin: str, distribution: str) -> None:
        for model_type in record.model_types:
            other = self._by_type.get(model_type)
            if other is not None:
                raise DuplicateNameError(
                    f"model_type {model_type!r} is claimed by model family {other.record.name!r} "
                    f"(plugin {other.plugin!r}, distribution {other.distribution!r}) and by "
                    f"{record.name!r} (plugin {plugin!r}, distribution {distribution!r})"
                )
        super().add(record, plugin, distribution)
        for model_type in record.model_types:
            self._by_type[model_type] = Entry(record, plugin, distribution)

    def by_model_type(self, model_type: str) -> ModelFamily:
        """The family handling HF ``model_type``; ValueError listing supported types."""
        entry = self._by_type.get(model_type)
        if entry is None:
            supported = ", ".join(sorted(self._by_type)) or "(none: is miles-models installed?)"
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported model types: {supported}. "
                "Install a model plugin that handles it (see README: writing a model plugin)."
            )
        return entry.record

    def model_types(self) -> list[str]:
        """All HF model types some family handles, sorted."""
        return sorted(self._by_type)
