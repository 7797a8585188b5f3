"""LoRA on the routed experts' stacked weights (PEFT's ``target_parameters``): adapters cross
between miles and PEFT with the logits of the transformers model under ``peft`` (the
independent reference) within float32 tolerance, both ways; gradients reach the adapters
through the per-expert loop and the grouped-GEMM path alike; the engine's adapter mode
re-merges after each sync; R3's replayed ids pick the adapted experts."""

from __future__ import annotations

import json

import pytest
import torch

from miles_host.config import MilesConfig
from miles_host.lora import apply_lora, lora_modules, merged_state_dict, save_adapter
from miles_host.lora.experts import LoraExperts
from miles_host.lora.sync import prepare_engine_model
from miles_host.models import load_pretrained
from tests.lora.test_peft_interop import (ALPHA, RANK, _assert_close, _hf_model, _merged_model, peft,
                                          peft_adapter_in_miles, transformers)
from tests.lora.test_peft_interop import _input_ids as _ids
QWEN3_MOE = dict(vocab_size=99, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                 num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, max_position_embeddings=128, pad_token_id=0, eos_token_id=1)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """A tiny random Qwen3-MoE checkpoint (hidden 64, 4 experts, top-2)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("lora_qwen3_moe")
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE)).save_pretrained(path)
    return path


def _adapted(path, seed: int = 1, rank: int = RANK, **flags):
    """The native model with adapters as ``flags`` say, every ``B`` drawn away from zero."""
    config = MilesConfig(hf_checkpoint=str(path), lora_rank=rank, lora_alpha=ALPHA, **flags)
    model = load_pretrained(str(path), dtype=torch.float32)
    apply_lora(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in lora_modules(model).values():
            for b in module.lora_B.values():
                b.normal_(0, 0.2)
    return model, config


@pytest.mark.parametrize("targets", ["q_proj,experts", "experts.down_proj"])
def test_expert_adapter_saved_by_miles_gives_the_same_logits_under_peft(moe_checkpoint, tmp_path, targets):
    model, config = _adapted(moe_checkpoint, target_modules=targets)
    experts = [m for m in lora_modules(model).values() if isinstance(m, LoraExperts)]
    assert len(experts) == 2 and all(len(m.parts) == targets.count("experts") * (2 if targets.endswith("experts")
                                                                               else 1) for m in experts)
    save_adapter(model, tmp_path / "adapter", config)
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["target_parameters"] == (["experts.down_proj", "experts.gate_up_proj"]
                                          if targets.endswith("experts") else ["experts.down_proj"])
    reference = peft.PeftModel.from_pretrained(_hf_model(moe_checkpoint), str(tmp_path / "adapter")).eval()
    merged = _merged_model(moe_checkpoint, model)
    with torch.no_grad():
        want = reference(_ids()).logits
        base = _hf_model(moe_checkpoint)(_ids()).logits
        assert (want - base).abs().max() > 1e-2  # the adapter changes the model
        _assert_close(model(_ids()), want)
        _assert_close(merged(_ids()), want)


def test_adapter_trained_by_peft_with_target_parameters_gives_the_same_logits_in_miles(moe_checkpoint, tmp_path):
    reference, model, summary = peft_adapter_in_miles(
        moe_checkpoint, tmp_path, target_modules=["o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    assert summary.adapted_modules == 2 * 3  # per layer: o_proj and both expert stacks
    with torch.no_grad():
        want = reference(_ids()).logits
        _assert_close(model(_ids()), want)
        _assert_close(_merged_model(moe_checkpoint, model)(_ids()), want)


def _adapter_grads(model) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(_ids()).float().pow(2).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("rank", [4, 2])  # float32: rank 4 takes the low-rank grouped GEMMs, 2 the merged stacks
def test_gradients_reach_the_expert_adapters_through_the_loop_and_the_grouped_path(moe_checkpoint, rank, monkeypatch):
    from miles_host.kernels import moe_train

    model, _ = _adapted(moe_checkpoint, target_modules="experts", rank=rank)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    experts = [m for m in lora_modules(model).values() if isinstance(m, LoraExperts)]
    calls, grouped = [], moe_train.grouped_experts
    monkeypatch.setattr(moe_train, "grouped_experts", lambda *a, **k: calls.append(k) or grouped(*a, **k))
    grads = {}
    for impl in ("loop", "grouped"):
        for module in experts:
            module.experts_impl = impl
        grads[impl] = _adapter_grads(model)
    assert len(calls) == 2 and all(bool(k.get("adapters")) == moe_train.low_rank_fits(rank, torch.float32)
                                   for k in calls)
    assert set(grads["loop"]) == {f"layers.{i}.mlp.experts.lora_{m}.{k}" for i in range(2) for m in "AB"
                                  for k in ("gate_up_proj", "down_proj")}
    assert all(not any(p.grad is not None for p in m.parameters(recurse=False)) for m in experts)
    for name, grad in grads["loop"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grads["grouped"][name], grad, rtol=1e-4, atol=1e-6)


def test_the_expert_delta_is_w_plus_scaled_b_a_per_expert(moe_checkpoint):
    """The merged stacks against the plain float64 formula, expert by expert."""
    model, _ = _adapted(moe_checkpoint, target_modules="experts")
    state = model.state_dict()
    merged = merged_state_dict(model)
    scaling = ALPHA / RANK
    for key in ("gate_up_proj", "down_proj"):
        name = f"layers.1.mlp.experts.{key}"
        a, b = state[f"layers.1.mlp.experts.lora_A.{key}"], state[f"layers.1.mlp.experts.lora_B.{key}"]
        for e in range(QWEN3_MOE["num_experts"]):
            want = state[name][e].double() + scaling * b[e].double() @ a[e].double()
            torch.testing.assert_close(merged[name][e].double(), want, rtol=0, atol=1e-6)
    assert not any(".lora_" in k for k in merged)


def test_target_names_pick_the_expert_stacks_as_upstream_does(moe_checkpoint):
    def adapted(**flags):
        model = load_pretrained(str(moe_checkpoint), dtype=torch.float32)
        apply_lora(model, MilesConfig(hf_checkpoint=str(moe_checkpoint), lora_rank=RANK, lora_alpha=ALPHA, **flags))
        return {name: sorted(p.key for p in m.parts) for name, m in lora_modules(model).items()
                if name.endswith("experts")}

    both = {f"layers.{i}.mlp.experts": ["down_proj", "gate_up_proj"] for i in range(2)}
    assert adapted() == both  # all-linear: upstream's HF defaults include the packed expert stacks
    assert adapted(target_modules="experts") == adapted(target_modules="linear_fc1,linear_fc2") == both
    assert adapted(target_modules="gate_proj,up_proj") == {name: ["gate_up_proj"] for name in both}
    assert adapted(target_modules="mlp.experts.down_proj") == {name: ["down_proj"] for name in both}
    assert adapted(exclude_modules="experts") == {}
    with pytest.raises(ValueError, match="gate_proj matches no adaptable module.*experts.gate_up_proj"):
        adapted(target_modules="gate_proj")  # half of the packed stack, and no dense MLP here
    with pytest.raises(ValueError, match="--lora-dropout 0.1 with adapters on the routed experts"):
        adapted(lora_dropout=0.1)


def test_the_validation_stage_refuses_dropout_on_expert_adapters(moe_checkpoint):
    """Before any weight loads: the model is built on the meta device to see which stacks the flags choose."""
    from miles_host.lora.checks import check_lora
    from miles_host.plugin_manager import MilesPluginManager

    manager = MilesPluginManager()
    manager.activate()

    def check(**flags):
        check_lora(MilesConfig(hf_checkpoint=str(moe_checkpoint), lora_rank=RANK, lora_alpha=ALPHA, **flags),
                   manager.registries)

    with pytest.raises(ValueError, match=r"--lora-dropout 0.1 with adapters on the routed experts \(layers.0.mlp.experts"):
        check(lora_dropout=0.1)
    check(lora_dropout=0.1, exclude_modules="experts")
    check(lora_dropout=0.1, target_modules="q_proj")


def test_adapter_sync_engine_re_merges_the_expert_stacks_after_each_sync(moe_checkpoint):
    trainer, config = _adapted(moe_checkpoint, target_modules="q_proj,experts")
    config.lora_sync = "adapter"
    engine = prepare_engine_model(load_pretrained(str(moe_checkpoint), dtype=torch.float32), config)
    engine.load_state_dict(trainer.state_dict())
    for module in lora_modules(engine).values():
        module.miles_weights_updated()
    with torch.no_grad():
        _assert_close(engine(_ids()), trainer(_ids()))
        for name, tensor in trainer.state_dict().items():  # a later sync: the adapters only
            if ".lora_B." in name:
                engine.get_parameter(name).copy_(tensor * 1.5)
                trainer.get_parameter(name).mul_(1.5)
        for module in lora_modules(engine).values():
            module.miles_weights_updated()
        _assert_close(engine(_ids()), trainer(_ids()))


def test_replayed_expert_ids_run_through_the_adapted_experts(moe_checkpoint):
    """R3: ids a routing plugin replays pick which adapted experts run (the routing code is the
    block's own; the adapters only change the stacks)."""
    from miles_host.routing import RoutingContext

    model, _ = _adapted(moe_checkpoint, target_modules="experts")
    block = model.get_submodule("layers.0.mlp")
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    replay = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]])
    block.routing_hooks = type(block.routing_hooks)(None)
    block.routing_hooks._select = lambda **kw: kw["routing_context"].replay_expert_ids[kw["layer_index"]]
    with torch.no_grad():
        have = block(x, RoutingContext(replay_expert_ids={block.layer_index: replay}))
        scores = torch.softmax(x @ block.router.weight.t(), dim=-1).gather(1, replay)
        weights = scores / scores.sum(-1, keepdim=True) if block.moe.norm_topk_prob else scores
        experts = block.experts
        want = torch.zeros_like(x)
        for t in range(5):
            for k in range(2):
                e = int(replay[t, k])
                gate_up, down = experts.merged("gate_up_proj")[e], experts.merged("down_proj")[e]
                gate, up = (gate_up @ x[t]).chunk(2)
                want[t] += weights[t, k] * (down @ (torch.nn.functional.silu(gate) * up))
    _assert_close(have, want)


def _moe_policy(tiny_task, directory):
    """The tiny task's tokenizer over a Qwen3-MoE policy (hidden 64, 4 experts, top-2)."""
    import shutil

    model, data = tiny_task
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**{**QWEN3_MOE, "vocab_size": 14, "tie_word_embeddings": True})
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(directory)
    for file in model.iterdir():
        if "token" in file.name:
            shutil.copy(file, directory / file.name)
    return directory, data


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_a_grpo_run_trains_the_expert_adapters_and_the_engine_samples_from_them(tiny_task, tmp_path, signal_reward,
                                                                                 sync):
    from safetensors.torch import load_file

    from tests.distributed.conftest import base_args, read_metrics, run_one_process

    model, data = _moe_policy(tiny_task, tmp_path / "moe")
    argv = base_args(model, data, tmp_path / "out", "--num-rollout", "2", "--lora-rank", str(RANK), "--lora-alpha",
                     str(ALPHA), "--target-modules", "q_proj,experts", "--lora-sync", sync, *signal_reward,
                     "--save-hf", str(tmp_path / "hf_{rollout_id}"))
    assert run_one_process(argv) == 0
    metrics = read_metrics(tmp_path / "out")
    experts = 2 * 4 * RANK * ((64 + 64) + (32 + 64))  # 2 layers x 4 experts: A and B of gate_up_proj, down_proj
    assert metrics[-1]["lora/trainable_params"] == experts + 2 * RANK * (64 + 64)
    # the engine samples from the trained expert adapters: its log-probs are the trainer's up to float32 rounding
    assert all(m["train/train_rollout_logprob_abs_diff_max"] < 1e-5 for m in metrics)
    adapter = load_file(str(tmp_path / "hf_1" / "adapter_model.safetensors"))
    stacks = [k for k in adapter if ".mlp.experts." in k and ".lora_B." in k]
    assert len(stacks) == 4 and all(adapter[k].abs().max() > 0 for k in stacks)  # B left its zero start


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_expert_adapter_gradients_of_the_bf16_grouped_gemms_match_the_float32_loop(moe_checkpoint, monkeypatch):
    """On the GPU under bf16 autocast the experts take the grouped GEMMs (``_grouped_mm``) with the
    adapters' low-rank grouped GEMMs; the adapters' gradients are the float32 per-expert loop's up to bf16 rounding."""
    from miles_host.kernels import moe_train

    model, _ = _adapted(moe_checkpoint, target_modules="q_proj,experts", rank=8)  # bf16: low-rank grouped GEMMs
    model.cuda()
    experts = [m for m in lora_modules(model).values() if isinstance(m, LoraExperts)]
    for module in experts:
        module.experts_impl = "loop"
    model.zero_grad()
    model(_ids().cuda()).float().pow(2).mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    calls = []
    grouped = moe_train.grouped_experts
    monkeypatch.setattr(moe_train, "grouped_experts", lambda *a, **k: calls.append(k["adapters"]) or grouped(*a, **k))
    for module in experts:
        module.experts_impl = "auto"
    model.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(_ids().cuda()).float().pow(2).mean().backward()
    assert len(calls) == len(experts)  # the grouped path ran, with the low-rank terms of both stacks
    assert all(adapter is not None for adapters in calls for adapter in adapters)
    for name, grad in want.items():
        have = dict(model.named_parameters())[name].grad
        assert (have - grad).norm() <= 5e-2 * grad.norm(), name


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native_dp", "fsdp"])
def test_two_gloo_trainers_train_the_expert_adapters_as_one_process(tiny_task, tmp_path, signal_reward, backend):
    from tests.lora.test_training import one_and_two_gloo_trainers

    model, data = _moe_policy(tiny_task, tmp_path / "moe")
    a, b = one_and_two_gloo_trainers(model, data, tmp_path, backend, "--lora-rank", str(RANK), "--lora-alpha",
                                     str(ALPHA), "--target-modules", "experts", *signal_reward, rel=1e-5,
                                     worker_timeout=120)
    assert any(".experts.lora_B." in name for name in a["model"])
    for name in a["model"]:
        assert (a["model"][name] - b["model"][name]).abs().max() <= 1e-5, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_over_the_fused_moe_follows_expert_adapter_syncs(tmp_path):
    """The engine of ``--lora-sync adapter`` on the GPU (fused MoE kernels over the merged-stack
    buffers, CUDA graphs): after an adapter-only sync it samples the tokens of an eager engine
    that was sent the merged weights."""
    from miles_host.lora.sync import is_adapter_tensor, rollout_state
    from miles_host.rollout import Engine
    from tests.lora.test_engine_adapter import PROMPTS, SAMPLING, _tokens_and_log_probs

    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE))
    with torch.no_grad():  # peaky logits: no near-ties for greedy decoding
        for name, parameter in hf.named_parameters():
            parameter.normal_(0.0, 0.12 if parameter.dim() > 1 else 0.05)
            if name.endswith("norm.weight"):
                parameter.add_(1.0)
    hf.save_pretrained(tmp_path / "moe")
    path = str(tmp_path / "moe")
    trainer, config = _adapted(path, target_modules="q_proj,experts")
    config.lora_sync = "adapter"
    merged_config = MilesConfig(hf_checkpoint=path, lora_rank=RANK, lora_alpha=ALPHA, target_modules="q_proj,experts")

    def engine(lora_config, **kwargs):
        model = load_pretrained(path, dtype=torch.float32, device="cuda")
        if lora_config is not None:
            model = prepare_engine_model(model, lora_config)
        return Engine(model, max_num_seqs=8, mem_fraction_static=0.3, max_kv_cache_tokens=4096, block_size=4, **kwargs)

    graphs, merged = engine(config), engine(None, enforce_eager=True)
    assert graphs.runner.graphs is not None
    graphs.update_weights(list(rollout_state(trainer, None, config).items()), weight_version=1)
    with torch.no_grad():
        for name, parameter in trainer.named_parameters():
            if ".lora_B." in name:
                parameter.mul_(1.5)
    adapters = [(n, t) for n, t in rollout_state(trainer, None, config).items() if is_adapter_tensor(n)]
    graphs.update_weights(adapters, weight_version=2)
    merged.update_weights(list(rollout_state(trainer, None, merged_config).items()), weight_version=2)
    for (tokens, log_probs), (want_tokens, want_log_probs) in zip(_tokens_and_log_probs(graphs),
                                                                  _tokens_and_log_probs(merged)):
        assert tokens == want_tokens
        assert (log_probs - want_log_probs).abs().max() <= 1e-4


def test_r3_replays_the_rollout_experts_through_the_expert_adapters(tmp_path):
    """The R3 plugin with adapters on the routed experts: training replays the rollout's expert
    ids (the train/rollout log-prob gap shrinks as without LoRA), and the expert adapters train."""
    from tests.plugins.r3.test_r3 import _run, save_moe_task

    model, data = save_moe_task(tmp_path, "qwen3_moe")
    lora = ("--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--target-modules", "experts")
    run, _, replayed, _ = _run(model, data, tmp_path / "r3", "--plugins", "r3", *lora)
    _, _, plain, _ = _run(model, data, tmp_path / "base", *lora)
    assert replayed["train/train_rollout_logprob_abs_diff"] < plain["train/train_rollout_logprob_abs_diff"]
    experts = [m for m in lora_modules(run.trainer.model).values() if isinstance(m, LoraExperts)]
    assert experts and all(float(b.grad.abs().sum()) > 0 for m in experts for b in m.lora_B.values())
