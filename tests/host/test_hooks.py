"""One test per hook: a throwaway plugin class in a fresh plugin manager.

Each test is named ``test_<hook name>`` so the meta-test can see every hook is
exercised.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from miles_host import records
from miles_host.cli.args import resolve_run_config
from miles_host.cli.main import plugin_commands
from miles_host.models.context import RoutingContext
from miles_host.plugin_manager import MilesPluginManager, PluginError
from miles_host.routing import RoutingHooks
from tests.run_inputs import run_inputs


def manager_with(plugin, name="throwaway") -> MilesPluginManager:
    manager = MilesPluginManager()
    manager.discover(entry_points=[])
    manager.add_inline_plugin(plugin, name)
    manager.activate()
    return manager


def _registry_test(hook_name, record, attribute):
    class Plugin:
        pass

    setattr(Plugin, hook_name, staticmethod(lambda: [record]))
    registry = getattr(manager_with(Plugin()).registries, attribute)
    assert registry.get(record.name) is record
    assert registry.entry(record.name).plugin == "throwaway"
    return registry


def test_miles_register_precisions():
    registry = _registry_test(
        "miles_register_precisions", records.Precision("int3", prepare_train_model=lambda m, c: m), "precisions"
    )
    assert "bf16" in registry  # the built-in is still there


def test_miles_register_rollout_backends():
    registry = _registry_test("miles_register_rollout_backends", records.RolloutBackend("fake", factory=lambda config, manager: None), "rollout_backends")
    assert "embedded" in registry


def test_miles_register_decoding_strategies():
    registry = _registry_test(
        "miles_register_decoding_strategies", records.DecodingStrategy("medusa"), "decoding_strategies"
    )
    assert "plain" in registry


def test_miles_register_corrections():
    registry = _registry_test("miles_register_corrections", records.Correction("mycorr", fn=lambda *args: None), "corrections")
    assert {"tis", "mis", "icepop"} <= set(registry.names())


def test_miles_register_model_families():
    family = records.ModelFamily("toy", model_types=("toy_lm",))
    registry = _registry_test("miles_register_model_families", family, "model_families")
    assert registry.by_model_type("toy_lm") is family
    with pytest.raises(ValueError, match="unsupported model_type 'nope'.*toy_lm"):
        registry.by_model_type("nope")

    class Clash:
        @staticmethod
        def miles_register_model_families():
            return [records.ModelFamily("toy2", model_types=("toy_lm",))]

    manager = MilesPluginManager()
    manager.discover(entry_points=[])
    manager.add_inline_plugin(Clash(), "clash")
    manager.add_inline_plugin(type("P", (), {"miles_register_model_families": staticmethod(lambda: [family])})(), "first")
    manager.activate()
    with pytest.raises(PluginError, match="model_type 'toy_lm' is claimed"):
        manager.registries


def test_miles_register_weight_sync_transports():
    registry = _registry_test(
        "miles_register_weight_sync_transports", records.WeightSyncTransport("carrier-pigeon", factory=lambda config: None), "weight_sync_transports"
    )
    assert {"inprocess", "disk"} <= set(registry.names())


def test_miles_register_reward_functions():
    registry = _registry_test(
        "miles_register_reward_functions", records.RewardFunction("always_one", fn=lambda s, c=None: 1.0), "reward_functions"
    )
    assert {"math", "deepscaler", "f1", "exact"} <= set(registry.names())


def test_miles_register_advantage_estimators():
    registry = _registry_test(
        "miles_register_advantage_estimators", records.AdvantageEstimator("mine", fn=lambda inputs, config: []), "advantage_estimators"
    )
    assert {"grpo", "gspo", "rloo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"} <= set(registry.names())
    assert registry.get("ppo").needs_critic


def test_miles_register_loss_terms():
    _registry_test("miles_register_loss_terms", records.LossTerm("aux", fn=lambda outputs, batch, config: (0.0, {})), "loss_terms")


def test_miles_register_train_backends():
    registry = _registry_test("miles_register_train_backends", records.TrainBackend("jax", factory=lambda config, manager: None), "train_backends")
    assert "native" in registry


def test_miles_register_loggers():
    registry = _registry_test("miles_register_loggers", records.Logger("stdout", factory=lambda config: None), "loggers")
    assert "jsonl" in registry


def test_override_replaces_a_builtin_only_when_asked():
    class Override:
        @staticmethod
        def miles_register_reward_functions():
            return [records.RewardFunction("math", fn=lambda s, c=None: 2.0, override=True)]

    registry = manager_with(Override()).registries.reward_functions
    assert registry.get("math").fn(None) == 2.0


def test_registration_hook_returning_garbage_names_the_plugin():
    class Bad:
        @staticmethod
        def miles_register_loggers():
            return ["not a record"]

    with pytest.raises(PluginError, match="'throwaway'"):
        manager_with(Bad()).registries


def test_miles_select_experts():
    class Replay:
        @staticmethod
        def miles_select_experts(layer_index, scores, topk, router_ids, routing_context):
            assert torch.equal(router_ids, torch.topk(scores, topk).indices)
            if layer_index in routing_context.replay_expert_ids:
                return routing_context.replay_expert_ids[layer_index]
            return None

    hooks = RoutingHooks(manager_with(Replay()).hook)
    scores = torch.tensor([[0.1, 0.9, 0.5], [0.8, 0.1, 0.3]])
    replay = torch.tensor([[2, 0], [1, 2]])
    context = RoutingContext(replay_expert_ids={3: replay})
    assert torch.equal(hooks.select(3, scores, 2, context), replay)
    assert torch.equal(hooks.select(4, scores, 2, context), torch.tensor([[1, 2], [0, 2]]))
    with pytest.raises(ValueError, match="shape"):
        hooks.select(3, scores, 2, RoutingContext(replay_expert_ids={3: torch.tensor([[1]])}))


def test_miles_experts_selected():
    class Capture:
        @staticmethod
        def miles_experts_selected(layer_index, expert_ids, routing_context):
            routing_context.captured[layer_index] = expert_ids

    hooks = RoutingHooks(manager_with(Capture()).hook)
    context = RoutingContext(phase="rollout")
    ids = hooks.select(0, torch.tensor([[0.0, 1.0, 2.0]]), 2, context)
    assert torch.equal(context.captured[0], ids) and ids.tolist() == [[2, 1]]
    assert not RoutingHooks(manager_with(object()).hook).active  # no routing plugins: no hook calls


def test_miles_prepare_model():
    class AttachHead:
        @staticmethod
        def miles_prepare_model(model, role, config):
            if role == "train":
                model.extra_head = torch.nn.Linear(2, 2)

    manager = manager_with(AttachHead())
    model = torch.nn.Module()
    manager.hook.miles_prepare_model(model=model, role="train", config=None)
    assert isinstance(model.extra_head, torch.nn.Linear)
    other = torch.nn.Module()
    manager.hook.miles_prepare_model(model=other, role="rollout", config=None)
    assert not hasattr(other, "extra_head")


def test_miles_train_batch_prepared():
    seen = []

    class Attach:
        @staticmethod
        def miles_train_batch_prepared(batch, samples, config):
            batch["extra"] = len(samples)
            seen.append(config)

    batch = {}
    manager_with(Attach()).hook.miles_train_batch_prepared(batch=batch, samples=[1, 2], config="cfg")
    assert batch == {"extra": 2} and seen == ["cfg"]


def test_miles_step_end():
    class AddMetric:
        @staticmethod
        def miles_step_end(rollout_id, metrics, config):
            metrics["plugin/step"] = rollout_id

    class Ratio:
        @staticmethod
        def miles_step_end(metrics, counters):
            metrics["plugin/ratio"] = counters["plugin/hit"] / counters["plugin/all"]

    metrics = {}
    manager_with(AddMetric()).hook.miles_step_end(rollout_id=7, metrics=metrics, config=None, counters={})
    assert metrics == {"plugin/step": 7}
    manager_with(Ratio()).hook.miles_step_end(rollout_id=7, metrics=metrics, config=None,
                                              counters={"plugin/hit": 1.0, "plugin/all": 4.0})
    assert metrics["plugin/ratio"] == 0.25


def test_miles_rank_counters():
    """Each plugin's counts of this process, summed key-wise; a failing plugin is left out with a warning."""
    from miles_host.plugin_manager import sum_counters

    class Hits:
        @staticmethod
        def miles_rank_counters(config):
            return {"a/hit": 2, "a/all": 5.0}

    class More:
        @staticmethod
        def miles_rank_counters(config):
            return {"a/hit": 1}

    class Broken:
        @staticmethod
        def miles_rank_counters(config):
            raise RuntimeError("counter exploded")

    manager = MilesPluginManager()
    manager.discover(entry_points=[])
    for plugin, name in ((Hits(), "hits"), (More(), "more"), (Broken(), "broken")):
        manager.add_inline_plugin(plugin, name)
    manager.activate()
    with pytest.warns(UserWarning, match="'broken'.*counter exploded"):
        counts = manager.rank_counters(config=None)
    assert counts == {"a/hit": 3.0, "a/all": 5.0}
    # a trainer group adds its ranks' dicts the same way
    assert sum_counters([counts, {"a/hit": 1.0}]) == {"a/hit": 4.0, "a/all": 5.0}


class FlagsPlugin:
    @staticmethod
    def miles_add_arguments(parser):
        parser.add_argument("--throwaway-k", type=int, default=2)

    @staticmethod
    def miles_activate(args):
        return args.throwaway_k > 2

    @staticmethod
    def miles_configure(config):
        config.rollout_batch_size = config.throwaway_k * 10

    #: what miles_process_start saw, per call
    started: list = []

    @staticmethod
    def miles_process_start(config):
        FlagsPlugin.started.append(config.rollout_batch_size)


def _resolve(argv):
    manager = MilesPluginManager()
    manager.discover(entry_points=[])
    manager.plugins["flags"] = __import__("miles_host.plugin_manager", fromlist=["PluginInfo"]).PluginInfo(
        "flags", "(inline)", "", "FlagsPlugin", module=FlagsPlugin()
    )
    return resolve_run_config(argv, manager)


def test_miles_add_arguments():
    config, _ = _resolve(["--plugins", "flags", "--throwaway-k", "2"])
    assert config.throwaway_k == 2 and config.plugin_args == {"throwaway_k": 2}


def test_miles_activate():
    config, _ = _resolve(["--throwaway-k", "3"])
    assert config.plugins == ["flags"]
    config, _ = _resolve(["--rollout-batch-size", "8"])
    assert config.plugins == [] and config.rollout_batch_size == 8


def test_miles_configure():
    config, _ = _resolve(["--plugins", "flags", "--throwaway-k", "2"])
    assert config.rollout_batch_size == 20


def test_miles_validate():
    """Fires in the validation stage with the finished config and the registries; its
    ValueError refuses the run (and --dry-run) alike."""
    seen = []

    class Checks:
        @staticmethod
        def miles_validate(config, registries):
            seen.append((config.rollout_batch_size, "bf16" in registries.precisions))
            if config.rollout_batch_size == 3:
                raise ValueError("--rollout-batch-size 3: refused by the throwaway plugin")

    def resolve(argv):
        manager = MilesPluginManager()
        manager.discover(entry_points=[])
        manager.add_inline_plugin(Checks(), "checks")
        return resolve_run_config(argv, manager)

    config, _ = resolve(["--rollout-batch-size", "4"])
    assert seen == [(4, True)]
    with pytest.raises(ValueError, match="refused by the throwaway plugin"):
        resolve(["--rollout-batch-size", "3"])


def test_miles_process_start():
    """In the driver after miles_configure; in a worker once its manager is rebuilt from that config."""
    import miles_r3.plugin as r3
    from miles_host.distributed.comm import rebuild_manager

    FlagsPlugin.started.clear()
    config, _ = _resolve(["--plugins", "flags", "--throwaway-k", "3"])
    assert FlagsPlugin.started == [30]  # the configured value
    # a worker process: R2 configured by the driver reaches r3's module state there
    config, _ = resolve_run_config([*run_inputs(moe=True), "--plugins", "r3", "--use-routing-replay"],
                                   MilesPluginManager())
    r3.STATE.mode = "r3"  # what a fresh worker process starts with
    rebuild_manager(config)
    assert r3.STATE.mode == "r2" and config.old_logprob_pass == "always"


def test_miles_register_commands():
    calls = []

    class Hello:
        @staticmethod
        def miles_register_commands():
            return [
                records.Command(
                    "hello",
                    add_arguments=lambda p: p.add_argument("--who", default="world"),
                    run=lambda args: calls.append(args.who) or 0,
                )
            ]

    manager = MilesPluginManager()
    manager.discover(entry_points=[])
    manager.add_inline_plugin(Hello(), "hello-plugin")
    command = plugin_commands(manager)["hello"]
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert command.run(parser.parse_args(["--who", "miles"])) == 0 and calls == ["miles"]


def test_miles_register_checkpoint_converters(tmp_path):
    from miles_host.cli.main import checkpoint_converters

    written = []

    class Halve:
        @staticmethod
        def miles_register_checkpoint_converters():
            return [
                records.CheckpointConverter(
                    "half",
                    add_arguments=lambda p: p.add_argument("--factor", type=float, default=0.5),
                    convert=lambda src, dst, args: written.append((src, dst, args.factor)),
                )
            ]

    manager = MilesPluginManager()
    manager.discover(entry_points=[])
    manager.add_inline_plugin(Halve(), "halve")
    converter = checkpoint_converters(manager)["half"]
    parser = argparse.ArgumentParser()
    converter.add_arguments(parser)
    converter.convert("a", "b", parser.parse_args(["--factor", "0.25"]))
    assert written == [("a", "b", 0.25)]
    manager.activate()
    assert manager.registries.checkpoint_converters.get("half") is not None


def test_convert_command_rejects_unknown_format(capsys):
    from miles_host.cli.main import main

    assert main(["convert", "--to", "nosuchformat", "a", "b"]) == 2
    assert "unknown checkpoint format 'nosuchformat'" in capsys.readouterr().err
