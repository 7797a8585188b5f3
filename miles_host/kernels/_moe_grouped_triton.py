"""Triton body of :mod:`miles_host.kernels.moe_grouped` (imported only where Triton runs).

Three kernels make the fused MoE forward (plus the quantized GEMMs the precision
plugins build from :func:`block_rows`):

- :func:`_route_kernel`, one program: the padded, expert-sorted row layout of a
  batch (every expert's rows start at a multiple of ``BLOCK_M``). Counts by
  ``tl.histogram``, block starts by ``tl.cumsum``, the rank of each (token, slot)
  pair inside its expert from one ``tl.sort`` of ``expert * NP + pair`` (stable:
  the layout of :func:`~miles_host.kernels.moe_grouped.route`, bit for bit). Its
  body is :func:`fill_layout`, which the fused router
  (:mod:`~miles_host.kernels._moe_router_triton`) runs on the ids it has just chosen.
- :func:`_moe_gemm_kernel`: one grouped GEMM launch for all experts. A program
  computes one row block x one ``BLOCK_N`` column tile, ``out[rows, n] = a[rows, :]
  @ w[expert][n, :]^T`` with fp32 accumulation from ``k = 0``. With ``GATHER`` the
  rows of ``a`` are read through the row -> token table (the first GEMM reads ``x``
  itself); padding rows read zeros. With ``HAS_BIAS`` the expert's bias row is
  added to the fp32 accumulators before any rounding (what ``F.linear(x, w, b)``
  rounds once). With ``GATED`` (gate_up) the program also multiplies the up rows
  ``N + n`` and writes :func:`act_and_mul` of gate and up (each rounded to the
  output dtype first, as the eager ops of bf16 tensors do): ``act(gate) * up``,
  or gpt-oss' clamped SwiGLU (``ACT`` 3 with ``LIMIT`` and ``ALPHA``).
- :func:`_combine_kernel`: ``y[t] = sum_k w[t, k] * out[row of (t, k)]`` in fp32,
  slots in their order, one rounding: the top-k weighted sum in one launch.

Under the interpreter (``EMULATE``) ``tl.dot`` runs on float32 copies (its
``np.matmul`` reads bfloat16 as raw integers) and downcasts round by integer
arithmetic (``cast_rne``). ``K`` is a constexpr (a model constant), so the K loop
has a static trip count on both paths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_host.kernels import pdl
from miles_host.kernels._split_k_triton import cast_rne, emulate_rounding
from miles_host.kernels._triton_common import pdl_start, pdl_wait
from miles_host.kernels.moe_configs import max_row_blocks

#: activation code of the GATED epilogue, by config name
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "clamped_swiglu": 3}


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr, EMULATE: tl.constexpr):
    """``acc + a @ b`` in fp32 (float32 inputs: ``ieee``, never TF32)."""
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def act_and_mul(gate, up, ACT: tl.constexpr, DTYPE: tl.constexpr, EMULATE: tl.constexpr,
                LIMIT: tl.constexpr = 0.0, ALPHA: tl.constexpr = 1.0):
    """``act(gate) * up`` of fp32 accumulators, rounded as eager ops on ``DTYPE`` tensors round:
    gate and up to ``DTYPE``, the activation to ``DTYPE``, the product to ``DTYPE``.

    ``ACT`` 3 is gpt-oss' clamped SwiGLU, every eager op of
    :func:`~miles_host.kernels.eager_ops.clamped_swiglu` rounded in turn:
    ``g = min(gate, LIMIT)``, ``u = clamp(up, -LIMIT, LIMIT)``, ``(u + 1) * (g * sigmoid(g * ALPHA))``.
    """
    gate = cast_rne(gate, DTYPE, EMULATE).to(tl.float32)
    up = cast_rne(up, DTYPE, EMULATE).to(tl.float32)
    if ACT == 3:
        gate = cast_rne(tl.minimum(gate, LIMIT), DTYPE, EMULATE).to(tl.float32)
        up = cast_rne(tl.minimum(tl.maximum(up, -LIMIT), LIMIT), DTYPE, EMULATE).to(tl.float32)
        scaled = cast_rne(gate * ALPHA, DTYPE, EMULATE).to(tl.float32)
        sigmoid = cast_rne(1.0 / (1.0 + tl.exp(-scaled)), DTYPE, EMULATE).to(tl.float32)
        activated = cast_rne(gate * sigmoid, DTYPE, EMULATE).to(tl.float32)
        up = cast_rne(up + 1.0, DTYPE, EMULATE).to(tl.float32)
    else:
        if ACT == 0:
            activated = gate / (1.0 + tl.exp(-gate))
        elif ACT == 1:
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            activated = 0.5 * gate * (2.0 / (1.0 + tl.exp(-2.0 * inner)))  # 1 + tanh(inner)
        else:
            activated = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
        activated = cast_rne(activated, DTYPE, EMULATE).to(tl.float32)
    return cast_rne(activated * up, DTYPE, EMULATE)


@triton.jit
def block_rows(RowToken, BlockExpert, pid_m, BLOCK_M: tl.constexpr, GATHER: tl.constexpr):
    """``(expert, a_rows, row_ok, out_rows)`` of row block ``pid_m`` (``expert < 0``: unused block).

    ``a_rows``: the rows of the GEMM input to read (tokens with ``GATHER``, else the
    padded rows themselves); ``row_ok``: False on padding rows (their input reads as 0).
    """
    expert = tl.load(BlockExpert + pid_m)
    out_rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    if GATHER:
        token = tl.load(RowToken + out_rows)
        row_ok = token >= 0
        a_rows = tl.where(row_ok, token, 0).to(tl.int64)
    else:
        row_ok = out_rows >= 0
        a_rows = out_rows
    return expert, a_rows, row_ok, out_rows


@triton.jit
def fill_layout(
    ids, RowToken, PairRow, BlockExpert, Scratch, num_rows, num_blocks,
    TOP_K: tl.constexpr, E: tl.constexpr, NB: tl.constexpr, NP: tl.constexpr, BLOCK_M: tl.constexpr,
    MAX_ROWS: tl.constexpr, MAX_BLOCKS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr,
):
    """The layout of :func:`_route_kernel` from ``ids``: int32 ``[NP]``, pair ``t * TOP_K + k``'s
    expert (``E`` past the last pair). Writes the three layout tensors; one program."""
    pairs = tl.arange(0, NP)
    counts = tl.histogram(ids, NB)
    experts = tl.arange(0, NB)
    real = experts < E
    padded = tl.where(real, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    first = tl.cumsum(counts, 0) - counts  # index of each expert's first pair in the sorted order
    tl.store(Scratch + experts, ends - padded - first)  # padded row of sorted position p: p + this
    for start in range(0, MAX_ROWS, CHUNK):
        rows = start + tl.arange(0, CHUNK)
        tl.store(RowToken + rows, tl.full((CHUNK,), -1, tl.int64), mask=rows < num_rows)
    for start in range(0, MAX_BLOCKS, BLOCK_CHUNK):  # block b's expert: how many experts end at or before it
        blocks = start + tl.arange(0, BLOCK_CHUNK)
        expert = tl.sum(((ends[None, :] <= (blocks * BLOCK_M)[:, None]) & real[None, :]).to(tl.int32), axis=1)
        tl.store(BlockExpert + blocks, tl.where(expert < E, expert, -1), mask=blocks < num_blocks)
    tl.debug_barrier()
    keys = tl.sort(ids * NP + pairs)
    sorted_ids = keys // NP
    pair = keys % NP
    used = sorted_ids < E
    row = pairs + tl.load(Scratch + sorted_ids, mask=used, other=0)
    tl.store(RowToken + row, (pair // TOP_K).to(tl.int64), mask=used)
    tl.store(PairRow + pair, row.to(tl.int64), mask=used)


@triton.jit
def _route_kernel(
    Ids, RowToken, PairRow, BlockExpert, Scratch,
    num_pairs, num_rows, num_blocks,
    TOP_K: tl.constexpr, E: tl.constexpr, NB: tl.constexpr, NP: tl.constexpr, BLOCK_M: tl.constexpr,
    MAX_ROWS: tl.constexpr, MAX_BLOCKS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    pdl_wait(PDL)
    pairs = tl.arange(0, NP)
    ids = tl.load(Ids + pairs, mask=pairs < num_pairs, other=E).to(tl.int32)  # E: past the last pair
    fill_layout(ids, RowToken, PairRow, BlockExpert, Scratch, num_rows, num_blocks,
                TOP_K, E, NB, NP, BLOCK_M, MAX_ROWS, MAX_BLOCKS, CHUNK, BLOCK_CHUNK)


@triton.jit
def _combine_epilogue(C, RowToken, PairRow, Weights, Y, Counters, out_rows, offs_n, N, pid_n, num_n_tiles,
                      stride_cm, stride_cn, stride_wt, stride_yt, TOP_K: tl.constexpr, EMULATE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """After a down-GEMM program stored its rows: the last of a token's ``TOP_K`` rows to arrive for this
    column tile (an int32 counter per (token, tile), acquire-release at GPU scope after a CTA barrier,
    as :func:`~miles_host.kernels._split_k_triton.split_k_epilogue`) sums the token's rows times its gate
    weights in slot order in fp32, rounds once to ``Y``'s dtype and resets the counter: what
    :func:`_combine_kernel` computes, bit for bit. A token has at most one row in a block (its slots
    go to distinct experts), so a program's rows never share a counter."""
    tl.debug_barrier()
    token = tl.load(RowToken + out_rows)
    valid = token >= 0
    counter = Counters + tl.where(valid, token, 0) * num_n_tiles + pid_n
    arrived = tl.atomic_add(counter, 1, mask=valid, sem="acq_rel", scope="gpu")
    last = valid & (arrived == TOP_K - 1)
    cols_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        row = tl.load(PairRow + token * TOP_K + slot, mask=last, other=0)
        weight = tl.load(Weights + token * stride_wt + slot, mask=last, other=0.0).to(tl.float32)
        part = tl.load(C + row[:, None] * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn,
                       mask=last[:, None] & cols_ok[None, :], other=0.0, cache_modifier=".cg")
        acc += part.to(tl.float32) * weight[:, None]
    tl.store(Y + token[:, None] * stride_yt + offs_n[None, :], cast_rne(acc, Y.dtype.element_ty, EMULATE),
             mask=last[:, None] & cols_ok[None, :])
    tl.atomic_xchg(counter, 0, mask=last, sem="relaxed", scope="gpu")


@triton.jit
def _moe_gemm_kernel(
    A, RowToken, BlockExpert, W, Bias, C,
    N,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_cm, stride_cn,
    K: tl.constexpr, K_BLOCKS: tl.constexpr, GATHER: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
    PairRow=None, Weights=None, Y=None, Counters=None, stride_wt=0, stride_yt=0,
    COMBINE: tl.constexpr = False, TOP_K: tl.constexpr = 1,
):
    pdl_start(PDL)
    pdl_wait(PDL)  # the layout and the input rows come from the kernels before
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, a_rows, row_ok, out_rows = block_rows(RowToken, BlockExpert, pid_m, BLOCK_M, GATHER)
    if expert >= 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
        w_ptrs = W + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + offs_k[:, None].to(tl.int64) * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, K_BLOCKS):
            k_ok = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _mma(a, tl.load(w_ptrs, mask=k_ok[:, None], other=0.0), acc, IEEE, EMULATE)
            if GATED:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None], other=0.0)
                acc_up = _mma(a, w_up, acc_up, IEEE, EMULATE)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:  # the expert's bias row (gate_up: gate columns, then up at N + n)
            bias_ptrs = Bias + expert.to(tl.int64) * stride_be + cols * stride_bn
            acc += tl.load(bias_ptrs).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(bias_ptrs + N * stride_bn).to(tl.float32)[None, :]
        if GATED:
            out = act_and_mul(acc, acc_up, ACT, C.dtype.element_ty, EMULATE, LIMIT, ALPHA)
        else:
            out = cast_rne(acc, C.dtype.element_ty, EMULATE)
        c_ptrs = C + out_rows[:, None] * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
        tl.store(c_ptrs, out, mask=(offs_n < N)[None, :])
        if COMBINE:
            _combine_epilogue(C, RowToken, PairRow, Weights, Y, Counters, out_rows, offs_n, N, pid_n,
                              tl.num_programs(1), stride_cm, stride_cn, stride_wt, stride_yt, TOP_K, EMULATE,
                              BLOCK_M, BLOCK_N)


@triton.jit
def _combine_kernel(
    Out, PairRow, Weights, Y, H, stride_or, stride_wt, stride_yt,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        row = tl.load(PairRow + token * TOP_K + slot)
        weight = tl.load(Weights + token * stride_wt + slot).to(tl.float32)
        acc += tl.load(Out + row * stride_or + cols, mask=col_ok, other=0.0).to(tl.float32) * weight
    tl.store(Y + token * stride_yt + cols, cast_rne(acc, Y.dtype.element_ty, EMULATE), mask=col_ok)


# ----------------------------------------------------------------------------- launchers


def layout_constants(num_pairs: int, num_experts: int, block_m: int) -> dict:
    """The constexprs of :func:`fill_layout` for ``num_pairs`` pairs (one compilation per power of two)."""
    np_ = max(16, triton.next_power_of_2(num_pairs))
    nb = max(16, triton.next_power_of_2(num_experts + 1))
    max_blocks = max_row_blocks(np_, num_experts, block_m)  # of NP, not T: one compilation per power of two
    return dict(E=num_experts, NB=nb, NP=np_, BLOCK_M=block_m, MAX_ROWS=max_blocks * block_m, MAX_BLOCKS=max_blocks,
                CHUNK=256, BLOCK_CHUNK=max(1, 8192 // nb))


def route_layout(ids_TK, num_experts, block_m, row_token_R, pair_row_TK, block_expert_B) -> None:
    """Fill the layout tensors (see :func:`~miles_host.kernels.moe_grouped.route`) in one launch."""
    num_tokens, top_k = ids_TK.shape
    num_pairs = num_tokens * top_k
    constants = layout_constants(num_pairs, num_experts, block_m)
    scratch = torch.empty(constants["NB"], dtype=torch.int32, device=ids_TK.device)
    _route_kernel[(1,)](
        ids_TK.reshape(-1), row_token_R, pair_row_TK, block_expert_B, scratch,
        num_pairs, row_token_R.shape[0], block_expert_B.shape[0],
        TOP_K=top_k, **constants, num_warps=8 if constants["NP"] >= 1024 else 4, **pdl.options(ids_TK),
    )


def moe_gemm(a, row_token_R, block_expert_B, w_ENK, out_RN, config, gather: bool, activation: str | None,
             bias_EN: torch.Tensor | None = None, swiglu_limit: float | None = None, swiglu_alpha: float = 1.0,
             combine: tuple | None = None) -> None:
    """``out[r] = a[row r] @ w_ENK[expert of r's block]^T (+ bias_EN[expert])`` for every row of a used block.

    ``activation`` (gate_up): ``w_ENK`` is ``[E, 2N, K]`` (gate rows first), ``bias_EN``
    ``[E, 2N]`` likewise, and ``out[r] = act(gate) * up``, ``[R, N]`` (``clamped_swiglu``:
    with ``swiglu_limit`` and ``swiglu_alpha``). ``a``: ``[T, K]`` (``gather``: row r
    reads ``a[row_token_R[r]]``) or ``[R, K]``. Rows of unused blocks are not written.
    ``combine``: ``(pair_row_TK, weights_TK, y_TH)`` (the down projection): the top-k weighted sum of
    each token's rows into ``y_TH`` in the same launch (:func:`_combine_epilogue`).
    """
    n, k = out_RN.shape[1], w_ENK.shape[2]
    num_blocks = block_expert_B.shape[0]
    if num_blocks == 0 or n == 0:
        return
    bias = bias_EN if bias_EN is not None else w_ENK  # never read without HAS_BIAS
    grid = (num_blocks, triton.cdiv(n, config.block_n))
    extra = {}
    if combine is not None:
        from miles_host.kernels import split_k

        pair_row_TK, weights_TK, y_TH = combine
        extra = dict(PairRow=pair_row_TK, Weights=weights_TK, Y=y_TH,
                     Counters=split_k.semaphores(out_RN.device, pair_row_TK.shape[0] * grid[1]),
                     stride_wt=weights_TK.stride(0), stride_yt=y_TH.stride(0), COMBINE=True,
                     TOP_K=pair_row_TK.shape[1])
    _moe_gemm_kernel[grid](
        a, row_token_R, block_expert_B, w_ENK, bias, out_RN,
        n,
        a.stride(0), a.stride(1), w_ENK.stride(0), w_ENK.stride(1), w_ENK.stride(2), bias.stride(0), bias.stride(1),
        out_RN.stride(0), out_RN.stride(1),
        K=k, K_BLOCKS=triton.cdiv(k, config.block_k), GATHER=gather, GATED=activation is not None,
        ACT=ACTIVATIONS[activation] if activation is not None else 0, HAS_BIAS=bias_EN is not None,
        LIMIT=float(swiglu_limit) if swiglu_limit is not None else 0.0, ALPHA=float(swiglu_alpha),
        IEEE=a.dtype == torch.float32, EMULATE=emulate_rounding(),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.options(a), **extra,
    )


def grouped_mm(a, row_token_R, block_expert_B, w_EKN, out_RN, config, gather: bool) -> torch.Tensor:
    """``out[r] = a[row r] @ w_EKN[expert of r's block]`` (``w_EKN``: any-strided ``[E, K, N]`` view)."""
    moe_gemm(a, row_token_R, block_expert_B, w_EKN.transpose(1, 2), out_RN, config, gather, None)
    return out_RN


def combine(out_RH, pair_row_TK, weights_TK, y_TH) -> torch.Tensor:
    """``y[t] = sum_k weights[t, k] * out[pair_row[t, k]]`` (fp32, one rounding) in one launch."""
    num_tokens, top_k = pair_row_TK.shape
    hidden = out_RH.shape[1]
    if num_tokens == 0:
        return y_TH
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        out_RH, pair_row_TK.contiguous(), weights_TK, y_TH, hidden, out_RH.stride(0), weights_TK.stride(0),
        y_TH.stride(0), TOP_K=top_k, BLOCK_H=block_h, EMULATE=emulate_rounding(), num_warps=4,
        **pdl.options(out_RH),
    )
    return y_TH


@triton.jit
def _moe_gemv_kernel(
    A, RowToken, PairRow, BlockExpert, W, C,
    N, stride_am, stride_we, stride_wn, stride_cm,
    K: tl.constexpr, BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr, GATHER: tl.constexpr, GATED: tl.constexpr,
    ACT: tl.constexpr, EMULATE: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program ``(n tile, pair)``: one (token, slot) pair's ``BLOCK_N`` output columns on the CUDA cores,
    written to the pair's row of the padded layout (what :func:`_moe_gemm_kernel` writes there).
    fp32 products accumulated elementwise over the unrolled K-blocks (every load of a program issued
    together; the activation read in the weight tile's layout, no shared memory), one sum per column;
    ``GATED``: gate and up columns and :func:`act_and_mul` as the grouped kernel's epilogue.

    Under PDL the gate_up launch (``GATED``) lets its successor launch only after its own wait
    (the router it waited for has completed), so the down launch after it reads the routing and
    its first weight block before its wait: the down projection's weight stream starts while
    gate_up finishes. The products are the same either way."""
    if GATED:
        pdl_wait(PDL)
        pdl_start(PDL)
    else:
        pdl_start(PDL)
    pid_n = tl.program_id(0)
    row = tl.load(PairRow + tl.program_id(1))
    expert = tl.load(BlockExpert + row // ROW_BLOCK).to(tl.int64)
    if GATHER:
        a_row = tl.load(RowToken + row)
    else:
        a_row = row
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    cols = tl.where(mask_n, offs_n, 0).to(tl.int64)
    w_ptrs = W + expert * stride_we + cols[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = A + a_row * stride_am + (offs_n * 0)[:, None] + offs_k[None, :]
    w_first = tl.load(w_ptrs)
    if not GATED:
        pdl_wait(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kb in tl.static_range(K // BLOCK_K):
        x = tl.load(x_ptrs + kb * BLOCK_K).to(tl.float32)
        if kb == 0:
            acc += w_first.to(tl.float32) * x
        else:
            acc += tl.load(w_ptrs + kb * BLOCK_K).to(tl.float32) * x
        if GATED:
            acc_up += tl.load(w_ptrs + N * stride_wn + kb * BLOCK_K).to(tl.float32) * x
    if GATED:
        out = act_and_mul(tl.sum(acc, axis=1), tl.sum(acc_up, axis=1), ACT, C.dtype.element_ty, EMULATE)
    else:
        out = cast_rne(tl.sum(acc, axis=1), C.dtype.element_ty, EMULATE)
    tl.store(C + row * stride_cm + offs_n, out, mask=mask_n)


@triton.jit
def _moe_gemv_combine_kernel(
    A, PairRow, BlockExpert, Weights, W, Y,
    N, stride_am, stride_we, stride_wn, stride_wt, stride_yt,
    K: tl.constexpr, BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr, TOP_K: tl.constexpr,
    EMULATE: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program ``(n tile, token)``: the token's ``TOP_K`` down-projection rows at ``BLOCK_N`` columns,
    each summed and rounded to Y's dtype as :func:`_moe_gemv_kernel` stores it, times its gate weight,
    summed in fp32 in slot order and rounded once, as :func:`_combine_kernel` sums the stored rows:
    the two launches in one, the same bits, no padded rows written or read back. Every slot's loads
    are unrolled (issued together). Under PDL the routing and the first slot's first weight block
    are read before the wait (see :func:`_moe_gemv_kernel`: the gate_up launch before it triggers
    after its own wait)."""
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    cols = tl.where(mask_n, offs_n, 0).to(tl.int64)
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        row = tl.load(PairRow + token * TOP_K + slot)
        expert = tl.load(BlockExpert + row // ROW_BLOCK).to(tl.int64)
        weight = tl.load(Weights + token * stride_wt + slot).to(tl.float32)
        w_ptrs = W + expert * stride_we + cols[:, None] * stride_wn + offs_k[None, :]
        x_ptrs = A + row * stride_am + (offs_n * 0)[:, None] + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if slot == 0:
            w_first = tl.load(w_ptrs)
            pdl_wait(PDL)
            acc += w_first.to(tl.float32) * tl.load(x_ptrs).to(tl.float32)
        for kb in tl.static_range(1 if slot == 0 else 0, K // BLOCK_K):
            acc += tl.load(w_ptrs + kb * BLOCK_K).to(tl.float32) * tl.load(x_ptrs + kb * BLOCK_K).to(tl.float32)
        y += cast_rne(tl.sum(acc, axis=1), Y.dtype.element_ty, EMULATE).to(tl.float32) * weight
    tl.store(Y + token * stride_yt + offs_n, cast_rne(y, Y.dtype.element_ty, EMULATE), mask=mask_n)


def _gemv_block_k(launch, k: int) -> int:
    block_k = launch.block_k or next(b for b in (512, 256, 128, 64, 32, 16) if k % b == 0)
    if k % block_k:
        raise ValueError(f"the MoE GEMV's block_k {block_k} does not divide K = {k}")
    return block_k


def moe_gemv_combine(act_RI, routing, w_EHI, y_TH, launch) -> None:
    """``y[t] = sum_k w[t, k] * (act[row of (t, k)] @ w_EHI[expert]^T)`` by :func:`_moe_gemv_combine_kernel`:
    :func:`moe_gemv` of the down projection and :func:`combine` in one launch (``launch``: a
    :class:`~miles_host.kernels.moe_configs.GemvLaunch`)."""
    num_tokens, top_k = routing.pair_row_TK.shape
    n, k = y_TH.shape[1], w_EHI.shape[2]
    if num_tokens == 0 or n == 0:
        return
    weights_TK = routing.weights_TK.contiguous()
    _moe_gemv_combine_kernel[(triton.cdiv(n, launch.block_n), num_tokens)](
        act_RI, routing.pair_row_TK.contiguous(), routing.block_expert_B, weights_TK, w_EHI, y_TH,
        n, act_RI.stride(0), w_EHI.stride(0), w_EHI.stride(1), weights_TK.stride(0), y_TH.stride(0),
        K=k, BLOCK_K=_gemv_block_k(launch, k), ROW_BLOCK=routing.block_m, TOP_K=top_k, EMULATE=emulate_rounding(),
        BLOCK_N=launch.block_n, num_warps=launch.num_warps, **pdl.options(act_RI),
    )


def moe_gemv(a, routing, w_ENK, out_RN, gather: bool, activation: str | None, launch) -> None:
    """:func:`moe_gemm`'s rows for a few tokens by :func:`_moe_gemv_kernel`, one program row per
    (token, slot) pair (no biases, no clamped SwiGLU); ``launch``: a
    :class:`~miles_host.kernels.moe_configs.GemvLaunch` (its ``block_k`` 0: the largest of 512, 256, ...
    that divides K)."""
    n, k = out_RN.shape[1], w_ENK.shape[2]
    pairs = routing.pair_row_TK.numel()
    if pairs == 0 or n == 0:
        return
    block_k = _gemv_block_k(launch, k)
    _moe_gemv_kernel[(triton.cdiv(n, launch.block_n), pairs)](
        a, routing.row_token_R, routing.pair_row_TK.reshape(-1), routing.block_expert_B, w_ENK, out_RN,
        n, a.stride(0), w_ENK.stride(0), w_ENK.stride(1), out_RN.stride(0),
        K=k, BLOCK_K=block_k, ROW_BLOCK=routing.block_m, GATHER=gather, GATED=activation is not None,
        ACT=ACTIVATIONS[activation] if activation is not None else 0, EMULATE=emulate_rounding(),
        BLOCK_N=launch.block_n, num_warps=launch.num_warps, **pdl.options(a),
    )
