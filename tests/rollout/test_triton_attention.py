"""CPU: the Triton paged-attention kernels (split-KV decode, the fused KV write) without a GPU.

Under Triton's interpreter in a subprocess (``interpreted_triton_attention.py``), compiled
for sm_90 here; the GPU runs are in ``test_gpu_attention.py``.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from tests.plugins.triton_interpret import run_interpreted
from tests.plugins.triton_sm90 import compile_sm90

pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")


def test_cpu_kernels_under_the_triton_interpreter(request):
    """Split-KV decode vs the reference, counters left at zero, invariant mode unsplit, KV write bit for bit."""
    run_interpreted(Path(__file__).with_name("interpreted_triton_attention.py"), request)


def test_decode_splits_depend_on_the_grid_only():
    from miles_host.kernels.paged_attention import decode_splits

    cpu = torch.device("cpu")  # an H200's 132 SMs
    # Qwen3-8B (8 KV heads): batch 1 -> 16 splits (128 programs), 8 -> 8, 16 -> 4 (512 of 528), 17 fills the SMs
    assert [decode_splits(b, 8, cpu) for b in (1, 2, 4, 8, 12, 16, 17, 64)] == [16, 16, 16, 8, 4, 4, 1, 1]
    assert decode_splits(1, 1, cpu) == 16 and decode_splits(1, 132, cpu) == 1


def _signature(fn, types: dict[str, str]) -> dict[str, str]:
    """Every runtime parameter of ``fn`` in order: ``types`` or i32."""
    names = [n for n, p in inspect.signature(fn.fn).parameters.items()
             if "constexpr" not in str(p.annotation)]
    return {name: types.get(name, "i32") for name in names}


def test_split_decode_kernel_compiles_for_sm90_with_its_atomics():
    from miles_host.kernels import paged_attention as triton_attention

    pointers = ["Q", "K_cache", "V_cache", "Out", "block_tables", "context_lens", "cu_seqlens_q", "tile_seq",
                "tile_q_start"]
    types = {**{name: "*i32" for name in pointers}, "Q": "*bf16", "K_cache": "*bf16", "V_cache": "*bf16",
             "Out": "*bf16", "Partial_acc": "*fp32", "Partial_ml": "*fp32", "Counters": "*i32",
             "scale": "fp32", "softcap": "fp32"}
    signature = _signature(triton_attention._paged_attention_kernel, types)
    for window, softcap in ((False, False), (True, True)):
        constexprs = dict(GROUP=4, GROUP_PAD=4, BLOCK_M=4, PAGE=16, BLOCK_N=64, D=128, D_PAD=128, DV=128,
                          DV_PAD=128, SPLITS=16, USE_SOFTCAP=softcap, USE_WINDOW=window, IEEE=False)
        ptx = compile_sm90(triton_attention._paged_attention_kernel, signature, constexprs, 4, 2,
                           unaligned=("scale", "softcap", "window"))
        assert re.search(r"atom\.global\.gpu\.acq_rel\.add\.u32", ptx), "the arrival counter"
        assert re.search(r"atom\.global\.gpu\.relaxed\.exch\.b32", ptx), "the reset"
        assert "ld.global.cg" in ptx  # partials read from L2
        assert "mma" in ptx  # scores and P @ V on the tensor cores


@pytest.mark.parametrize("src, cache", [("bf16", "bf16"), ("fp32", "bf16")])
def test_kv_write_kernel_compiles_for_sm90(src, cache):
    from miles_host.kernels import paged_attention as triton_attention

    types = {"K": f"*{src}", "V": f"*{src}", "K_cache": f"*{cache}", "V_cache": f"*{cache}", "slots": "*i64"}
    signature = _signature(triton_attention._kv_write_kernel, types)
    constexprs = dict(D=128, D_PAD=128, DV=128, DV_PAD=128, BLOCK_H=8, EMULATE=False)
    ptx = compile_sm90(triton_attention._kv_write_kernel, signature, constexprs, 4, 1, unaligned=("H",))
    assert ("cvt.rn.bf16" in ptx) == (src != cache)
