"""``--plugins fp8`` with ``--train-backend megatron``: Megatron's linears run miles-fp8's
block-scaled FP8 GEMMs (CPU emulation here) and compute what the native FP8 trainer
computes, so training and the FP8 rollout multiply the same quantized weights."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
transformers = pytest.importorskip("transformers")

from tests.plugins.megatron.conftest import save_models  # noqa: E402
from tests.plugins.megatron.test_megatron_trainer import log_probs, make_samples, make_trainer, set_experts_impl  # noqa: E402

#: FP8 blocks are 128 x 128: dims that are multiples of 128 (head_dim 128: same blocks in both layouts)
MODELS = {
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128, tie_word_embeddings=True),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, tie_word_embeddings=False),
    "qwen3_tp": lambda: transformers.Qwen3Config(  # two kv heads: one per rank at TP = 2
        vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=128, tie_word_embeddings=False),
    "tp_cuts_blocks": lambda: transformers.Qwen3Config(  # intermediate 384: 192-row shards at TP = 2
        vocab_size=64, hidden_size=256, intermediate_size=384, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=128, tie_word_embeddings=True),
    "head_dim_64": lambda: transformers.Qwen3Config(
        vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group(one_rank_group):
    """(see conftest: no process group left behind)"""


def _outlier_rows(model):
    """Rows scaled by up to 4x: the FP8 scales differ across blocks."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.mul_(torch.rand(parameter.shape[0], 1) * 4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("megatron_fp8"), MODELS, _outlier_rows)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_fp8_log_probs_equal_the_native_fp8_trainers(models, name):
    native = make_trainer(models, name, "native", "--plugins", "fp8")
    megatron = make_trainer(models, name, "megatron", "--plugins", "fp8")
    # FP8 experts keep the per-expert loop (the grouped GEMMs would skip their FP8 linears)
    set_experts_impl(megatron, "grouped")
    bf16 = make_trainer(models, name, "megatron")
    samples = make_samples()
    expected, got, plain = log_probs(native, samples), log_probs(megatron, samples), log_probs(bf16, samples)
    assert (got - expected).abs().max() < 1e-5
    assert (got - plain).abs().max() > 1e-4  # the FP8 GEMMs did run
    routed = [n for n, m in megatron.model.gpt.named_modules() if getattr(m, "_forward_impl", None) is not None
              and getattr(m._forward_impl, "func", None) is not None]
    assert any("linear_qkv" in n for n in routed) and not any("output_layer" in n for n in routed)


def test_fp8_training_step_and_rollout_weights_match_the_native_fp8_trainer(models):
    """The rollout weights (master weights quantized at sync) are the native trainer's bit for
    bit; a step's loss is the same. Gradients agree to FP8 rounding only: the weight-gradient
    GEMM quantizes activations and output gradients in groups of 128 tokens, and Megatron's
    padded [S, B] token order groups other tokens than the native packed order."""
    native = make_trainer(models, "qwen3_moe", "native", "--plugins", "fp8")
    megatron = make_trainer(models, "qwen3_moe", "megatron", "--plugins", "fp8")
    expected = dict(native.named_weights_for_rollout())
    exported = dict(megatron.named_weights_for_rollout())
    assert exported.keys() == expected.keys()
    assert any(t.dtype == torch.float8_e4m3fn for t in exported.values())  # quantized for the FP8 engine
    for key in expected:
        assert torch.equal(exported[key], expected[key]), key
    samples = make_samples()
    want, got = native.train(samples), megatron.train(samples)
    assert got["train/loss"] == pytest.approx(want["train/loss"], abs=1e-5)
    assert got["train/pg_loss"] == pytest.approx(want["train/pg_loss"], abs=1e-5)
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=0.1)


def test_fp8_refuses_what_it_cannot_make_unified(models):
    with pytest.raises(ValueError, match="head_dim 64"):
        make_trainer(models, "head_dim_64", "megatron", "--plugins", "fp8")
    with pytest.raises(ValueError, match=r"intermediate_size 384 / 2 = 192, not multiples of 128"):
        make_trainer(models, "tp_cuts_blocks", "megatron", "--plugins", "fp8", "--tensor-model-parallel-size", "2",
                     "--actor-num-gpus-per-node", "2")


@pytest.mark.parametrize("sequence_parallel", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fp8_with_two_tensor_parallel_ranks_gives_the_one_process_step(models, sequence_parallel):
    """TP = 2 (gloo, two trainer processes) with FP8: each rank's shard holds whole 128 x 128 blocks, so the
    FP8 values are the one-process ones and the loss, grad norm and the next step's loss agree to float32
    summation order (the input-gradient all-reduce, or with sequence parallelism the all-gather and
    reduce-scatter, done around the FP8 GEMMs)."""
    from tests.plugins.megatron.test_megatron_parallel import _leave_groups

    samples = make_samples()
    _leave_groups()
    single = make_trainer(models, "qwen3_tp", "megatron", "--plugins", "fp8")
    want = [single.train(samples) for _ in range(2)]
    _leave_groups()
    extra = ["--sequence-parallel"] if sequence_parallel else []
    group = make_trainer(models, "qwen3_tp", "megatron", "--plugins", "fp8", "--tensor-model-parallel-size", "2",
                         "--actor-num-gpus-per-node", "2", *extra)
    # Sequence parallelism pads the sequence dimension to a multiple of TP, which regroups the tokens of the
    # weight-gradient GEMMs' 128-token FP8 groups: the gradients agree to FP8 rounding only (as with EP).
    grad_rel, next_loss_abs = (0.1, 1e-3) if sequence_parallel else (1e-4, 1e-5)
    try:
        got = [group.train(samples) for _ in range(2)]
        assert got[0]["train/loss"] == pytest.approx(want[0]["train/loss"], abs=1e-5)
        assert got[1]["train/loss"] == pytest.approx(want[1]["train/loss"], abs=next_loss_abs)
        assert got[0]["train/grad_norm"] == pytest.approx(want[0]["train/grad_norm"], rel=grad_rel)
        # The first (clipped) Adam step moves each weight by ~lr * sign(gradient): where a gradient element
        # is at the level of the dgrad all-reduce's summation-order noise its sign can differ, and a
        # weight that moves a 128 x 128 block's largest element requantizes the whole block. The second
        # step's gradients then agree to FP8 rounding only (without FP8 this comparison is exact to
        # float32 summation order: test_megatron_parallel).
        assert got[1]["train/grad_norm"] == pytest.approx(want[1]["train/grad_norm"], rel=0.1)
    finally:
        group.stop()
        _leave_groups()


def test_fp8_with_two_expert_parallel_ranks_gives_the_one_process_loss(models, tmp_path):
    """EP = 2 (gloo, two trainer processes, each rank holding half of the experts) with FP8:
    the first step's loss is the one-process loss (the forward quantizes each token's row on
    its own), the gradient norm agrees to FP8 rounding (token groups differ per rank)."""
    from tests.plugins.megatron.test_megatron_parallel import _leave_groups

    samples = make_samples()
    _leave_groups()
    single = make_trainer(models, "qwen3_moe", "megatron", "--plugins", "fp8")
    want = single.train(samples)
    _leave_groups()
    group = make_trainer(models, "qwen3_moe", "megatron", "--plugins", "fp8", "--expert-model-parallel-size", "2",
                         "--actor-num-gpus-per-node", "2")
    try:
        assert len(group.local.model.gpt.decoder.layers[0].mlp.experts.local_experts) == 2
        got = group.train(samples)
        assert got["train/loss"] == pytest.approx(want["train/loss"], abs=1e-5)
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=0.1)
    finally:
        group.stop()
        _leave_groups()
