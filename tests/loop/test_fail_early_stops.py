"""Stopping without losing work: SIGTERM / SIGHUP / Ctrl-C, a full disk, a shared --save,
leftover partial files, a reused --output-dir."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from miles_host.checkpoint import load_checkpoint
from miles_host.cli.main import main
from miles_host.run_control import SaveLock, Stopped, StopSignals
from tests.loop.conftest import base_args, read_metrics

REPO = Path(__file__).resolve().parents[2]


def _comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


@pytest.fixture
def stop_rewards(tmp_path, monkeypatch):
    """A reward with signal in each group that, while ``block`` exists, blocks in rollout 1
    after touching ``marker`` (the moment a test sends its signal)."""
    folder = tmp_path / "rewards"
    folder.mkdir()
    block, marker = tmp_path / "block", tmp_path / "marker"
    (folder / "stop_rewards.py").write_text(textwrap.dedent(
        f"""
        import pathlib
        import time

        def odd_first_char(sample, config):
            if sample.metadata["rollout_id"] == 1 and pathlib.Path({str(block)!r}).exists():
                pathlib.Path({str(marker)!r}).touch()
                time.sleep(120)
            return float(sample.response[:1] in ("1", "3", "5", "7", "9", "+"))
        """
    ))
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("stop_rewards", None)
    return folder, block, marker


@pytest.fixture
def one_thread():
    """The in-process runs use one thread, as the subprocess runs do (``OMP_NUM_THREADS=1``):
    a reduction split over another number of threads rounds differently."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _start(argv: list[str], reward_folder: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(reward_folder), str(REPO)]), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "miles_host.cli.main", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"the run ended early: {process.communicate()[1]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("the run never reached rollout 1")
        time.sleep(0.1)


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.slow)])  # one handler
def test_a_stop_signal_checkpoints_the_last_completed_rollout_and_resume_is_exact(
        tiny_task, tmp_path, stop_rewards, one_thread, signum):
    model, data = tiny_task
    folder, block, marker = stop_rewards
    reward = ("--custom-rm-path", "stop_rewards.odd_first_char")
    straight, first, resumed, ckpt = tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "ckpt"
    assert main(base_args(model, data, straight, "--num-rollout", "3", *reward)) == 0

    block.touch()
    process = _start(base_args(model, data, first, "--num-rollout", "3", *reward, "--save", str(ckpt)), folder)
    _wait_for(marker, process)
    os.kill(process.pid, signum)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, err
    name = signal.Signals(signum).name
    assert "saving checkpoint of rollout 0" in err and f"stopped by {name}" in err, err
    assert load_checkpoint(str(ckpt))["rollout_id"] == 0

    block.unlink()
    assert main(base_args(model, data, resumed, "--num-rollout", "3", *reward, "--load", str(ckpt))) == 0
    got = [_comparable(m) for m in read_metrics(first) + read_metrics(resumed)]
    expected = [_comparable(m) for m in read_metrics(straight)]
    assert [m["rollout_id"] for m in got] == [0, 1, 2]
    for want, have in zip(expected, got):
        assert want.keys() == have.keys()
        for key in want:
            assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key


def test_a_signal_during_a_save_waits_for_it():
    stops = StopSignals()
    with stops:
        with pytest.raises(Stopped) as raised:
            with stops.saving():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                finished = True  # the save went on to its end
        assert finished and raised.value.exit_code == 143
        with stops.saving(stopping=True):  # the run is already stopping: the save ends, nothing more
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_a_second_signal_during_the_final_save_waits_for_it(tiny_task, tmp_path, stop_rewards, monkeypatch, capsys):
    """SIGTERM in rollout 1, then another while rollout 0's checkpoint is written: the
    write completes, the run exits 143, the checkpoint loads."""
    import miles_host.loop as loop

    model, data = tiny_task
    folder, _, _ = stop_rewards
    (folder / "terminating_reward.py").write_text(textwrap.dedent(
        """
        import os
        import signal

        def terminate_in_second_rollout(sample, config):
            if sample.metadata["rollout_id"] == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            return 0.0
        """
    ))
    sys.modules.pop("terminating_reward", None)
    handler_before = signal.getsignal(signal.SIGTERM)  # another test's library (ray) may have set one
    real_save = loop.save_checkpoint

    def save_hit_by_a_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs here, in the middle of the save
        return real_save(*args, **kwargs)

    monkeypatch.setattr(loop, "save_checkpoint", save_hit_by_a_signal)
    ckpt = tmp_path / "ckpt"
    args = base_args(model, data, tmp_path / "o", "--num-rollout", "3", "--save", str(ckpt),
                     "--custom-rm-path", "terminating_reward.terminate_in_second_rollout")
    assert main(args) == 143
    err = capsys.readouterr().err
    assert "SIGTERM received while a checkpoint is being written" in err, err
    assert load_checkpoint(str(ckpt))["rollout_id"] == 0
    assert signal.getsignal(signal.SIGTERM) is handler_before  # the run's handlers are gone


@pytest.fixture
def interrupting_reward(tmp_path, monkeypatch):
    (tmp_path / "interrupting_reward.py").write_text(
        "def first_rollout(sample, config):\n    raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("interrupting_reward", None)
    return "interrupting_reward.first_rollout"


def test_ctrl_c_in_the_first_rollout_writes_no_checkpoint(tiny_task, tmp_path, interrupting_reward, capsys):
    model, data = tiny_task
    ckpt = tmp_path / "ckpt"
    assert main(base_args(model, data, tmp_path / "o", "--custom-rm-path", interrupting_reward,
                          "--save", str(ckpt))) == 130
    assert "no rollout completed, no checkpoint written" in capsys.readouterr().err
    assert not list(ckpt.glob("iter_*"))  # no iter_-000001


def _full_disk_after(calls: int):
    import torch

    real_save, seen = torch.save, {"n": 0}

    def save(obj, path, *args, **kwargs):
        seen["n"] += 1
        if seen["n"] > calls:
            Path(path).write_bytes(b"PK\x03\x04 half a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    return save


def test_a_full_disk_while_saving_names_the_disk_and_keeps_the_previous_checkpoint(
        tiny_task, tmp_path, capsys, monkeypatch):
    import torch

    model, data = tiny_task
    ckpt = tmp_path / "ckpt"
    monkeypatch.setattr(torch, "save", _full_disk_after(1))  # the save of rollout 0 succeeds, rollout 1's fails
    assert main(base_args(model, data, tmp_path / "o", "--num-rollout", "3", "--save", str(ckpt),
                          "--save-interval", "1")) == 1
    err = capsys.readouterr().err
    assert "checkpoint of rollout 1 was not written" in err and "No space left on device" in err, err
    assert "the disk mounted at" in err and "iter_0000001" in err, err
    assert "Traceback" not in err
    assert not list(ckpt.rglob("*.tmp")) and not (ckpt / "iter_0000001").exists()
    monkeypatch.undo()
    assert load_checkpoint(str(ckpt))["rollout_id"] == 0
    resumed = tmp_path / "r"
    assert main(base_args(model, data, resumed, "--num-rollout", "2", "--load", str(ckpt))) == 0
    assert [m["rollout_id"] for m in read_metrics(resumed)] == [1]


def test_a_full_disk_stops_the_run_instead_of_tearing_metrics(tiny_task, tmp_path, capsys, monkeypatch):
    from miles_host.logging_backends import JsonlLogger

    model, data = tiny_task
    out = tmp_path / "o"
    writes = {"n": 0}

    def half_then_full(handle, data_bytes):
        writes["n"] += 1
        if writes["n"] == 2:
            handle.write(data_bytes[: len(data_bytes) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        handle.write(data_bytes)

    monkeypatch.setattr(JsonlLogger, "_write", staticmethod(half_then_full))
    assert main(base_args(model, data, out, "--num-rollout", "3")) == 1
    err = capsys.readouterr().err
    assert "metrics.jsonl" in err and "No space left on device" in err and "the disk mounted at" in err, err
    assert [m["rollout_id"] for m in read_metrics(out)] == [0]  # whole lines only


def test_two_runs_sharing_a_save_directory_are_refused(tiny_task, tmp_path, capsys):
    model, data = tiny_task
    ckpt = tmp_path / "ckpt"
    held = SaveLock(str(ckpt))  # the first run
    try:
        assert main(base_args(model, data, tmp_path / "o", "--save", str(ckpt))) == 2
        err = capsys.readouterr().err
        assert "--save" in err and "in use by another run" in err and f"pid {os.getpid()}" in err, err
    finally:
        held.release()
    assert main(base_args(model, data, tmp_path / "o2", "--num-rollout", "1", "--save", str(ckpt))) == 0
    SaveLock(str(ckpt)).release()  # the finished run let go of it


def test_partial_files_of_an_unfinished_save_are_removed(tiny_task, tmp_path, capsys):
    model, data = tiny_task
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000003").mkdir(parents=True)
    (ckpt / "iter_0000003" / "state.pt.tmp").write_bytes(b"half")
    (ckpt / "latest_checkpointed_iteration.txt.tmp").write_text("3")
    assert main(base_args(model, data, tmp_path / "o", "--num-rollout", "1", "--save", str(ckpt))) == 0
    assert not list(ckpt.rglob("*.tmp"))
    assert "state.pt.tmp, left by a save that did not finish" in capsys.readouterr().err


def test_a_reused_output_dir_starts_a_fresh_metrics_file(tiny_task, tmp_path, capsys):
    model, data = tiny_task
    out = tmp_path / "o"
    assert main(base_args(model, data, out, "--num-rollout", "2")) == 0
    assert main(base_args(model, data, out, "--num-rollout", "2")) == 0
    assert [m["rollout_id"] for m in read_metrics(out)] == [0, 1]
    kept = [json.loads(line)["rollout_id"] for line in (out / "metrics.1.jsonl").read_text().splitlines()]
    assert kept == [0, 1]
    assert "kept as metrics.1.jsonl" in capsys.readouterr().err
