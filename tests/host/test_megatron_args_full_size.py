"""slime's MODEL_ARGS of full-size models against those models' published ``config.json``.

The flags are slime's ``scripts/models/*.sh`` arrays as bash expands them; the configs are
the fields of the models' published HF configs that the checks read (only ``config.json``
is written: ``--dry-run`` builds no model). Every flag agrees, so none may be reported:
this guards the checks against refusing a correct slime script (the switches whose absence
counts, ``--rotary-interleaved`` of GLM-4, Llama-3 rope scaling, MLA without a q low rank).
"""

from __future__ import annotations

import json

import pytest

from miles_host.cli.main import main


def _layer_freq(dense: int, total: int) -> str:
    return "[" + ",".join("0" if i < dense else "1" for i in range(total)) + "]"


#: name -> (config.json fields, the script's MODEL_ARGS)
MODELS = {
    "llama3.1-8B-Instruct": (
        dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=14336, rope_theta=500000.0, vocab_size=128256, rms_norm_eps=1e-5, hidden_act="silu",
             rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192, "rope_type": "llama3"},
             tie_word_embeddings=False, max_position_embeddings=131072, attention_bias=False, mlp_bias=False),
        "--swiglu --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --max-position-embeddings 131072 "
        "--use-rotary-position-embeddings --disable-bias-linear --normalization RMSNorm --norm-epsilon 1e-5 "
        "--rotary-base 500000 --vocab-size 128256 --kv-channels 128 --use-rope-scaling --rotary-scaling-factor 8.0 "
        "--untie-embeddings-and-output-weights",
    ),
    "glm4-9B": (
        dict(model_type="glm4", hidden_size=4096, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=2,
             head_dim=128, intermediate_size=13696, partial_rotary_factor=0.5, rms_norm_eps=1e-5, vocab_size=151552,
             rope_theta=10000.0, attention_bias=True, tie_word_embeddings=False, max_position_embeddings=32768,
             hidden_act="silu"),
        "--spec slime_plugins.models.glm4 get_glm_spec --swiglu --num-layers 40 --hidden-size 4096 --ffn-hidden-size "
        "13696 --num-attention-heads 32 --group-query-attention --num-query-groups 2 --use-rotary-position-embeddings "
        "--disable-bias-linear --add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-5 --rotary-base 10000 "
        "--vocab-size 151552 --post-self-attn-layernorm --post-mlp-layernorm --rotary-interleaved --rotary-percent 0.5 "
        "--no-rope-fusion --untie-embeddings-and-output-weights",
    ),
    "qwen2.5-7B": (
        dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
             intermediate_size=18944, tie_word_embeddings=False, rope_theta=1000000.0, vocab_size=152064,
             rms_norm_eps=1e-6, max_position_embeddings=131072, hidden_act="silu"),
        "--swiglu --num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944 --num-attention-heads 28 "
        "--group-query-attention --num-query-groups 4 --use-rotary-position-embeddings --disable-bias-linear "
        "--add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-06 --rotary-base 1000000 --vocab-size 152064 "
        "--untie-embeddings-and-output-weights",
    ),
    "moonlight": (
        dict(model_type="deepseek_v3", hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
             num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
             v_head_dim=128, n_routed_experts=64, n_shared_experts=2, moe_intermediate_size=1408,
             intermediate_size=11264, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.446,
             rope_theta=50000.0, rope_scaling=None, vocab_size=163840, rms_norm_eps=1e-5, num_experts_per_tok=6,
             tie_word_embeddings=False, max_position_embeddings=8192, hidden_act="silu", norm_topk_prob=True,
             scoring_func="sigmoid", topk_method="noaux_tc"),
        "--disable-bias-linear --num-layers 27 --hidden-size 2048 --ffn-hidden-size 11264 --num-attention-heads 16 "
        "--kv-channels 128 --normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-5 "
        "--rotary-percent 1.0 --swiglu --untie-embeddings-and-output-weights --no-masked-softmax-fusion "
        "--vocab-size 163840 --multi-latent-attention --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 "
        "--v-head-dim 128 --qk-layernorm --rotary-scaling-factor 1 --rotary-base 50000 --mscale 1.0 "
        "--mscale-all-dim 1.0 --attention-softmax-in-fp32 --no-rope-fusion --num-experts 64 --moe-layer-freq "
        f"{_layer_freq(1, 27)} --moe-ffn-hidden-size 1408 --moe-router-topk 6 "
        "--moe-shared-expert-intermediate-size 2816 --moe-router-pre-softmax --moe-router-score-function sigmoid "
        "--moe-router-enable-expert-bias --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type "
        "alltoall --moe-aux-loss-coeff 0 --moe-router-bias-update-rate 0 --moe-router-group-topk 1 "
        "--moe-router-num-groups 1 --moe-grouped-gemm --moe-router-topk-scaling-factor 2.446 --moe-token-drop-policy "
        "probs --moe-router-dtype fp32 --moe-permute-fusion",
    ),
    "deepseek-v3": (
        dict(model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
             num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
             v_head_dim=128, n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048,
             intermediate_size=18432, first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5,
             rope_theta=10000, vocab_size=129280, rms_norm_eps=1e-6, num_experts_per_tok=8,
             rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 4096, "type": "yarn"},
             tie_word_embeddings=False, max_position_embeddings=163840, hidden_act="silu", norm_topk_prob=True,
             scoring_func="sigmoid", topk_method="noaux_tc"),
        "--disable-bias-linear --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 "
        "--kv-channels 128 --normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --swiglu "
        "--untie-embeddings-and-output-weights --vocab-size 129280 --multi-latent-attention --q-lora-rank 1536 "
        "--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm "
        "--rotary-scaling-factor 40 --rotary-base 10000 --mscale 1.0 --mscale-all-dim 1.0 --attention-softmax-in-fp32 "
        f"--no-rope-fusion --num-experts 256 --moe-layer-freq {_layer_freq(3, 61)} --moe-ffn-hidden-size 2048 "
        "--moe-router-topk 8 --moe-shared-expert-intermediate-size 2048 --moe-router-pre-softmax "
        "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-load-balancing-type "
        "seq_aux_loss --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0 --moe-router-bias-update-rate 0 "
        "--moe-router-group-topk 4 --moe-router-num-groups 8 --moe-grouped-gemm --moe-router-topk-scaling-factor 2.5 "
        "--moe-router-dtype fp32 --moe-permute-fusion",
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_slime_script_agrees_with_the_published_config(name, tmp_path, capsys):
    fields, model_args = MODELS[name]
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(fields))
    (tmp_path / "prompts.jsonl").write_text('{"input": "1+1=", "label": "2"}\n')
    code = main(["run", "--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(tmp_path / "prompts.jsonl"),
                 "--rm-type", "exact", "--n-samples-per-prompt", "2", *model_args.split(), "--dry-run"])
    err = capsys.readouterr().err
    assert code == 0, err
