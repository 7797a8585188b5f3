"""Bad prompt data is refused at load, naming the file, line and flag, before any rollout."""

from __future__ import annotations

import json

import pytest

from miles_host.cli.main import main
from miles_host.data import PromptDataset, PromptRecord
from tests.loop.conftest import base_args


def _write(path, lines):
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def _run_fails(tiny_task, tmp_path, capsys, data, *extra) -> str:
    model, _ = tiny_task
    out = tmp_path / "o"
    assert main(base_args(model, data, out, "--num-rollout", "1", *extra)) == 2
    assert not (out / "metrics.jsonl").exists()  # refused before the first rollout
    return capsys.readouterr().err


def test_a_prompt_that_is_a_number_names_the_line(tiny_task, tmp_path, capsys):
    data = _write(tmp_path / "d.jsonl", [{"input": "1+1=", "label": "2"}, {"input": 7, "label": "7"}])
    err = _run_fails(tiny_task, tmp_path, capsys, data)
    assert "d.jsonl:2" in err and "'input' is int" in err and "--input-key" in err, err


def test_a_chat_prompt_without_apply_chat_template_is_refused_at_load(tiny_task, tmp_path, capsys):
    chat = [{"role": "user", "content": "1+1="}]
    data = _write(tmp_path / "d.jsonl", [{"input": "1+1=", "label": "2"}] * 3 + [{"input": chat, "label": "2"}])
    err = _run_fails(tiny_task, tmp_path, capsys, data)
    assert "d.jsonl:4" in err and "--apply-chat-template" in err, err


def test_non_utf8_bytes_name_the_file_and_line(tiny_task, tmp_path, capsys):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"input": "1+1=", "label": "2"}\n{"input": "caf\xe9", "label": "2"}\n')
    err = _run_fails(tiny_task, tmp_path, capsys, data)
    assert "latin1.jsonl:2" in err and "UTF-8" in err and "0xe9" in err, err


def test_a_directory_as_prompt_data_is_called_a_directory(tiny_task, tmp_path, capsys):
    (tmp_path / "folder").mkdir()
    err = _run_fails(tiny_task, tmp_path, capsys, tmp_path / "folder")
    assert "--prompt-data" in err and "is a directory" in err and "does not exist" not in err, err


def test_eval_files_are_checked_at_start(tiny_task, tmp_path, capsys):
    model, data = tiny_task
    bad = _write(tmp_path / "eval.jsonl", [{"input": "1+1=", "label": "2"}, {"input": None, "label": "2"}])
    err = _run_fails(tiny_task, tmp_path, capsys, data, "--eval-prompt-data", "held_out", str(bad),
                     "--eval-interval", "1")
    assert "eval.jsonl:2" in err, err
    err = _run_fails(tiny_task, tmp_path, capsys, data, "--eval-prompt-data", "held_out", str(tmp_path / "none.jsonl"))
    assert "--eval-prompt-data" in err and "none.jsonl does not exist" in err, err


def test_chat_prompts_are_accepted_with_apply_chat_template(tmp_path):
    chat = [{"role": "user", "content": "1+1="}]
    path = _write(tmp_path / "d.jsonl", [{"input": chat, "label": "2", "metadata": {"k": [1, 2]}}])
    dataset = PromptDataset.from_file(str(path), "input", "label", "metadata", False, 0, apply_chat_template=True)
    assert dataset.prompts[0].prompt == chat and dataset.prompts[0].metadata == {"k": [1, 2]}
    with pytest.raises(ValueError, match="item 0 is not a chat message"):
        PromptDataset.from_file(str(_write(tmp_path / "e.jsonl", [{"input": ["hi"]}])), "input", None, "metadata",
                                False, 0, apply_chat_template=True)


def test_prompt_records_are_compact(tmp_path):
    """Loading holds at most 3.5x the file in memory at the peak (measured on these records:
    3.0x; 10.0x when every record was read into a dict before any was converted)."""
    import tracemalloc

    lines = [{"input": f"What is {i} + {2 * i}? Answer in a box.", "label": str(3 * i),
              "metadata": {"source": "synthetic", "id": i}} for i in range(20000)]
    path = _write(tmp_path / "big.jsonl", lines)
    tracemalloc.start()
    try:
        dataset = PromptDataset.from_file(str(path), "input", "label", "metadata", False, 0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3.5 * path.stat().st_size, peak / path.stat().st_size
    assert dataset.prompts[5] == PromptRecord(lines[5]["input"], "15", {"source": "synthetic", "id": 5}, 5)
    served = dataset.prompts[5].metadata
    served["added"] = 1  # a consumer's change does not reach the data set
    assert dataset.prompts[5].metadata == {"source": "synthetic", "id": 5}


# -- output paths: checked before the run starts ---------------------------------------


def _refused(tiny_task, tmp_path, capsys, *extra) -> str:
    model, data = tiny_task
    out = tmp_path / "o"
    assert main(base_args(model, data, out, "--num-rollout", "1", *extra)) == 2
    assert not (out / "metrics.jsonl").exists()
    return capsys.readouterr().err


def test_save_under_a_file_is_refused_at_start(tiny_task, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    err = _refused(tiny_task, tmp_path, capsys, "--save", str(tmp_path / "a_file" / "ckpt"))
    assert "--save" in err and "a_file is a file" in err, err


def test_save_hf_with_an_unknown_key_lists_the_keys(tiny_task, tmp_path, capsys):
    err = _refused(tiny_task, tmp_path, capsys, "--save-hf", str(tmp_path / "hf_{step}"))
    assert "--save-hf" in err and "{step}" in err and "{rollout_id}" in err, err


def test_a_malformed_save_hf_template_names_the_flag(tiny_task, tmp_path, capsys):
    err = _refused(tiny_task, tmp_path, capsys, "--save-hf", str(tmp_path / "x_{"))
    assert "--save-hf" in err and "not a valid template" in err, err


def test_an_output_dir_that_cannot_be_created_names_the_flag(tiny_task, tmp_path, capsys):
    model, data = tiny_task
    (tmp_path / "a_file").write_text("x")
    assert main(base_args(model, data, tmp_path / "a_file" / "out", "--num-rollout", "1")) == 2
    err = capsys.readouterr().err
    assert "--output-dir" in err and "cannot be created" in err and "Traceback" not in err, err


def test_save_hf_with_rollout_id_writes_where_the_template_says(tiny_task, tmp_path):
    model, data = tiny_task
    assert main(base_args(model, data, tmp_path / "o", "--num-rollout", "1",
                          "--save-hf", str(tmp_path / "hf_{rollout_id}"))) == 0
    assert (tmp_path / "hf_0" / "config.json").is_file()


def test_dump_rollouts_on_a_full_disk_warns_and_the_run_continues(tiny_task, tmp_path, capsys, monkeypatch):
    import errno
    import pathlib

    model, data = tiny_task
    out = tmp_path / "o"
    real_open = pathlib.Path.open

    def full_disk(self, mode="r", *args, **kwargs):
        if self.parent.name == "rollouts" and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", full_disk)
    assert main(base_args(model, data, out, "--num-rollout", "2", "--dump-rollouts")) == 0
    err = capsys.readouterr().err
    assert "--dump-rollouts could not write" in err and "rollout_00000.jsonl" in err and "No space left" in err, err
    assert [json.loads(line)["rollout_id"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1]
