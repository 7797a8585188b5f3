"""The run's tokenizer, refused when it cannot encode text.

transformers builds a tokenizer even from a directory without tokenizer files, with an
empty vocabulary: every prompt then becomes ``[]``, every sample fails and nothing
trains. :func:`load_tokenizer` checks that a probe text encodes to some token ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: what an HF model directory holds when it has a tokenizer (one of them is enough)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer_config.json")
_PROBE = "The answer is 42."


def load_tokenizer(path: str, flag: str = "--hf-checkpoint") -> Any:
    """``AutoTokenizer.from_pretrained(path)``; ValueError naming ``flag`` when it encodes
    nothing (no tokenizer files, or an empty vocabulary)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer(_PROBE, add_special_tokens=False)["input_ids"]:
        present = [name for name in TOKENIZER_FILES if (Path(path) / name).is_file()]
        found = f"it has {', '.join(present)}" if present else f"it has none of {', '.join(TOKENIZER_FILES)}"
        raise ValueError(
            f"{flag} {path}: the tokenizer there is empty (it encodes {_PROBE!r} to no tokens, so every prompt "
            f"would be empty); {found}. Copy the tokenizer files of the model into that directory"
        )
    return tokenizer
