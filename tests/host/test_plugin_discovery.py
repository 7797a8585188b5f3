"""Plugin discovery through real installed distributions (see conftest.py)."""

from __future__ import annotations

import json

from tests.host.conftest import dry_run_config
from tests.run_inputs import run_inputs

FEATURE_PLUGINS = {"fp8", "int4", "r3", "spec"}
MODEL_FAMILIES = {"qwen", "llama", "deepseek", "glm", "minimax", "gemma"}


def test_plugins_json_lists_installed_plugins(run_miles):
    result = run_miles("plugins", "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert FEATURE_PLUGINS | MODEL_FAMILIES <= set(rows)
    assert rows["fp8"]["distribution"] == "miles-fp8"
    assert rows["qwen"]["distribution"] == "miles-models" and rows["qwen"]["status"] == "active"
    assert "miles_register_model_families" in rows["qwen"]["hooks"]
    assert rows["goodplug"]["status"] == "available"
    assert rows["goodplug"]["version"] == "0.0.1"
    assert rows["brokenplug"]["status"] == "failed"
    assert "this_module_does_not_exist_anywhere" in rows["brokenplug"]["error"]
    assert rows["builtin-rewards"]["distribution"] == "miles-host"


def test_plugins_table_output(run_miles):
    result = run_miles("plugins")
    assert result.returncode == 0
    assert "goodplug" in result.stdout and "miles-test-goodplug" in result.stdout


def test_unknown_plugin_name_exits_2_and_lists_installed(run_miles):
    result = run_miles("run", "--plugins", "fp8,nosuchplugin", "--dry-run")
    assert result.returncode == 2
    assert "'nosuchplugin'" in result.stderr
    for name in ("fp8", "r3", "goodplug"):
        assert name in result.stderr


def test_selected_broken_plugin_names_plugin_distribution_and_cause(run_miles):
    result = run_miles("run", "--plugins", "brokenplug", "--dry-run")
    assert result.returncode == 1
    assert "'brokenplug'" in result.stderr
    assert "miles-test-brokenplug" in result.stderr
    assert "ModuleNotFoundError" in result.stderr


def test_unselected_broken_plugin_only_warns(run_miles):
    result = run_miles("run", "--dry-run")
    assert result.returncode == 0
    assert "brokenplug" in result.stderr and "not usable" in result.stderr
    names = [p["name"] for p in dry_run_config(result)["active_plugins"]]
    assert "brokenplug" not in names


def test_plugin_with_excluded_host_version_is_a_clear_error(run_miles):
    result = run_miles("run", "--plugins", "oldplug", "--dry-run")
    assert result.returncode == 1
    assert "requires miles-host<0.1" in result.stderr
    assert "0.1.0" in result.stderr


def test_misspelled_hook_is_an_error(run_miles):
    result = run_miles("run", "--plugins", "typoplug", "--dry-run")
    assert result.returncode == 1
    assert "miles_register_reward_fuctions" in result.stderr
    assert "miles-test-typoplug" in result.stderr


def test_duplicate_record_names_name_both_distributions(run_miles):
    result = run_miles("run", "--plugins", "dupreward", "--dry-run")
    assert result.returncode == 1
    assert "reward function named 'math'" in result.stderr
    assert "miles-host" in result.stderr and "miles-test-dupreward" in result.stderr


def test_duplicate_plugin_names_name_both_distributions(run_miles):
    result = run_miles("run", "--plugins", "dupname", "--dry-run")
    assert result.returncode == 1
    assert "miles-test-dupname-a" in result.stderr and "miles-test-dupname-b" in result.stderr


def test_third_party_plugin_flags_config_and_records(run_miles):
    result = run_miles("run", "--plugins", "goodplug", "--goodplug-level", "3", "--rm-type", "response_length", "--dry-run")
    config = dry_run_config(result)["config"]
    assert config["plugins"] == ["goodplug"]
    assert config["plugin_args"]["goodplug_level"] == 3
    assert config["plugin_args"]["goodplug_configured"] is True


def test_miles_plugins_environment_variable_selects(run_miles):
    result = run_miles("run", *run_inputs(moe=True), "--dry-run", env={"MILES_PLUGINS": "goodplug,r3"})
    assert dry_run_config(result)["config"]["plugins"] == ["r3", "goodplug"] or set(
        dry_run_config(result)["config"]["plugins"]
    ) == {"goodplug", "r3"}


def test_disable_builtin_with_p_no(run_miles):
    result = run_miles("run", "-p", "no:builtin-loggers", "--dry-run")
    names = [p["name"] for p in dry_run_config(result)["active_plugins"]]
    assert "builtin-loggers" not in names and "builtin-precision" in names


def test_flag_of_inactive_plugin_is_not_silently_ignored(run_miles):
    result = run_miles("run", "--goodplug-level", "5", "--dry-run")
    assert result.returncode == 2
    assert "--goodplug-level belongs to plugin 'goodplug'" in result.stderr
