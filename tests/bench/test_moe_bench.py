"""``bench/moe.py`` on the CPU: the random model is allocated in its dtype, and the tiny run covers both shapes
(the DeepSeek shape's decode bound over the engine's latent cache)."""

from __future__ import annotations

import json

import pytest
import torch

from bench import moe, moe_models
from miles_host.kernels import switches


def test_build_model_allocates_in_the_requested_dtype():
    model = moe_models.build_model("tiny_dsv3", torch.bfloat16, "cpu")
    kept_fp32 = {id(m.weight) for m in model.modules() if getattr(m, "keep_fp32", False)}
    kept_fp32 |= {id(m.expert_bias) for m in model.modules() if getattr(m, "expert_bias", None) is not None}
    assert kept_fp32, "the DeepSeek shape keeps its router in float32"
    for name, tensor in model.named_parameters():
        expected = torch.float32 if id(tensor) in kept_fp32 else torch.bfloat16
        assert tensor.dtype == expected, name
    experts = [t for n, t in model.named_parameters() if "experts" in n and t.dim() == 3]
    assert experts and all(0.015 < t.float().std().item() < 0.025 for t in experts)  # N(0, 0.02), not left empty


def test_a_model_prepared_a_layer_at_a_time_is_the_whole_model_prepared():
    """INT4 experts (CPU): every weight and quantized buffer, and the logits, as ``prepare(build_model(...))``."""
    whole = moe_models.prepare(moe_models.build_model("tiny_dsv3", torch.float32, "cpu"), "int4")
    by_layer = moe_models.build_prepared("tiny_dsv3", torch.float32, "cpu", "int4")
    whole_state, layer_state = whole.state_dict(), by_layer.state_dict()
    assert whole_state.keys() == layer_state.keys() and any("packed" in name for name in whole_state)
    for name, tensor in whole_state.items():
        assert torch.equal(tensor, layer_state[name]), name
    assert type(whole.layers[0].mlp.experts) is type(by_layer.layers[0].mlp.experts)
    ids = torch.tensor([[3, 17, 5, 9]])
    with torch.no_grad():
        assert torch.equal(whole(ids), by_layer(ids))


def test_tiny_bench_decodes_and_prefills_both_shapes(tmp_path, monkeypatch):
    out = tmp_path / "rows.json"
    monkeypatch.setattr(switches, "VALUES", dict(switches.VALUES))  # the bench sets switches for the process
    assert moe.main(["--tiny", "--shapes", "qwen3_30b,dsv3", "--precisions", "bf16", "--kernels", "fused",
                     "--switch", "mla_kv_cache=latent", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    cases = {(r["shape"], r["case"]) for r in rows}
    for shape in ("tiny", "tiny_dsv3"):
        assert {(shape, "decode b1"), (shape, "decode b4"), (shape, "prefill 2x16")} <= cases
    assert all(r["tok_s"] > 0 for r in rows)
    decode = {r["shape"]: r for r in rows if r["case"].startswith("decode")}
    model = moe_models.build_model("tiny_dsv3", torch.bfloat16, "cpu")
    mla = model.config.mla  # the bound counts the engine's latent cache: one row per token and layer
    row_values = model.config.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    assert decode["tiny_dsv3"]["kv_bytes_per_token"] in (2 * row_values, 4 * row_values)  # bf16, or float32 on CPU


def test_gemv_table_takes_the_fastest_launch_of_each_projection(tmp_path):
    from bench.moe_gemv_sweep import fastest_launches
    from miles_host.kernels.moe_configs import GemvLaunch

    def row(shape, projection, us, block_n):
        return dict(shape=shape, projection=projection, launch=f"n{block_n}", us=us, tb_s=1.0,
                    fields=dict(block_n=block_n, block_k=256, num_warps=4))

    path = tmp_path / "sweep.json"
    path.write_text(json.dumps([row("qwen3", "gate_up", 19.0, 8), row("qwen3", "gate_up", 18.0, 4),
                                row("qwen3", "down", 9.0, 16), row("dsv3", "down", 1.0, 32)]))
    assert fastest_launches(str(path)) == {"gate_up": GemvLaunch(4, 256, 4), "down": GemvLaunch(16, 256, 4)}
    assert fastest_launches(str(path), "dsv3") == {"down": GemvLaunch(32, 256, 4)}


def test_prefill_switch_times_each_value_in_one_engine(tmp_path, monkeypatch):
    out = tmp_path / "rows.json"
    monkeypatch.setattr(switches, "VALUES", dict(switches.VALUES))
    switches.host_switches()
    before = switches.value(switches.declared("mla_prefill"))
    assert moe.main(["--tiny", "--shapes", "dsv3", "--precisions", "bf16", "--kernels", "fused", "--batches", "1",
                     "--prefill-switch", "mla_prefill=absorbed,expanded", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    prefill = [r["case"] for r in rows if r["case"].startswith("prefill")]
    assert prefill == ["prefill 2x16 mla_prefill=absorbed", "prefill 2x16 mla_prefill=expanded"]
    assert switches.value(switches.declared("mla_prefill")) == before  # restored after each case


def test_bench_switches_are_checked_and_host_switches_declared_from_their_records(monkeypatch):
    monkeypatch.setattr(switches, "_DECLARED", {})  # a fresh process: no kernel module imported yet
    monkeypatch.setattr(switches, "VALUES", {})
    moe._import_switch_owner("mla_prefill")
    assert switches.declared("mla_prefill").choices == ("absorbed", "expanded")
    with pytest.raises(ValueError, match="--mla-prefill 'bogus': choose from absorbed, expanded"):
        moe.main(["--tiny", "--prefill-switch", "mla_prefill=bogus"])
