"""Programmatic dependent launch of the decode kernels (:mod:`miles_host.kernels.pdl`).

CPU: every PDL-aware kernel, compiled for sm_90 with ``PDL=True``, signals its successor, and
waits for its predecessor before its first store or atomic; the small-M GEMM loads weights
before the wait (its prefetch). GPU: a decode step of a small Qwen3-MoE model in CUDA graphs
gives the same bits with ``--pdl on`` and ``--pdl off``.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from miles_host.kernels import pdl, switches
from tests.plugins.triton_sm90 import compile_sm90

WAIT, TRIGGER = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
#: PTX instructions that write memory (a store, an atomic, a reduction)
WRITES = re.compile(r"^\s*(@!?%p\d+\s+)?(st\.global|atom\.|red\.)", re.MULTILINE)
LOADS = re.compile(r"^\s*(@!?%p\d+\s+)?ld\.global", re.MULTILINE)


def _signature(fn, types: dict[str, str]) -> dict[str, str]:
    """Every runtime parameter of ``fn`` in order: ``types`` or i32."""
    names = [n for n, p in inspect.signature(fn.fn).parameters.items() if "constexpr" not in str(p.annotation)]
    return {name: types.get(name, "i32") for name in names}


#: a kernel that lets its successor launch only after its own wait, loading nothing before it
LATE_TRIGGER = "late trigger"


def _check_contract(ptx: str, prefetches: bool | str = False) -> None:
    assert TRIGGER in ptx and WAIT in ptx
    wait_at = ptx.index(WAIT)
    assert (ptx.index(TRIGGER) > wait_at) == (prefetches == LATE_TRIGGER)
    first_write = WRITES.search(ptx)
    assert first_write is not None and first_write.start() > wait_at, "a store before the wait"
    first_load = LOADS.search(ptx)
    assert first_load is not None
    assert (first_load.start() < wait_at) == (prefetches is True)


def _kernels():
    """(kernel, runtime argument types, constexprs, num_warps, num_stages, whether it prefetches weights)."""
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    from miles_host.kernels import _moe_grouped_triton, _moe_router_triton, _rmsnorm_triton, _rotary_triton
    from miles_host.kernels import _small_m_gemm_triton, mla_attention, paged_attention
    from miles_host.kernels._moe_grouped_triton import layout_constants

    import triton.language as tl

    bf16 = "*bf16"
    layout = layout_constants(8, 128, 16)
    moe_gemv = {"A": bf16, "RowToken": "*i64", "PairRow": "*i64", "BlockExpert": "*i32", "W": bf16, "C": bf16}
    moe_gemv_constants = dict(ROW_BLOCK=16, ACT=0, EMULATE=False)
    return {
        "rmsnorm": (_rmsnorm_triton._rmsnorm_kernel, {"X": bf16, "R": bf16, "W": bf16, "Out": bf16, "ResOut": bf16,
                                                       "eps": "fp32"},
                    dict(HAS_RESIDUAL=True, UNIT_OFFSET=False, BLOCK=2048, DTYPE=tl.bfloat16), 4, 1, True),
        "small_m": (_small_m_gemm_triton._small_m_kernel, {"x_ptr": bf16, "w_ptr": bf16, "y_ptr": bf16,
                                                            "part_ptr": "*fp32", "sem_ptr": "*i32"},
                    dict(BLOCKS_PER_SPLIT=4, SPLIT_K=4, REDUCE_IN_KERNEL=True, EMULATE=False, BLOCK_M=16,
                         BLOCK_N=64, BLOCK_K=128), 4, 4, True),
        "gemv": (_small_m_gemm_triton._gemv_kernel, {"x_ptr": bf16, "w_ptr": bf16, "y_ptr": bf16,
                                                      "part_ptr": "*fp32", "sem_ptr": "*i32"},
                 dict(BLOCKS_PER_SPLIT=4, SPLIT_K=2, REDUCE_IN_KERNEL=True, EMULATE=False, BLOCK_N=16, BLOCK_K=256,
                      STRIDE_WN=2048), 4, 1, True),
        "qk_norm_rope": (_rotary_triton._qk_norm_rope_kernel,
                         {n: bf16 for n in ("Q", "K", "QW", "KW", "Cos", "Sin", "QOut", "KOut", "V", "KCache",
                                            "VCache")} | {"Slots": "*i64", "eps": "fp32"},
                         dict(D=128, BLOCK_D=128, R=64, BLOCK_R=64, PASS=0, BLOCK_P=1, HAS_NORM=True,
                              UNIT_OFFSET=False, INTERLEAVED=False, DTYPE=tl.bfloat16, STORE_KV=True), 1, 1, True),
        "kv_write": (paged_attention._kv_write_kernel, {"K": bf16, "V": bf16, "K_cache": bf16, "V_cache": bf16,
                                                        "slots": "*i64"},
                     dict(D=128, D_PAD=128, DV=128, DV_PAD=128, BLOCK_H=4, EMULATE=False), 4, 1, False),
        "paged_attention": (paged_attention._paged_attention_kernel,
                            {"Q": bf16, "K_cache": bf16, "V_cache": bf16, "Out": bf16, "Partial_acc": "*fp32",
                             "Partial_ml": "*fp32", "Counters": "*i32", "block_tables": "*i32",
                             "context_lens": "*i32", "cu_seqlens_q": "*i32", "tile_seq": "*i32",
                             "tile_q_start": "*i32", "scale": "fp32", "softcap": "fp32"},
                            dict(GROUP=8, GROUP_PAD=8, BLOCK_M=2, PAGE=16, BLOCK_N=32, D=128, D_PAD=128, DV=128,
                                 DV_PAD=128, SPLITS=16, USE_SOFTCAP=False, USE_WINDOW=False, IEEE=False), 4, 2,
                            True),  # the step's tiles and context lengths before the wait
        "mla_attention": (mla_attention._mla_attention_kernel,
                          {"Q_latent": bf16, "Q_rope": bf16, "Cache": bf16, "Out": bf16, "Partial_acc": "*fp32",
                           "Partial_ml": "*fp32", "Counters": "*i32", "block_tables": "*i32", "context_lens": "*i32",
                           "cu_seqlens_q": "*i32", "tile_seq": "*i32", "tile_q_start": "*i32", "scale": "fp32"},
                          dict(R=512, R_PAD=512, P=64, P_PAD=64, BLOCK_M=1, BLOCK_H=16, PAGE=16, BLOCK_N=32,
                               SPLITS=16, IEEE=False), 4, 2, True),  # the same metadata before its wait
        "router": (_moe_router_triton._router_kernel,
                   {"Logits": bf16, "Bias": "*fp32", "Ids": "*i64", "Weights": bf16, "RowToken": "*i64",
                    "PairRow": "*i64", "BlockExpert": "*i32", "Scratch": "*i32", "norm_eps": "fp32",
                    "scaling": "fp32"},
                   dict(TOP_K=8, K_P=8, T_P=2, G=1, G_P=1, S=128, S_P=128, TOPK_GROUP=1, SOFTMAX=True,
                        HAS_BIAS=False, NORM=True, EMULATE=False, **layout), 1, 1, False),
        "route": (_moe_grouped_triton._route_kernel, {"Ids": "*i64", "RowToken": "*i64", "PairRow": "*i64",
                                                      "BlockExpert": "*i32", "Scratch": "*i32"},
                  dict(TOP_K=8, **layout), 4, 1, False),
        "moe_gemm": (_moe_grouped_triton._moe_gemm_kernel,
                     {"A": bf16, "RowToken": "*i64", "BlockExpert": "*i32", "W": bf16, "Bias": bf16, "C": bf16},
                     dict(K=2048, K_BLOCKS=16, GATHER=True, GATED=True, ACT=0, HAS_BIAS=False, LIMIT=0.0,
                          ALPHA=1.0, IEEE=False, EMULATE=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128), 4, 3, False),
        "combine": (_moe_grouped_triton._combine_kernel, {"Out": bf16, "PairRow": "*i64", "Weights": bf16, "Y": bf16},
                    dict(TOP_K=8, BLOCK_H=1024, EMULATE=False), 4, 1, False),
        # the expert GEMVs: gate_up triggers after its wait, so the down launch reads the routing and its
        # first weight block before its own
        "moe_gemv_gate_up": (_moe_grouped_triton._moe_gemv_kernel, moe_gemv, dict(moe_gemv_constants, K=2048,
                             BLOCK_K=512, GATHER=True, GATED=True, BLOCK_N=8), 4, 1, LATE_TRIGGER),
        "moe_gemv_down": (_moe_grouped_triton._moe_gemv_kernel, moe_gemv, dict(moe_gemv_constants, K=768,
                          BLOCK_K=256, GATHER=False, GATED=False, BLOCK_N=16), 4, 1, True),
        "moe_gemv_combine": (_moe_grouped_triton._moe_gemv_combine_kernel,
                             {"A": bf16, "PairRow": "*i64", "BlockExpert": "*i32", "Weights": bf16, "W": bf16,
                              "Y": bf16},
                             dict(K=768, BLOCK_K=256, ROW_BLOCK=16, TOP_K=8, EMULATE=False, BLOCK_N=4), 4, 1, True),
    }


@pytest.mark.parametrize("name", ["rmsnorm", "small_m", "gemv", "qk_norm_rope", "kv_write", "paged_attention",
                                  "mla_attention", "router", "route", "moe_gemm", "combine", "moe_gemv_gate_up", "moe_gemv_down",
                                  "moe_gemv_combine"])
def test_pdl_kernels_wait_before_they_write(name):
    """Built for sm_90 with PDL: the trigger, then the wait before any store or atomic; only the
    kernels with weights to prefetch (or the attention, the step's metadata) load before the wait; the
    gate_up expert GEMV triggers its successor only after its wait. Without PDL: no griddepcontrol at all."""
    fn, types, constexprs, warps, stages, prefetches = _kernels()[name]
    signature = _signature(fn, types)
    unaligned = tuple(n for n, t in signature.items() if not t.startswith("*"))
    _check_contract(compile_sm90(fn, signature, {**constexprs, "PDL": True}, warps, stages, unaligned), prefetches)
    plain = compile_sm90(fn, signature, {**constexprs, "PDL": False}, warps, stages, unaligned)
    assert "griddepcontrol" not in plain


def test_pdl_options_are_off_on_the_cpu_and_with_the_switch_off():
    assert pdl.options(torch.zeros(1)) == {"PDL": False}
    with switches.switched(pdl="off"):
        assert not pdl.enabled(torch.zeros(1))
    with pytest.raises(ValueError, match="--pdl 'maybe'"):
        switches.setVALUES(pdl="maybe")


def test_pdl_needs_an_nvidia_gpu_of_compute_capability_9(monkeypatch):
    """On by default, so every GPU that lacks ``griddepcontrol`` must launch plainly: older NVIDIA
    GPUs, and ROCm (whose architecture numbers come back as capabilities, gfx942 as 9.4)."""
    supports = pdl._supports.__wrapped__
    for hip, capability, expected in [(None, (9, 0), True), (None, (10, 0), True), (None, (8, 0), False),
                                      ("6.2", (9, 4), False)]:
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert supports(0) is expected, (hip, capability)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_decode_graphs_give_the_same_bits_with_and_without_pdl():
    """A small Qwen3-MoE model (fused router and experts, small-M projections, split-KV attention)
    decodes greedily in CUDA graphs: identical tokens and log-probs with PDL on and off."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < pdl.MIN_CAPABILITY:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    from tests.kernels.small_moe_decode import decode

    with switches.switched(pdl="off"):
        plain = decode()
    with switches.switched(pdl="on"):
        launched = decode()
    assert launched["tokens"] == plain["tokens"]
    assert launched["logprobs"] == plain["logprobs"]
