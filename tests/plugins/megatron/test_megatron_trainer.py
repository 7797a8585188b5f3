"""``--train-backend megatron``: the native trainer's RL step on a Megatron-Core GPTModel.

CPU, float32, tiny HF models (hidden 64, 2 layers) saved with transformers. The
megatron trainer must give the native trainer's log-probs, losses and weights, and
with R3 train on the replayed experts through Megatron's RouterReplay. Skipped
where megatron-core is not installed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
transformers = pytest.importorskip("transformers")

from miles_host.cli.args import resolve_run_config  # noqa: E402
from miles_host.plugin_manager import MilesPluginManager  # noqa: E402
from miles_host.sample import Sample, Status  # noqa: E402
from tests.plugins.megatron.conftest import save_models  # noqa: E402

MODELS = {
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, tie_word_embeddings=False),
    # a dense first layer: Megatron builds that layer without a router (moe_layer_freq)
    "qwen3_moe_dense_first": lambda: transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0]),
}
TOP_K = 2


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group(one_rank_group):
    """(see conftest: no process group left behind)"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("megatron_trainer"), MODELS)


def make_trainer(models, name, backend, *flags):
    paths, data = models
    manager = MilesPluginManager()
    manager.discover()
    argv = ["--hf-checkpoint", str(paths[name]), "--prompt-data", str(data), "--rm-type", "exact",
            "--device", "cpu", "--train-backend", backend, "--micro-batch-size", "2", "--lr", "1e-4", *flags]
    config, _ = resolve_run_config(argv, manager)
    return manager.registries.train_backends.get(backend).factory(config, manager)


def make_samples(routes: bool = False, layers: int = 2, experts: int = 4) -> list[Sample]:
    """Two groups of two, prompts and responses of different lengths (padding matters)."""
    generator = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    samples = []
    for index, (prompt, response) in enumerate([(3, 4), (5, 2), (2, 6), (4, 3)]):
        tokens = torch.randint(2, 64, (prompt + response,), generator=generator).tolist()
        routed = None
        if routes:  # distinct random experts per token and layer, unrelated to the router's choice
            routed = np.stack([
                np.stack([rng.permutation(experts)[:TOP_K] for _ in range(layers)])
                for _ in range(len(tokens) - 1)
            ])
        samples.append(Sample(
            tokens=tokens, response_length=response, reward=[1.0, 0.0, 0.2, 0.9][index], loss_mask=[1] * response,
            status=Status.COMPLETED, group_index=index // 2, index=index, rollout_log_probs=[-4.0] * response,
            rollout_routed_experts=routed,
        ))
    return samples


def log_probs(trainer, samples, phase="old_logprob"):
    batch = trainer.pack(samples, phase)
    with torch.no_grad():
        return trainer.response_log_probs(trainer.model, batch)[0]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_log_probs_equal_the_native_trainers(models, name):
    native = make_trainer(models, name, "native")
    megatron = make_trainer(models, name, "megatron")
    assert type(megatron).__name__ == "MegatronTrainer"
    assert type(megatron.model.gpt).__name__ == "GPTModel"
    samples = make_samples()
    expected, got = log_probs(native, samples), log_probs(megatron, samples)
    assert got.shape == expected.shape == (sum(s.response_length for s in samples),)
    assert (got - expected).abs().max() < 1e-5
    moe_layers = [i for i, is_moe in enumerate(megatron.model.config.moe_layers) if is_moe]
    assert sorted(megatron.model.replay.routers) == moe_layers


def test_plain_attention_runs_one_sdpa_call_and_equals_megatrons_local_attention(models, monkeypatch):
    """Causal GQA layers run :class:`SdpaAttention` (no ``[S, S]`` scores materialised); the log-probs
    equal those of Megatron's local ``DotProductAttention`` on the same weights, padding included."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from miles_megatron import sdpa_attention
    from miles_megatron.sdpa_attention import SdpaAttention

    def core_attentions(trainer):
        return {type(layer.self_attention.core_attention) for layer in trainer.model.gpt.decoder.layers}

    sdpa = make_trainer(models, "qwen3", "megatron")
    assert core_attentions(sdpa) == {SdpaAttention}
    monkeypatch.setattr(sdpa_attention, "plain_attention", lambda config: False)
    local = make_trainer(models, "qwen3", "megatron")
    assert core_attentions(local) == {DotProductAttention}
    samples = make_samples()
    torch.testing.assert_close(log_probs(sdpa, samples), log_probs(local, samples), rtol=0, atol=2e-6)


def set_experts_impl(trainer, impl: str) -> int:
    """Set the megatron trainer's ``experts_impl`` (``MoEConfig.experts_impl``) on every MoE layer; how many."""
    from miles_megatron.grouped_experts import GroupedSequentialMLP

    experts = [module for module in trainer.model.gpt.modules() if isinstance(module, GroupedSequentialMLP)]
    for module in experts:
        module.experts_impl = impl
    return len(experts)


# the MoE model twice: SequentialMLP's per-expert loop (auto on the CPU) and the grouped GEMMs
@pytest.mark.parametrize("name, experts_impl, recompute", [
    ("qwen3", "auto", False), ("qwen3_moe", "auto", False), ("qwen3_moe", "grouped", False),
    ("qwen3_moe", "grouped", True),  # the grouped experts' weight gradients under recomputation
])
def test_two_steps_give_the_native_losses_and_weights(models, name, experts_impl, recompute):
    """Same data, same optimizer: same losses and exported weights after two steps.

    Gradients agree to float32 rounding, but AdamW divides each gradient element by
    its running RMS: an element whose gradient is float noise (mathematically zero)
    moves by a noise-dependent fraction of the learning rate in either backend, so
    the weight gap scales with --lr (measured here: < 1e-6 at 1e-4; ~1e-5 for the
    MoE model at 1e-3)."""
    flags = ("--calculate-per-token-loss", "--entropy-coef", "0.01", "--use-kl-loss", "--kl-loss-coef", "0.1",
             *(("--recompute-granularity", "full") if recompute else ()))
    native = make_trainer(models, name, "native", *flags)
    megatron = make_trainer(models, name, "megatron", *flags)
    assert set_experts_impl(megatron, experts_impl) == (2 if name == "qwen3_moe" else 0)
    samples = make_samples()
    for _ in range(2):
        want, got = native.train(samples), megatron.train(samples)
        assert abs(want["train/loss"]) > 1e-3
        for key in ("train/loss", "train/grad_norm", "train/pg_loss", "train/entropy_loss", "train/kl_loss"):
            assert got[key] == pytest.approx(want[key], abs=1e-5), key
    expected = dict(native.named_weights_for_rollout())
    exported = dict(megatron.named_weights_for_rollout())
    assert exported.keys() == expected.keys()
    assert max(float((exported[k] - expected[k]).abs().max()) for k in expected) < 1e-5
    # and the weights did move
    assert any(not torch.equal(exported[k], native.ref_model.state_dict()[k]) for k in expected)


def _routing_maps(trainer):
    """Record the ``routing_map`` ([tokens, experts], Megatron's token order) of every MoE router call."""
    from miles_megatron.replay import moe_routers

    calls = []
    for layer, router in moe_routers(trainer.model.gpt).items():
        router.register_forward_hook(lambda module, args, out, layer=layer: calls.append((layer, out[1].detach())))
    return calls


def _expected_map(samples, position, seq_len, experts=4):
    """The replayed experts of MoE layer ``position`` as a routing map in Megatron's
    ``[S, B]`` order (row ``s * B + b``); rows without a route are not compared."""
    batch = len(samples)
    expected = torch.zeros(seq_len * batch, experts, dtype=torch.bool)
    compared = torch.zeros(seq_len * batch, dtype=torch.bool)
    for b, sample in enumerate(samples):
        for s, ids in enumerate(sample.rollout_routed_experts[:, position]):
            expected[s * batch + b, torch.from_numpy(ids.astype(np.int64))] = True
            compared[s * batch + b] = True
    return expected, compared


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_r3_replays_the_rollout_experts_and_the_router_still_learns(models, recompute):
    flags = ("--plugins", "r3", *(("--recompute-granularity", "full") if recompute else ()))
    megatron = make_trainer(models, "qwen3_moe", "megatron", *flags)
    native = make_trainer(models, "qwen3_moe", "native", *flags)
    samples = make_samples(routes=True)
    # the replayed forward is the native trainer's replayed forward, and replay changes it
    replayed = log_probs(megatron, samples, "train")
    assert (replayed - log_probs(native, samples, "train")).abs().max() < 1e-5
    assert (replayed - log_probs(make_trainer(models, "qwen3_moe", "megatron"), samples, "train")).abs().max() > 1e-3
    calls = _routing_maps(megatron)
    metrics = megatron.train(samples)
    assert metrics["train/grad_norm"] > 0
    # the train pass over 2 micro-batches, 2 MoE layers each (+ the recomputed train pass); one
    # optimizer step, so no separate old-logprob pass (--old-logprob-pass auto)
    assert len(calls) == (8 if recompute else 4)
    micro_batches = {2 * max(len(s.tokens) for s in micro): micro for micro in (samples[:2], samples[2:])}
    assert len(micro_batches) == 2  # a micro-batch is told apart by its row count ([S * B, experts])
    for layer, routing_map in calls:
        micro = micro_batches[routing_map.shape[0]]
        expected, compared = _expected_map(micro, layer, max(len(s.tokens) for s in micro))
        assert int(compared.sum()) == sum(len(s.tokens) - 1 for s in micro)
        assert torch.equal(routing_map[compared], expected[compared]), layer
    for layer in (0, 1):
        weight = megatron.model.gpt.decoder.layers[layer].mlp.router.weight
        assert weight.grad is not None and float(weight.grad.abs().sum()) > 0
    # the same step on the native trainer (also replaying): same loss, gradient norm and weights
    want = native.train(samples)
    assert metrics["train/loss"] == pytest.approx(want["train/loss"], abs=1e-5)
    assert metrics["train/grad_norm"] == pytest.approx(want["train/grad_norm"], abs=1e-5)
    expected_weights = dict(native.named_weights_for_rollout())
    exported = dict(megatron.named_weights_for_rollout())
    assert max(float((exported[k] - expected_weights[k]).abs().max()) for k in expected_weights) < 1e-5


def test_replay_ids_without_a_routing_plugin_go_through_router_replay(models):
    """``RoutingContext.replay_expert_ids`` alone (no routing plugin) is replayed too."""
    from miles_r3.replay import replay_ids_for_batch

    megatron = make_trainer(models, "qwen3_moe", "megatron")
    assert not megatron.model.replay.routing_hooks.active
    samples = make_samples(routes=True)[:2]
    calls = _routing_maps(megatron)
    batch = megatron.pack(samples, "train")
    batch.routing.replay_expert_ids.update(
        replay_ids_for_batch(samples, [s.rollout_routed_experts for s in samples], [0, 1], TOP_K, torch.device("cpu"))
    )
    megatron.response_log_probs(megatron.model, batch)[0].sum().backward()
    seq_len = max(len(s.tokens) for s in samples)
    for layer, routing_map in calls:
        expected, compared = _expected_map(samples, layer, seq_len)
        assert torch.equal(routing_map[compared], expected[compared])
    # (Megatron's DistributedDataParallel accumulates the gradients in main_grad)
    assert float(megatron.model.gpt.decoder.layers[0].mlp.router.weight.main_grad.abs().sum()) > 0


def test_bf16_autocast_keeps_the_native_precision_policy(models):
    """The GPU precision policy, checked under CPU bf16 autocast: the residual stream stays
    float32 (as in the native model; Megatron's bias-dropout-add would cast it to bf16), the
    router GEMM gets bf16 input (its autograd Function has no custom_bwd), and a layer re-run
    outside autocast, as activation recomputation does in backward, runs under the forward's."""
    from miles_megatron.runtime import on_device

    trainer = make_trainer(models, "qwen3_moe", "megatron")
    policy = trainer.model
    seen, inputs = [], {}
    for layer in policy.gpt.decoder.layers:
        layer.register_forward_hook(lambda m, a, out: seen.append(("residual", out[0].dtype)))
        layer.mlp.router.register_forward_hook(lambda m, args, out: seen.append(("router", args[0].dtype)))
        layer.self_attention.register_forward_pre_hook(
            lambda m, a: seen.append(("autocast", torch.is_autocast_enabled("cpu"))))
    first = policy.gpt.decoder.layers[0]
    first.register_forward_pre_hook(lambda m, a, k: inputs.update(args=a, kwargs=k), with_kwargs=True)
    batch = trainer.pack(make_samples(), "train")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = policy.forward_hidden(batch.input_ids_T, batch.positions_T, batch.cu_seqlens)
    assert hidden.dtype == torch.float32
    assert sorted(set(seen)) == [("autocast", True), ("residual", torch.float32), ("router", torch.bfloat16)]
    seen.clear()
    with torch.no_grad(), on_device(torch.device("cpu")):
        first(*inputs["args"], **inputs["kwargs"])  # outside autocast, as a recomputation
    assert ("autocast", True) in seen and ("router", torch.bfloat16) in seen


@pytest.mark.parametrize("flags,message", [
    # context parallelism: one trainer process per CP rank
    (("--context-parallel-size", "2"), "TP 1 x PP 1 x CP 2 x DP 1 \\(EP 1, expert TP 1\\) runs 2 trainer processes.*"
     "--actor-num-gpus-per-node 2"),
    # EP carved out of TP x DP (Megatron's expert grid): EP 4 over TP 2 needs Megatron's DP 2
    (("--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "4", "--actor-num-gpus-per-node", "2"),
     "TP 2 x PP 1 x DP 2 \\(EP 4, expert TP 1\\) runs 4 trainer processes.*--actor-num-gpus-per-node 4"),
    # TP/EP/PP runs one trainer process per rank: the placement must say so
    (("--tensor-model-parallel-size", "2"), "runs 2 trainer processes.*--actor-num-gpus-per-node 2"),
    (("--pipeline-model-parallel-size", "2"), "runs 2 trainer processes.*--actor-num-gpus-per-node 2"),
    # DP a multiple of the smallest EP allows (EP 2 at TP 1: DP 2, 4, ...)
    (("--expert-model-parallel-size", "2", "--actor-num-gpus-per-node", "3"),
     "--actor-num-gpus-per-node 2 or a multiple of 2"),
    (("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"),
     "TP 2 x PP 2 x DP 1 \\(EP 1, expert TP 1\\) runs 4 trainer processes.*--actor-num-gpus-per-node 4"),
], ids=["cp", "tp_ep_four_trainers", "tp_one_trainer", "pp_one_trainer", "ep_three_trainers", "tp_pp_two_trainers"])
def test_parallel_sizes_it_does_not_run_are_refused_clearly(models, flags, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(models, "qwen3", "megatron", *flags)


def test_pipeline_size_must_divide_the_layers(models):
    from miles_host.models import load_pretrained
    from miles_megatron.policy import transformer_config

    config = load_pretrained(models[0]["qwen3"]).config
    with pytest.raises(ValueError, match="2 decoder layers do not split evenly over 3 stages"):
        transformer_config(config, pp=3)
    assert transformer_config(config, pp=2).pipeline_model_parallel_size == 2


def test_short_quickstart_run_with_save_and_resume(tmp_path):
    from miles_host.cli.main import main
    from miles_host.models import load_pretrained
    from miles_host.quickstart_preset import QUICKSTART_DIR

    evaluation = tmp_path / "eval.jsonl"
    evaluation.write_text("".join((QUICKSTART_DIR / "data" / "eval.jsonl").read_text().splitlines(True)[:8]))
    common = ["--train-backend", "megatron", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
              "--eval-prompt-data", "addition", str(evaluation), "--no-progress", "--save", str(tmp_path / "ckpt")]
    out = tmp_path / "out"
    assert main(["run", *common, "--num-rollout", "2", "--output-dir", str(out),
                 "--save-hf", str(tmp_path / "hf")]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["rollout_id"] in (0, 1) and "train/loss" in r]
    assert len(steps) == 2 and all(r["train/grad_norm"] > 0 for r in steps)
    # the megatron trainer's log-probs are the (native) engine's up to float32 rounding
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in steps)
    saved = load_pretrained(tmp_path / "hf").state_dict()
    initial = load_pretrained(QUICKSTART_DIR / "model").state_dict()
    assert saved.keys() == initial.keys() and any(not torch.equal(saved[k], initial[k]) for k in saved)
    resumed = tmp_path / "resumed"
    assert main(["run", *common, "--num-rollout", "3", "--output-dir", str(resumed), "--load", str(tmp_path / "ckpt")]) == 0
    assert [json.loads(line)["rollout_id"] for line in (resumed / "metrics.jsonl").read_text().splitlines()][0] == 2


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_mtp_draft_training_on_megatrons_mtp_layer_equals_the_native_draft(models, name):
    """``--plugins spec --enable-mtp-training``: the draft is Megatron-Core's MultiTokenPredictionLayer;
    from the same draft weights, two steps give the native trainer's MTP loss, policy loss and
    weights (draft included, under the native ``mtp.0.*`` names that weight sync carries)."""
    flags = ("--plugins", "spec", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.2")
    native = make_trainer(models, name, "native", *flags)
    megatron = make_trainer(models, name, "megatron", *flags)
    assert type(megatron.model.gpt.mtp.layers[0]).__name__ == "MultiTokenPredictionLayer"
    draft = {k: v for k, v in native.model.state_dict().items() if k.startswith("mtp.")}
    assert draft and all(torch.isfinite(v).all() for v in draft.values())
    megatron.model.load_state_dict({**megatron.model.state_dict(), **draft})
    megatron._make_optimizer()  # fresh AdamW state over the loaded draft
    samples = make_samples()
    for _ in range(2):
        want, got = native.train(samples), megatron.train(samples)
        assert want["train/mtp/loss"] > 0
        for key in ("train/mtp/loss", "train/loss", "train/grad_norm"):
            assert got[key] == pytest.approx(want[key], abs=1e-5), key
    expected = dict(native.named_weights_for_rollout())
    exported = dict(megatron.named_weights_for_rollout())
    assert exported.keys() == expected.keys() and any(k.startswith("mtp.0.") for k in exported)
    assert max(float((exported[k] - expected[k]).abs().max()) for k in expected) < 1e-5
    assert not torch.equal(exported["mtp.0.eh_proj.weight"], draft["mtp.0.eh_proj.weight"])  # the draft learned


def test_mtp_draft_refused_under_expert_parallel_sizes_above_one():
    from miles_megatron.mtp import attach_mtp_block

    policy = type("Policy", (), {"sizes": type("Sizes", (), {"parallel": True})(), "gpt": None})()
    with pytest.raises(ValueError, match="parallel size 1"):
        attach_mtp_block(policy, 1)


def test_megatron_subgroups_time_out_after_the_worker_timeout(models, monkeypatch):
    """A rank whose peer failed waits --worker-timeout (rounded up to whole minutes) in a TP/EP/PP
    collective, not Megatron's default 30 minutes."""
    from megatron.core import parallel_state

    seen = {}
    real = parallel_state.initialize_model_parallel

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(parallel_state, "initialize_model_parallel", spy)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    make_trainer(models, "qwen3", "megatron", "--worker-timeout", "90")
    assert seen["distributed_timeout_minutes"] == 2


def test_tp1_linears_run_f_linear_with_megatrons_results(models):
    """At TP size 1 every decoder linear but the routed experts' runs ``F.linear`` (autograd's own
    backward): the output and gradients of Megatron's linear function, bit for bit (float32 CPU)."""
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    from miles_megatron.plain_linears import plain_linear

    for name, plain_per_layer in (("qwen3", 4), ("qwen3_moe", 2)):  # (MoE: qkv and proj; the experts keep Megatron's)
        gpt = make_trainer(models, name, "megatron").model.gpt
        for layer in gpt.decoder.layers:
            impls = [vars(m).get("_forward_impl") for m in layer.modules() if hasattr(m, "_forward_impl")]
            assert impls.count(plain_linear) == plain_per_layer, name
    linear = gpt.decoder.layers[0].self_attention.linear_qkv
    x = torch.randn(5, 2, linear.weight.shape[1], generator=torch.Generator().manual_seed(0), requires_grad=True)
    results = []
    for impl in (plain_linear, linear_with_grad_accumulation_and_async_allreduce):
        out = impl(x, linear.weight, None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                   sequence_parallel=False, tp_group=linear.tp_group)
        results.append((out, *torch.autograd.grad(out.square().sum(), [x, linear.weight])))
    for got, want in zip(*results):
        assert torch.equal(got, want)
