"""The typed backend interfaces (miles_host.protocols) and the records the host dispatches on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from miles_host import records
from miles_host.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, compute_advantages
from miles_host.algorithms.losses import POLICY_LOSSES, PolicyLossBatch, policy_loss, policy_loss_for, ppo_policy_loss
from miles_host.distributed.placement import prepare, wants_distributed
from miles_host.phases import PhasePlan, Phases
from miles_host.plugin_manager import MilesPluginManager, PluginError
from miles_host.protocols import (
    MetricsLogger,
    RolloutBackend,
    RolloutBackendBase,
    Trainer,
    TrainerBase,
    WeightSyncTransport,
    build,
    missing_members,
    protocol_members,
)


def manager_with(plugin, name="throwaway") -> MilesPluginManager:
    manager = MilesPluginManager()
    manager.discover(entry_points=[])
    manager.add_inline_plugin(plugin, name)
    manager.activate()
    return manager


# -- registration and construction checks ------------------------------------------------


@pytest.mark.parametrize(
    "hook, record, field",
    [
        ("miles_register_rollout_backends", records.RolloutBackend("nofactory"), "factory"),
        ("miles_register_train_backends", records.TrainBackend("nofactory"), "factory"),
        ("miles_register_weight_sync_transports", records.WeightSyncTransport("nofactory"), "factory"),
        ("miles_register_loggers", records.Logger("nofactory"), "factory"),
        ("miles_register_advantage_estimators", records.AdvantageEstimator("nofn"), "fn"),
        ("miles_register_corrections", records.Correction("nofn"), "fn"),
        ("miles_register_reward_functions", records.RewardFunction("nofn"), "fn"),
    ],
)
def test_a_record_without_its_callable_is_refused_at_registration_naming_the_plugin(hook, record, field):
    plugin = type("Plugin", (), {hook: staticmethod(lambda: [record])})()
    with pytest.raises(PluginError, match=rf"plugin 'careless'.*{record.name!r} without {field}"):
        manager_with(plugin, "careless").registries


class HalfTrainer:
    """Trains, but cannot hand its weights to the engine or checkpoint."""

    def __init__(self, config, manager):
        self.model = torch.nn.Linear(2, 2)
        self.consecutive_nan_steps = 0

    def train(self, samples):
        return {}


def test_a_backend_object_missing_members_is_refused_naming_plugin_and_members():
    class Plugin:
        @staticmethod
        def miles_register_train_backends():
            return [records.TrainBackend("half", factory=HalfTrainer)]

    manager = manager_with(Plugin(), "half-plugin")
    with pytest.raises(TypeError) as error:
        build(manager.registries.train_backends, "half", Trainer, None, manager)
    message = str(error.value)
    assert "training backend 'half' (plugin 'half-plugin'" in message
    for member in ("named_weights_for_rollout", "state_dict", "load_state_dict", "rank_counters", "full_state_dict"):
        assert member in message
    assert "TrainerBase" in message  # where the optional members' defaults are


def test_subclassing_the_base_gives_the_optional_members():
    class Complete(TrainerBase, HalfTrainer):
        def rank_counters(self):
            return {}

        def named_weights_for_rollout(self):
            return list(self.model.state_dict().items())

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    class Plugin:
        @staticmethod
        def miles_register_train_backends():
            return [records.TrainBackend("complete", factory=Complete)]

    manager = manager_with(Plugin())
    trainer = build(manager.registries.train_backends, "complete", Trainer, None, manager)
    assert trainer.full_state_dict() is None and not trainer.can_offload_train_state
    with pytest.raises(NotImplementedError):
        trainer.offload_train_state()


def _host_classes():
    from miles_megatron.trainer import MegatronTrainer
    from miles_sglang.backend import SGLangRolloutBackend

    from miles_host.distributed.dp_trainer import DataParallelTrainer
    from miles_host.distributed.fsdp_trainer import Fsdp2Trainer
    from miles_host.distributed.rollout_worker import RolloutRouter
    from miles_host.distributed.trainer_group import TrainerGroup
    from miles_host.distributed.transports import BroadcastTransport, IpcTransport
    from miles_host.logging_backends import JsonlLogger, TensorBoardLogger, WandbLogger
    from miles_host.rollout_backend import EmbeddedRolloutBackend
    from miles_host.trainer import NativeTrainer
    from miles_host.weight_sync import DiskTransport, InProcessTransport

    return [
        (Trainer, [NativeTrainer, DataParallelTrainer, Fsdp2Trainer, TrainerGroup, MegatronTrainer]),
        (RolloutBackend, [EmbeddedRolloutBackend, RolloutRouter, SGLangRolloutBackend]),
        (WeightSyncTransport, [InProcessTransport, DiskTransport, BroadcastTransport, IpcTransport]),
        (MetricsLogger, [JsonlLogger, TensorBoardLogger, WandbLogger]),
    ]


def test_every_host_and_plugin_backend_class_implements_its_protocol():
    # ``model`` / ``consecutive_nan_steps`` are set by ``__init__``; everything else is on the class
    per_instance = {"model", "consecutive_nan_steps"}
    for protocol, classes in _host_classes():
        for cls in classes:
            missing = [m for m in protocol_members(protocol) if m not in per_instance and not hasattr(cls, m)]
            assert missing == [], f"{cls.__name__} lacks {missing} of {protocol.__name__}"
    assert missing_members(SimpleNamespace(push=lambda *a: None), WeightSyncTransport) == []


def test_phases_refuse_a_backend_that_does_not_release_memory():
    class Engine(RolloutBackendBase):
        pass

    class Plain(TrainerBase):
        pass

    with pytest.raises(ValueError, match="cannot release its memory"):
        Phases(PhasePlan(rollout_tags=("kv_cache",)), Plain(), Engine())
    with pytest.raises(ValueError, match="--offload-train.*cannot offload"):
        Phases(PhasePlan(offload_train=True), Plain(), Engine())
    Phases(PhasePlan(), Plain(), Engine())  # nothing to move: any backend will do


# -- the launcher dispatches on record fields ---------------------------------------------


def _placement_config(**fields):
    defaults = dict(use_ray=False, actor_num_nodes=1, actor_num_gpus_per_node=1, rollout_num_gpus=None,
                    rollout_backend="embedded", train_backend="native", weight_sync="inprocess", colocate=False,
                    device="cpu", use_fault_tolerance=False)
    return SimpleNamespace(**{**defaults, **fields})


def test_multi_process_runs_follow_the_records_not_backend_names():
    class Plugin:
        @staticmethod
        def miles_register_rollout_backends():
            return [
                records.RolloutBackend("pool", factory=lambda c, m: None, multi_process=True),
                records.RolloutBackend("local", factory=lambda c, m: None, distributed_variant="pool"),
            ]

    registries = manager_with(Plugin()).registries
    assert not wants_distributed(_placement_config(), registries)
    assert wants_distributed(_placement_config(rollout_backend="pool"), registries)
    assert wants_distributed(_placement_config(train_backend="fsdp"), registries)
    assert not wants_distributed(_placement_config(rollout_backend="local"), registries)
    config = _placement_config(rollout_backend="local", actor_num_gpus_per_node=2)
    assert wants_distributed(config, registries)
    prepare(config, registries)
    assert (config.rollout_backend, config.train_backend, config.weight_sync) == ("pool", "native_dp", "broadcast")


# -- advantage estimator and correction records --------------------------------------------


def _inputs():
    torch.manual_seed(0)
    lengths = [3, 2, 4, 1]
    return AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0, 2.0, 0.5]), group_index=torch.tensor([0, 0, 1, 1]),
        response_lengths=lengths, values=[torch.randn(n) for n in lengths],
    )


def _config(**fields):
    return SimpleNamespace(**{"normalize_advantages": False, "disable_rewards_normalization": False,
                              "disable_grpo_std_normalization": False, **fields})


def test_the_estimator_record_says_whether_the_host_whitens_and_builds_value_targets():
    raw = [torch.tensor([3.0, 1.0, 2.0]), torch.tensor([5.0, 5.0]), torch.tensor([0.0, 1.0, 0.0, 1.0]), torch.tensor([7.0])]
    plain = records.AdvantageEstimator("plain", fn=lambda inputs, config: [r.clone() for r in raw])
    inputs = _inputs()
    out = compute_advantages(plain, inputs, _config())
    assert all(torch.equal(a, r) for a, r in zip(out.advantages, raw))
    assert all(torch.equal(a, r) for a, r in zip(out.returns, raw))

    whitened = compute_advantages(records.AdvantageEstimator("w", fn=plain.fn, whiten=True), inputs, _config())
    flat = torch.cat(whitened.advantages).double()
    assert flat.mean().item() == pytest.approx(0.0, abs=1e-6) and flat.std(unbiased=True).item() == pytest.approx(1.0, rel=1e-4)  # masked_whiten: unbiased variance, as slime

    critic = compute_advantages(records.AdvantageEstimator("c", fn=plain.fn, needs_critic=True), inputs, _config())
    for returns, advantage, value in zip(critic.returns, raw, inputs.values):
        assert torch.allclose(returns, advantage + value)


def test_builtin_estimator_records_carry_what_slime_does():
    assert {name for name, r in ADVANTAGE_ESTIMATORS.items() if r.whiten} == {"reinforce_plus_plus", "reinforce_plus_plus_baseline"}
    assert {name for name, r in ADVANTAGE_ESTIMATORS.items() if r.needs_critic} == {"ppo"}
    for name, record in ADVANTAGE_ESTIMATORS.items():
        # the library default for a config without a record agrees with the record
        assert (record.policy_loss or ppo_policy_loss) is policy_loss_for(SimpleNamespace(advantage_estimator=name))
    assert ADVANTAGE_ESTIMATORS["gspo"].policy_loss is POLICY_LOSSES["gspo"]


def test_policy_loss_uses_the_term_it_is_given():
    calls = []

    def spy(log_probs, old_log_probs, advantages, loss_mask, response_lengths, config):
        calls.append(advantages.clone())
        return ppo_policy_loss(log_probs, old_log_probs, advantages, loss_mask, response_lengths, config)

    batch = PolicyLossBatch(
        log_probs=torch.tensor([-1.0, -2.0, -0.5]), advantages=torch.tensor([1.0, -1.0, 0.5]),
        loss_mask=torch.ones(3), response_lengths=[3],
    )
    config = SimpleNamespace(
        advantage_estimator="cispo", eps_clip=0.2, eps_clip_high=None, eps_clip_c=None, use_rollout_logprobs=False,
        use_kl_loss=False, kl_loss_coef=0.0, entropy_coef=0.0, loss_agg_mode="token-mean",
        calculate_per_token_loss=False, use_tis=False, use_mis=False, use_icepop=False, kl_loss_type="k1",
        use_unbiased_kl=False,
    )
    policy_loss(batch, config, corrections=[], pg_loss=spy)
    assert len(calls) == 1 and torch.equal(calls[0], batch.advantages)


def test_builtin_corrections_are_registered_from_their_records():
    from miles_host.algorithms.corrections import CORRECTION_RECORDS, CORRECTIONS, enabled_corrections
    from miles_host.plugin_manager import load_registries

    registered = load_registries().corrections
    for record in CORRECTION_RECORDS:
        assert registered.get(record.name) is record and CORRECTIONS[record.name] is record.fn
    config = SimpleNamespace(use_tis=False, use_mis=True, use_icepop=True)
    assert enabled_corrections(config) == [CORRECTIONS["mis"], CORRECTIONS["icepop"]]
    assert [r.fn for r in registered if r.enabled(config)] == enabled_corrections(config)


def test_cli_commands_and_converters_go_through_a_registry():
    from miles_host.cli.main import checkpoint_converters, plugin_commands

    class NoRun:
        @staticmethod
        def miles_register_commands():
            return [records.Command("idle")]

    manager = MilesPluginManager()
    manager.discover(entry_points=[])
    manager.add_inline_plugin(NoRun(), "lazy")
    with pytest.raises(PluginError, match=r"plugin 'lazy'.*command 'idle' without run"):
        plugin_commands(manager)

    def converter(name):
        return type(name, (), {"miles_register_checkpoint_converters": staticmethod(
            lambda: [records.CheckpointConverter("int3", convert=lambda src, dst, args: None)])})()

    manager = MilesPluginManager()
    manager.discover(entry_points=[])
    manager.add_inline_plugin(converter("A"), "first")
    manager.add_inline_plugin(converter("B"), "second")
    with pytest.raises(PluginError, match="checkpoint converter named 'int3': 'first'.*'second'"):
        checkpoint_converters(manager)
