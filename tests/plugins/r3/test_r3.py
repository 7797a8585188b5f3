"""miles-r3: the experts chosen in rollout are the experts trained.

Rollout runs in bfloat16 and training in float32 on purpose, so the two routers
disagree on some tokens; with R3 training must use the rollout's experts on
100% of token-layers and the train-rollout log-prob gap must shrink.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles_host.cli.args import resolve_run_config
from miles_host.loop import Run
from miles_host.plugin_manager import MilesPluginManager, PluginError
from miles_host.sample import Sample
from miles_r3.replay import replay_ids_for_batch
from tests.loop.conftest import write_addition_data
from tests.run_inputs import run_inputs

transformers = pytest.importorskip("transformers")

MOE_CASES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=14, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
    ),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        vocab_size=14, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=0, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_group=2, topk_group=1, eos_token_id=1, pad_token_id=0, bos_token_id=0,
    ),
}


def length_reward(sample, config):
    """A reward with variance inside every group (so the policy gradient is not zero)."""
    return float(len(sample.response)) + 0.1 * (sample.index % 3)


def _char_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("0123456789+=")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")


def save_moe_task(root, case: str, prompts: int = 32):
    """A random ``MOE_CASES[case]`` model with near-tied routers and an addition dataset under ``root``."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MOE_CASES[case]())
    with torch.no_grad():  # near-tied router scores: bf16 rounding then flips some top-k choices
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                parameter.mul_(0.05)
    model.save_pretrained(root / "model")
    _char_tokenizer().save_pretrained(root / "model")
    return root / "model", write_addition_data(root / "data.jsonl", prompts)


@pytest.fixture(scope="module", params=sorted(MOE_CASES))
def moe_task(request, tmp_path_factory):
    return save_moe_task(tmp_path_factory.mktemp(request.param), request.param)


class Observer:
    """Records the experts every MoE layer used, per forward phase."""

    def __init__(self):
        self.used = []

    def miles_experts_selected(self, layer_index, expert_ids, routing_context):
        self.used.append((routing_context.phase, layer_index, expert_ids.clone()))


def _run(model, data, tmp_path, *flags):
    manager = MilesPluginManager()
    manager.discover()
    observer = Observer()
    manager.add_inline_plugin(observer, "observer")
    argv = [
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--label-key", "label",
        "--custom-rm-path", f"{__name__}.length_reward", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "12", "--num-rollout", "1", "--micro-batch-size", "1", "--lr", "1e-3",
        "--dtype", "bfloat16", "--device", "cpu", "--output-dir", str(tmp_path), "--no-progress", *flags,
    ]
    config, _ = resolve_run_config(argv, manager)
    run = Run(config, manager)
    run.sync_weights(version=run.state.weight_version)
    groups, _ = run.rollout.generate(0)
    samples = [s for g in groups for s in g]
    metrics = run.trainer.train(samples)
    manager.hook.miles_step_end(rollout_id=0, metrics=metrics, config=config, counters=manager.rank_counters(config))
    return run, samples, metrics, observer


def test_training_uses_the_rollout_experts_and_shrinks_the_mismatch(moe_task, tmp_path):
    model, data = moe_task
    run, samples, metrics, observer = _run(model, data, tmp_path / "r3", "--plugins", "r3")
    moe_layers = [i for i, m in enumerate(run.trainer.model.config.moe_layers) if m]
    for sample in samples:
        assert sample.rollout_routed_experts.shape == (len(sample.tokens) - 1, len(moe_layers), 2)
        assert sample.rollout_routed_experts.dtype == np.uint8
    # micro-batch size 1: the train passes are the samples in order, one forward each
    train_passes = [ids for phase, _, ids in observer.used if phase == "train"]
    assert len(train_passes) == len(samples) * len(moe_layers)
    compared = agreed = 0
    for index, sample in enumerate(samples):
        for position in range(len(moe_layers)):
            used = train_passes[index * len(moe_layers) + position][:-1].sort(dim=-1).values
            rollout = torch.from_numpy(sample.rollout_routed_experts[:, position].astype(np.int64)).sort(dim=-1).values
            compared += used.shape[0]
            agreed += int((used == rollout).all(dim=-1).sum())
    assert agreed == compared  # 100% of token-layers
    agreement = metrics["r3/expert_agreement"]
    replay_diff = metrics["train/train_rollout_logprob_abs_diff"]

    router = next(m for m in run.trainer.model.modules() if type(m).__name__ == "Router")
    grads = [p.grad for p in router.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)  # the router still learns

    _, _, baseline, _ = _run(model, data, tmp_path / "base")
    plain_diff = baseline["train/train_rollout_logprob_abs_diff"]
    print(f"\nR3 {model.parent.name}: expert agreement without replay {agreement:.4f}; "
          f"train-rollout |logprob diff| with R3 {replay_diff:.3e}, without {plain_diff:.3e}")
    assert agreement < 1.0, "bf16 rollout vs fp32 training should disagree somewhere"
    assert replay_diff < plain_diff


def test_shape_mismatch_names_sample_and_shapes():
    sample = Sample(tokens=[1, 2, 3, 4], response_length=2, index=5, group_index=1,
                    rollout_routed_experts=np.zeros((2, 2, 2), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"sample 5 .*\(2, 2, 2\).*\(3, 2, 2\)"):
        replay_ids_for_batch([sample], [sample.rollout_routed_experts], [0, 1], 2, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"\(3, 3, 2\)"):
        replay_ids_for_batch([sample], [np.zeros((3, 2, 2), dtype=np.uint8)], [0, 1, 2], 2, torch.device("cpu"))


def test_r3_on_a_dense_model_says_there_is_nothing_to_replay(tmp_path):
    from tests.loop.conftest import build_tiny_policy

    model = build_tiny_policy(tmp_path / "dense")
    data = write_addition_data(tmp_path / "data.jsonl", 8)
    with pytest.raises(ValueError, match="no MoE layers: there is nothing to replay"):
        _run(model, data, tmp_path / "out", "--plugins", "r3")  # refused by the validation stage
    assert not (tmp_path / "out").exists()


def test_slime_flag_activates_r3_and_routing_capture():
    manager = MilesPluginManager()
    config, _ = resolve_run_config([*run_inputs(moe=True), "--use-rollout-routing-replay"], manager)
    assert "r3" in config.plugins and config.rollout_return_routed_experts


def test_unknown_hook_name_in_r3_would_be_caught():
    manager = MilesPluginManager()
    manager.discover()
    manager.activate(selected=["r3"])
    assert manager.plugins["r3"].status == "active"
    with pytest.raises(PluginError):
        manager.add_inline_plugin(object(), "r3")


def test_replay_survives_activation_recomputation(moe_task, tmp_path):
    """With --recompute-granularity full every MoE layer runs twice in training
    (forward, then recompute in backward): both passes use the rollout's experts."""
    model, data = moe_task
    run, samples, metrics, observer = _run(model, data, tmp_path / "recompute", "--plugins", "r3",
                                           "--recompute-granularity", "full")
    moe_layers = [i for i, m in enumerate(run.trainer.model.config.moe_layers) if m]
    train_passes = [(layer, ids) for phase, layer, ids in observer.used if phase == "train"]
    per_sample = 2 * len(moe_layers)  # forward + recompute (in reverse layer order)
    assert len(train_passes) == per_sample * len(samples)
    for index, sample in enumerate(samples):
        rollout = torch.from_numpy(sample.rollout_routed_experts.astype(np.int64)).sort(dim=-1).values
        passes = train_passes[index * per_sample:(index + 1) * per_sample]
        assert sorted(layer for layer, _ in passes) == sorted(moe_layers * 2)
        for layer, ids in passes:
            assert torch.equal(ids[:-1].sort(dim=-1).values, rollout[:, moe_layers.index(layer)])


def test_partial_rollout_keeps_the_routes_of_earlier_tokens():
    from miles_host.rollout_manager import merge_routed_experts

    sample = Sample(tokens=[1, 2, 3, 4, 5], response_length=2)
    first = np.array([[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]])  # 5 tokens -> 4 rows
    merge_routed_experts(sample, first)
    sample.tokens += [6, 7]
    # the continuation re-prefills the old tokens (possibly routed differently under new weights)
    second = np.array([[[7, 7]]] * 4 + [[[1, 2]], [[3, 4]]])
    merge_routed_experts(sample, second)
    assert sample.rollout_routed_experts.tolist() == first.tolist() + [[[1, 2]], [[3, 4]]]
    assert sample.rollout_routed_experts.dtype == np.uint8


def test_agreement_is_counted_on_the_device_and_read_once_per_step(monkeypatch):
    """Each replayed MoE layer adds to device tensors (no host read per layer and
    micro-batch); miles_rank_counters reads the step's sums once and starts the next step."""
    from types import SimpleNamespace

    from miles_r3 import plugin
    from miles_r3.replay import ReplayState

    state = ReplayState()
    monkeypatch.setattr(plugin, "STATE", state)
    torch.manual_seed(0)
    agree = total = 0
    for layer in range(3):
        router_ids = torch.randint(0, 8, (6, 2))
        replay = torch.where(torch.rand(6, 1) < 0.5, router_ids.flip(-1), torch.randint(0, 8, (6, 2)))
        replay[0] = -1  # a row without a recorded route keeps the router's choice and is not compared
        context = SimpleNamespace(phase="train", replay_expert_ids={layer: replay})
        plugin.miles_select_experts(layer, None, 2, router_ids, context)
        assert isinstance(state.agree, torch.Tensor) and isinstance(state.total, torch.Tensor)
        for row in range(1, 6):
            total += 1
            agree += sorted(router_ids[row].tolist()) == sorted(replay[row].tolist())
    assert plugin.miles_rank_counters(None) == {"r3/agree": float(agree), "r3/total": float(total)}
    assert state.agree == 0 and state.total == 0
