"""DeepSeek-V3 on ``--train-backend megatron``: Megatron-Core's own MLA, yarn rope and
DeepSeek's MoE routing, against transformers' DeepSeek-V3.

A tiny ``deepseek_v3`` (hidden 64, 2 layers, the first dense, 8 routed experts in 4
groups (or 4 in 2) + a shared expert, ``q_lora_rank`` set or not, ``v_head_dim`` equal to
``qk_nope_head_dim`` or not, yarn with ``mscale_all_dim`` != 1 so
both the cos/sin factor and the softmax scale differ from 1, a random
``e_score_correction_bias``, ``rms_norm_eps`` != the latent norms' 1e-6) saved with
transformers. The megatron trainer's log-probs are transformers' (float32, CPU); training
steps give the native trainer's losses and weights, in one process and with TP = 2 (with and
without sequence parallelism), EP = 2 or PP = 2 (two gloo trainer processes); the weights go back
to HF names unchanged. Skipped where megatron-core is not installed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
transformers = pytest.importorskip("transformers")

from tests.plugins.megatron.conftest import assert_log_probs_equal_transformers, save_models, transformers_log_probs  # noqa: E402
from tests.plugins.megatron.test_megatron_trainer import log_probs, make_samples, make_trainer  # noqa: E402

YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.8}


def _deepseek_v3(q_lora_rank: int | None, experts: int, groups: int, group_topk: int, v_head_dim: int = 16):
    return lambda: transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=experts, n_shared_experts=1,
        num_experts_per_tok=2, n_group=groups, topk_group=group_topk, first_k_dense_replace=1,
        routed_scaling_factor=2.5, q_lora_rank=q_lora_rank,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=v_head_dim, rope_theta=10000.0,
        rope_scaling=dict(YARN), max_position_embeddings=163840, rms_norm_eps=1e-5, tie_word_embeddings=False)


MODELS = {
    # slime's tiny DeepSeek-V3 routing: groups scored by their top 2 (Megatron's rule would take the top 1)
    "deepseek_v3": _deepseek_v3(32, experts=8, groups=4, group_topk=2),
    # top_k = 2 x topk_group: Megatron's own group-limited top-k is DeepSeek's; values narrower than keys
    "deepseek_v3_q_proj": _deepseek_v3(None, experts=4, groups=2, group_topk=1, v_head_dim=12),
}
FLAGS = ("--calculate-per-token-loss", "--entropy-coef", "0.01", "--use-kl-loss", "--kl-loss-coef", "0.1")
KEYS = ("train/loss", "train/grad_norm", "train/pg_loss", "train/entropy_loss", "train/kl_loss")


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group(one_rank_group):
    """(see conftest: no process group left behind)"""


def _random_expert_bias(model) -> None:
    """A nonzero ``e_score_correction_bias``: the choice differs from the plain top-k."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("megatron_deepseek"), MODELS, prepare=_random_expert_bias)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_log_probs_equal_transformers(models, name):
    assert_log_probs_equal_transformers(models, name)


def test_megatron_builds_mla_yarn_and_deepseek_routing(models):
    """Megatron-Core's own modules and settings, not a re-implementation."""
    from safetensors.torch import load_file

    gpt = make_trainer(models, "deepseek_v3", "megatron").model.gpt
    config = gpt.config
    assert type(config).__name__ == "MLATransformerConfig" and config.multi_latent_attention
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim) == (32, 16, 16, 8, 16)
    assert (config.rope_type, config.rotary_scaling_factor, config.original_max_position_embeddings,
            config.mscale, config.mscale_all_dim) == ("yarn", 40.0, 4096, 1.0, 0.8)
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias, config.moe_router_num_groups,
            config.moe_router_group_topk, config.moe_router_topk_scaling_factor) == ("sigmoid", True, 4, 2, 2.5)
    assert config.moe_layer_freq == [0, 1] and config.moe_shared_expert_intermediate_size == 32
    dense, moe = gpt.decoder.layers
    for layer in (dense, moe):
        attention = layer.self_attention
        assert type(attention).__name__ == "MLASelfAttention"
        assert type(attention.rotary_pos_emb).__name__ == "YarnRotaryEmbedding"
        assert attention.q_layernorm.eps == attention.kv_layernorm.eps == 1e-6  # HF's latent norms
    assert not hasattr(dense.mlp, "router") and type(moe.mlp).__name__ == "MoELayer"
    hf = load_file(str(models[0]["deepseek_v3"] / "model.safetensors"))
    bias = hf["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().sum() > 0 and torch.equal(moe.mlp.router.expert_bias, bias)


def test_two_steps_give_the_native_losses_and_weights(models):
    native = make_trainer(models, "deepseek_v3", "native", *FLAGS)
    megatron = make_trainer(models, "deepseek_v3", "megatron", *FLAGS)
    samples = make_samples()
    for _ in range(2):
        want, got = native.train(samples), megatron.train(samples)
        assert abs(want["train/loss"]) > 1e-3 and got["train/grad_norm"] > 0
        for key in KEYS:
            assert got[key] == pytest.approx(want[key], abs=1e-5), key
    expected = dict(native.named_weights_for_rollout())
    exported = dict(megatron.named_weights_for_rollout())
    assert exported.keys() == expected.keys()
    assert max(float((exported[k] - expected[k]).abs().max()) for k in expected) < 1e-5
    start = native.ref_model.state_dict()
    assert any(not torch.equal(exported[k], start[k]) for k in expected)
    # every MLA projection, norm and the MoE router learned on Megatron's side
    for suffix in ("q_a_proj", "q_a_norm", "q_b_proj", "kv_a_proj", "kv_a_norm", "kv_b_proj", "o_proj"):
        assert not torch.equal(exported[f"layers.1.attn.{suffix}.weight"], start[f"layers.1.attn.{suffix}.weight"])
    assert not torch.equal(exported["layers.1.mlp.router.weight"], start["layers.1.mlp.router.weight"])


def test_weights_go_back_to_hf_names_unchanged(models, tmp_path):
    """Megatron's state -> native names -> the family's HF names: the checkpoint it was loaded from."""
    from safetensors.torch import load_file

    from miles_host.models import load_pretrained, save_pretrained

    path = models[0]["deepseek_v3"]
    trainer = make_trainer(models, "deepseek_v3", "megatron")
    assert not any(name.startswith("self_attention") for name in trainer.full_state_dict())
    save_pretrained(load_pretrained(path), tmp_path / "hf", state_dict=trainer.full_state_dict())
    original, exported = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "hf/model.safetensors"))
    assert exported.keys() == original.keys()
    hf_names = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    for name in hf_names:
        assert f"model.layers.0.self_attn.{name}.weight" in exported
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_r3_replays_through_deepseek_routing(models):
    """R3 on the sigmoid / expert-bias / group-limited router: the native trainer's replayed log-probs
    and agreement counts."""
    megatron = make_trainer(models, "deepseek_v3", "megatron", "--plugins", "r3")
    native = make_trainer(models, "deepseek_v3", "native", "--plugins", "r3")
    samples = make_samples(routes=True, layers=1, experts=8)  # routes of the one MoE layer
    replayed = log_probs(megatron, samples, "train")
    assert (replayed - log_probs(native, samples, "train")).abs().max() < 1e-5
    assert (replayed - log_probs(make_trainer(models, "deepseek_v3", "megatron"), samples, "train")).abs().max() > 1e-3
    # the router's own choice (R3 counts where the rollout agreed with it) is DeepSeek's
    megatron.train(samples)
    native.train(samples)
    assert megatron.rank_counters()["r3/total"] > 0
    assert megatron.rank_counters() == native.rank_counters()


@pytest.mark.parametrize("size_flag,extra", [
    ("--tensor-model-parallel-size", ()),
    ("--tensor-model-parallel-size", ("--sequence-parallel",)),
    ("--expert-model-parallel-size", ()),
    ("--pipeline-model-parallel-size", ()),  # the dense layer on the first stage, the MoE layer on the second
], ids=["tp2", "tp2_sp", "ep2", "pp2"])
def test_two_gloo_ranks_give_the_one_process_losses_and_weights(models, size_flag, extra):
    from miles_host.distributed.trainer_group import TrainerGroup
    from tests.plugins.megatron.test_megatron_parallel import _leave_groups

    single = make_trainer(models, "deepseek_v3", "megatron", *FLAGS)
    samples = make_samples()
    want = [single.train(samples) for _ in range(2)]
    expected = {k: v.float() for k, v in single.named_weights_for_rollout()}
    _leave_groups()
    group = make_trainer(models, "deepseek_v3", "megatron", *FLAGS, size_flag, "2", "--actor-num-gpus-per-node", "2",
                         "--worker-timeout", "120", *extra)
    try:
        assert isinstance(group, TrainerGroup)
        attention = group.local.model.gpt.decoder.layers[0].self_attention
        if size_flag == "--tensor-model-parallel-size":  # half of the heads; the latent down projections split too
            assert attention.linear_q_up_proj.weight.shape == (2 * 24, 32)
            assert attention.linear_kv_down_proj.weight.shape == (12, 64)
        for step in range(2):
            got = group.train(samples)
            for key in KEYS:
                assert got[key] == pytest.approx(want[step][key], abs=1e-5), (step, key)
        exported = {k: v.float() for k, v in group.named_weights_for_rollout()}
        assert exported.keys() == expected.keys()
        assert max(float((exported[k] - expected[k]).abs().max()) for k in expected) < 1e-5
    finally:
        group.stop()
        _leave_groups()


def _with(config, **changes):
    """A copy of a native config with rope / mla / moe fields changed (``rope__factor=...``)."""
    import dataclasses

    parts = {}
    for key, value in changes.items():
        part, field = key.split("__")
        parts.setdefault(part, {})[field] = value
    return dataclasses.replace(config, **{part: dataclasses.replace(getattr(config, part), **fields)
                                          for part, fields in parts.items()})


@pytest.mark.parametrize("changes,message", [
    ({"rope__interleaved": False}, "MLA with rope_interleave=false"),
    ({"rope__rope_type": "linear"}, "MLA with rope scaling 'linear'"),
    ({"rope__attention_factor": 1.5}, "yarn attention factor 1.5"),
    ({"rope__truncate": False}, "yarn with truncate=false"),
    ({"moe__norm_topk_prob": False}, "sigmoid routing without norm_topk_prob"),
])
def test_what_megatron_computes_differently_is_refused_by_name(models, changes, message):
    from miles_host.models import load_pretrained
    from miles_megatron.weights import megatron_transformer_config_kwargs

    config = load_pretrained(models[0]["deepseek_v3"]).config
    assert megatron_transformer_config_kwargs(config)["multi_latent_attention"]
    with pytest.raises(ValueError, match=f"does not support .*{message}.*use --train-backend native"):
        megatron_transformer_config_kwargs(_with(config, **changes))


def test_latent_down_projections_must_split_over_tensor_parallel_ranks(models):
    from miles_host.models import load_pretrained
    from miles_megatron.mla import tensor_parallel_problems

    config = load_pretrained(models[0]["deepseek_v3"]).config  # q_lora_rank 32, kv_lora_rank 16 + rope 8
    assert tensor_parallel_problems(config, 2) == tensor_parallel_problems(config, 8) == []
    assert tensor_parallel_problems(config, 3) == ["q_lora_rank (32)"]
    assert tensor_parallel_problems(config, 16) == ["kv_lora_rank + qk_rope_head_dim (24)"]
    assert tensor_parallel_problems(_with(config, mla__q_lora_rank=None), 3) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_log_probs_follow_transformers_within_bf16_and_a_step_trains(models):
    """On CUDA (NCCL, bf16 autocast over float32 masters): the log-probs are transformers' float32 ones
    within a bf16 tolerance (mean and max over the response tokens; a near-tied expert choice may flip
    under bf16), and one training step gives a finite loss and a nonzero gradient norm.

        python -m pytest tests/plugins/megatron/test_megatron_deepseek.py -m gpu
    """
    trainer = make_trainer(models, "deepseek_v3", "megatron", *FLAGS, "--device", "cuda")
    assert trainer.model.gpt.decoder.layers[0].self_attention.linear_kv_down_proj.weight.is_cuda
    samples = make_samples()
    got = log_probs(trainer, samples).float().cpu()
    diff = (got - transformers_log_probs(models[0]["deepseek_v3"], samples)).abs()
    assert float(diff.mean()) < 1e-2 and float(diff.max()) < 5e-2, diff
    metrics = trainer.train(samples)
    assert torch.isfinite(torch.tensor(metrics["train/loss"])) and metrics["train/grad_norm"] > 0


def test_mtp_draft_on_an_mla_layer_equals_the_native_draft(models):
    """``--plugins spec --enable-mtp-training``: Megatron's MTP layer with MLA (and DeepSeek routing) gives
    the native draft's losses; where Megatron's group-limited top-k is not the model's, it is refused."""
    flags = ("--plugins", "spec", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.2")
    native = make_trainer(models, "deepseek_v3_q_proj", "native", *flags)
    megatron = make_trainer(models, "deepseek_v3_q_proj", "megatron", *flags)
    assert type(megatron.model.gpt.mtp.layers[0].transformer_layer.self_attention).__name__ == "MLASelfAttention"
    draft = {k: v for k, v in native.model.state_dict().items() if k.startswith("mtp.")}
    megatron.model.load_state_dict({**megatron.model.state_dict(), **draft})
    megatron._make_optimizer()  # fresh AdamW state over the loaded draft
    samples = make_samples()
    for _ in range(2):
        want, got = native.train(samples), megatron.train(samples)
        for key in ("train/mtp/loss", "train/loss", "train/grad_norm"):
            assert got[key] == pytest.approx(want[key], abs=1e-5), key
    with pytest.raises(ValueError, match="draft's MoE router would take Megatron's group-limited top-k"):
        make_trainer(models, "deepseek_v3", "megatron", *flags)
