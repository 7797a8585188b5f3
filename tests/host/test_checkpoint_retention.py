"""--save-retain-interval: which checkpoints a run keeps."""

from __future__ import annotations

import pytest

from miles_host.checkpoint import load_checkpoint, prune_checkpoints, save_checkpoint
from miles_host.config import MilesConfig


def _folders(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("iter_"))


def test_between_retained_checkpoints_only_the_newest_stays(tmp_path):
    for rollout_id in range(7):  # --save-interval 1, --save-retain-interval 3
        save_checkpoint(str(tmp_path), rollout_id, {"trainer": {}})
        prune_checkpoints(str(tmp_path), rollout_id, 3)
    # kept: after 3 and 6 completed rollouts (ids 2, 5) and the newest (6)
    assert _folders(tmp_path) == ["iter_0000002", "iter_0000005", "iter_0000006"]
    assert load_checkpoint(str(tmp_path))["rollout_id"] == 6


def test_without_the_flag_every_checkpoint_stays(tmp_path):
    for rollout_id in range(3):
        save_checkpoint(str(tmp_path), rollout_id, {"trainer": {}})
        assert prune_checkpoints(str(tmp_path), rollout_id, None) == []
    assert len(_folders(tmp_path)) == 3


def test_newer_folders_of_an_abandoned_run_are_left(tmp_path):
    for rollout_id in (0, 1, 4):
        save_checkpoint(str(tmp_path), rollout_id, {"trainer": {}})
    save_checkpoint(str(tmp_path), 2, {"trainer": {}})
    prune_checkpoints(str(tmp_path), 2, 2)
    assert _folders(tmp_path) == ["iter_0000001", "iter_0000002", "iter_0000004"]


@pytest.mark.parametrize("values, message", [
    ({"save_retain_interval": 0, "save": "x"}, "positive"),
    ({"save_retain_interval": 4}, "needs --save"),
    ({"save_retain_interval": 5, "save": "x", "save_interval": 2}, "multiple of --save-interval"),
])
def test_values_that_cannot_work(values, message):
    with pytest.raises(ValueError, match=message):
        MilesConfig(**values)


def test_an_empty_or_missing_load_directory_has_nothing_to_resume(tmp_path):
    from miles_host.checkpoint import has_checkpoint

    assert not has_checkpoint(str(tmp_path / "missing"))
    assert not has_checkpoint(str(tmp_path))
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert not has_checkpoint(str(tmp_path))
    (tmp_path / "iter_0000003").mkdir()  # a damaged one counts: loading it reports the damage
    assert has_checkpoint(str(tmp_path))
