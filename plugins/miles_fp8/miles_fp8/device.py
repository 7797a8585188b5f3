"""Hardware checks: FP8 tensor cores need compute capability 8.9 (Ada) or newer."""

from __future__ import annotations

import torch

MIN_CAPABILITY = (8, 9)


def check_fp8_capability(capability: tuple[int, int], device_name: str = "this GPU") -> None:
    """ValueError (saying what to do) when ``capability`` has no FP8 tensor cores."""
    if tuple(capability) < MIN_CAPABILITY:
        raise ValueError(
            f"FP8 precision needs an NVIDIA GPU with compute capability >= 8.9 (Ada, Hopper, Blackwell); "
            f"{device_name} has {capability[0]}.{capability[1]}. Drop --plugins fp8 / --precision fp8 to "
            "train and roll out in bf16, or run on an H100/H200/L40S-class GPU. (On CPU the plugin "
            "emulates FP8 in float32.)"
        )


def check_fp8_device(device: torch.device | str) -> None:
    """Check a device before swapping linears to FP8; CPU is fine (float32 emulation)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    check_fp8_capability(torch.cuda.get_device_capability(index), torch.cuda.get_device_name(index))
