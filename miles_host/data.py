"""Prompt data: jsonl or parquet records -> prompts, labels, metadata.

``PromptDataset`` serves batches in epochs (shuffled per epoch with
``--rollout-seed`` when ``--rollout-shuffle``) and keeps its position
(epoch, offset) so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass
class PromptRecord:
    """One prompt of the data set."""

    prompt: str | list[dict]
    label: Any
    metadata: dict
    index: int


def read_records(path: str) -> list[dict]:
    """All records of a .jsonl or .parquet file; clear errors for missing files
    and malformed lines (with the line number)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"prompt data file {path} does not exist")
    if file.suffix == ".parquet":
        try:
            import pyarrow.parquet as parquet
        except ImportError as error:
            raise ValueError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from error
        return parquet.read_table(file).to_pylist()
    records = []
    with file.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: malformed JSON line: {error.msg}") from error
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_number}: each line must be a JSON object")
            records.append(record)
    if not records:
        raise ValueError(f"prompt data file {path} holds no records")
    return records


def to_prompt_records(
    records: list[dict], path: str, input_key: str, label_key: str | None, metadata_key: str
) -> list[PromptRecord]:
    """Pick the prompt, label and metadata of every record by key."""
    prompts = []
    for index, record in enumerate(records):
        if input_key not in record:
            raise ValueError(
                f"{path}: record {index + 1} has no key {input_key!r} (keys: {sorted(record)}); "
                "set --input-key to the prompt's key"
            )
        if label_key is not None and label_key not in record:
            raise ValueError(f"{path}: record {index + 1} has no label key {label_key!r}; check --label-key")
        label = record.get(label_key) if label_key else None
        prompts.append(PromptRecord(record[input_key], label, dict(record.get(metadata_key) or {}), index))
    return prompts


class PromptDataset:
    """Epoch-wise batches of prompts with a resumable position."""

    def __init__(self, prompts: list[PromptRecord], shuffle: bool, seed: int):
        if not prompts:
            raise ValueError("the prompt data set is empty (after filtering by --rollout-max-prompt-len?)")
        self.prompts = prompts
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self._order = self._order_of(0)

    @classmethod
    def from_file(
        cls,
        path: str,
        input_key: str,
        label_key: str | None,
        metadata_key: str,
        shuffle: bool,
        seed: int,
        keep: Callable[[PromptRecord], bool] | None = None,
    ) -> "PromptDataset":
        """Load ``path``; ``keep`` filters prompts (e.g. by token length)."""
        prompts = to_prompt_records(read_records(path), path, input_key, label_key, metadata_key)
        if keep is not None:
            prompts = [p for p in prompts if keep(p)]
        return cls(prompts, shuffle, seed)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self, size: int) -> list[PromptRecord]:
        """The next ``size`` prompts, wrapping into the next epoch."""
        batch = []
        while len(batch) < size:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._order_of(self.epoch)
            batch.append(self.prompts[self._order[self.offset]])
            self.offset += 1
        return batch

    def state_dict(self) -> dict:
        """Position for checkpoints."""
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position saved by :meth:`state_dict`."""
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._order_of(self.epoch)
