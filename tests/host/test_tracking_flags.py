"""The wandb and TensorBoard flags reach wandb.login / wandb.init and the event-file directory."""

from __future__ import annotations

import sys
import types

from miles_host.config import MilesConfig
from miles_host.logging_backends import WandbLogger, tensorboard_dir, wandb_init_kwargs


def test_wandb_flags_reach_init_and_login(monkeypatch, tmp_path):
    calls = {}
    fake = types.ModuleType("wandb")
    fake.login = lambda **kw: calls.setdefault("login", kw)
    fake.init = lambda **kw: calls.setdefault("init", kw) and None
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = MilesConfig(use_wandb=True, wandb_project="slime-dev", wandb_group="qwen3-30B-A3B-TIS",
                         wandb_run_id="run-7", wandb_key="k3y", wandb_host="https://wandb.example",
                         wandb_team="team", wandb_mode="online", wandb_dir=str(tmp_path / "wb"),
                         output_dir=str(tmp_path / "out"))
    WandbLogger(config)
    assert calls["login"] == {"key": "k3y", "host": "https://wandb.example"}
    init = calls["init"]
    assert (init["project"], init["entity"], init["group"], init["id"], init["resume"], init["mode"], init["dir"]) == (
        "slime-dev", "team", "qwen3-30B-A3B-TIS", "run-7", "allow", "online", str(tmp_path / "wb"))
    assert init["name"].startswith("qwen3-30B-A3B-TIS_") and len(init["name"]) > len("qwen3-30B-A3B-TIS_")
    assert init["config"]["wandb_group"] == "qwen3-30B-A3B-TIS"


def test_wandb_defaults_and_fixed_name(tmp_path):
    config = MilesConfig(output_dir=str(tmp_path))
    assert wandb_init_kwargs(config) == {"project": "miles", "dir": str(tmp_path)}
    named = MilesConfig(wandb_group="g", disable_wandb_random_suffix=True)
    assert wandb_init_kwargs(named)["name"] == "g"


def test_tensorboard_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    config = MilesConfig(output_dir=str(tmp_path), tb_project_name="proj", tb_experiment_name="exp")
    assert tensorboard_dir(config) == tmp_path / "tensorboard" / "proj" / "exp"
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    assert tensorboard_dir(MilesConfig(output_dir=str(tmp_path))) == tmp_path / "tb"


def test_tracking_flags_without_an_effect_warn_once(capsys, monkeypatch):
    from miles_host.validation import ignored_flags
    from miles_host.validation.ignored_flags import warn_ignored_flags

    monkeypatch.setattr(ignored_flags, "_warned", set())
    config = MilesConfig(wandb_always_use_train_step=True, log_multi_turn=True,
                         user_set=["wandb_always_use_train_step", "log_multi_turn"])
    warned = warn_ignored_flags(config)
    assert warned == ["--wandb-always-use-train-step", "--log-multi-turn"]
    assert "rollout step" in capsys.readouterr().err
    assert warn_ignored_flags(config) == []  # once per process


def test_no_login_offline(monkeypatch, tmp_path):
    calls = {}
    fake = types.ModuleType("wandb")
    fake.login = lambda **kw: calls.setdefault("login", kw)
    fake.init = lambda **kw: calls.setdefault("init", kw) and None
    monkeypatch.setitem(sys.modules, "wandb", fake)
    WandbLogger(MilesConfig(use_wandb=True, wandb_key="k3y", wandb_mode="offline", output_dir=str(tmp_path)))
    assert "login" not in calls and calls["init"]["mode"] == "offline"
