"""Prompt data: jsonl or parquet records -> prompts, labels, metadata.

``PromptDataset`` serves batches in epochs (shuffled per epoch with
``--rollout-seed`` when ``--rollout-shuffle``) and keeps its position
(epoch, offset) so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator


class PromptRecord:
    """One prompt of the data set. Compact, since a data set keeps one per line of its
    file: slots, and the metadata kept as its JSON text (decoded, a fresh dict, on
    each read of ``metadata``)."""

    __slots__ = ("prompt", "label", "index", "_metadata")

    def __init__(self, prompt: str | list[dict], label: Any, metadata: dict | None, index: int):
        self.prompt = prompt
        self.label = label
        self.index = index
        self._metadata: str | dict | None = None
        if metadata:
            try:
                self._metadata = json.dumps(metadata, separators=(",", ":"))
            except (TypeError, ValueError):  # values JSON cannot hold (parquet dates, ...): kept as they are
                self._metadata = dict(metadata)

    @property
    def metadata(self) -> dict:
        kept = self._metadata
        if kept is None:
            return {}
        return json.loads(kept) if isinstance(kept, str) else dict(kept)

    def __repr__(self) -> str:
        return f"PromptRecord(prompt={self.prompt!r}, label={self.label!r}, metadata={self.metadata!r}, index={self.index})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PromptRecord):
            return NotImplemented
        return (self.prompt, self.label, self.metadata, self.index) == (
            other.prompt, other.label, other.metadata, other.index)


def missing_data_file(path: str, flag: str) -> FileNotFoundError:
    """The error for a ``flag`` path that is not a readable file (a directory is named as one)."""
    file = Path(path)
    if file.is_dir():
        return FileNotFoundError(f"{flag} {path} is a directory; give a .jsonl or .parquet file")
    return FileNotFoundError(f"{flag}: prompt data file {path} does not exist")


def iter_records(path: str, flag: str = "--prompt-data") -> Iterator[tuple[str, dict]]:
    """``(where, record)`` for every record of a .jsonl or .parquet file, one at a
    time; ``where`` is ``path:line`` (jsonl) or ``path: row N`` (parquet). Clear
    errors, naming the file and line, for a missing file, a directory, malformed
    JSON, non-UTF-8 bytes and lines that are not JSON objects."""
    file = Path(path)
    if not file.is_file():
        raise missing_data_file(path, flag)
    if file.suffix == ".parquet":
        try:
            import pyarrow.parquet as parquet
        except ImportError as error:
            raise ValueError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from error
        row = 0
        for batch in parquet.ParquetFile(file).iter_batches():
            for record in batch.to_pylist():
                row += 1
                yield f"{path}: row {row}", record
        return
    with file.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{path}:{line_number}: not valid UTF-8 (byte 0x{raw[error.start]:02x} at column "
                    f"{error.start + 1}); {flag} files must be UTF-8 encoded"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: malformed JSON line: {error.msg}") from error
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_number}: each line must be a JSON object")
            yield f"{path}:{line_number}", record


def read_records(path: str, flag: str = "--prompt-data") -> list[dict]:
    """All records of a .jsonl or .parquet file (see :func:`iter_records`)."""
    records = [record for _, record in iter_records(path, flag)]
    if not records:
        raise ValueError(f"prompt data file {path} holds no records")
    return records


def check_prompt(prompt: Any, where: str, input_key: str, apply_chat_template: bool | None) -> None:
    """A prompt is a string, or (with ``--apply-chat-template``) a list of chat messages
    ``{"role": ..., "content": ...}``. ``apply_chat_template`` None: either is accepted."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list):
        for position, message in enumerate(prompt):
            if not (isinstance(message, dict) and "role" in message and "content" in message):
                raise ValueError(
                    f"{where}: prompt {input_key!r} is a list, but its item {position} is not a chat message "
                    f"{{'role': ..., 'content': ...}} (got {type(message).__name__})"
                )
        if apply_chat_template is False:
            raise ValueError(
                f"{where}: prompt {input_key!r} is a chat (a list of messages); add --apply-chat-template "
                "to format it with the tokenizer's chat template"
            )
        return
    raise ValueError(
        f"{where}: prompt {input_key!r} is {type(prompt).__name__} {str(prompt)[:40]!r}; expected a string "
        "(or a list of chat messages with --apply-chat-template); check --input-key"
    )


def read_tools(record: dict, tool_key: str, where: str) -> list[dict] | None:
    """The tool definitions of a record under ``tool_key`` (``--tool-key``): a list of OpenAI
    tool records, or that list as a JSON string (as slime's data sets store it); None when the
    record has no such key."""
    tools = record.get(tool_key)
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: tools {tool_key!r} is a string but not JSON: {error.msg}") from error
    if hasattr(tools, "tolist"):  # parquet list columns arrive as numpy arrays
        tools = tools.tolist()
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise ValueError(
            f"{where}: tools {tool_key!r} must be a list of tool definitions ({{'type': 'function', 'function': "
            f"{{'name', 'description', 'parameters'}}}}), got {type(tools).__name__}; check --tool-key"
        )
    return tools


def to_prompt_records(
    records: Iterable, path: str, input_key: str, label_key: str | None, metadata_key: str,
    apply_chat_template: bool | None = None, tool_key: str | None = None,
) -> list[PromptRecord]:
    """Pick the prompt, label and metadata of every record by key, checking the
    prompt's type (:func:`check_prompt`). ``records``: dicts, or ``(where, dict)``
    pairs as :func:`iter_records` yields them. With ``tool_key`` the record's tool
    definitions (:func:`read_tools`) go into its metadata as ``tools``."""
    prompts = []
    for index, item in enumerate(records):
        where, record = item if isinstance(item, tuple) else (f"{path}: record {index + 1}", item)
        if input_key not in record:
            raise ValueError(
                f"{where}: record {index + 1} has no key {input_key!r} (keys: {sorted(record)}); "
                "set --input-key to the prompt's key"
            )
        if label_key is not None and label_key not in record:
            raise ValueError(f"{where}: record {index + 1} has no label key {label_key!r}; check --label-key")
        prompt = record[input_key]
        check_prompt(prompt, where, input_key, apply_chat_template)
        label = record.get(label_key) if label_key else None
        metadata = record.get(metadata_key)
        if metadata is not None and not isinstance(metadata, dict):
            raise ValueError(f"{where}: metadata {metadata_key!r} must be a JSON object, got {type(metadata).__name__}")
        tools = read_tools(record, tool_key, where) if tool_key else None
        if tools is not None:
            metadata = {**(metadata or {}), "tools": tools}
        prompts.append(PromptRecord(prompt, label, metadata, index))
    if not prompts:
        raise ValueError(f"prompt data file {path} holds no records")
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
        apply_chat_template: bool | None = None,
        flag: str = "--prompt-data",
        tool_key: str | None = None,
    ) -> "PromptDataset":
        """Load ``path`` record by record (no second copy of the file's records);
        ``keep`` filters prompts (e.g. by token length); ``apply_chat_template``
        (``--apply-chat-template``) decides whether chat-list prompts are accepted;
        ``tool_key`` (``--tool-key``) puts each record's tools in its metadata."""
        prompts = to_prompt_records(iter_records(path, flag), path, input_key, label_key, metadata_key,
                                    apply_chat_template, tool_key)
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
