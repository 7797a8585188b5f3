"""The latent MLA attention kernel (:mod:`miles_host.kernels.mla_attention`) against the paged
attention reference: on CPU under Triton's interpreter (``interpreted_mla_attention.py``) and
compiled for sm_90; on a GPU at DeepSeek-V3's widths."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from tests.kernels.mla_cases import latent_case
from tests.plugins.triton_interpret import run_interpreted
from tests.plugins.triton_sm90 import compile_sm90

pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")


def test_cpu_kernel_under_the_triton_interpreter(request):
    """Decode (split and not, one or two head blocks, several tokens per tile), prefill over a
    cached prefix and multi-token decode against the reference; counters left at zero."""
    run_interpreted(Path(__file__).with_name("interpreted_mla_attention.py"), request)


def test_split_kernel_compiles_for_sm90_at_deepseek_v3_widths():
    from miles_host.kernels import mla_attention

    kernel = mla_attention._mla_attention_kernel
    names = [n for n, p in inspect.signature(kernel.fn).parameters.items() if "constexpr" not in str(p.annotation)]
    types = {"Q_latent": "*bf16", "Q_rope": "*bf16", "Cache": "*bf16", "Out": "*bf16", "Partial_acc": "*fp32",
             "Partial_ml": "*fp32", "Counters": "*i32", "block_tables": "*i32", "context_lens": "*i32",
             "cu_seqlens_q": "*i32", "tile_seq": "*i32", "tile_q_start": "*i32", "scale": "fp32"}
    signature = {name: types.get(name, "i32") for name in names}
    constexprs = dict(R=512, R_PAD=512, P=64, P_PAD=64, BLOCK_M=1, BLOCK_H=16, PAGE=16,
                      BLOCK_N=mla_attention.LATENT_KEYS, SPLITS=16, IEEE=False)
    ptx = compile_sm90(kernel, signature, constexprs, 4, 2, unaligned=("scale", "num_heads"))
    assert "mma" in ptx  # scores and P @ latents on the tensor cores
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add\.u32", ptx), "the arrival counter"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads, rank, rope", [(128, 512, 64), (16, 512, 64), (8, 64, 32)])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_gpu_kernel_matches_the_reference(heads, rank, rope, mode):
    from miles_host.kernels.mla_attention import mla_attention_triton

    if mode == "decode":
        lengths_ctx = [1, 17, 300, 64, 129, 1000]
        lengths_new = [1] * len(lengths_ctx)
    else:
        lengths_ctx, lengths_new = [5, 200, 64, 333], [5, 150, 64, 1]
    for dtype, tolerance in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
        q_latent, q_rope, cache, meta, scale, reference = latent_case(
            lengths_new, lengths_ctx, heads, rank, rope, dtype=dtype, device="cuda")
        out = mla_attention_triton(q_latent, q_rope, cache, meta, scale=scale)
        torch.testing.assert_close(out.float(), reference.float(), atol=tolerance, rtol=tolerance)
