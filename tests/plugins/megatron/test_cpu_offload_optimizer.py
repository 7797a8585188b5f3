"""--optimizer-cpu-offload on the megatron trainer: Megatron's FP32Optimizer steps the host's
CpuOffloadOptimizer; the same training and the same gathered checkpoint state as the device
optimizer (one process, CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.megatron.conftest import save_models
from tests.plugins.megatron.test_megatron_trainer import MODELS, make_samples, make_trainer

pytest.importorskip("megatron.core")


def test_cpu_offloaded_step_trains_and_checkpoints_as_the_device_one(tmp_path):
    from miles_host.optimizer import CpuOffloadOptimizer
    from miles_megatron.optimizer_state import gather_optimizer_state, load_optimizer_state

    models = save_models(tmp_path, {"qwen3": MODELS["qwen3"]})
    results = []
    for flags in ((), ("--optimizer-cpu-offload", "--weight-decay", "0.1")):
        flags = flags or ("--weight-decay", "0.1")
        trainer = make_trainer(models, "qwen3", "megatron", *flags)
        inner = trainer.optimizer.megatron.chained_optimizers[0].optimizer  # the FP32Optimizer's torch optimizer
        assert isinstance(inner, CpuOffloadOptimizer) == ("--optimizer-cpu-offload" in flags)
        metrics = [trainer.train(make_samples()) for _ in range(2)]
        gathered = gather_optimizer_state(trainer)  # what a TP/EP/PP checkpoint holds
        if "--optimizer-cpu-offload" in flags:  # and it loads back into the CPU state
            load_optimizer_state(trainer, gathered)
            assert gather_optimizer_state(trainer)["step"] == gathered["step"]
            assert all(t.device.type == "cpu" for s in inner.inner.state.values() for t in s.values())
        results.append((metrics, {k: v.clone() for k, v in trainer.model.state_dict().items()
                                  if torch.is_tensor(v)}, gathered))
        trainer.close()
    (plain_metrics, plain_weights, plain_optim), (cpu_metrics, cpu_weights, cpu_optim) = results
    for a, b in zip(plain_metrics, cpu_metrics):
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
    for name, value in plain_weights.items():
        torch.testing.assert_close(cpu_weights[name], value, rtol=1e-5, atol=1e-6)
    assert plain_optim["step"] == cpu_optim["step"] > 0
    for key, moments in plain_optim["moments"].items():
        for name, value in moments.items():
            torch.testing.assert_close(cpu_optim["moments"][key][name], value, rtol=1e-5, atol=1e-7)
