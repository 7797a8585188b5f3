"""DeepSeek Sparse Attention over the paged cache (:mod:`miles_host.kernels.dsa`): the PyTorch
reference against float64 loops over the keys, the Triton kernels against the reference on CPU
under Triton's interpreter (``interpreted_dsa.py``) and on a GPU (marked ``gpu``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from miles_host.kernels import dsa
from tests.plugins.triton_interpret import run_interpreted


def paged_case(*, context_lens, num_new, block_size=4, index_heads=16, index_dim=16, heads=4, dk=24, dv=12,
               topk=5, dtype=torch.float32, device="cpu", seed=0):
    """A random step over a paged cache: blocks of each sequence scattered over the cache."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks_of = [(c + block_size - 1) // block_size for c in context_lens]
    total_blocks = sum(num_blocks_of) + 3
    order = torch.randperm(total_blocks, generator=generator).tolist()
    tables = torch.zeros(len(context_lens), max(num_blocks_of), dtype=torch.int32)
    used = 0
    for b, n in enumerate(num_blocks_of):
        tables[b, :n] = torch.tensor(order[used:used + n])
        used += n
    num_tokens = sum(num_new)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(device)

    cu = torch.tensor([0] + num_new).cumsum(0).to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    meta = SimpleNamespace(cu_seqlens_q=cu.to(device), context_lens_B=lens.to(device))
    seq_T, pos_T = dsa.step_tokens(meta, num_tokens)
    return SimpleNamespace(
        q_index=rand(num_tokens, index_heads, index_dim), w=rand(num_tokens, index_heads).float(),
        k_index=rand(total_blocks, block_size, 1, index_dim), q=rand(num_tokens, heads, dk),
        k_cache=rand(total_blocks, block_size, heads, dk), v_cache=rand(total_blocks, block_size, heads, dv),
        tables=tables.to(device), seq=seq_T, pos=pos_T, max_keys=max(context_lens), topk=topk,
        index_scale=index_dim**-0.5, scale=dk**-0.5, block_size=block_size,
    )


def _slot(case, seq: int, position: int) -> int:
    return int(case.tables[seq, position // case.block_size]) * case.block_size + position % case.block_size


def loop_scores(case) -> list[list[float]]:
    """Each token's indexer score of each visible key, in float64, one key at a time."""
    keys = case.k_index.double().reshape(-1, case.k_index.shape[-1])
    rows = []
    for t in range(case.q_index.shape[0]):
        seq, pos = int(case.seq[t]), int(case.pos[t])
        q, w = case.q_index[t].double(), case.w[t].double()
        rows.append([
            float((w * torch.relu(case.index_scale * (q @ keys[_slot(case, seq, j)]))).sum()) for j in range(pos + 1)
        ])
    return rows


def loop_attention(case, selected: list[list[int]]) -> torch.Tensor:
    """Each token's attention over its selected keys, in float64."""
    keys = case.k_cache.double().reshape(-1, *case.k_cache.shape[2:])
    values = case.v_cache.double().reshape(-1, *case.v_cache.shape[2:])
    out = torch.zeros(case.q.shape[0], case.q.shape[1], values.shape[-1], dtype=torch.float64)
    for t, positions in enumerate(selected):
        slots = torch.tensor([_slot(case, int(case.seq[t]), j) for j in positions])
        scores = torch.einsum("hd,khd->hk", case.q[t].double(), keys[slots]) * case.scale
        out[t] = torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), values[slots])
    return out


CASE = dict(context_lens=[13, 3, 9], num_new=[4, 3, 1])  # a prefill chunk, a fresh prompt, a decode


def test_reference_scores_top_k_and_attention_equal_float64_loops():
    case = paged_case(**CASE)
    scores = dsa.index_scores_reference(
        case.q_index, case.w, case.k_index, case.tables, case.seq, case.pos, case.max_keys, case.index_scale
    )
    expected = loop_scores(case)
    for t, row in enumerate(expected):
        assert torch.allclose(scores[t, : len(row)].double(), torch.tensor(row, dtype=torch.float64), atol=1e-5)
        assert torch.all(scores[t, len(row):] == float("-inf"))
    positions = dsa.topk_positions(scores, case.topk)
    selected = []
    for t, row in enumerate(expected):
        best = sorted(range(len(row)), key=lambda j: -row[j])[: case.topk]
        chosen = [j for j in positions[t].tolist() if j >= 0]
        assert sorted(chosen) == sorted(best)  # a context shorter than top-k keeps every key
        selected.append(chosen)
    out = dsa.sparse_attention_reference(
        case.q, case.k_cache, case.v_cache, case.tables, case.seq, positions, case.scale
    )
    assert torch.allclose(out.double(), loop_attention(case, selected), atol=1e-5)


def test_selection_mask_marks_the_selected_keys_only():
    positions = torch.tensor([[2, 0, -1], [1, -1, -1]])
    assert dsa.selection_mask(positions, 4).tolist() == [[True, False, True, False], [False, True, False, False]]


def test_cpu_kernels_under_the_triton_interpreter(request):
    run_interpreted(Path(__file__).with_name("interpreted_dsa.py"), request)


def assert_kernels_match_reference(case, atol: float) -> None:
    """Both Triton kernels against the PyTorch reference on the case's inputs."""
    from miles_host.kernels._dsa_triton import index_scores_triton, sparse_attention_triton

    args = (case.q_index, case.w, case.k_index, case.tables, case.seq, case.pos, case.max_keys, case.index_scale)
    expected = dsa.index_scores_reference(*args)
    got = index_scores_triton(*args)
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(got))
    assert torch.allclose(got[finite], expected[finite], atol=atol, rtol=atol)
    positions = dsa.topk_positions(expected, case.topk)
    attention_args = (case.q, case.k_cache, case.v_cache, case.tables, case.seq, positions, case.scale)
    reference = dsa.sparse_attention_reference(*attention_args).float()
    assert torch.allclose(sparse_attention_triton(*attention_args).float(), reference, atol=atol, rtol=atol)


@pytest.mark.parametrize("pointer", ["*bf16", "*fp32"])
def test_kernels_compile_for_sm90(pointer):
    """The GPU build (no interpreter) of both kernels at DeepSeek-V3.2's shapes: the indexer product on
    tensor cores for bf16, never TF32 for float32."""
    pytest.importorskip("triton")
    from miles_host.kernels import _dsa_triton
    from tests.plugins.triton_sm90 import compile_sm90

    ieee = pointer == "*fp32"
    scores = {"Q": pointer, "W": "*fp32", "KI": pointer, "block_tables": "*i32", "seq_T": "*i64", "pos_T": "*i64",
              "Out": "*fp32", "scale": "fp32", "num_keys": "i32", "block_size": "i32", "stride_qt": "i32",
              "stride_qi": "i32", "stride_wt": "i32", "stride_kslot": "i32", "stride_bt": "i32", "stride_ot": "i32"}
    ptx = compile_sm90(_dsa_triton._index_scores_kernel, scores, dict(
        NUM_I=64, I_PAD=64, D=128, D_PAD=128, BLOCK_L=_dsa_triton.KEYS_PER_PROGRAM, IEEE=ieee,
    ), num_warps=4, num_stages=2, unaligned=("num_keys",))
    assert "tf32" not in ptx
    if not ieee:
        assert "bf16" in ptx
    attention = {"Q": pointer, "Kc": pointer, "Vc": pointer, "block_tables": "*i32", "seq_T": "*i64", "Sel": "*i64",
                 "Out": pointer, "scale": "fp32", "num_selected": "i32", "block_size": "i32",
                 **{name: "i32" for name in ("stride_qt", "stride_qh", "stride_kslot", "stride_kh", "stride_vslot",
                                             "stride_vh", "stride_bt", "stride_st", "stride_ot", "stride_oh")}}
    compile_sm90(_dsa_triton._sparse_attention_kernel, attention, dict(
        DK=192, DK_PAD=256, DV=128, DV_PAD=128, BLOCK_K=_dsa_triton.SELECTED_PER_ITERATION,
    ), num_warps=4, num_stages=2, unaligned=("num_selected",))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_gpu_kernels_match_the_reference_at_deepseek_v32_head_shapes(dtype, atol):
    # DeepSeek-V3.2's indexer (64 heads of 128, top-2048) and MLA head dims (192 / 128), 16 heads
    case = paged_case(
        context_lens=[3000, 700, 2100], num_new=[1, 700, 1], block_size=16, index_heads=64, index_dim=128,
        heads=16, dk=192, dv=128, topk=2048, dtype=dtype, device="cuda",
    )
    assert_kernels_match_reference(case, atol)
