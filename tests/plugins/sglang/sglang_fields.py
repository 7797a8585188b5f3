"""SGLang's request field lists, read from its source with ``ast`` (nothing is imported:
SGLang's modules need CUDA-side packages this test machine does not have).

``python -m tests.plugins.sglang.sglang_fields SGLANG_SOURCE_DIR VERSION`` rewrites the
pinned copy ``data/sglang_fields.json``; ``SGLANG_SOURCE_DIR`` holds ``sglang/srt/...``
(an unpacked wheel, a checkout's ``python/``, or site-packages).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

PINNED = Path(__file__).parent / "data" / "sglang_fields.json"
GENERATE_REQ_INPUT = "sglang/srt/managers/io_struct.py"
SAMPLING_PARAMS = "sglang/srt/sampling/sampling_params.py"
#: SamplingParams fields after this comment are SGLang's own bookkeeping, not request keys
INTERNAL_MARKER = "# --- Internal fields"


def class_fields(path: Path, name: str, stop_marker: str | None = None) -> list[str]:
    """The annotated fields of class ``name`` in ``path``, in order (up to ``stop_marker``)."""
    source = path.read_text()
    lines = source.splitlines()
    stop_line = next((i + 1 for i, line in enumerate(lines) if stop_marker and stop_marker in line), None)
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [
                statement.target.id for statement in node.body
                if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and (stop_line is None or statement.lineno < stop_line)
            ]
    raise LookupError(f"class {name} is not in {path}")


def extract(root: Path) -> dict[str, list[str]]:
    """``{"GenerateReqInput": [...], "SamplingParams": [...]}`` from an SGLang source tree."""
    return {
        "GenerateReqInput": class_fields(root / GENERATE_REQ_INPUT, "GenerateReqInput"),
        "SamplingParams": class_fields(root / SAMPLING_PARAMS, "SamplingParams", INTERNAL_MARKER),
    }


def pinned() -> dict:
    return json.loads(PINNED.read_text())


if __name__ == "__main__":
    source_root, version = Path(sys.argv[1]), sys.argv[2]
    PINNED.write_text(json.dumps({"sglang_version": version, **extract(source_root)}, indent=1) + "\n")
    print(f"wrote {PINNED}")
