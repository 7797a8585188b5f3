"""Prompt data: jsonl and parquet, keys, shuffling and resumable positions."""

from __future__ import annotations

import json

import pytest

from miles_host.data import PromptDataset


def _records(n):
    return [{"question": f"{i}+1=", "answer": str(i + 1), "metadata": {"i": i}} for i in range(n)]


def test_parquet_and_jsonl_give_the_same_prompts(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    records = _records(5)
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    parquet.write_table(pyarrow.Table.from_pylist(records), tmp_path / "p.parquet")
    loaded = [PromptDataset.from_file(str(tmp_path / f"p.{ext}"), "question", "answer", "metadata", False, 0)
              for ext in ("jsonl", "parquet")]
    for a, b in zip(*(d.prompts for d in loaded)):
        assert (a.prompt, a.label, a.metadata) == (b.prompt, b.label, b.metadata)


def test_shuffle_is_seeded_per_epoch_and_the_position_resumes(tmp_path):
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in _records(6)) + "\n")
    make = lambda: PromptDataset.from_file(str(tmp_path / "p.jsonl"), "question", "answer", "metadata", True, 7)  # noqa: E731
    first = make()
    order = [p.index for p in first.next_batch(4)]
    state = first.state_dict()
    rest = [p.index for p in first.next_batch(5)]  # wraps into epoch 1, reshuffled
    assert sorted(order + rest[:2]) == list(range(6)) and first.epoch == 1
    resumed = make()
    resumed.load_state_dict(state)
    assert [p.index for p in resumed.next_batch(5)] == rest
    assert [p.index for p in make().next_batch(4)] == order  # same seed, same order
