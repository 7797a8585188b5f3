"""Sweep the split-KV launches of the Triton paged-attention decode kernel on a decode step's shapes.

A decode step of ``--batches`` sequences of ``--contexts`` cached tokens (Qwen3-30B-A3B's heads by
default: 32 query / 4 KV heads of 128, 16-token pages), at every split count of ``--splits`` and
keys per iteration of ``--split-keys``
(:data:`~miles_host.kernels.paged_attention.DECODE_SPLIT_KEYS`), inside one CUDA graph of launches
that read distinct sequences' pages (at least ``--cold-bytes`` of KV per graph: no launch finds its
keys in the L2, as the layers of a decode step), replayed (:func:`bench.small_m.graph_seconds`, the
median of ``--replays``). The default launch (:func:`~miles_host.kernels.paged_attention.decode_splits`)
is marked. Every candidate's output is checked against the PyTorch reference first.

    python -m bench.attention_decode_sweep --batches 1,32 --contexts 320,4096
    python -m bench.attention_decode_sweep --mla --heads-q 128 --split-keys 16,32,64 (DeepSeek-V3's latent MLA)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Callable

import torch

from bench.small_m import graph_seconds, write_rows


def decode_case(batch: int, context: int, calls: int, heads_q: int, heads_kv: int, dim: int, page: int, device):
    """``calls`` decode steps of ``batch`` sequences over one paged cache, each step its own sequences:
    ``(q, k_cache, v_cache, [metadata per call], block tables per call)``."""
    from miles_host.kernels.attention_metadata import AttentionMetadata
    from miles_host.kernels.paged_attention import build_tiles, tokens_per_tile

    blocks_per_seq = math.ceil(context / page)
    num_seqs = batch * calls
    generator = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's dtypes
    shape = (num_seqs * blocks_per_seq, page, heads_kv, dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    v_cache = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    q = torch.randn(batch, heads_q, dim, device=device, dtype=dtype, generator=generator)
    cu = list(range(batch + 1))
    metas = []
    for call in range(calls):
        first = call * batch * blocks_per_seq
        tables = (first + torch.arange(batch * blocks_per_seq, device=device, dtype=torch.int32)).view(batch, -1)
        meta = AttentionMetadata(
            slot_mapping_T=torch.zeros(batch, dtype=torch.long, device=device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            context_lens_B=torch.full((batch,), context, dtype=torch.int32, device=device),
            block_tables_BM=tables, max_q_len=1, max_context_len=context, is_decode=True,
        )
        meta.tile_seq, meta.tile_q_start = build_tiles(cu, tokens_per_tile(heads_q, heads_kv, True), device)
        metas.append(meta)
    return q, k_cache, v_cache, metas


@dataclasses.dataclass
class DecodeKernel:
    """One decode attention kernel under the sweep: ``launch(meta, splits)``, the reference output of
    the first call, the split count its launcher picks, the module constant of its keys per
    iteration and the KV bytes one call reads."""

    launch: Callable
    expected: torch.Tensor
    default_splits: int
    keys_module: object
    keys_name: str
    kv_bytes: int
    metas: list


def gqa_kernel(batch: int, context: int, args, device) -> DecodeKernel:
    """The paged GQA kernel (``--heads-q`` / ``--heads-kv`` heads of ``--dim``)."""
    from miles_host.kernels import paged_attention
    from miles_host.rollout.attention import paged_attention_reference

    kv_bytes = batch * context * args.heads_kv * args.dim * 2 * 2
    calls = max(args.min_calls, math.ceil(args.cold_bytes / kv_bytes))
    q, k_cache, v_cache, metas = decode_case(batch, context, calls, args.heads_q, args.heads_kv, args.dim,
                                             args.page, device)
    scale = args.dim ** -0.5
    first = metas[0]
    expected = paged_attention_reference(q, k_cache, v_cache, first.block_tables_BM, list(range(batch + 1)),
                                         [context] * batch, scale=scale).float()
    return DecodeKernel(
        lambda meta, splits: paged_attention.paged_attention_triton(q, k_cache, v_cache, meta, scale=scale,
                                                                    splits=splits),
        expected, paged_attention.decode_splits(first.tile_seq.shape[0], args.heads_kv, device),
        paged_attention, "DECODE_SPLIT_KEYS", kv_bytes, metas)


def mla_kernel(batch: int, context: int, args, device) -> DecodeKernel:
    """The latent MLA kernel (``--mla``: ``--heads-q`` heads over one latent row of ``--rank`` +
    ``--rope`` per token, DeepSeek-V3's 128 x (512 + 64) by default)."""
    from miles_host.kernels import mla_attention
    from miles_host.kernels.paged_attention import decode_splits, tokens_per_tile
    from miles_host.rollout.attention import paged_attention_reference

    rank, width = args.rank, args.rank + args.rope
    kv_bytes = batch * context * width * 2
    calls = max(args.min_calls, math.ceil(args.cold_bytes / kv_bytes))
    q, cache, _, metas = decode_case(batch, context, calls, args.heads_q, 1, width, args.page, device)
    scale = width ** -0.5
    first = metas[0]
    expected = paged_attention_reference(q, cache, cache[..., :rank], first.block_tables_BM, list(range(batch + 1)),
                                         [context] * batch, scale=scale).float()
    head_blocks = math.ceil(args.heads_q / mla_attention.heads_per_program(args.heads_q,
                                                                           tokens_per_tile(args.heads_q, 1, True)))
    return DecodeKernel(
        lambda meta, splits: mla_attention.mla_attention_triton(q[..., :rank], q[..., rank:], cache[:, :, 0], meta,
                                                                scale=scale, splits=splits),
        expected, decode_splits(first.tile_seq.shape[0], head_blocks, device, mla_attention.LATENT_PROGRAMS_PER_SM),
        mla_attention, "LATENT_KEYS", kv_bytes, metas)


def sweep(batch: int, context: int, args, device) -> list[dict]:
    kernel = (mla_kernel if args.mla else gqa_kernel)(batch, context, args, device)
    default_keys = getattr(kernel.keys_module, kernel.keys_name)
    first, calls = kernel.metas[0], len(kernel.metas)
    results = []
    key_counts = [int(v) for v in args.split_keys.split(",")]
    for split_keys in key_counts:
        for splits in (int(v) for v in args.splits.split(",")):
            if splits == 1 and split_keys != key_counts[0] and not args.mla:
                continue  # the GQA kernel's one split does not read DECODE_SPLIT_KEYS: timed once
            label = f"splits {splits} keys {split_keys}"
            if splits == kernel.default_splits and (splits == 1 or split_keys == default_keys):
                label += " (default)"
            setattr(kernel.keys_module, kernel.keys_name, split_keys)
            try:
                out = kernel.launch(first, splits)
                error = (out.float() - kernel.expected).abs().max().item()
                if error > 2e-2:
                    print(f"b{batch} ctx {context} {label}: WRONG (max abs error {error:.3g})", flush=True)
                    continue
                seconds = graph_seconds(lambda: [kernel.launch(meta, splits) for meta in kernel.metas],
                                        device, args.replays) / calls
                results.append(dict(batch=batch, context=context, splits=splits, split_keys=split_keys, label=label,
                                    us=seconds * 1e6, tb_s=kernel.kv_bytes / seconds / 1e12))
                print(f"  b{batch} ctx {context} {label}: {seconds * 1e6:.2f} us", flush=True)  # as measured
            except Exception as error:  # noqa: BLE001 - a candidate that does not build is reported, skipped
                print(f"b{batch} ctx {context} {label}: failed: {str(error).splitlines()[0][:160]}", flush=True)
            finally:
                setattr(kernel.keys_module, kernel.keys_name, default_keys)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--contexts", default="320,4096")
    parser.add_argument("--splits", default="1,2,4,8,16,32")
    parser.add_argument("--split-keys", default="16,32,64")
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--mla", action="store_true", help="the latent MLA kernel (keys per iteration: LATENT_KEYS)")
    parser.add_argument("--rank", type=int, default=512, help="--mla: the latent width")
    parser.add_argument("--rope", type=int, default=64, help="--mla: the rope key width")
    parser.add_argument("--cold-bytes", type=float, default=128e6, help="KV bytes read per graph at least")
    parser.add_argument("--min-calls", type=int, default=8)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for batch in (int(v) for v in args.batches.split(",")):
        for context in (int(v) for v in args.contexts.split(",")):
            found = sorted(sweep(batch, context, args, torch.device("cuda")), key=lambda r: r["us"])
            for r in found:
                print(f"b{batch} ctx {context} {r['label']:<30} {r['us']:7.2f} us  {r['tb_s']:5.2f} TB/s", flush=True)
            rows += found
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
