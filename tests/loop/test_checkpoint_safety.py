"""``--load`` of damaged or hostile checkpoints: named, refused, or replaced by the
newest intact earlier iteration; never loaded silently and never running code."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from miles_host.checkpoint import LATEST, load_checkpoint, save_checkpoint
from miles_host.checkpoint_integrity import MANIFEST, CheckpointDamaged, sha256_of
from miles_host.cli.main import main
from tests.loop.conftest import base_args, read_metrics


@pytest.fixture(scope="module")
def two_checkpoints(tiny_task, tmp_path_factory):
    """A run of two rollouts that saved after each: (checkpoint dir, its metrics)."""
    model, data = tiny_task
    root = tmp_path_factory.mktemp("two_checkpoints")
    args = base_args(model, data, root / "out", "--num-rollout", "2", "--save", str(root / "ckpt"), "--save-interval", "1")
    assert main(args) == 0
    return root / "ckpt", read_metrics(root / "out")


@pytest.fixture
def checkpoints(two_checkpoints, tmp_path):
    """A private copy of the two checkpoints (iter 0 and iter 1)."""
    source, _ = two_checkpoints
    return shutil.copytree(source, tmp_path / "ckpt")


def _newest(ckpt):
    return ckpt / "iter_0000001" / "state.pt"


def _flip_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_checkpoints_carry_a_manifest_of_checksums(checkpoints):
    manifest = json.loads((checkpoints / "iter_0000001" / MANIFEST).read_text())
    state = _newest(checkpoints)
    assert manifest["files"]["state.pt"] == {"bytes": state.stat().st_size, "sha256": sha256_of(state)}
    assert manifest["rollout_id"] == 1


def test_a_flipped_byte_is_detected_and_the_previous_checkpoint_resumes_exactly(tiny_task, two_checkpoints, checkpoints,
                                                                                 tmp_path, capsys):
    model, data = tiny_task
    _, saved_metrics = two_checkpoints
    _flip_byte(_newest(checkpoints))
    out = tmp_path / "resumed"
    assert main(base_args(model, data, out, "--num-rollout", "2", "--load", str(checkpoints))) == 0
    err = capsys.readouterr().err
    assert f"{_newest(checkpoints)} is damaged" in err and "SHA-256" in err
    assert "loading the newest intact checkpoint instead" in err and "iter_0000000" in err
    # the fallback resumes after rollout 0: rollout 1 again, with the metrics the first run had for it
    (resumed,) = read_metrics(out)
    expected = saved_metrics[1]
    assert resumed["rollout_id"] == 1
    for key, value in expected.items():
        if not key.startswith("perf/"):
            assert resumed[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "garbage", "no_manifest_truncated", "bad_manifest"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(checkpoints, capsys, damage):
    state = _newest(checkpoints)
    data = state.read_bytes()
    if damage == "truncated":
        state.write_bytes(data[: len(data) // 3])
    elif damage == "zeroed":
        state.write_bytes(bytes(len(data)))
    elif damage == "garbage":
        state.write_bytes(os.urandom(len(data)))
    elif damage == "no_manifest_truncated":
        (state.parent / MANIFEST).unlink()
        state.write_bytes(data[: len(data) // 3])
    else:
        (state.parent / MANIFEST).write_text("{not json")
    loaded = load_checkpoint(str(checkpoints))
    assert loaded["rollout_id"] == 0
    err = capsys.readouterr().err
    named = state.parent / MANIFEST if damage == "bad_manifest" else state
    assert f"{named} is damaged" in err and "iter_0000000" in err


@pytest.mark.parametrize("latest", ["garbage\n", "", "7"])
def test_a_bad_latest_file_falls_back_to_the_newest_intact_iteration(checkpoints, capsys, latest):
    (checkpoints / LATEST).write_text(latest)
    assert load_checkpoint(str(checkpoints))["rollout_id"] == 1
    assert str(checkpoints / LATEST) in capsys.readouterr().err


def test_every_checkpoint_damaged_is_an_error_naming_the_files(tiny_task, checkpoints, tmp_path, capsys):
    model, data = tiny_task
    for folder in ("iter_0000000", "iter_0000001"):
        _flip_byte(checkpoints / folder / "state.pt", offset=100)
    assert main(base_args(model, data, tmp_path / "o", "--num-rollout", "3", "--load", str(checkpoints))) == 2
    err = capsys.readouterr().err
    assert "--load" in err and "no intact checkpoint" in err
    assert f"{checkpoints / 'iter_0000000' / 'state.pt'} is damaged" in err
    assert f"{_newest(checkpoints)} is damaged" in err


def test_nan_in_the_saved_trainer_state_is_refused_naming_the_tensor(checkpoints, capsys):
    state = torch.load(_newest(checkpoints), weights_only=True)
    state["trainer"]["model"]["norm.weight"][3] = float("nan")
    state["trainer"]["optimizer"]["state"][0]["exp_avg_sq"][0] = float("inf")
    payload = {k: v for k, v in state.items() if k not in ("rollout_id", "rng")}
    save_checkpoint(str(checkpoints), 1, payload)
    assert load_checkpoint(str(checkpoints))["rollout_id"] == 0
    err = capsys.readouterr().err
    assert "NaN/Inf values in trainer.model.norm.weight, trainer.optimizer.state.0.exp_avg_sq" in err


class _RunsACommand:
    """Unpickling this runs a shell command (what a hostile checkpoint would do)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_crafted_pickle_is_refused_and_runs_nothing(tiny_task, checkpoints, tmp_path, capsys):
    model, data = tiny_task
    marker = tmp_path / "pwned"
    shutil.rmtree(checkpoints / "iter_0000000")
    state = _newest(checkpoints)
    real = torch.load(state, weights_only=True)
    torch.save({**real, "history": _RunsACommand(f"touch {marker}")}, state)
    # the attacker rewrites the manifest too: the checksum passes, the load itself must refuse
    manifest = json.loads((state.parent / MANIFEST).read_text())
    manifest["files"]["state.pt"] = {"bytes": state.stat().st_size, "sha256": sha256_of(state)}
    (state.parent / MANIFEST).write_text(json.dumps(manifest))
    assert main(base_args(model, data, tmp_path / "o", "--num-rollout", "3", "--load", str(checkpoints))) == 2
    err = capsys.readouterr().err
    assert f"{state} was refused" in err and "run code" in err
    assert not marker.exists()
    with pytest.raises(CheckpointDamaged):
        load_checkpoint(str(checkpoints))
    assert not marker.exists()
