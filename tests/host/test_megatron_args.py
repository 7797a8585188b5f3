"""Megatron's MODEL_ARGS / PERF_ARGS as slime's launch scripts write them.

Four tiny HF checkpoints (hidden 64, 2 layers) are built with transformers' config classes,
shaped like the models of slime's ``scripts/models/qwen3-0.6B.sh``, ``qwen3-30B-A3B.sh``,
``deepseek-v3.sh`` and ``glm4.5-106B-A12B.sh``; each model's ``MODEL_ARGS`` are computed
from its config the way those scripts spell them (the reference is the HF config, read by
transformers, not by miles). They pass ``miles run --dry-run``; each wrong value is an
error naming the flag, its value, the config key and the config's value.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from miles_host.cli.backend_choice import choose_train_backend
from miles_host.cli.main import main
from miles_host.validation import ignored_flags
from miles_host.validation.megatron_arch import moe_layer_pattern
from miles_megatron.plugin import megatron_available

MEGATRON = megatron_available()[0]


def _qwen3(folder: Path) -> dict:
    from transformers import Qwen3Config

    return _save(folder, Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000, tie_word_embeddings=True,
        max_position_embeddings=256))


def _qwen3_moe(folder: Path) -> dict:
    from transformers import Qwen3MoeConfig

    return _save(folder, Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1000000, tie_word_embeddings=False,
        max_position_embeddings=256))


def _deepseek_v3(folder: Path) -> dict:
    from transformers import DeepseekV3Config

    yarn = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    return _save(folder, DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000,
        rope_scaling=yarn, max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False))


def _glm45(folder: Path) -> dict:
    from transformers import Glm4MoeConfig

    return _save(folder, Glm4MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, attention_bias=True, rope_theta=1000000,
        partial_rotary_factor=0.5, max_position_embeddings=256, tie_word_embeddings=False))


def _save(folder: Path, config) -> dict:
    config.save_pretrained(folder)
    return json.loads((folder / "config.json").read_text())


def _rope_theta(hf: dict) -> int:
    return int((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta")))


def _moe_layer_freq(hf: dict, first_dense: int) -> str:
    """``printf -v MOE_LAYER_FREQ "[%s]" "$(IFS=', '; echo "${arr[*]}")"`` of slime's scripts."""
    return "[" + ",".join("0" if i < first_dense else "1" for i in range(hf["num_hidden_layers"])) + "]"


def qwen3_model_args(hf: dict) -> list[str]:
    """``scripts/models/qwen3-0.6B.sh``."""
    return ["--swiglu", "--num-layers", str(hf["num_hidden_layers"]), "--hidden-size", str(hf["hidden_size"]),
            "--ffn-hidden-size", str(hf["intermediate_size"]), "--num-attention-heads", str(hf["num_attention_heads"]),
            "--group-query-attention", "--num-query-groups", str(hf["num_key_value_heads"]),
            "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
            "--norm-epsilon", "1e-6", "--rotary-base", str(_rope_theta(hf)), "--vocab-size", str(hf["vocab_size"]),
            "--kv-channels", str(hf["head_dim"]), "--qk-layernorm"]


def qwen3_moe_model_args(hf: dict) -> list[str]:
    """``scripts/models/qwen3-30B-A3B.sh`` (its perf flags included)."""
    return ["--disable-bias-linear", "--qk-layernorm", "--group-query-attention",
            "--num-attention-heads", str(hf["num_attention_heads"]),
            "--num-query-groups", str(hf["num_key_value_heads"]),
            "--kv-channels", str(hf["head_dim"]), "--num-layers", str(hf["num_hidden_layers"]),
            "--hidden-size", str(hf["hidden_size"]), "--ffn-hidden-size", str(hf["intermediate_size"]),
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--norm-epsilon", "1e-6",
            "--rotary-percent", "1.0", "--swiglu", "--untie-embeddings-and-output-weights",
            "--vocab-size", str(hf["vocab_size"]), "--rotary-base", str(_rope_theta(hf)),
            "--moe-ffn-hidden-size", str(hf["moe_intermediate_size"]), "--moe-router-score-function", "softmax",
            "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", str(hf["num_experts_per_tok"]),
            "--moe-layer-freq", _moe_layer_freq(hf, 0),
            "--num-experts", str(hf.get("num_experts") or hf["num_local_experts"]),
            "--moe-grouped-gemm", "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32",
            "--moe-permute-fusion", "--moe-aux-loss-coeff", "0"]


def deepseek_v3_model_args(hf: dict) -> list[str]:
    """``scripts/models/deepseek-v3.sh``."""
    rope = hf.get("rope_parameters") or hf["rope_scaling"]
    return ["--disable-bias-linear", "--num-layers", str(hf["num_hidden_layers"]),
            "--hidden-size", str(hf["hidden_size"]), "--ffn-hidden-size", str(hf["intermediate_size"]),
            "--num-attention-heads", str(hf["num_attention_heads"]), "--kv-channels", str(hf["qk_nope_head_dim"]),
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--norm-epsilon", "1e-6",
            "--swiglu", "--untie-embeddings-and-output-weights", "--vocab-size", str(hf["vocab_size"]),
            "--multi-latent-attention", "--q-lora-rank", str(hf["q_lora_rank"]),
            "--kv-lora-rank", str(hf["kv_lora_rank"]), "--qk-head-dim", str(hf["qk_nope_head_dim"]),
            "--qk-pos-emb-head-dim", str(hf["qk_rope_head_dim"]), "--v-head-dim", str(hf["v_head_dim"]),
            "--qk-layernorm", "--rotary-scaling-factor", str(int(rope["factor"])),
            "--rotary-base", str(_rope_theta(hf)), "--mscale", "1.0", "--mscale-all-dim", "1.0",
            "--attention-softmax-in-fp32", "--no-rope-fusion",
            "--num-experts", str(hf["n_routed_experts"]), "--moe-layer-freq", _moe_layer_freq(hf, 1),
            "--moe-ffn-hidden-size", str(hf["moe_intermediate_size"]),
            "--moe-router-topk", str(hf["num_experts_per_tok"]),
            "--moe-shared-expert-intermediate-size", str(hf["moe_intermediate_size"] * hf["n_shared_experts"]),
            "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-token-dispatcher-type", "alltoall",
            "--moe-aux-loss-coeff", "0", "--moe-router-bias-update-rate", "0",
            "--moe-router-group-topk", str(hf["topk_group"]), "--moe-router-num-groups", str(hf["n_group"]),
            "--moe-grouped-gemm", "--moe-router-topk-scaling-factor", str(hf["routed_scaling_factor"]),
            "--moe-router-dtype", "fp32", "--moe-permute-fusion"]


def glm45_model_args(hf: dict) -> list[str]:
    """``scripts/models/glm4.5-106B-A12B.sh`` (N_DENSE_LAYERS=1, N_MOE_LAYERS=1)."""
    dense = hf["first_k_dense_replace"]
    return ["--disable-bias-linear", "--group-query-attention", "--num-attention-heads", str(hf["num_attention_heads"]),
            "--num-query-groups", str(hf["num_key_value_heads"]), "--kv-channels", str(hf["head_dim"]),
            "--num-layers", str(hf["num_hidden_layers"]), "--hidden-size", str(hf["hidden_size"]),
            "--ffn-hidden-size", str(hf["intermediate_size"]), "--add-qkv-bias", "--normalization", "RMSNorm",
            "--position-embedding-type", "rope", "--rotary-percent", "0.5", "--swiglu",
            "--untie-embeddings-and-output-weights", "--vocab-size", str(hf["vocab_size"]),
            "--rotary-base", str(_rope_theta(hf)),
            "--moe-ffn-hidden-size", str(hf["moe_intermediate_size"]),
            "--moe-shared-expert-intermediate-size", str(hf["moe_intermediate_size"] * hf["n_shared_experts"]),
            "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate", "0", "--moe-router-load-balancing-type", "seq_aux_loss",
            "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", str(hf["num_experts_per_tok"]),
            "--moe-layer-freq", f"[0]*{dense}+[1]*{hf['num_hidden_layers'] - dense}",
            "--num-experts", str(hf["n_routed_experts"]), "--moe-grouped-gemm", "--moe-router-dtype", "fp32",
            "--moe-permute-fusion", "--moe-aux-loss-coeff", "0"]


#: slime's MISC_ARGS and the single-GPU parts of its PERF_ARGS (run-qwen3-30B-A3B.sh)
PERF_ARGS = ["--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
             "--expert-tensor-parallel-size", "1", "--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "2048",
             "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
             "--attention-softmax-in-fp32", "--attention-backend", "flash", "--use-distributed-optimizer"]

MODELS = {
    "qwen3": (_qwen3, qwen3_model_args),
    "qwen3_moe": (_qwen3_moe, qwen3_moe_model_args),
    "deepseek_v3": (_deepseek_v3, deepseek_v3_model_args),
    "glm4_moe": (_glm45, glm45_model_args),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``{name: (folder, hf config dict, slime MODEL_ARGS)}`` and a prompt file."""
    root = tmp_path_factory.mktemp("megatron-args")
    (root / "prompts.jsonl").write_text('{"input": "1+1=", "label": "2"}\n')
    built = {}
    for name, (build, model_args) in MODELS.items():
        hf = build(root / name)
        built[name] = (root / name, hf, model_args(hf))
    return root, built


def _run(capsys, models, name, *argv):
    root, built = models
    folder, _, _ = built[name]
    code = main(["run", "--hf-checkpoint", str(folder), "--prompt-data", str(root / "prompts.jsonl"),
                 "--rm-type", "exact", "--n-samples-per-prompt", "2", *argv, "--dry-run"])
    captured = capsys.readouterr()
    return code, captured.err


@pytest.mark.parametrize("name", list(MODELS))
def test_slime_model_args_pass_dry_run(models, name, capsys):
    _, built = models
    code, err = _run(capsys, models, name, *built[name][2], *PERF_ARGS)
    assert code == 0, err
    assert "error" not in err


def _replace(argv: list[str], flag: str, value: str | None) -> list[str]:
    """``argv`` with ``flag``'s value replaced (``None``: a switch, dropped; a flag the script
    does not give: appended)."""
    if flag not in argv:
        return [*argv, flag, value]
    index = argv.index(flag)
    if value is None:
        return argv[:index] + argv[index + 1:]
    return argv[:index + 1] + [value] + argv[index + 2:]


#: (model, flag, wrong value or None to drop a switch, config key named, config value named)
WRONG = [
    ("qwen3", "--num-layers", "28", "num_hidden_layers", "2"),
    ("qwen3", "--hidden-size", "1024", "hidden_size", "64"),
    ("qwen3", "--ffn-hidden-size", "3072", "intermediate_size", "128"),
    ("qwen3", "--num-query-groups", "8", "num_key_value_heads", "2"),
    ("qwen3", "--kv-channels", "128", "head_dim", "16"),
    ("qwen3", "--vocab-size", "151936", "vocab_size", "128"),
    ("qwen3", "--norm-epsilon", "1e-05", "rms_norm_eps", "1e-06"),
    ("qwen3", "--rotary-base", "10000", "rope_parameters.rope_theta", "1000000"),
    ("qwen3", "--qk-layernorm", None, "model_type", "qwen3"),
    ("qwen3", "--swiglu", None, "hidden_act", "silu"),
    ("qwen3", "--group-query-attention", None, "num_key_value_heads", "2"),
    ("qwen3_moe", "--num-experts", "128", "num_local_experts", "8"),
    ("qwen3_moe", "--moe-router-topk", "8", "num_experts_per_tok", "2"),
    ("qwen3_moe", "--moe-ffn-hidden-size", "768", "moe_intermediate_size", "32"),
    ("qwen3_moe", "--moe-layer-freq", "[0, 1]", "mlp_only_layers", "[]"),
    ("qwen3_moe", "--moe-router-score-function", "sigmoid", "model_type", "qwen3_moe"),
    ("qwen3_moe", "--untie-embeddings-and-output-weights", None, "tie_word_embeddings", "False"),
    ("deepseek_v3", "--q-lora-rank", "1536", "q_lora_rank", "32"),
    ("deepseek_v3", "--kv-lora-rank", "512", "kv_lora_rank", "16"),
    ("deepseek_v3", "--qk-head-dim", "128", "qk_nope_head_dim", "16"),
    ("deepseek_v3", "--qk-pos-emb-head-dim", "64", "qk_rope_head_dim", "8"),
    ("deepseek_v3", "--v-head-dim", "128", "v_head_dim", "16"),
    ("deepseek_v3", "--rotary-scaling-factor", "4", "rope_parameters.factor", "40.0"),
    ("deepseek_v3", "--moe-router-topk-scaling-factor", "1", "routed_scaling_factor", "2.5"),
    ("deepseek_v3", "--moe-router-num-groups", "8", "n_group", "4"),
    ("deepseek_v3", "--moe-router-group-topk", "4", "topk_group", "2"),
    ("deepseek_v3", "--moe-shared-expert-intermediate-size", "2048", "n_shared_experts", "1"),
    ("deepseek_v3", "--moe-layer-freq", "[1]*2", "first_k_dense_replace", "1"),
    ("deepseek_v3", "--multi-latent-attention", None, "kv_lora_rank", "16"),
    # yarn parameters, as upstream miles' Kimi scripts spell them (flags appended to the script's)
    ("deepseek_v3", "--original-max-position-embeddings", "8192", "rope_parameters.original_max_position_embeddings",
     "4096"),
    ("deepseek_v3", "--beta-fast", "16", "rope_parameters.beta_fast", "32"),
    ("glm4_moe", "--rotary-percent", "1", "rope_parameters.partial_rotary_factor", "0.5"),
    ("glm4_moe", "--add-qkv-bias", None, "attention_bias", "True"),
    ("glm4_moe", "--moe-router-enable-expert-bias", None, "model_type", "glm4_moe"),
]


@pytest.mark.parametrize("name, flag, value, key, hf_value", WRONG,
                         ids=[f"{n}{f}{'=' + v if v else '-dropped'}" for n, f, v, _, _ in WRONG])
def test_a_wrong_architecture_flag_names_both_values(models, capsys, name, flag, value, key, hf_value):
    _, built = models
    code, err = _run(capsys, models, name, *_replace(built[name][2], flag, value))
    assert code == 2
    shown = "off (not given)" if value is None else value.replace("[1]*2", "[1, 1]")
    assert f"{flag} {shown} disagrees with --hf-checkpoint" in err, err
    assert f"its config.json has {key} = {hf_value}" in err, err
    assert err.count("disagrees") == 1, err  # only the flag that was changed


def test_the_reference_values_are_the_hf_configs(models):
    """The tiny configs are what the scripts' MODEL_ARGS describe (read by transformers)."""
    _, built = models
    assert built["qwen3_moe"][1]["num_local_experts"] == 8 and built["deepseek_v3"][1]["first_k_dense_replace"] == 1
    assert built["glm4_moe"][1]["rope_parameters"]["partial_rotary_factor"] == 0.5


def test_a_partial_model_args_block_checks_only_what_it_gives(models, capsys):
    code, err = _run(capsys, models, "glm4_moe", "--num-layers", "2", "--hidden-size", "64", "--num-experts", "8")
    assert code == 0, err  # no --num-attention-heads: not a full block, absent switches are not read
    code, err = _run(capsys, models, "glm4_moe", "--num-layers", "2", "--hidden-size", "64",
                     "--num-attention-heads", "4")
    assert code == 2 and "--swiglu off (not given) disagrees" in err, err


# -- --spec --------------------------------------------------------------------------------


def test_spec_of_a_model_miles_builds(models, capsys, tmp_path):
    from transformers import Glm4Config

    folder = tmp_path / "glm4"
    Glm4Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16).save_pretrained(folder)
    prompts = models[0] / "prompts.jsonl"
    base = ["run", "--hf-checkpoint", str(folder), "--prompt-data", str(prompts), "--rm-type", "exact",
            "--n-samples-per-prompt", "2", "--dry-run"]
    assert main([*base, "--spec", "slime_plugins.models.glm4", "get_glm_spec", "--post-self-attn-layernorm",
                 "--post-mlp-layernorm", "--rotary-interleaved", "--add-qkv-bias", "--disable-bias-linear"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("spec, message", [
    (["slime_plugins.models.glm4", "get_glm_spec"], "builds GLM-4 dense (sandwich norms) (model_type glm4), but "
                                                    "--hf-checkpoint is model_type glm4_moe"),
    (["slime_plugins.models.qwen3_5", "get_qwen3_5_spec"], "builds Qwen3.5 (gated delta-net linear attention) "
                                                            "(model_type qwen3_5/qwen3_5_moe), but "),
    (["slime_plugins.models.qwen3_next", "get_qwen3_next_spec"], "builds Qwen3-Next (gated delta-net linear "
                                                                 "attention) (model_type qwen3_next), but "),
    (["my_plugins.models.mine", "get_spec"], "not a layer spec miles knows"),
    # upstream miles spells slime's specs miles_plugins.models.*
    (["miles_plugins.models.glm4", "get_glm_spec"], "--spec miles_plugins.models.glm4 get_glm_spec builds GLM-4"),
    (["miles_plugins.models.glm5.glm5", "get_glm5_spec"], "a model miles cannot build"),
])
def test_spec_that_does_not_fit_is_an_error(models, capsys, spec, message):
    code, err = _run(capsys, models, "glm4_moe", "--spec", *spec)
    assert code == 2 and message in err, err


@pytest.mark.parametrize("argv, feature", [
    (["--use-gated-attention"], "gated attention (Qwen3-Next, Qwen3.5)"),
    (["--softmax-type", "learnable"], "attention sinks (gpt-oss)"),
    (["--moe-latent-size", "1024"], "MoE latent projections (Nemotron-3)"),
    (["--custom-model-provider-path", "my.provider"], "a custom Megatron model provider"),
])
def test_flags_of_models_miles_does_not_build_say_so(models, capsys, argv, feature):
    code, err = _run(capsys, models, "qwen3", *argv)
    assert code == 2 and f"describes {feature}" in err and "a model miles cannot build" in err, err


# -- --moe-layer-freq ----------------------------------------------------------------------


def test_moe_layer_freq_reads_as_megatron_does():
    assert moe_layer_pattern("[0]*1+[1]*3", 4) == [0, 1, 1, 1]
    assert moe_layer_pattern("[0, 1, 1]", 3) == [0, 1, 1]
    assert moe_layer_pattern("1", 3) == [1, 1, 1]
    assert moe_layer_pattern("2", 4) == [1, 0, 1, 0]
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        moe_layer_pattern("[__import__('os')]", 1)


# -- PERF_ARGS -----------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--attention-dropout", "0.1"], "--attention-dropout 0.1: miles trains without dropout"),
    (["--hidden-dropout", "0.1"], "--hidden-dropout 0.1: miles trains without dropout"),
    (["--moe-aux-loss-coeff", "0.001"], "--moe-aux-loss-coeff 0.001: miles adds no load-balancing loss"),
    (["--moe-router-bias-update-rate", "0.001"], "--moe-router-bias-update-rate 0.001"),
    (["--fp16"], "--fp16 on: miles trains in bf16"),
    (["--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size 2"),
    (["--decoder-last-pipeline-num-layers", "1"], "uneven stages are not supported"),
])
def test_perf_values_no_backend_honours_are_errors(models, capsys, argv, message):
    code, err = _run(capsys, models, "qwen3_moe", *argv)
    assert code == 2 and message in err, err


def test_ignored_perf_flags_warn_once_each(models, capsys, monkeypatch):
    monkeypatch.setattr(ignored_flags, "_warned", set())
    _, built = models
    code, err = _run(capsys, models, "qwen3_moe", *built["qwen3_moe"][2], *PERF_ARGS)
    assert code == 0, err
    for flag in ("--moe-grouped-gemm", "--moe-permute-fusion", "--moe-router-dtype", "--moe-token-dispatcher-type",
                 "--moe-token-drop-policy", "--attention-backend", "--use-distributed-optimizer"):
        assert err.count(f"{flag} is accepted for slime compatibility and ignored") == 1, (flag, err)
    # what miles does anyway: no warning
    for flag in ("--attention-dropout", "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
                 "--moe-aux-loss-coeff", "--moe-router-load-balancing-type"):
        assert f"{flag} is accepted" not in err
    code, err = _run(capsys, models, "qwen3_moe", "--moe-grouped-gemm")
    assert code == 0 and "--moe-grouped-gemm" not in err  # once per process


# -- the backend of a slime script's model parallelism -------------------------------------


def test_model_parallelism_without_a_backend_needs_the_megatron_plugin():
    args = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                              expert_model_parallel_size=1, context_parallel_size=1, sequence_parallel=True,
                              train_backend="native")
    with pytest.raises(ValueError, match=r"--tensor-model-parallel-size 2, --sequence-parallel: .*--train-backend "
                                         r"megatron.*pip install miles-megatron"):
        choose_train_backend(args, set(), installed=set())
    assert choose_train_backend(args, {"train_backend"}, installed=set()) is None  # the user's choice stays
    assert args.train_backend == "native"


@pytest.mark.skipif(not MEGATRON, reason="megatron-core is not installed")
def test_slime_parallelism_picks_the_megatron_backend(models, capsys):
    _, built = models
    argv = [*built["qwen3_moe"][2], "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--expert-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"]  # EP inside TP: 2 ranks
    code, err = _run(capsys, models, "qwen3_moe", *argv)
    assert code == 0, err
    assert err.count("trains with --train-backend megatron (plugin miles-megatron)") == 1
    assert "--moe-router-dtype is accepted" not in err  # the megatron backend passes it to TransformerConfig
    code, err = _run(capsys, models, "qwen3_moe", *argv, "--train-backend", "native")
    assert code == 2 and "not supported by --train-backend native" in err


@pytest.mark.skipif(not MEGATRON, reason="megatron-core is not installed")
@pytest.mark.parametrize("name, argv, message", [
    # context parallelism runs one trainer process per CP rank too
    ("qwen3", ["--context-parallel-size", "2"], "--actor-num-gpus-per-node 2"),
    ("qwen3", ["--tensor-model-parallel-size", "2"], "--actor-num-gpus-per-node 2"),
])
def test_parallelism_the_megatron_backend_cannot_honour_is_an_error(models, capsys, name, argv, message):
    code, err = _run(capsys, models, name, *argv)
    assert code == 2 and message in err, err


@pytest.mark.skipif(not MEGATRON, reason="megatron-core is not installed")
def test_perf_flags_reach_the_transformer_config(models):
    import torch

    from miles_host.config import MilesConfig
    from miles_host.models.loading import native_config, read_hf_config
    from miles_host.plugin_manager import model_family_for
    from miles_megatron.perf_flags import dispatcher_for, transformer_config_overrides
    from miles_megatron.policy import transformer_config

    _, built = models
    config = MilesConfig(moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall", attention_softmax_in_fp32=True)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert transformer_config_overrides(config, cuda) == {
        "attention_softmax_in_fp32": True, "moe_token_dispatcher_type": "alltoall", "moe_router_dtype": "fp32"}
    assert transformer_config_overrides(config, cpu)["moe_token_dispatcher_type"] == "allgather"
    assert dispatcher_for("flex", cuda) == "alltoall"
    assert transformer_config_overrides(config, cuda, model_parallel=True)["moe_token_dispatcher_type"] == "allgather"
    hf = read_hf_config(str(built["qwen3_moe"][0]))
    moe = transformer_config(native_config(hf, model_family_for(hf["model_type"])),
                             overrides=transformer_config_overrides(config, cpu))
    assert (moe.moe_router_dtype, moe.attention_softmax_in_fp32, moe.moe_token_dispatcher_type) == (
        "fp32", True, "allgather")
    hf = read_hf_config(str(built["qwen3"][0]))
    dense = transformer_config(native_config(hf, model_family_for(hf["model_type"])),
                               overrides=transformer_config_overrides(config, cpu))
    assert dense.attention_softmax_in_fp32 and dense.moe_router_dtype is None  # MoE fields only for MoE models


# -- sliding windows and --rope-type (upstream miles' launchers) ---------------------------


@pytest.fixture
def sliding_model(tmp_path):
    """A tiny Qwen3 whose first layer is sliding-window (window 16), the second full."""
    from transformers import Qwen3Config

    folder = tmp_path / "sliding"
    Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=16, use_sliding_window=True,
                layer_types=["sliding_attention", "full_attention"]).save_pretrained(folder)
    (tmp_path / "prompts.jsonl").write_text('{"input": "1+1=", "label": "2"}\n')
    return ["run", "--hf-checkpoint", str(folder), "--prompt-data", str(tmp_path / "prompts.jsonl"), "--rm-type",
            "exact", "--n-samples-per-prompt", "2", "--dry-run"]


@pytest.mark.parametrize("argv, message", [
    (["--window-size", "16,0", "--window-attn-skip-freq", "2"], None),  # Megatron: layer % 2 == 0 is full
    (["--window-size", "16,0", "--window-attn-skip-freq", "[1,0]"], None),
    (["--window-size", "16,0"], "--window-attn-skip-freq [1, 1] disagrees"),  # every layer windowed
    (["--window-size", "8,0", "--window-attn-skip-freq", "2"], "its config.json has sliding_window = 16"),
    (["--rope-type", "rope"], None),
    (["--rope-type", "yarn"], "--rope-type yarn disagrees"),
])
def test_window_layout_and_rope_type(sliding_model, capsys, argv, message):
    code = main([*sliding_model, *argv])
    err = capsys.readouterr().err
    if message is None:
        assert code == 0, err
    else:
        assert code == 2 and message in err, err


# -- end to end on CPU ---------------------------------------------------------------------


@pytest.mark.skipif(not MEGATRON, reason="megatron-core is not installed")
def test_slime_argument_set_trains_with_tensor_parallel_megatron(tmp_path):
    """The quickstart model launched as a slime script launches it: its MODEL_ARGS, PERF_ARGS with
    ``--tensor-model-parallel-size 2 --sequence-parallel`` and no ``--train-backend``: two Megatron
    trainer processes (gloo) train one step and the trained weights reach the engine."""
    from miles_host.quickstart_preset import QUICKSTART_DIR

    hf = json.loads((QUICKSTART_DIR / "model" / "config.json").read_text())
    slime_perf = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
                  "--context-parallel-size", "1", "--expert-model-parallel-size", "1",
                  "--expert-tensor-parallel-size", "1", "--recompute-granularity", "full", "--recompute-method",
                  "uniform", "--recompute-num-layers", "1", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
                  "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32", "--attention-backend", "flash"]
    out = tmp_path / "out"
    code = main(["run", *qwen3_model_args(hf), *slime_perf, "--actor-num-gpus-per-node", "2", "--num-rollout", "1",
                 "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--no-progress", "--worker-timeout", "120",
                 "--output-dir", str(out)])
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 1 and steps[0]["train/grad_norm"] > 0
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-5  # the engine and the TP trainers agree
    config = json.loads((out / "config.json").read_text())
    assert config["train_backend"] == "megatron" and config["tensor_model_parallel_size"] == 2


@pytest.mark.skipif(not MEGATRON, reason="megatron-core is not installed")
def test_megatron_trainer_with_slime_moe_perf_flags_on_cpu(tmp_path):
    """A Qwen3-MoE step on the one-process megatron trainer with slime's MoE PERF_ARGS: the
    router-dtype / softmax flags reach the model and (float32 on CPU) change no number."""
    import torch
    import torch.distributed as dist

    from tests.plugins.megatron.conftest import save_models
    from tests.plugins.megatron.test_megatron_trainer import MODELS as TRAINER_MODELS
    from tests.plugins.megatron.test_megatron_trainer import make_samples, make_trainer

    existed = dist.is_initialized()
    models = save_models(tmp_path, {"qwen3_moe": TRAINER_MODELS["qwen3_moe"]})
    perf = ("--moe-router-dtype", "fp32", "--attention-softmax-in-fp32", "--moe-token-dispatcher-type", "alltoall",
            "--moe-grouped-gemm", "--moe-permute-fusion", "--moe-aux-loss-coeff", "0")
    results = []
    for flags in ((), perf):
        trainer = make_trainer(models, "qwen3_moe", "megatron", *flags)
        config = trainer.model.gpt.config
        results.append((trainer.train(make_samples()), trainer.model.state_dict(),
                        (config.moe_router_dtype, config.attention_softmax_in_fp32, config.moe_token_dispatcher_type)))
        trainer.close()
    (plain, plain_weights, plain_config), (slime, slime_weights, slime_config) = results
    assert plain_config == (None, False, "allgather") and slime_config == ("fp32", True, "allgather")  # CPU: allgather
    assert plain["train/loss"] == pytest.approx(slime["train/loss"], abs=1e-6)
    assert all(torch.allclose(plain_weights[k], slime_weights[k], atol=1e-6) for k in plain_weights)
    if not existed and dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.skipif(not MEGATRON, reason="megatron-core is not installed")
def test_slime_moe_argument_set_trains_with_expert_parallel_megatron(tmp_path):
    """A tiny Qwen3-MoE (random weights, the quickstart's tokenizer) launched with slime's
    qwen3-30B-A3B MODEL_ARGS and ``--expert-model-parallel-size 2``, no ``--train-backend``:
    two Megatron trainer processes (gloo) train one step; the engine's and the trainers'
    log-probs of the rollout agree."""
    import shutil

    import torch
    import transformers

    from miles_host.quickstart_preset import QUICKSTART_DIR

    folder = tmp_path / "moe"
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=99, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1000000, tie_word_embeddings=False,
        max_position_embeddings=128, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(QUICKSTART_DIR / "model" / name, folder / name)
    hf = json.loads((folder / "config.json").read_text())
    slime_perf = ["--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "2",
                  "--expert-tensor-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                  "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
                  "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
                  "--attention-softmax-in-fp32", "--attention-backend", "flash"]
    out = tmp_path / "out"
    code = main(["run", "--hf-checkpoint", str(folder), "--prompt-data", str(QUICKSTART_DIR / "data" / "train.jsonl"),
                 "--label-key", "label", "--rm-type", "exact", *qwen3_moe_model_args(hf), *slime_perf,
                 "--actor-num-gpus-per-node", "2", "--num-rollout", "1", "--rollout-batch-size", "2",
                 "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4", "--device", "cpu",
                 "--dtype", "float32", "--no-progress", "--worker-timeout", "120", "--output-dir", str(out),
                 "--entropy-coef", "0.01"])  # a random model's rewards are all 0: the entropy term moves it
    assert code == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "train/loss" in r]
    assert len(steps) == 1 and steps[0]["train/grad_norm"] > 0
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert json.loads((out / "config.json").read_text())["train_backend"] == "megatron"
