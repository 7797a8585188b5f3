"""``miles memory``: parameter counts and BF16/INT4 bytes against hand computations."""

from __future__ import annotations

import json

import pytest

from miles_host.cli.main import main
from miles_int4.memory import weight_memory

LLAMA3_70B = dict(
    model_type="llama", _name_or_path="Llama-3-70B", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
    num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu",
)
QWEN3_235B_A22B = dict(
    model_type="qwen3_moe", _name_or_path="Qwen3-235B-A22B", hidden_size=4096, intermediate_size=12288,
    moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=False, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    hidden_act="silu",
)
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", _name_or_path="DeepSeek-V3", hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256,
    n_shared_experts=1, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, n_group=8, topk_group=4,
    num_experts_per_tok=8, routed_scaling_factor=2.5, num_nextn_predict_layers=1, max_position_embeddings=163840,
    rms_norm_eps=1e-6, tie_word_embeddings=False, norm_topk_prob=True, scoring_func="sigmoid",
    topk_method="noaux_tc", hidden_act="silu", rope_theta=10000.0,
)


def int4_bytes(quantized: int, total: int, group_size: int = 128) -> int:
    return quantized // 2 + quantized // group_size * 2 + (total - quantized) * 2


def llama_70b_counts():
    H, I, L, V, kv = 8192, 28672, 80, 128256, 8 * 128
    linears = L * (2 * H * H + 2 * H * kv + 3 * H * I)
    total = linears + 2 * V * H + H + L * 2 * H
    return {"experts": 0, "all": linears}, total


def qwen3_235b_counts():
    H, L, V, E, I, q, kv, d = 4096, 94, 151936, 128, 1536, 64 * 128, 4 * 128, 128
    experts = L * E * 3 * H * I
    attention = L * (2 * H * q + 2 * H * kv)
    total = experts + attention + L * (E * H + 2 * H + 2 * d) + 2 * V * H + H
    return {"experts": experts, "all": experts + attention}, total


def deepseek_v3_counts():
    H, V, E, I_moe, I_dense = 7168, 129280, 256, 2048, 18432
    heads, q_rank, kv_rank, nope, rope, v = 128, 1536, 512, 128, 64, 128
    dense_layers, moe_layers = 3, 58 + 1  # + the MTP layer (num_nextn_predict_layers=1), an MoE layer
    attention = H * q_rank + q_rank * heads * (nope + rope) + H * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * H
    attention_norms = q_rank + kv_rank
    experts = moe_layers * E * 3 * H * I_moe
    linears = 62 * attention + dense_layers * 3 * H * I_dense + moe_layers * 3 * H * I_moe + 2 * H * H  # + eh_proj
    routers = moe_layers * (E * H + E)  # weight + expert-score bias
    mtp_extras = 3 * H + V * H + V * H  # enorm, hnorm, head norm; its embedding and head
    total = experts + linears + routers + 62 * (attention_norms + 2 * H) + 2 * V * H + H + mtp_extras
    return {"experts": experts, "all": experts + linears}, total


@pytest.mark.parametrize(
    "config,counts",
    [(LLAMA3_70B, llama_70b_counts), (QWEN3_235B_A22B, qwen3_235b_counts), (DEEPSEEK_V3, deepseek_v3_counts)],
    ids=["llama3-70b", "qwen3-235b-a22b", "deepseek-v3"],
)
def test_big_model_memory_matches_hand_computation(config, counts, capsys):
    quantized, total = counts()
    for target in ("experts", "all"):
        memory = weight_memory(config, 128, target)
        assert memory.total_params == total
        assert memory.quantized_params == quantized[target]
        assert memory.bf16_bytes == 2 * total
        assert memory.int4_bytes == int4_bytes(quantized[target], total)
    everything = weight_memory(config, 128, "all")
    # the usage guide's table says ~3.1x for 70B/235B/671B; real counts give 3.5-3.9x for the weights
    assert 3.4 < everything.ratio < 3.9
    assert everything.quantized_ratio == pytest.approx(4 / (1 + 4 / 128))
    print(f"\n{config['_name_or_path']}: {total / 1e9:.2f}B params, BF16 {everything.bf16_bytes / 1e9:.1f} GB, "
          f"INT4 all {everything.int4_bytes / 1e9:.1f} GB ({everything.ratio:.2f}x), "
          f"INT4 experts {weight_memory(config, 128, 'experts').int4_bytes / 1e9:.1f} GB")


def test_small_config_by_hand_and_the_command(tmp_path, capsys, tiny_checkpoints):
    path = tiny_checkpoints["qwen3_moe"]
    config = json.loads((path / "config.json").read_text())
    # hidden 128, 2 layers (layer 0 dense, I=256; layer 1: 4 experts of I=64), q 4x32, kv 2x32, vocab 96
    H, V, q, kv, d = 128, 96, 128, 64, 32
    attention = 2 * H * q + 2 * H * kv
    experts = 4 * 3 * H * 64
    dense_mlp = 3 * H * 256
    total = 2 * V * H + H + 2 * (attention + 2 * H + 2 * d) + dense_mlp + experts + 4 * H
    memory = weight_memory(config, 32, "experts")
    assert (memory.total_params, memory.quantized_params) == (total, experts)
    assert memory.int4_bytes == experts // 2 + experts // 32 * 2 + (total - experts) * 2
    assert weight_memory(config, 64, "all").quantized_params == experts + 2 * attention + dense_mlp

    assert main(["memory", "--hf-checkpoint", str(path), "--int4-group-size", "32"]) == 0
    out = capsys.readouterr().out
    assert f"{total / 1e9:,.2f}B parameters" in out and "INT4 experts" in out and "INT4 all" in out
    (tmp_path / "llama.json").write_text(json.dumps(LLAMA3_70B))
    assert main(["memory", "--config", str(tmp_path / "llama.json")]) == 0
    out = capsys.readouterr().out
    assert "141.1 GB" in out and "39.5 GB" in out and "3.57x" in out


def test_memory_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="no 'model_type'"):
        weight_memory({"hidden_size": 8})
    assert main(["memory", "--config", str(tmp_path / "absent.json")]) == 2
