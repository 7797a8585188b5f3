"""Decode-shape bf16 linear: ``y = x @ w^T`` for a few token rows, split over K so that every SM
streams the weight.

At batch 1 a decode step's attention projections are GEMVs, and cuBLAS picks 64x8 tiles
that leave most SMs idle: measured on the H200 (Qwen3-30B-A3B shape) its qkv and o
projections read their weights at ~45% of HBM speed. This kernel cuts the output into
``BLOCK_N``-row tiles and the reduction into the split that
:func:`miles_host.kernels.split_k.plan_split_k` picks (about two programs per SM); each
program streams its ``[BLOCK_N, 128]`` weight tiles once (Triton pipelines them through
shared memory), multiplies them with the ``[BLOCK_M, 128]`` activation tile on the tensor
cores (the weight is the MMA's M side, so 1-16 tokens pad only to 16) and accumulates in
fp32; the partial tiles are summed in split order by the last program of each tile
(:func:`~miles_host.kernels.triton_common.split_k_epilogue`: deterministic, graph-safe).
The FP8 and INT4 plugins' small-M kernels are built the same way.

:func:`decode_linear` is what the model's fused inference path calls: this kernel for a
plain ``nn.Linear`` on CUDA with at most :data:`MAX_M` rows, a 16-bit weight and shapes
that tile; ``module(x)`` otherwise (training, CPU, quantized linears, odd shapes, and
``--small-m-gemm torch``). The sums
run in another order than cuBLAS's: outputs agree to fp32 rounding before the bf16 cast,
not bit for bit (batch-invariant mode never comes here).

Tensor legend: M tokens, N out features, K in features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_host.kernels import pdl, split_k, switches

#: largest token count this kernel takes: on the H200 (Qwen3-30B-A3B shape, same run) batch-1
#: decode ran 1.13x faster with it than with cuBLAS, batch 8 0.96x (bench/RESULTS.md)
MAX_M = 4
#: reduction depth of one K-block
BLOCK_K = 128
#: output rows per program
BLOCK_N = 64

#: ``--small-m-gemm``: ``triton`` (this kernel) or ``torch`` (the module, cuBLAS: baselines, debugging)
SMALL_M = switches.declare_host("small_m_gemm")


@dataclass(frozen=True)
class Launch:
    """How one small-M GEMM launches: ``kernel`` ``"mma"`` (:func:`_small_m_kernel`, tensor cores,
    any M up to :data:`MAX_M`) or ``"gemv"`` (:func:`_gemv_kernel`, CUDA cores, one token), its
    tile and the K-split (None: :func:`~miles_host.kernels.split_k.plan_split_k`'s)."""

    kernel: str = "mma"
    block_n: int = BLOCK_N
    block_k: int = BLOCK_K
    split: int | None = None
    num_warps: int = 4
    num_stages: int = 4

    def tiles(self, n: int, k: int) -> bool:
        """Whether an ``[n, k]`` weight is a whole number of this launch's tiles."""
        return n % self.block_n == 0 and k % self.block_k == 0


#: the launch of every shape the table does not name
DEFAULT_LAUNCH = Launch()
#: swept launches by ``(M, N, K)``: the fastest of ``bench/small_m_sweep.py`` on an H100 (graph-timed over
#: several weights, cold L2), where it beat the default and cuBLAS. Qwen3-30B-A3B's one-token qkv projection:
#: 7.83 us (2.68 TB/s) against 9.43 (planned default) and 9.98 (cuBLAS); its router: 1.94 us against 3.73
#: and 4.81; the LM head of the Qwen3 vocabulary (:func:`swept_matmul`): 197.1 us (3.16 TB/s) against 199.6
#: and 205.5 (cuBLAS). Its o projection keeps the default (7.57 us, cuBLAS 10.74, over eight weights; a sweep
#: over four weights on another H100 had a GEMV at 9.48 against the default's 11.21: to settle on an H200)
LAUNCHES: dict[tuple[int, int, int], Launch] = {
    (1, 5120, 2048): Launch("gemv", block_n=16, block_k=512, split=1, num_warps=4, num_stages=1),
    (1, 128, 2048): Launch("gemv", block_n=16, block_k=512, split=1, num_warps=4, num_stages=1),
    (1, 151936, 2048): Launch("gemv", block_n=16, block_k=256, split=1, num_warps=4, num_stages=1),
}


def launch_for(m: int, n: int, k: int) -> Launch:
    """The table's launch for this shape, else :data:`DEFAULT_LAUNCH`."""
    return LAUNCHES.get((m, n, k), DEFAULT_LAUNCH)


def small_m_linear_reference(x_MK: torch.Tensor, w_NK: torch.Tensor, bias_N: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-PyTorch reference: float64 products and sums, cast to ``x``'s dtype."""
    y_MN = x_MK.double() @ w_NK.double().T
    if bias_N is not None:
        y_MN = y_MN + bias_N.double()
    return y_MN.to(x_MK.dtype)


def fits(x_MK: torch.Tensor, w_NK: torch.Tensor) -> bool:
    """Whether :func:`small_m_linear` takes these operands."""
    m, k = x_MK.shape
    n = w_NK.shape[0]
    return (0 < m <= MAX_M and w_NK.shape[1] == k and k % BLOCK_K == 0 and n % BLOCK_N == 0
            and x_MK.dtype == w_NK.dtype and x_MK.dtype in (torch.bfloat16, torch.float16))


def small_m_linear(x_MK: torch.Tensor, w_NK: torch.Tensor, split: int | None = None,
                   launch: Launch | None = None) -> torch.Tensor:
    """``x @ w^T`` for ``x [M, K]`` (M <= :data:`MAX_M`) in one Triton launch (see the module doc).

    ``launch``: the kernel and tiles (default :func:`launch_for` the shape); ``split`` overrides
    its K-split (tests, sweeps). CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``.
    """
    from miles_host.kernels._small_m_gemm_triton import _gemv_kernel, _small_m_kernel
    from miles_host.kernels.triton_common import emulate_rounding

    if not fits(x_MK, w_NK):
        raise ValueError(f"small-M GEMM: x {tuple(x_MK.shape)} {x_MK.dtype}, w {tuple(w_NK.shape)} {w_NK.dtype}: "
                         f"needs M <= {MAX_M}, K a multiple of {BLOCK_K}, N of {BLOCK_N}, one 16-bit dtype")
    x_MK = x_MK if x_MK.stride(-1) == 1 else x_MK.contiguous()
    w_NK = w_NK if w_NK.stride(-1) == 1 else w_NK.contiguous()
    m, k = x_MK.shape
    n = w_NK.shape[0]
    launch = launch or launch_for(m, n, k)
    if not launch.tiles(n, k) or (launch.kernel == "gemv" and m != 1):
        launch = DEFAULT_LAUNCH
    out = torch.empty((m, n), dtype=x_MK.dtype, device=x_MK.device)
    n_tiles, k_blocks = n // launch.block_n, k // launch.block_k
    split = split or launch.split
    if split is None:
        sms = split_k.num_sms(x_MK.device.index or 0) if x_MK.is_cuda else 132
        plan = split_k.plan_split_k(m, n_tiles, k_blocks, k * x_MK.element_size(), sms)
    else:
        plan = split_k.fixed_split(n_tiles, k_blocks, split)
    partials, counters, in_kernel = split_k.workspace(plan, m, n, x_MK.device, out)
    common = dict(BLOCKS_PER_SPLIT=plan.blocks_per_split, SPLIT_K=plan.split_k, REDUCE_IN_KERNEL=in_kernel,
                  EMULATE=emulate_rounding(), BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
                  num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl.options(x_MK))
    if launch.kernel == "gemv":
        _gemv_kernel[(plan.n_tiles, plan.split_k)](x_MK, w_NK, out, partials, counters, n,
                                                   STRIDE_WN=w_NK.stride(0), **common)
    else:
        _small_m_kernel[(plan.n_tiles, plan.split_k)](
            x_MK, w_NK, out, partials, counters, m, n, x_MK.stride(0), w_NK.stride(0), out.stride(0),
            BLOCK_M=split_k.block_m_for(m), **common,
        )
    if not in_kernel:
        out.copy_(partials.sum(dim=0))
    return out


def takes(x_MK: torch.Tensor, w_NK: torch.Tensor) -> bool:
    """Whether the decode paths run :func:`small_m_linear` on these operands: CUDA, no autograd,
    operands it :func:`fits`, ``--small-m-gemm triton``."""
    return (x_MK.is_cuda and x_MK.dim() == 2 and not torch.is_grad_enabled() and fits(x_MK, w_NK)
            and switches.value(SMALL_M) == "triton")


def decode_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """``x @ w^T`` (no bias): :func:`small_m_linear` where it :func:`takes` the operands, else ``F.linear``."""
    return small_m_linear(x_MK, w_NK) if takes(x_MK, w_NK) else torch.nn.functional.linear(x_MK, w_NK)


def swept_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """:func:`decode_matmul` where :data:`LAUNCHES` names the shape (a sweep measured a launch
    faster than cuBLAS there: the LM head of a one-token step), else ``F.linear``."""
    if x_MK.dim() == 2 and (x_MK.shape[0], *w_NK.shape) in LAUNCHES:
        return decode_matmul(x_MK, w_NK)
    return torch.nn.functional.linear(x_MK, w_NK)


def decode_linear(module: torch.nn.Module, x_MK: torch.Tensor) -> torch.Tensor:
    """``module(x)``, by :func:`small_m_linear` where it serves (see the module doc)."""
    if type(module) is not torch.nn.Linear or not takes(x_MK, module.weight):
        return module(x_MK)
    y_MN = small_m_linear(x_MK, module.weight)
    return y_MN if module.bias is None else y_MN + module.bias
