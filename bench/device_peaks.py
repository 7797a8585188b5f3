"""The memory and matrix ceilings the benchmarks compute their bounds from, by the GPU they
run on: device-to-device copy bandwidth (bytes read + written per second) and the bf16 matrix
rate on random data, as measured on the lent machines (the library's device KINDS.md), not the
datasheets' figures. Off a GPU (the ``--tiny`` CPU runs) the H200's figures are used."""

from __future__ import annotations

import torch

#: (name fragment as ``torch.cuda.get_device_name`` reports it, copy bytes/s, bf16 FLOP/s)
PEAKS = (
    ("H200", 4.24e12, 790e12),
    ("H100", 3.0e12, 790e12),
)


def _peaks() -> tuple[float, float]:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "H200"
    for fragment, copy_bytes, flops in PEAKS:
        if fragment in name:
            return copy_bytes, flops
    raise RuntimeError(f"no measured ceilings for {name!r}: add its copy bandwidth and bf16 rate to "
                       "bench/device_peaks.py PEAKS (measure them in the first call on that machine)")


def hbm_bytes_per_s() -> float:
    """Copy bandwidth of this machine's GPU (the HBM bound of memory-bound steps)."""
    return _peaks()[0]


def bf16_flops() -> float:
    """bf16 matrix rate of this machine's GPU (the compute bound of prefill and training)."""
    return _peaks()[1]


def decode_bound_tok_s(batch: int, prompt_len: int, new_tokens: int, step_bytes: float,
                       kv_bytes_per_token: float) -> float:
    """Decode tok/s at this GPU's copy bandwidth over steps 1..new_tokens-1 (step i reads the
    weights once and batch x (prompt + i) tokens of KV)."""
    steps = range(1, new_tokens)
    seconds = sum((step_bytes + batch * (prompt_len + i) * kv_bytes_per_token) / hbm_bytes_per_s() for i in steps)
    return batch * len(steps) / seconds
