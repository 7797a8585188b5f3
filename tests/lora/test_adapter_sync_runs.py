"""``miles run --lora-rank N --lora-sync adapter`` end to end on CPU: the in-process engine and
an engine process (``--rollout-num-gpus 1``, each weight-sync transport) sample from the
trained adapters (their log-probs are the trainer's up to float32 rounding), and every
step's sync moves the adapter tensors alone."""

from __future__ import annotations

import pytest
import torch

from miles_host.config import MilesConfig
from miles_host.lora import apply_lora
from miles_host.models import load_pretrained
from tests.distributed.conftest import base_args, read_metrics, resolve, run_launched, run_one_process

ADAPTER = ("--lora-rank", "4", "--lora-alpha", "8", "--lora-sync", "adapter")


def _adapter_bytes(model_path) -> int:
    """Bytes of the run's lora_A / lora_B tensors (float32 on CPU)."""
    model = load_pretrained(str(model_path), dtype=torch.float32)
    apply_lora(model, MilesConfig(hf_checkpoint=str(model_path), lora_rank=4, lora_alpha=8))
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _check(metrics: list[dict], adapter_bytes: int) -> None:
    assert len(metrics) == 3
    # an engine left on the first sync's adapters would differ by ~1e-2 from the second rollout on
    assert all(m["train/train_rollout_logprob_abs_diff_max"] < 1e-5 for m in metrics)
    assert all(m["perf/weight_sync_bytes"] == adapter_bytes for m in metrics)


def test_in_process_engine_samples_from_adapter_only_syncs(tiny_task, tmp_path, signal_reward, capsys):
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "out", "--num-rollout", "3", *ADAPTER, *signal_reward)
    assert run_one_process(argv) == 0
    _check(read_metrics(tmp_path / "out"), _adapter_bytes(model))
    assert "later weight syncs send the adapters only" in capsys.readouterr().err


@pytest.mark.parametrize("transport", ["broadcast", "cuda_ipc"])
def test_an_engine_process_takes_adapter_only_syncs(tiny_task, tmp_path, signal_reward, transport):
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "out", "--num-rollout", "3", *ADAPTER, *signal_reward,
                     "--weight-sync", transport)
    assert run_launched(argv, worker_timeout=90, rollout_num_gpus=1) == 0
    _check(read_metrics(tmp_path / "out"), _adapter_bytes(model))


def test_adapter_sync_is_refused_where_the_engine_cannot_carry_adapters(tiny_task, tmp_path):
    from miles_host.lora.checks import check_lora

    model, data = tiny_task
    config, manager = resolve(base_args(model, data, tmp_path), lora_sync="adapter")
    with pytest.raises(ValueError, match="--lora-sync adapter.*--lora-rank 0"):
        check_lora(config, manager.registries)
    config, manager = resolve(base_args(model, data, tmp_path, *ADAPTER), rollout_backend="sglang")
    with pytest.raises(ValueError, match="--rollout-backend sglang.*--lora-sync merged"):
        check_lora(config, manager.registries)


INT4_BASE = ("--plugins", "int4", "--int4-target", "all", "--int4-group-size", "32")


@pytest.mark.parametrize("backend", ["native", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_adapters_over_an_int4_base_sample_as_the_qat_trainer_scores(tiny_task, tmp_path, signal_reward, backend):
    """``--plugins int4 --lora-sync adapter``: the engine's INT4 linears (quantized by the first sync)
    with adapters next to them give the QAT trainer's log-probs, and each step syncs the adapters alone
    (in process, and with the FSDP trainer and an engine process)."""
    model, data = tiny_task
    argv = base_args(model, data, tmp_path / "out", "--num-rollout", "3", *ADAPTER, *INT4_BASE, *signal_reward)
    if backend == "native":
        assert run_one_process(argv) == 0
    else:
        assert run_launched([*argv, "--weight-sync", "broadcast"], worker_timeout=90, rollout_num_gpus=1,
                            train_backend=backend) == 0
    _check(read_metrics(tmp_path / "out"), _adapter_bytes(model))
