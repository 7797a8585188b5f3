"""The inputs every ``miles run`` needs (a model directory, prompts, a reward), for
tests of flags that never get to load them: ``--dry-run`` and refused settings.

The model directory holds only a ``config.json`` (what the validation stage reads: the
shipped quickstart model's, or an MoE variant of it); a test that trains builds a real
tiny checkpoint instead.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

QUICKSTART_CONFIG = Path(__file__).resolve().parents[1] / "miles_host" / "quickstart" / "model" / "config.json"
#: what turns the quickstart's dense Qwen3 into a Qwen3-MoE (4 experts, top-2, every layer)
MOE_FIELDS = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}

_FOLDER: Path | None = None


def write_model_config(folder: Path, moe: bool = False) -> Path:
    """``folder/config.json``: the quickstart model's config (``moe``: its MoE variant)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads(QUICKSTART_CONFIG.read_text())
    (folder / "config.json").write_text(json.dumps({**config, **(MOE_FIELDS if moe else {})}))
    return folder


def run_input_folder() -> Path:
    """A folder (one per test process) with ``model/`` and ``moe_model/`` configs and ``prompts.jsonl``."""
    global _FOLDER
    if _FOLDER is None:
        _FOLDER = Path(tempfile.mkdtemp(prefix="miles-run-inputs-"))
        atexit.register(shutil.rmtree, _FOLDER, True)
        write_model_config(_FOLDER / "model")
        write_model_config(_FOLDER / "moe_model", moe=True)
        (_FOLDER / "prompts.jsonl").write_text('{"input": "1+1=", "label": "2"}\n')
    return _FOLDER


def run_inputs(moe: bool = False) -> list[str]:
    """``--hf-checkpoint DIR --prompt-data FILE --rm-type exact --n-samples-per-prompt 2`` (a group to
    compare within, as the default estimator needs); ``moe``: an MoE model's directory."""
    folder = run_input_folder()
    return ["--hf-checkpoint", str(folder / ("moe_model" if moe else "model")),
            "--prompt-data", str(folder / "prompts.jsonl"), "--rm-type", "exact", "--n-samples-per-prompt", "2"]
