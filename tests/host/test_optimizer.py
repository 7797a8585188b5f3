"""--optimizer, Megatron's weight-decay groups and --optimizer-cpu-offload, against plain
float64 formulas of AdamW and SGD."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from miles_host.optimizer import CpuOffloadOptimizer, build_optimizer, no_weight_decay, parameter_groups


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(6, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 3, bias=False)

    def forward(self, ids):
        return self.head(self.norm(self.proj(self.embed(ids)))).logsumexp(-1).sum()


def _config(**values):
    base = dict(optimizer="adam", lr=0.1, adam_beta1=0.9, adam_beta2=0.98, adam_eps=1e-8, weight_decay=0.1,
                sgd_momentum=0.9)
    return SimpleNamespace(**{**base, **values})


def _grads(model, steps):
    """The gradients of each step, recomputed on the model as it is at that step."""
    ids = torch.tensor([0, 3, 5, 1])
    model.zero_grad()
    model(ids * (steps % 2 + 1) % 6).backward()


def _reference(initial, grads, config, decayed):
    """float64 AdamW / SGD with PyTorch's and Megatron's update rules."""
    params = {n: p.double().clone() for n, p in initial.items()}
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    for t, grad in enumerate(grads, 1):
        for n, p in params.items():
            g = grad[n].double()
            wd = config.weight_decay if n in decayed else 0.0
            if config.optimizer == "adam":
                p.mul_(1 - config.lr * wd)
                m[n] = config.adam_beta1 * m[n] + (1 - config.adam_beta1) * g
                v[n] = config.adam_beta2 * v[n] + (1 - config.adam_beta2) * g * g
                m_hat = m[n] / (1 - config.adam_beta1 ** t)
                v_hat = v[n] / (1 - config.adam_beta2 ** t)
                p.sub_(config.lr * m_hat / (v_hat.sqrt() + config.adam_eps))
            else:
                g = g + wd * p
                m[n] = g if t == 1 else config.sgd_momentum * m[n] + g
                p.sub_(config.lr * m[n])
    return params


def test_biases_and_norms_are_not_decayed():
    model = Tiny()
    plain = {n for n, p in model.named_parameters() if no_weight_decay(n, p)}
    assert plain == {"proj.bias", "norm.weight", "norm.bias"}
    groups = parameter_groups(model.named_parameters(), 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    assert [len(g["params"]) for g in parameter_groups(model.named_parameters(), 0.0)] == [6]  # one group


@pytest.mark.parametrize("name", ["adam", "sgd"])
@pytest.mark.parametrize("cpu_offload", [False, True])
def test_steps_match_the_formula(name, cpu_offload):
    config = _config(optimizer=name, lr=0.05 if name == "adam" else 0.01)
    model = Tiny()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    decayed = {n for n, p in model.named_parameters() if not no_weight_decay(n, p)}
    optimizer = build_optimizer(model.named_parameters(), config, cpu_offload=cpu_offload)
    if cpu_offload:
        assert isinstance(optimizer, CpuOffloadOptimizer) and not optimizer.state
    grads = []
    for step in range(3):
        _grads(model, step)
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        optimizer.step()
    # the reference replays the same gradients (each taken at the trained model's point)
    expected = _reference(initial, grads, config, decayed)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach().double(), expected[n], rtol=1e-5, atol=1e-6)


def test_cpu_offload_follows_the_schedule_and_checkpoints():
    config = _config()
    model = Tiny()
    optimizer = build_optimizer(model.named_parameters(), config, cpu_offload=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    for step in range(2):
        _grads(model, step)
        optimizer.step()
        scheduler.step()
    assert [g["lr"] for g in optimizer.inner.param_groups] == [0.05, 0.05]  # the lr of the last step taken
    saved = optimizer.state_dict()
    assert all(t.device.type == "cpu" for s in saved["state"].values() for t in s.values())
    twin = Tiny()
    twin.load_state_dict(model.state_dict())
    restored = build_optimizer(twin.named_parameters(), config, cpu_offload=True)
    restored.load_state_dict(copy.deepcopy(saved))  # as torch.save/load would: no shared moments
    _grads(model, 2)
    _grads(twin, 2)
    optimizer.step()
    for group in restored.param_groups:
        group["lr"] = optimizer.param_groups[0]["lr"]
    restored.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)


def test_backends_that_cannot_refuse_by_name():
    from miles_host.distributed.fsdp_trainer import Fsdp2Trainer
    from miles_host.trainer import NativeTrainer

    assert NativeTrainer.cpu_offload_refusal is None and "sgd" in NativeTrainer.optimizer_names
    assert "FSDP2" in Fsdp2Trainer.cpu_offload_refusal
    megatron = pytest.importorskip("miles_megatron.trainer")
    assert megatron.MegatronTrainer.optimizer_names == ("adam",)
    assert megatron.MegatronTrainer.cpu_offload_refusal is None  # its CPU step: tests/plugins/megatron


def test_cpu_offload_trains_parameters_set_after_construction():
    """A data-parallel broadcast (or any write) between construction and the first step is kept."""
    config = _config(weight_decay=0.0)
    model, twin = Tiny(), Tiny()
    offloaded = build_optimizer(model.named_parameters(), config, cpu_offload=True)
    with torch.no_grad():
        for a, b in zip(model.parameters(), twin.parameters()):
            a.add_(0.5)
            b.add_(0.5)
    plain = build_optimizer(twin.named_parameters(), config)
    for module, optimizer in ((model, offloaded), (twin, plain)):
        _grads(module, 0)
        optimizer.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)
