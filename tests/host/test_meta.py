"""Meta-tests: every hook is documented (docs/hooks.md up to date) and tested."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

from miles_host import hookspecs

REPO = Path(__file__).resolve().parents[2]
HOOKS = [name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("miles_")]


def test_hooks_doc_is_generated_and_current():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_hooks_doc.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    text = (REPO / "docs" / "hooks.md").read_text()
    for name in HOOKS:
        heading = re.search(rf"^### {name}\((.*?)\)", text, re.M)
        assert heading, f"{name} has no heading in docs/hooks.md"
        documented = [p.split(":")[0].strip() for p in heading.group(1).split(",") if p.strip()]
        assert documented == list(inspect.signature(getattr(hookspecs, name)).parameters)


def test_every_hook_has_a_docstring_saying_when_it_fires():
    for name in HOOKS:
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        assert "Fires" in doc, f"{name}: docstring must say when it fires"


def test_every_hook_has_a_test():
    tested = set(re.findall(r"def test_(miles_\w+)\(", (REPO / "tests" / "host" / "test_hooks.py").read_text()))
    assert sorted(set(HOOKS) - tested) == []
