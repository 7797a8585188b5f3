"""Write docs/hooks.md from miles_host/hookspecs.py (run after changing a hook).

``python scripts/gen_hooks_doc.py`` rewrites the file; ``--check`` exits 1 when
it is out of date (the meta-test runs the same comparison).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from miles_host import hookspecs  # noqa: E402

CONCERNS = [
    ("Precision", ["miles_register_precisions", "miles_register_checkpoint_converters"]),
    ("Routing", ["miles_select_experts", "miles_experts_selected"]),
    ("Rollout", ["miles_register_rollout_backends", "miles_register_decoding_strategies"]),
    ("Correction", ["miles_register_corrections"]),
    ("Model family", ["miles_register_model_families"]),
    ("Weight sync", ["miles_register_weight_sync_transports"]),
    (
        "The loop",
        [
            "miles_register_reward_functions",
            "miles_register_advantage_estimators",
            "miles_register_loss_terms",
            "miles_register_train_backends",
            "miles_register_loggers",
            "miles_prepare_model",
            "miles_train_batch_prepared",
            "miles_rank_counters",
            "miles_step_end",
        ],
    ),
    (
        "Command line and configuration",
        ["miles_add_arguments", "miles_activate", "miles_configure", "miles_validate", "miles_process_start",
         "miles_register_commands"],
    ),
]


def hook_names() -> list[str]:
    """Every hook declared in hookspecs.py, in file order."""
    return [
        name
        for name, obj in inspect.getmembers(hookspecs, inspect.isfunction)
        if name.startswith("miles_")
    ]


def render() -> str:
    """The markdown of docs/hooks.md."""
    lines = [
        "# miles hooks",
        "",
        "Generated from `miles_host/hookspecs.py` by `python scripts/gen_hooks_doc.py`; do not edit by hand.",
        "",
        "A plugin is a module (or object) with functions named like these hooks; the",
        "`@hookimpl` marker from `miles_host.hookspecs` is optional. Registration hooks return",
        "records from `miles_host.records`, each with a `name`.",
        "",
    ]
    documented = [name for _, names in CONCERNS for name in names]
    missing = sorted(set(hook_names()) - set(documented))
    assert not missing, f"add {missing} to CONCERNS in scripts/gen_hooks_doc.py"
    for concern, names in CONCERNS:
        lines += [f"## {concern}", ""]
        for name in names:
            function = getattr(hookspecs, name)
            signature = str(inspect.signature(function)).replace("'", "").replace('"', "")
            opts = getattr(function, f"{hookspecs.PROJECT}_spec", {}) or {}
            firstresult = " (firstresult: stops at the first non-None answer)" if opts.get("firstresult") else ""
            lines += [f"### {name}{signature}{firstresult}", "", inspect.getdoc(function) or "", ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    path = REPO / "docs" / "hooks.md"
    text = render()
    if "--check" in sys.argv:
        if not path.exists() or path.read_text() != text:
            print("docs/hooks.md is out of date: run python scripts/gen_hooks_doc.py")
            return 1
        return 0
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
