"""The inputs every ``miles run`` needs (a model directory, prompts, a reward), for
tests of flags that never get to load them: ``--dry-run`` and refused settings.

The model directory holds only a ``config.json`` (what the validation stage reads);
a test that trains builds a real tiny checkpoint instead.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

_FOLDER: Path | None = None


def run_input_folder() -> Path:
    """A folder (one per test process) with ``model/config.json`` and ``prompts.jsonl``."""
    global _FOLDER
    if _FOLDER is None:
        _FOLDER = Path(tempfile.mkdtemp(prefix="miles-run-inputs-"))
        atexit.register(shutil.rmtree, _FOLDER, True)
        (_FOLDER / "model").mkdir()
        (_FOLDER / "model" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        (_FOLDER / "prompts.jsonl").write_text('{"input": "1+1=", "label": "2"}\n')
    return _FOLDER


def run_inputs() -> list[str]:
    """``--hf-checkpoint DIR --prompt-data FILE --rm-type exact``."""
    folder = run_input_folder()
    return ["--hf-checkpoint", str(folder / "model"), "--prompt-data", str(folder / "prompts.jsonl"),
            "--rm-type", "exact"]
