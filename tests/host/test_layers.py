"""The layer rules, read from the imports (ast) of every module.

kernels <- models <- rollout / trainer <- loop <- cli: a kernel imports nothing from
the models or the rollout engine, a model nothing from the rollout engine; plugins use
public host modules only; and no import inside a function hides an import cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOST = ROOT / "miles_host"


def module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


HOST_MODULES = {module_name(path, ROOT): path for path in HOST.rglob("*.py")}


def imports(path: Path) -> list[tuple[str, str | None, bool]]:
    """``(module, imported name or None, inside a function?)`` for every import of ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(inner) for inner in ast.walk(node) if inner is not node)
    found = []
    for node in ast.walk(tree):
        lazy = id(node) in in_function
        if isinstance(node, ast.Import):
            found += [(alias.name, None, lazy) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.module, alias.name, lazy) for alias in node.names]
    return found


def host_targets(module: str, name: str | None, importer: str = "") -> list[str]:
    """The host modules an import runs: the module (or the submodule it names) and the
    packages above it that ``importer`` is not itself inside (a module of a package that
    is still initialising imports its siblings fine)."""
    target = f"{module}.{name}" if name and f"{module}.{name}" in HOST_MODULES else module
    if target not in HOST_MODULES:
        return []
    parts = target.split(".")
    packages = [".".join(parts[:i]) for i in range(1, len(parts))]
    return [p for p in packages if p in HOST_MODULES and not importer.startswith(p + ".")] + [target]


def top_level_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in HOST_MODULES}
    for name, path in HOST_MODULES.items():
        for module, imported, lazy in imports(path):
            if not lazy:
                graph[name].update(t for t in host_targets(module, imported, name) if t != name)
    return graph


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return False


@pytest.mark.parametrize(
    "layer, forbidden",
    [
        ("miles_host.kernels", ("miles_host.models", "miles_host.rollout")),
        ("miles_host.models", ("miles_host.rollout",)),
    ],
)
def test_lower_layers_import_nothing_from_higher_ones(layer, forbidden):
    bad = [
        f"{name} imports {module}{'.' + imported if imported else ''}"
        for name, path in HOST_MODULES.items() if name == layer or name.startswith(layer + ".")
        for module, imported, _ in imports(path)
        if any(t == f or t.startswith(f + ".") for t in host_targets(module, imported) for f in forbidden)
    ]
    assert bad == []


def test_plugins_import_only_public_host_modules_and_names():
    bad = []
    for path in (ROOT / "plugins").rglob("*.py"):
        if "egg-info" in str(path):
            continue
        for module, imported, _ in imports(path):
            if not module.startswith("miles_host"):
                continue
            private_module = any(part.startswith("_") and part != "__init__" for part in module.split("."))
            private_name = imported is not None and imported.startswith("_") and not imported.startswith("__")
            if private_module or private_name:
                bad.append(f"{path.relative_to(ROOT)}: from {module} import {imported}")
    assert bad == []


def test_no_import_inside_a_function_hides_a_cycle():
    """An import inside a function that the imported module's own top-level imports lead
    back from would be a cycle; such imports exist only to dodge it."""
    graph = top_level_graph()
    cycles = []
    for name, path in HOST_MODULES.items():
        for module, imported, lazy in imports(path):
            if not lazy:
                continue
            for target in host_targets(module, imported, name):
                if target != name and not name.startswith(target + ".") and reaches(graph, target, name):
                    cycles.append(f"{name} -> {target} (inside a function) -> ... -> {name}")
    assert cycles == []


def test_the_named_cycles_are_gone():
    graph = top_level_graph()
    assert "miles_host.loop" in graph["miles_host.distributed.launcher"]
    assert not reaches(graph, "miles_host.loop", "miles_host.distributed.launcher")
    assert not reaches(graph, "miles_host.kernels.paged_attention", "miles_host.rollout.attention")
    for name in graph:
        if name.startswith("miles_host.kernels"):
            assert not any(t.startswith("miles_host.models") for t in graph[name]), name
