"""GPU: ``--train-backend megatron`` on CUDA, on a Qwen3-MoE-shaped model (hidden 512,
4 MoE layers of 8 experts top-2 with intermediate 256, 8 query / 4 KV heads of dim 64,
vocab 1024; random init, float32 checkpoint).

Both trainers keep float32 masters and run the forward under bf16 autocast; Megatron
runs over a one-rank NCCL group with its CUDA RNG tracker seeded.

- Log-probs of the same packed samples equal the native backend's within a bf16
  tolerance: with the same experts (the native router's choice replayed into both),
  and with each router choosing for itself (bf16 rounding may flip a near-tied expert
  choice; those tokens are counted and printed).
- One GRPO step with R3: rollout by the embedded engine on the GPU capturing the routes,
  reward, one optimizer step of the megatron trainer; the loss is finite and Megatron's
  routers used the rollout's experts on every token (recorded with a forward hook).

    python -m pytest tests/plugins/megatron/test_megatron_gpu.py -m gpu -s
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
transformers = pytest.importorskip("transformers")

from miles_host.cli.args import resolve_run_config  # noqa: E402
from miles_host.plugin_manager import MilesPluginManager  # noqa: E402
from miles_host.sample import Sample, Status  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda"
VOCAB, LAYERS, EXPERTS, TOP_K = 1024, 4, 8, 2
#: bf16 tolerance, with the same experts. bf16 keeps 8 significant bits (relative rounding
#: 2^-9 ~ 2e-3). The two backends round at different places — attention (flash/SDPA vs
#: Megatron's unfused bf16 GEMMs with a float32 softmax), q/k norm outputs, gate weights
#: (float32 vs bf16) and where they are applied (after vs before the expert's down
#: projection), the top-k sum (float32 vs bf16) — each a ~2^-9 relative change of a branch
#: output, over 4 layers, then a bf16 vocab GEMM whose logits (|z| ~ 1) carry ~4e-3 each.
#: So: mean |diff| within a few bf16 steps of the logits, any token within ~10 steps, and
#: Megatron's error against the float32 forward no worse than a few times the native's.
#: (CPU stand-in for CUDA autocast at this shape: max 1.0e-2, mean 2.2e-3 with the same
#: experts; the native bf16-vs-fp32 error is max 6.7e-2, mean 4.0e-3.)
TOL_MEAN, TOL_MAX, TOL_VS_NATIVE_BF16 = 1e-2, 5e-2, 2.0


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group(one_rank_group):
    """(see conftest: no process group left behind)"""


def build_moe_model(directory):
    """A random Qwen3-MoE checkpoint and a word-level tokenizer covering its vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, tie_word_embeddings=False,
        eos_token_id=1, pad_token_id=0, bos_token_id=0, max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>"
    ).save_pretrained(directory)
    return directory


def write_prompts(path, count: int, length: int = 24):
    rng = random.Random(0)
    with path.open("w") as handle:
        for _ in range(count):
            handle.write(json.dumps({"input": " ".join(f"w{rng.randrange(2, VOCAB)}" for _ in range(length))}) + "\n")
    return path


def make_trainer(model, data, backend, *flags):
    manager = MilesPluginManager()
    manager.discover()
    argv = ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "exact", "--device", DEVICE,
            "--train-backend", backend, "--micro-batch-size", "4", *flags]
    config, _ = resolve_run_config(argv, manager)
    return manager.registries.train_backends.get(backend).factory(config, manager)


def make_samples() -> list[Sample]:
    """8 samples, prompts of 12-40 and responses of 8-56 tokens (unequal: padding matters)."""
    rng = np.random.default_rng(0)
    samples = []
    for index in range(8):
        prompt, response = int(rng.integers(12, 41)), int(rng.integers(8, 57))
        samples.append(Sample(
            tokens=rng.integers(2, VOCAB, prompt + response).tolist(), response_length=response,
            reward=float(index % 3), loss_mask=[1] * response, status=Status.COMPLETED, group_index=index // 4,
            index=index, rollout_log_probs=[-7.0] * response,
        ))
    return samples


def log_probs(trainer, samples, fp32: bool = False):
    """Response log-probs ``[R]`` of the old-logprob pass (``fp32``: autocast off)."""
    if fp32:
        trainer._autocast = lambda: torch.autocast(torch.device(DEVICE).type, enabled=False)
    try:
        with torch.no_grad():
            return trainer.response_log_probs(trainer.model, trainer.pack(samples, "old_logprob"))[0].float().cpu()
    finally:
        trainer.__dict__.pop("_autocast", None)


def native_routes(trainer, samples) -> list[np.ndarray]:
    """The native router's own experts per sample, ``[len - 1, layers, k]`` (R3's capture)."""
    from miles_host.models import ForwardContext, PackedAttention, RoutingContext
    from miles_host.trainer import PackedBatch

    batch = PackedBatch.from_samples(samples, trainer.device)
    routing = RoutingContext(phase="rollout")
    routing.extra["capture"] = True
    ctx = ForwardContext(attention=PackedAttention(batch.cu_seqlens), routing=routing)
    with torch.no_grad(), trainer._autocast():
        trainer.model.forward_hidden(batch.input_ids_T, batch.positions_T, ctx)
    stacked = torch.stack([routing.captured[layer].cpu() for layer in sorted(routing.captured)], dim=1)
    bounds = batch.cu_seqlens.tolist()
    return [stacked[start:end - 1].numpy().astype(np.uint8) for start, end in zip(bounds[:-1], bounds[1:])]


def record_routing_maps(trainer) -> list[tuple[int, torch.Tensor]]:
    """``(layer, routing_map [S * B, experts])`` of every MoE router call, in call order."""
    from miles_megatron.replay import moe_routers

    calls = []
    for layer, router in moe_routers(trainer.model.gpt).items():
        router.register_forward_hook(lambda module, args, out, layer=layer: calls.append((layer, out[1].detach().cpu())))
    return calls


def routes_as_maps(micro: list[Sample], routes: list[np.ndarray], position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample routes of MoE layer ``position`` as a routing map in Megatron's ``[S, B]``
    order (row ``s * B + b``), and which rows have a route."""
    batch, seq_len = len(micro), max(len(s.tokens) for s in micro)
    expected = torch.zeros(seq_len * batch, EXPERTS, dtype=torch.bool)
    compared = torch.zeros(seq_len * batch, dtype=torch.bool)
    for b, sample_routes in enumerate(routes):
        for s, ids in enumerate(sample_routes[:, position]):
            expected[s * batch + b, torch.from_numpy(ids.astype(np.int64))] = True
            compared[s * batch + b] = True
    return expected, compared


def _figures(name, got, want):
    diff = (got - want).abs()
    print(f"  {name:<34} max |diff| {float(diff.max()):.3e}  mean {float(diff.mean()):.3e}")
    return diff


def compare_log_probs(model, root) -> dict[str, float]:
    data = write_prompts(root / "prompts.jsonl", 8)
    samples = make_samples()
    native, megatron = make_trainer(model, data, "native"), make_trainer(model, data, "megatron")
    assert type(megatron.model.gpt).__name__ == "GPTModel" and megatron.device.type == torch.device(DEVICE).type
    reference = log_probs(native, samples, fp32=True)
    native_bf16 = log_probs(native, samples)
    calls = record_routing_maps(megatron)
    megatron_bf16 = log_probs(megatron, samples)
    print(f"\nmegatron vs native log-probs on {DEVICE}, {reference.numel()} response tokens of 8 packed samples:")
    native_error = _figures("native bf16 vs native fp32", native_bf16, reference)
    megatron_error = _figures("megatron bf16 vs native fp32", megatron_bf16, reference)
    own = _figures("megatron vs native (own routers)", megatron_bf16, native_bf16)

    # the same experts in both: the native router's choice, replayed (R3) into each backend
    native_r3 = make_trainer(model, data, "native", "--plugins", "r3")
    routes = native_routes(native_r3, samples)
    flipped = 0
    for layer, routing_map in calls:  # one packed forward: one call per MoE layer
        expected, rows = routes_as_maps(samples, routes, layer)
        flipped += int((routing_map[rows] != expected[rows]).any(-1).sum())
    token_layers = sum(len(s.tokens) - 1 for s in samples) * len(calls)
    print(f"  routers choose differently on {flipped} of {token_layers} token-layers")
    for sample, sample_routes in zip(samples, routes):
        sample.rollout_routed_experts = sample_routes
    native_replayed = log_probs(native_r3, samples)
    megatron_replayed = log_probs(make_trainer(model, data, "megatron", "--plugins", "r3"), samples)
    _figures("native replaying its own routes", native_replayed, native_bf16)
    same = _figures("megatron vs native (same experts)", megatron_replayed, native_replayed)

    assert float(same.mean()) < TOL_MEAN and float(same.max()) < TOL_MAX
    # and Megatron's bf16 forward is about as close to the float32 forward as the native one
    assert float(megatron_error.mean()) < TOL_VS_NATIVE_BF16 * float(native_error.mean()) + 1e-4
    # each router on its own: equal but where a near tie flipped an expert (tokens after it move)
    assert float(own.median()) < TOL_MEAN
    if flipped == 0:
        assert float(own.max()) < TOL_MAX
    return {"same_max": float(same.max()), "same_mean": float(same.mean()), "own_mean": float(own.mean()),
            "flipped": flipped}


def test_log_probs_equal_the_native_backends_within_bf16(tmp_path):
    compare_log_probs(build_moe_model(tmp_path / "model"), tmp_path)


def length_reward(sample, config=None):
    """A reward with variance inside every group (so the policy gradient is not zero)."""
    return float(len(sample.tokens)) + 0.1 * (sample.index % 3)


def grpo_step_with_r3(model, root) -> dict[str, float]:
    from miles_host.loop import Run
    from miles_host.trainer import micro_batches, trainable

    manager = MilesPluginManager()
    manager.discover()
    argv = [
        "--hf-checkpoint", str(model), "--prompt-data", str(write_prompts(root / "prompts.jsonl", 8)),
        "--custom-rm-path", f"{__name__}.length_reward", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "24", "--num-rollout", "1", "--micro-batch-size", "4", "--lr", "1e-4",
        "--device", DEVICE, "--train-backend", "megatron", "--plugins", "r3", "--output-dir", str(root / "out"),
        "--no-progress", *(["--sglang-mem-fraction-static", "0.05"] if DEVICE == "cuda" else []),
    ]
    config, _ = resolve_run_config(argv, manager)
    run = Run(config, manager)
    assert type(run.trainer).__name__ == "MegatronTrainer"
    run.sync_weights(version=run.state.weight_version)
    groups, _ = run.rollout.generate(0)
    samples = [s for group in groups for s in group]
    calls = record_routing_maps(run.trainer)
    metrics = run.trainer.train(samples)
    manager.hook.miles_step_end(rollout_id=0, metrics=metrics, config=config, counters=manager.rank_counters(config))
    run.sync_weights()  # the trained weights back to the engine (native names, from CUDA)

    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["train/grad_norm"])
    assert metrics["train/grad_norm"] > 0 and "train/nan_step_skipped" not in metrics
    routers = [layer.mlp.router.weight for layer in run.trainer.model.gpt.decoder.layers]
    assert all(w.grad is not None and float(w.grad.abs().sum()) > 0 for w in routers)  # the router still learns
    # one optimizer step, no KL: the training forward is the only pass, micro-batch by micro-batch
    micros = micro_batches([s for s in samples if trainable(s)], config)
    assert len(calls) == len(micros) * LAYERS
    compared = response_compared = 0
    for index, (layer, routing_map) in enumerate(calls):
        micro = micros[index // LAYERS]
        assert layer == index % LAYERS
        expected, rows = routes_as_maps(micro, [s.rollout_routed_experts for s in micro], layer)
        assert int(rows.sum()) == sum(len(s.tokens) - 1 for s in micro)
        assert torch.equal(routing_map[rows], expected[rows]), f"layer {layer}: Megatron did not use the rollout's experts"
        compared += int(rows.sum())
        response_compared += sum(s.response_length for s in micro)
    figures = {
        "samples": len(samples), "token_layers": compared, "response_token_layers": response_compared,
        "loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"],
        "expert_agreement": metrics.get("r3/expert_agreement", float("nan")),
        "train_rollout_logprob_abs_diff": metrics["train/train_rollout_logprob_abs_diff"],
    }
    print(f"\nGRPO step, megatron + R3 on {DEVICE}: " + ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()))
    # the trainer replays the rollout's experts: its log-probs are the engine's up to bf16 rounding
    assert figures["train_rollout_logprob_abs_diff"] < TOL_MAX
    return figures


def test_grpo_step_with_r3_replays_the_rollout_experts(tmp_path):
    grpo_step_with_r3(build_moe_model(tmp_path / "model"), tmp_path)
