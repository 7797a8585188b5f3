"""Qwen3-Next / Qwen3.5 (Gated DeltaNet + gated attention) against transformers and float64 formulas."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from miles_host.kernels.gated_delta_rule import causal_conv, chunked_reference, gated_delta_rule, recurrent_step
from miles_host.models import load_pretrained, save_pretrained, token_log_probs

from .conftest import prompts_batch
from .qwen_next_cases import CASES, family_lookup, hf_model, save_case

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {case: save_case(case, tmp_path_factory.mktemp(case)) for case in CASES}


def _delta_rule_float64(q, k, v, g, beta, state):
    """The recurrence written out token by token in float64 (q/k L2-normalised, q scaled)."""
    q = q.double() / torch.sqrt((q.double() ** 2).sum(-1, keepdim=True) + 1e-6) / q.shape[-1] ** 0.5
    k = k.double() / torch.sqrt((k.double() ** 2).sum(-1, keepdim=True) + 1e-6)
    state, outputs = state.double().clone(), []
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            state[h] *= torch.exp(g[t, h].double())
            delta = beta[t, h].double() * (v[t, h].double() - state[h].T @ k[t, h])
            state[h] += torch.outer(k[t, h], delta)
        outputs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(outputs), state


def test_delta_rule_forms_match_the_float64_recurrence():
    torch.manual_seed(0)
    heads, key_dim, value_dim, lengths = 3, 5, 6, [11, 1, 4]
    total = sum(lengths)
    q, k = torch.randn(total, heads, key_dim), torch.randn(total, heads, key_dim)
    v = torch.randn(total, heads, value_dim)
    g, beta = -torch.rand(total, heads) * 2, torch.rand(total, heads)
    initial = torch.randn(len(lengths), heads, key_dim, value_dim)
    o, finals = gated_delta_rule(q, k, v, g, beta, lengths, initial, use_fla=False, chunk_size=4)
    start = 0
    for s, n in enumerate(lengths):
        rows = slice(start, start + n)
        expected_o, expected_state = _delta_rule_float64(q[rows], k[rows], v[rows], g[rows], beta[rows], initial[s])
        torch.testing.assert_close(o[rows].double(), expected_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(finals[s].double(), expected_state, atol=1e-5, rtol=1e-5)
        # the chunked form with one chunk, and the decode step token by token, agree too
        whole, _ = chunked_reference(q[rows], k[rows], v[rows], g[rows], beta[rows], initial[s], chunk_size=64)
        torch.testing.assert_close(whole.double(), expected_o, atol=1e-5, rtol=1e-5)
        state = initial[s : s + 1]
        for t in range(start, start + n):
            step_o, state = recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state)
            torch.testing.assert_close(step_o[0].double(), expected_o[t - start], atol=1e-5, rtol=1e-5)
        start += n


def test_short_convolution_continues_from_its_state():
    torch.manual_seed(1)
    channels, width = 5, 4
    x, weight = torch.randn(9, channels), torch.randn(channels, width)
    whole, state = causal_conv(x, weight, [9])
    first, mid = causal_conv(x[:6], weight, [6])
    steps, rest = [], mid
    for t in range(6, 9):
        y, rest = causal_conv(x[t : t + 1], weight, [1], rest)
        steps.append(y)
    torch.testing.assert_close(torch.cat([first, *steps]), whole)
    torch.testing.assert_close(rest, state)
    padded = torch.cat((torch.zeros(width - 1, channels), x)).double()
    expected = torch.stack([(padded[t : t + width].T * weight.double()).sum(-1) for t in range(9)])
    torch.testing.assert_close(whole.double(), torch.nn.functional.silu(expected), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_log_probs_match_transformers(case, checkpoints):
    # 70 tokens: more than one 64-token chunk of the delta rule
    input_ids, attention_mask = prompts_batch(lengths=(70, 9, 23), seed=3)
    with torch.no_grad():
        reference = hf_model(checkpoints[case])(input_ids=input_ids, attention_mask=attention_mask).logits
    model = load_pretrained(checkpoints[case], family=family_lookup)
    with torch.no_grad():
        logits = model(input_ids, attention_mask)
    valid = attention_mask.bool()
    assert (logits[valid] - reference[valid]).abs().max().item() <= 1e-4
    # the packed training forward's log-probs at temperature 0.7
    lengths = attention_mask.sum(1).tolist()
    tokens = [input_ids[row, :n] for row, n in enumerate(lengths)]
    targets_T = torch.cat([torch.roll(t, -1) for t in tokens])
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        log_probs_T, _ = model.packed_log_probs(
            torch.cat(tokens), torch.cat([torch.arange(n) for n in lengths]), cu_seqlens, targets_T, temperature=0.7
        )
    expected_T, _ = token_log_probs(reference[valid], targets_T, temperature=0.7)
    assert (log_probs_T - expected_T).abs().max().item() <= 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_weights_round_trip_bit_for_bit(case, checkpoints, tmp_path):
    model = load_pretrained(checkpoints[case], family=family_lookup)
    save_pretrained(model, tmp_path, family=family_lookup)
    original = load_file(checkpoints[case] / "model.safetensors")
    saved = {}
    for file in tmp_path.glob("*.safetensors"):
        saved.update(load_file(file))
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(saved[name], tensor), name


def test_gradients_flow_through_the_chunked_rule(checkpoints):
    model = load_pretrained(checkpoints["qwen3_5_text"], family=family_lookup).train()
    tokens = torch.randint(3, 128, (20,))
    cu_seqlens = torch.tensor([0, 12, 20], dtype=torch.int32)
    positions = torch.cat([torch.arange(12), torch.arange(8)])
    log_probs, _ = model.packed_log_probs(tokens, positions, cu_seqlens, torch.roll(tokens, -1))
    log_probs.sum().backward()
    layer = model.layers[0].attn
    for parameter in (layer.in_proj.weight, layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight):
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0


@pytest.mark.parametrize("case", ["qwen3_next", "qwen3_5_text"])
def test_mtp_layer_loads_into_the_mtp_slot_and_round_trips(case, checkpoints, tmp_path):
    import json
    import shutil

    from safetensors.torch import save_file

    path = tmp_path / "with_mtp"
    shutil.copytree(checkpoints[case], path)
    config = json.loads((path / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    # the MTP tensors a checkpoint stores, in HF names, with their shapes taken from the native layer
    family = family_lookup(config["model_type"])
    native = load_pretrained(checkpoints[case], family=family_lookup)
    from miles_host.models.loading import native_config
    from miles_host.models.model import MTPLayer

    layer = MTPLayer(native_config(config, family), native.config.num_layers, native.routing_hooks)
    generator = torch.Generator().manual_seed(5)
    mtp = {}
    for name, tensor in layer.state_dict().items():
        for hf_name, part in family.convert_native_tensor(f"mtp.0.{name}", tensor, native.config):
            mtp[hf_name] = torch.randn(part.shape, generator=generator)
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.input_layernorm.weight"} <= set(mtp)
    original = {**load_file(path / "model.safetensors"), **mtp}
    save_file(original, path / "model.safetensors", metadata={"format": "pt"})
    model = load_pretrained(path, family=family_lookup)
    assert len(model.mtp) == 1 and model.mtp[0].embed_tokens is None  # the model's embedding and head
    assert model.mtp[0].enorm.unit_offset  # zero-centred like every Qwen3-Next norm
    assert torch.equal(model.mtp[0].eh_proj.weight, mtp["mtp.fc.weight"])
    save_pretrained(model, tmp_path / "saved", family=family_lookup)
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert sorted(saved) == sorted(original)
    assert all(torch.equal(saved[name], tensor) for name, tensor in original.items())
