"""``bench/gpu_idle.py``: a training phase's GPU idle gaps charged to the host code after them,
on hand-built profiler events (no GPU needed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from bench import gpu_idle


@dataclass
class Event:
    name: str
    start: float
    end: float
    device_type: DeviceType = DeviceType.CPU
    id: int = 0
    linked_correlation_id: int = 0
    stack: list[str] = field(default_factory=list)
    cpu_parent: "Event | None" = None

    @property
    def time_range(self):
        return SimpleNamespace(start=self.start, end=self.end)


def _kernel(name, start, end, launcher):
    return Event(name, start, end, DeviceType.CUDA, linked_correlation_id=launcher.id)


def test_gaps_are_charged_to_the_code_that_launched_the_work_after_them():
    forward = Event("aten::mm", 0, 1, id=1, stack=["/x/torch/nn/functional.py(1): linear", "/repo/model.py(12): forward",
                                                    "/repo/trainer.py(40): train"])
    launch = Event("cudaLaunchKernel", 30, 31, id=2, cpu_parent=forward)  # (a runtime call: no stack of its own)
    backward_op = Event("autograd::engine::evaluate_function: MmBackward0", 50, 60, id=3)
    backward = Event("aten::mm", 51, 52, id=4, cpu_parent=backward_op)
    phase_on_gpu = Event(gpu_idle.PHASE, 0, 100, DeviceType.CUDA)  # the label's range, not GPU work
    events = [forward, launch, backward_op, backward, phase_on_gpu,
              _kernel("gemm", 0, 20, forward), _kernel("add", 10, 25, forward),  # overlapping: busy 0..25
              _kernel("gemm", 40, 45, launch), _kernel("gemm_bwd", 70, 80, backward)]
    busy, idle, by_launcher = gpu_idle.idle_gaps(events, (0, 100))
    assert busy == pytest.approx(25 + 5 + 10)
    assert idle == pytest.approx(15 + 25 + 20)
    assert by_launcher["model.py(12): forward <- trainer.py(40): train"] == pytest.approx(15)
    assert by_launcher["(no python frame) autograd::engine::evaluate_function: MmBackward0"] == pytest.approx(25)
    assert by_launcher["(after the last GPU work)"] == pytest.approx(20)
    totals = gpu_idle.kernel_totals(events)
    assert gpu_idle.PHASE not in totals
    assert totals["gemm"] == (2, pytest.approx(25)) and list(totals)[0] == "gemm"
