"""Finding, selecting and registering plugins.

Load order (tox's and pytest's model): the host's built-in plugins first, then
every distribution's entry point in the group ``miles.plugins``. Every entry
point is imported (so a broken plugin is reported even when not selected, and
its flags parse), but only these are registered with pluggy:

- built-ins (unless disabled with ``-p no:NAME``),
- plugins marked ``always_active = True`` (model families),
- plugins named in ``--plugins`` / ``MILES_PLUGINS``,
- plugins whose ``miles_activate(args)`` answers True for the parsed flags.

Errors say which plugin, which distribution and what to do.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import inspect
import os
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Iterable, Sequence

import pluggy
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import Version

from miles_host import __version__, hookspecs
from miles_host.records import REGISTRATION_HOOKS, ModelFamily
from miles_host.registry import DuplicateNameError, ModelFamilyRegistry, Registry

ENTRY_POINT_GROUP = "miles.plugins"
HOST_DISTRIBUTION = "miles-host"

#: The host's own defaults, registered first, in this order.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("builtin-precision", "miles_host.builtin.precision"),
    ("builtin-rewards", "miles_host.builtin.rewards"),
    ("builtin-advantages", "miles_host.builtin.advantages"),
    ("builtin-corrections", "miles_host.builtin.corrections"),
    ("builtin-rollout", "miles_host.builtin.rollout"),
    ("builtin-train", "miles_host.builtin.train"),
    ("builtin-weight-sync", "miles_host.builtin.weight_sync"),
    ("builtin-loggers", "miles_host.builtin.loggers"),
    ("builtin-distributed", "miles_host.distributed.plugin"),
)

#: registry attribute name -> (registration hook, human-readable kind)
REGISTRY_KINDS: dict[str, tuple[str, str]] = {
    "precisions": ("miles_register_precisions", "precision"),
    "rollout_backends": ("miles_register_rollout_backends", "rollout backend"),
    "decoding_strategies": ("miles_register_decoding_strategies", "decoding strategy"),
    "corrections": ("miles_register_corrections", "correction"),
    "model_families": ("miles_register_model_families", "model family"),
    "weight_sync_transports": ("miles_register_weight_sync_transports", "weight-sync transport"),
    "reward_functions": ("miles_register_reward_functions", "reward function"),
    "advantage_estimators": ("miles_register_advantage_estimators", "advantage estimator"),
    "loss_terms": ("miles_register_loss_terms", "loss term"),
    "train_backends": ("miles_register_train_backends", "training backend"),
    "loggers": ("miles_register_loggers", "logger"),
    "commands": ("miles_register_commands", "command"),
    "checkpoint_converters": ("miles_register_checkpoint_converters", "checkpoint converter"),
}
assert {hook for hook, _ in REGISTRY_KINDS.values()} == set(REGISTRATION_HOOKS)


class PluginError(Exception):
    """A plugin problem the user must fix; ``exit_code`` for the CLI."""

    exit_code = 1


class UnknownPluginError(PluginError):
    """``--plugins`` names a plugin that is not installed."""

    exit_code = 2


@dataclass
class PluginInfo:
    """What the host knows about one plugin, for ``miles plugins`` and errors."""

    name: str
    distribution: str
    version: str
    module_name: str
    builtin: bool = False
    module: ModuleType | None = None
    always_active: bool = False
    status: str = "available"  # available | active | failed | disabled
    error: str | None = None
    requires_host: str | None = None

    @property
    def hooks(self) -> list[str]:
        """Names of the hooks this plugin implements."""
        if self.module is None:
            return []
        return sorted(name for name in dir(self.module) if name.startswith("miles_") and callable(getattr(self.module, name)))

    def to_dict(self) -> dict[str, Any]:
        """JSON form for ``miles plugins --json``."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "module": self.module_name,
            "builtin": self.builtin,
            "always_active": self.always_active,
            "status": self.status,
            "error": self.error,
            "requires_host": self.requires_host,
            "hooks": self.hooks,
        }


class _MilesPluggyManager(pluggy.PluginManager):
    """Takes every ``miles_*`` callable as a hook implementation, marked or not
    (pytest's rule), so ``check_pending`` catches misspelled hook names."""

    def parse_hookimpl_opts(self, plugin: Any, name: str):  # type: ignore[override]
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith("miles_"):
            attr = getattr(plugin, name, None)
            if inspect.isroutine(attr):
                return {}
        return opts


@dataclass
class Registries:
    """One registry per record kind, filled by the active plugins."""

    precisions: Registry = field(default_factory=lambda: Registry("precision"))
    rollout_backends: Registry = field(default_factory=lambda: Registry("rollout backend"))
    decoding_strategies: Registry = field(default_factory=lambda: Registry("decoding strategy"))
    corrections: Registry = field(default_factory=lambda: Registry("correction"))
    model_families: ModelFamilyRegistry = field(default_factory=ModelFamilyRegistry)
    weight_sync_transports: Registry = field(default_factory=lambda: Registry("weight-sync transport"))
    reward_functions: Registry = field(default_factory=lambda: Registry("reward function"))
    advantage_estimators: Registry = field(default_factory=lambda: Registry("advantage estimator"))
    loss_terms: Registry = field(default_factory=lambda: Registry("loss term"))
    train_backends: Registry = field(default_factory=lambda: Registry("training backend"))
    loggers: Registry = field(default_factory=lambda: Registry("logger"))
    commands: Registry = field(default_factory=lambda: Registry("command"))
    checkpoint_converters: Registry = field(default_factory=lambda: Registry("checkpoint converter"))


def parse_plugin_names(values: Iterable[str] | None) -> list[str]:
    """``["fp8,r3", "spec"]`` -> ``["fp8", "r3", "spec"]``."""
    names: list[str] = []
    for value in values or ():
        names.extend(part.strip() for part in str(value).split(",") if part.strip())
    return names


class MilesPluginManager:
    """The host's plugin manager: discovery, selection, registries, hook relay."""

    def __init__(self) -> None:
        self.pm = _MilesPluggyManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.duplicates: dict[str, list[PluginInfo]] = {}
        self._registries: Registries | None = None
        self.discovered = False

    @property
    def hook(self) -> Any:
        """The pluggy hook relay (``manager.hook.miles_configure(config=...)``)."""
        return self.pm.hook

    # -- discovery -----------------------------------------------------------

    def discover(self, entry_points: Iterable[metadata.EntryPoint] | None = None) -> None:
        """Import the built-ins and every ``miles.plugins`` entry point."""
        for name, module_name in BUILTIN_PLUGINS:
            info = PluginInfo(name, HOST_DISTRIBUTION, __version__, module_name, builtin=True)
            info.module = importlib.import_module(module_name)
            self.plugins[name] = info
        if entry_points is None:
            entry_points = metadata.entry_points(group=ENTRY_POINT_GROUP)
        for entry_point in entry_points:
            self._discover_entry_point(entry_point)
        self.discovered = True

    def _discover_entry_point(self, entry_point: metadata.EntryPoint) -> None:
        dist = entry_point.dist
        dist_name = dist.metadata["Name"] if dist is not None else "(unknown distribution)"
        version = dist.version if dist is not None else "?"
        info = PluginInfo(entry_point.name, dist_name, version, entry_point.value)
        if entry_point.name in self.plugins:
            first = self.plugins[entry_point.name]
            self.duplicates.setdefault(entry_point.name, [first]).append(info)
            message = (
                f"two distributions provide a plugin named {entry_point.name!r}: "
                f"{first.distribution} and {dist_name}; uninstall one of them"
            )
            first.status, first.error = "failed", message
            return
        self.plugins[entry_point.name] = info
        info.requires_host = _host_requirement(dist)
        if info.requires_host is not None:
            try:
                spec = Requirement(f"{HOST_DISTRIBUTION}{info.requires_host}").specifier
            except InvalidRequirement:
                spec = None
            if spec is not None and not spec.contains(Version(__version__), prereleases=True):
                info.status = "failed"
                info.error = (
                    f"plugin {info.name!r} ({dist_name} {version}) requires miles-host{info.requires_host}, "
                    f"but this host is {__version__}; install a matching version of {dist_name}"
                )
                return
        try:
            info.module = entry_point.load()
        except Exception as error:  # a broken plugin must not take the host down
            info.status = "failed"
            info.error = f"import of {entry_point.value} failed: {type(error).__name__}: {error}"
            return
        info.always_active = bool(getattr(info.module, "always_active", False))

    def add_inline_plugin(self, plugin: Any, name: str, distribution: str = "(inline)") -> None:
        """Add an object as a plugin that is always active (tests, embedding apps).

        Call before :meth:`activate`; the object's ``miles_*`` attributes are its hooks.
        """
        if name in self.plugins:
            raise PluginError(f"a plugin named {name!r} is already known ({self.plugins[name].distribution})")
        info = PluginInfo(name, distribution, "", repr(plugin), module=plugin, always_active=True)
        self.plugins[name] = info

    # -- selection -----------------------------------------------------------

    def feature_plugin_names(self) -> list[str]:
        """Installed plugins a user selects by name (not built-ins, not always active)."""
        return sorted(n for n, p in self.plugins.items() if not p.builtin and not p.always_active)

    def call_each(self, hook_name: str, **kwargs: Any) -> dict[str, Any]:
        """Call ``hook_name`` on every importable plugin module, registered or not,
        returning ``{plugin name: answer}`` (used for flags and activation)."""
        answers = {}
        for name, info in self.plugins.items():
            function = getattr(info.module, hook_name, None) if info.module is not None else None
            if function is not None:
                answers[name] = function(**kwargs)
        return answers

    def activate(
        self,
        selected: Sequence[str] = (),
        disabled: Sequence[str] = (),
        args: Any | None = None,
    ) -> list[str]:
        """Register built-ins, always-active plugins, ``selected`` ones and the ones
        whose ``miles_activate(args)`` is True; return the active names.

        Raises :class:`UnknownPluginError` (exit code 2) for an unknown name and
        :class:`PluginError` for a selected plugin that failed to load or has a
        misspelled hook. Unselected broken plugins only warn.
        """
        if not self.discovered:
            self.discover()
        selected = parse_plugin_names(selected)
        disabled = set(parse_plugin_names(disabled))
        unknown = [name for name in [*selected, *disabled] if name not in self.plugins]
        if unknown:
            installed = ", ".join(sorted(self.plugins)) or "(none)"
            raise UnknownPluginError(
                f"unknown plugin(s) {', '.join(map(repr, unknown))}; installed plugins: {installed}. "
                "See `miles plugins`."
            )
        wanted = list(dict.fromkeys(selected))
        if args is not None:
            for name, answer in self.call_each("miles_activate", args=args).items():
                if answer and name not in wanted:
                    wanted.append(name)
        active: list[str] = []
        for name, info in self.plugins.items():
            is_wanted = info.builtin or info.always_active or name in wanted
            if name in disabled:
                info.status = "disabled"
                continue
            if info.status == "failed":
                if name in wanted:
                    raise PluginError(
                        f"plugin {name!r} from distribution {info.distribution} cannot be used: {info.error}"
                    )
                warnings.warn(f"plugin {name!r} ({info.distribution}) is not usable: {info.error}", stacklevel=2)
                continue
            if not is_wanted:
                continue
            self._register(info)
            active.append(name)
        self._check_pending()
        self._registries = None
        return active

    def _register(self, info: PluginInfo) -> None:
        try:
            self.pm.register(info.module, name=info.name)
        except (pluggy.PluginValidationError, ValueError) as error:
            info.status = "failed"
            info.error = str(error)
            raise PluginError(
                f"plugin {info.name!r} from distribution {info.distribution} has an invalid hook: {error}"
            ) from error
        info.status = "active"

    def _check_pending(self) -> None:
        known = {name for name in dir(hookspecs) if name.startswith("miles_")}
        for name, info in self.plugins.items():
            if info.status != "active":
                continue
            unknown = [hook for hook in info.hooks if hook not in known]
            if unknown:
                info.status = "failed"
                info.error = f"unknown hook(s) {unknown}"
                self.pm.unregister(name=name)
                raise PluginError(
                    f"plugin {name!r} from distribution {info.distribution} implements unknown hook(s) "
                    f"{', '.join(unknown)}; known hooks are listed in docs/hooks.md "
                    "(a misspelled name?)"
                )
        self.pm.check_pending()

    def call_isolated(self, hook_name: str, **kwargs: Any) -> list[str]:
        """Call every implementation of an observer hook (return values ignored) so
        that one plugin raising does not stop the others or the run: the error is
        warned with the plugin's name and distribution. Returns the failing plugins."""
        return self._call_each(hook_name, kwargs)[1]

    def _call_each(self, hook_name: str, kwargs: dict) -> tuple[list[Any], list[str]]:
        """Every implementation's result, each call isolated (see :meth:`call_isolated`); the failing plugins."""
        results, failed = [], []
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            try:
                results.append(impl.function(**{name: kwargs[name] for name in impl.argnames}))
            except Exception as error:  # noqa: BLE001 - isolate the plugin
                info = self.plugins.get(impl.plugin_name)
                where = f"{impl.plugin_name!r} ({info.distribution if info else '?'})"
                warnings.warn(f"plugin {where} failed in {hook_name}: {type(error).__name__}: {error}", stacklevel=3)
                failed.append(impl.plugin_name)
        return results, failed

    def rank_counters(self, config: Any) -> dict[str, float]:
        """This process's :func:`~miles_host.hookspecs.miles_rank_counters`, one dict (each plugin's
        call isolated, as in :meth:`call_isolated`)."""
        results, _ = self._call_each("miles_rank_counters", {"config": config})
        return sum_counters({str(key): float(value) for key, value in counts.items()}
                            for counts in results if counts is not None)

    def active_names(self) -> list[str]:
        """Names of the registered plugins, built-ins first."""
        return [name for name, info in self.plugins.items() if info.status == "active"]

    # -- registries ----------------------------------------------------------

    @property
    def registries(self) -> Registries:
        """Registries filled by the active plugins' registration hooks (cached)."""
        if self._registries is None:
            self._registries = self._build_registries()
        return self._registries

    def _build_registries(self) -> Registries:
        registries = Registries()
        for attribute, (hook_name, _kind) in REGISTRY_KINDS.items():
            registry = getattr(registries, attribute)
            caller = getattr(self.pm.hook, hook_name)
            # get_hookimpls() is in registration order (pluggy calls them LIFO), so
            # built-ins come first and a plugin's override=True record replaces them.
            for impl in caller.get_hookimpls():
                info = self.plugins.get(impl.plugin_name)
                distribution = info.distribution if info else impl.plugin_name
                try:
                    produced = impl.function() or ()
                except Exception as error:
                    raise PluginError(
                        f"plugin {impl.plugin_name!r} ({distribution}) failed in {hook_name}: "
                        f"{type(error).__name__}: {error}"
                    ) from error
                for record in produced:
                    try:
                        registry.add(record, impl.plugin_name, distribution)
                    except (DuplicateNameError, TypeError) as error:
                        raise PluginError(str(error)) from error
        return registries


def _host_requirement(dist: metadata.Distribution | None) -> str | None:
    """The version specifier a plugin distribution puts on miles-host, if any."""
    if dist is None:
        return None
    for text in dist.requires or ():
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.name.lower().replace("_", "-") == HOST_DISTRIBUTION and not requirement.marker:
            return str(requirement.specifier)
    return None


def create_plugin_manager(
    plugins: Sequence[str] = (),
    disabled: Sequence[str] = (),
    args: Any | None = None,
) -> MilesPluginManager:
    """Discover and activate plugins; ``MILES_PLUGINS`` adds to ``plugins``."""
    manager = MilesPluginManager()
    manager.discover()
    selected = [*parse_plugin_names([os.environ.get("MILES_PLUGINS", "")]), *parse_plugin_names(plugins)]
    manager.activate(selected=selected, disabled=disabled, args=args)
    return manager


_DEFAULT_MANAGER: MilesPluginManager | None = None


def default_plugin_manager() -> MilesPluginManager:
    """A process-wide manager with built-ins and always-active plugins (model
    families), for library use (``load_pretrained``) outside ``miles run``."""
    global _DEFAULT_MANAGER
    if _DEFAULT_MANAGER is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _DEFAULT_MANAGER = create_plugin_manager()
    return _DEFAULT_MANAGER


def load_registries() -> Registries:
    """Registries of the default plugin manager."""
    return default_plugin_manager().registries


def model_family_for(model_type: str) -> ModelFamily:
    """The model family handling ``model_type`` (ValueError lists supported ones)."""
    return load_registries().model_families.by_model_type(model_type)


def sum_counters(parts) -> dict[str, float]:
    """Key-wise sums of :func:`~miles_host.hookspecs.miles_rank_counters` dicts (of plugins or of ranks)."""
    total: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return total
