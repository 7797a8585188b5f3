"""The megatron trainer's step is Megatron-Core's optimizer in one process too (CPU, float32;
:mod:`miles_megatron.megatron_optimizer`).

- Its ``FP32Optimizer`` (dense and expert) with weight decay on matrices only and clipping that
  bites gives the native trainer's steps (``torch.optim.AdamW``, ``clip_grad_norm_``).
- A ``--ckpt-format torch`` checkpoint (moments under native names) resumes bit for bit; a
  one-process checkpoint of the host's AdamW is refused by name, or with ``--no-load-optim``
  gives its weights and schedule.
- ``--offload-train`` moves the inner optimizer's moments off and back, and training goes on
  as without it; a non-finite gradient norm skips the step (weights, moments, schedule kept).
Skipped where megatron-core is not installed.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("transformers")

from tests.plugins.megatron.test_megatron_trainer import (  # noqa: E402,F401
    _one_rank_group,
    make_samples,
    make_trainer,
    models,
)

#: weight decay, a clip below the first norm (about 3), a warm-up so the learning rate changes
FLAGS = ("--calculate-per-token-loss", "--weight-decay", "0.1", "--clip-grad", "0.5", "--lr-warmup-iters", "3",
         "--ckpt-format", "torch")


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in trainer.named_weights_for_rollout()}


def _moments(trainer) -> list[torch.Tensor]:
    return [state["exp_avg"] for state in trainer.optimizer.state.values()]


def test_megatrons_optimizer_gives_the_native_steps_with_decay_and_clipping(models):
    from megatron.core.optimizer.optimizer import FP32Optimizer

    native = make_trainer(models, "qwen3_moe", "native", *FLAGS)
    megatron = make_trainer(models, "qwen3_moe", "megatron", *FLAGS)
    chained = megatron.optimizer.megatron.chained_optimizers
    assert [type(o) for o in chained] == [FP32Optimizer, FP32Optimizer]  # dense, experts
    assert all(type(o.optimizer) is torch.optim.AdamW for o in chained)
    decay = {id(p): g["weight_decay"] for o in chained for g in o.optimizer.param_groups for p in g["params"]}
    gpt = megatron.model.gpt
    assert decay[id(gpt.decoder.layers[0].self_attention.linear_qkv.weight)] == 0.1
    assert decay[id(gpt.decoder.layers[0].input_layernorm.weight)] == 0.0
    samples = make_samples()
    for step in range(2):
        want, got = native.train(samples), megatron.train(samples)
        assert want["train/grad_norm"] > 1.0  # clipped
        for key in ("train/loss", "train/grad_norm", "train/lr"):
            assert got[key] == pytest.approx(want[key], abs=1e-5), (step, key)
    assert megatron.optimizer_steps() == native.optimizer_steps() == 2
    expected, exported = _weights(native), _weights(megatron)
    assert max(float((exported[k] - expected[k]).abs().max()) for k in expected) < 1e-5


def test_a_torch_format_checkpoint_resumes_exactly_and_the_host_adamws_is_refused(models):
    trainer = make_trainer(models, "qwen3", "megatron", *FLAGS)
    samples = make_samples()
    trainer.train(samples)
    state = copy.deepcopy(trainer.state_dict())  # (in one process its tensors are the live ones)
    assert state["optimizer"]["step"] == 1.0 and "embed_tokens.weight" in state["optimizer"]["moments"]["exp_avg"]
    want, want_weights = trainer.train(samples), _weights(trainer)
    resumed = make_trainer(models, "qwen3", "megatron", *FLAGS)
    resumed.load_state_dict(state)
    got, got_weights = resumed.train(samples), _weights(resumed)
    for key in ("train/loss", "train/grad_norm", "train/lr"):
        assert got[key] == want[key], key
    assert all(torch.equal(got_weights[k], want_weights[k]) for k in want_weights)
    host_adamw = {"model": state["model"], "optimizer": {"state": {}, "param_groups": []},
                  "scheduler": state["scheduler"], "train_backend": "megatron"}
    with pytest.raises(ValueError, match="holds the state of the host's AdamW.*--no-load-optim"):
        resumed.load_state_dict(host_adamw)
    fresh = make_trainer(models, "qwen3", "megatron", *FLAGS, "--no-load-optim")
    fresh.load_state_dict(host_adamw)  # the weights and schedule, fresh moments
    assert len(fresh.optimizer.state) == 0 and fresh.optimizer_steps() == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.full_state_dict().values(), state["model"].values()))


def test_offload_train_moves_the_moments_and_training_goes_on(models):
    plain = make_trainer(models, "qwen3", "megatron", *FLAGS)
    offloaded = make_trainer(models, "qwen3", "megatron", *FLAGS)
    assert offloaded.can_offload_train_state
    samples = make_samples()
    plain.train(samples)
    offloaded.train(samples)
    before = _moments(offloaded)
    assert len(before) == len(list(offloaded.optimizer.megatron.chained_optimizers[0].optimizer.state))
    offloaded.offload_train_state()
    offloaded.onload_train_state()
    after = _moments(offloaded)
    assert len(after) == len(before) and not any(a is b for a, b in zip(after, before))  # moved (copies)
    want, got = plain.train(samples), offloaded.train(samples)
    assert got["train/loss"] == want["train/loss"] and got["train/grad_norm"] == want["train/grad_norm"]
    expected, exported = _weights(plain), _weights(offloaded)
    assert all(torch.equal(exported[k], expected[k]) for k in expected)


def test_a_non_finite_gradient_norm_skips_the_step(models):
    trainer = make_trainer(models, "qwen3", "megatron", *FLAGS)
    samples = make_samples()
    trainer.train(samples)
    weights, moments = _weights(trainer), [m.clone() for m in _moments(trainer)]
    prepare = trainer.optimizer.megatron.prepare_grads

    def poisoned():
        trainer.model.gpt.decoder.layers[0].mlp.linear_fc2.weight.main_grad[0, 0] = float("nan")
        return prepare()

    trainer.optimizer.megatron.prepare_grads = poisoned
    metrics = trainer.train(samples)
    assert metrics["train/nan_step_skipped"] == 1.0 and trainer.consecutive_nan_steps == 1
    assert trainer.optimizer_steps() == 1
    assert all(torch.equal(a, b) for a, b in zip(_weights(trainer).values(), weights.values()))
    assert all(torch.equal(a, b) for a, b in zip(_moments(trainer), moments))


def test_megatrons_torch_adamw_on_the_fused_kernel_steps_as_torchs_fused_adamw():
    """``use_fused_kernel`` (applied on CUDA) turns the AdamW Megatron builds without TransformerEngine
    or Apex into torch's fused AdamW: the same steps bit for bit (torch runs that kernel on the CPU
    too), its ``step`` counters where torch's own fused AdamW keeps them."""
    from miles_megatron.megatron_optimizer import step_counter, use_fused_kernel

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    settings = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    megatrons = torch.optim.AdamW([{"params": params, "wd_mult": 1.0}], **settings)  # (foreach, as Megatron builds it)
    use_fused_kernel(megatrons)
    assert all(group["fused"] and not group["foreach"] for group in megatrons.param_groups)
    fused = torch.optim.AdamW(twins, fused=True, **settings)
    for step in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, t, g in zip(params, twins, grads):
            p.grad, t.grad = g.clone(), g.clone()
        megatrons.step()
        fused.step()
    for p, t in zip(params, twins):
        assert torch.equal(p, t)
        assert torch.equal(megatrons.state[p]["step"], fused.state[t]["step"])
        assert megatrons.state[p]["step"].dtype == fused.state[t]["step"].dtype
    assert step_counter(megatrons, params[0], 3).device == params[0].device
    plain = torch.optim.AdamW(twins, **settings)
    assert step_counter(plain, twins[0], 3).device.type == "cpu"
    use_fused_kernel(fused)  # (an optimizer that has stepped is left as it is)
