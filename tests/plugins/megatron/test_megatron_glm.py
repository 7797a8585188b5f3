"""GLM-4.5 (``glm4_moe``) on ``--train-backend megatron``: partial rotary (``partial_rotary_factor``
0.5, rotate-half pairs) as Megatron's ``rotary_percent``, q/k/v biases, per-head q/k norm or none,
sigmoid routing with expert bias, shared experts and a dense first layer, against transformers'
GLM-4.5.

Tiny models (hidden 64, 2 layers, the first dense, 4 routed experts + a shared one, head dim 16
of which 8 rotate) saved with transformers, with random q/k/v biases, q/k norm weights and
``e_score_correction_bias`` so that each of them matters. The megatron trainer's log-probs are
transformers' (float32, CPU); two training steps give the native trainer's losses and weights, in
one process and as slime's GLM-4.5 script runs it (TP 2 x EP 2 with sequence parallelism: two gloo
trainer processes). Interleaved pairs (GLM-4 dense) are checked on Megatron's rope op against
transformers' GLM-4 one. Skipped where megatron-core is not installed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
transformers = pytest.importorskip("transformers")

from tests.plugins.megatron.conftest import assert_log_probs_equal_transformers, save_models  # noqa: E402
from tests.plugins.megatron.test_megatron_trainer import make_samples, make_trainer  # noqa: E402


def _glm4_moe(qk_norm: bool, groups: int = 1):
    return lambda: transformers.Glm4MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=groups, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        attention_bias=True, use_qk_norm=qk_norm, partial_rotary_factor=0.5, rope_theta=10000.0,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)


MODELS = {
    "glm4_moe": _glm4_moe(qk_norm=False),  # GLM-4.5 / 4.6: no q/k norm
    "glm4_moe_qk_norm": _glm4_moe(qk_norm=True, groups=2),  # use_qk_norm, group-limited routing
}
FLAGS = ("--calculate-per-token-loss", "--entropy-coef", "0.01", "--use-kl-loss", "--kl-loss-coef", "0.1")
KEYS = ("train/loss", "train/grad_norm", "train/pg_loss", "train/entropy_loss", "train/kl_loss")


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group(one_rank_group):
    """(see conftest: no process group left behind)"""


def _randomize(model) -> None:
    """Nonzero q/k/v biases, q/k norm weights away from 1 and a nonzero expert-score bias."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "e_score_correction_bias")):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.2)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                tensor.copy_(1 + torch.randn(tensor.shape, generator=generator) * 0.2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("megatron_glm"), MODELS, prepare=_randomize)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_log_probs_equal_transformers(models, name):
    assert_log_probs_equal_transformers(models, name)


def test_megatron_builds_partial_rotary_biases_and_glm_routing(models):
    """Megatron-Core's own modules and settings, not a re-implementation."""
    gpt = make_trainer(models, "glm4_moe_qk_norm", "megatron").model.gpt
    config = gpt.config
    assert not config.rotary_interleaved and config.add_qkv_bias and config.qk_layernorm
    assert gpt.rotary_pos_emb.inv_freq.numel() == 4  # 8 of the 16 head dims rotate: 4 frequencies
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias, config.moe_router_num_groups,
            config.moe_router_group_topk, config.moe_router_topk_scaling_factor) == ("sigmoid", True, 2, 1, 2.5)
    assert config.moe_layer_freq == [0, 1] and config.moe_shared_expert_intermediate_size == 32
    dense, moe = gpt.decoder.layers
    assert dense.self_attention.linear_qkv.bias.shape == ((4 + 2 * 2) * 16,)
    assert not hasattr(dense.mlp, "router") and type(moe.mlp).__name__ == "MoELayer"
    plain = make_trainer(models, "glm4_moe", "megatron").model.gpt
    assert not plain.config.qk_layernorm and plain.config.moe_router_num_groups in (None, 1)


def test_two_steps_give_the_native_losses_and_weights(models):
    native = make_trainer(models, "glm4_moe", "native", *FLAGS)
    megatron = make_trainer(models, "glm4_moe", "megatron", *FLAGS)
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
    assert not torch.equal(exported["layers.0.attn.qkv_proj.bias"], start["layers.0.attn.qkv_proj.bias"])


def test_slime_glm45_layout_on_two_gloo_ranks_gives_the_one_process_losses_and_weights(models):
    """slime's GLM-4.5 script's layout, scaled down: TP 2 x EP 2 (expert TP 1) with sequence parallelism,
    two trainer processes, each half the heads (and their q/k/v biases) and half the experts."""
    from miles_host.distributed.trainer_group import TrainerGroup
    from tests.plugins.megatron.test_megatron_parallel import _leave_groups

    single = make_trainer(models, "glm4_moe", "megatron", *FLAGS)
    samples = make_samples()
    want = [single.train(samples) for _ in range(2)]
    expected = {k: v.float() for k, v in single.named_weights_for_rollout()}
    _leave_groups()
    group = make_trainer(models, "glm4_moe", "megatron", *FLAGS, "--tensor-model-parallel-size", "2",
                         "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                         "--sequence-parallel", "--actor-num-gpus-per-node", "2", "--worker-timeout", "120")
    try:
        assert isinstance(group, TrainerGroup) and len(group.handles) == 1
        dense, moe = group.local.model.gpt.decoder.layers
        assert dense.self_attention.linear_qkv.bias.shape == ((4 + 2 * 2) * 16 // 2,)
        assert len(moe.mlp.experts.local_experts) == 2
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


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_megatron_partial_rope_is_transformers(interleaved):
    """Megatron's ``RotaryEmbedding(rotary_percent=0.5)`` and rope op against transformers' GLM-4.5
    (halves) and GLM-4 (interleaved pairs) rope, 8 of 16 head dims rotating."""
    import importlib

    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer import TransformerConfig

    from miles_megatron.runtime import init_model_parallel, on_device

    family = "glm4" if interleaved else "glm4_moe"
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    hf_config = (transformers.Glm4Config if interleaved else transformers.Glm4MoeConfig)(
        hidden_size=64, num_attention_heads=4, head_dim=16, partial_rotary_factor=0.5, rope_theta=10000.0)
    rotary = getattr(modeling, "Glm4RotaryEmbedding" if interleaved else "Glm4MoeRotaryEmbedding")(hf_config)
    seq, heads, dim = 7, 4, 16
    q_SHD = torch.randn(seq, heads, dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float()
    positions = torch.arange(seq)[None]
    cos, sin = rotary(q_SHD[None], positions)
    want, _ = modeling.apply_rotary_pos_emb(q_SHD.transpose(0, 1)[None], q_SHD.transpose(0, 1)[None], cos, sin)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, kv_channels=dim,
                               rotary_interleaved=interleaved)
    init_model_parallel(torch.device("cpu"))  # the rope asks Megatron for its context-parallel group
    with on_device(torch.device("cpu")):
        freqs = RotaryEmbedding(kv_channels=dim, rotary_percent=0.5, rotary_interleaved=interleaved,
                                rotary_base=10000, use_cpu_initialization=True)(seq)
        got = apply_rotary_pos_emb(q_SHD[:, None], freqs, config)[:, 0]
    assert (got - want[0].transpose(0, 1)).abs().max() < 1e-6
    assert torch.equal(got[..., 8:], q_SHD[..., 8:])  # the other half passes through


def test_rope_mapping_and_what_megatron_cannot_express(models):
    import dataclasses

    from miles_host.models import load_pretrained
    from miles_megatron.weights import gpt_model_kwargs, megatron_transformer_config_kwargs

    config = load_pretrained(models[0]["glm4_moe"]).config
    assert (config.rope.rotary_dim, config.head_dim, config.rope.interleaved) == (8, 16, False)
    assert gpt_model_kwargs(config)["rotary_percent"] == 0.5
    assert megatron_transformer_config_kwargs(config)["rotary_interleaved"] is False
    pairs = dataclasses.replace(config, rope=dataclasses.replace(config.rope, interleaved=True))
    assert megatron_transformer_config_kwargs(pairs)["rotary_interleaved"] is True
    # Megatron builds int(head_dim * rotary_percent) rotary dims: 30 of 44 in float rounds to 29 as a plain ratio
    uneven = dataclasses.replace(config, head_dim=44, rope=dataclasses.replace(config.rope, rotary_dim=30))
    assert int(44 * gpt_model_kwargs(uneven)["rotary_percent"]) == 30
    sandwich = dataclasses.replace(config, sandwich_norm=True)  # GLM-4 dense
    with pytest.raises(ValueError, match="post-attention/post-MLP norms"):
        megatron_transformer_config_kwargs(sandwich)
