"""Rollout decode throughput of the embedded engine with bf16, INT4 and FP8 weights.

    python bench/quantized_decode.py            # H200: Qwen3-1.7B-shaped random model, bf16
    python bench/quantized_decode.py --model 8b # Qwen3-8B shape (hidden 4096, 36 layers, untied head)
    python bench/quantized_decode.py --tiny     # CPU smoke run of the same code paths (float32)
    python bench/quantized_decode.py --lora-rank 16 --precisions bf16,int4 --batches 1
                                                # LoRA adapters over each base (--lora-sync adapter)

One random-init Qwen3 checkpoint (1.7B shape: hidden 2048, intermediate 6144, 28
layers, 16 q / 8 kv heads of dim 128, vocab 151936, tied embeddings) is served by
``miles_host.rollout.Engine`` three times, one engine after the other (each freed
before the next is built), with the rollout model prepared by the precision
recipes the plugins register, exactly as a run's rollout backend does it
(``Precision.prepare_rollout_model`` then the ``miles_prepare_model`` hook):

- ``bf16``: the host's built-in recipe (dense linears in the model dtype);
- ``int4``: miles-int4 with ``--int4-target all --int4-rollout-gemm packed``
  (every linear but the head as INT4, group 128): on CUDA the ``halves`` layout,
  multiplied at decode by the Triton small-M kernel (``miles_int4.decode_gemm``);
- ``fp8``: miles-fp8 (``Fp8InferenceLinear``: FP8 E4M3 weights in 128x128 blocks);
  at decode each linear is one fused kernel that quantizes the activations 1x128
  inside the GEMM (``miles_fp8.decode_gemm``).

The paths they replaced can run in the same table: ``int4:tinygemm`` (torch's
``_weight_int4pack_mm``, ``--int4-cuda-layout tinygemm``), ``int4:rows`` (the ``halves``
bytes row by row instead of in 128-row tiles, ``--int4-tile-rows 0``) and ``fp8:unfused``
(a quantize kernel + ``block_scaled_mm`` per linear, ``--fp8-small-m 0``) and
``fp8:fp16-products`` (the fused kernel with fp16 products and fp32 sums instead of
FP8 tensor-core products, ``--fp8-small-m-mma 0``), e.g.
``--precisions bf16,int4,fp8,int4:tinygemm,fp8:unfused``.

``--lora-rank R`` puts LoRA adapters (rank R, every linear, ``--lora-sync adapter``) on each
rollout model after the recipe, as the rollout backend of a LoRA run does
(:func:`miles_host.lora.sync.prepare_engine_model`): plain linears become ``W x + s B (A x)``,
the quantized ones ``quantized_base(x) + s B (A x)`` with ``A``, ``B`` in the model dtype. So
``--lora-rank 16 --precisions bf16,int4 --batches 1`` compares batch-1 decode of LoRA over a
bf16 base with LoRA over an INT4 base (QLoRA-style rollout). The adapters' ``B`` are random
(not PEFT's zeros), so the low-rank GEMMs compute something, and the timing is what a trained
adapter costs.

Before an engine is built, one quantized linear of the prepared model is checked
against the plugin's own float reference; a precision whose plugin cannot be
used here (import, kernel, check, engine or generation error) is reported with
the reason and skipped, the others still run.

Cases: batch 1, 8 and 32 sequences of 128 random prompt tokens, 256 new tokens,
temperature 1.0, ignore_eos (prefix caching off, so every repeat prefills). tok/s
is completion tokens / wall time of ``engine.generate``; the decode figure
subtracts the wall time of the same prompts with ``max_new_tokens=1`` (prefill +
first token) and counts the other ``new_tokens - 1`` tokens per sequence. Medians
of ``--repeats`` timed runs after one warm-up. The HBM bound of a decode step is
the weight bytes it reads (linears as their kernels read them, plus the tied
embedding as lm_head, or the untied head, and the norms) plus the KV bytes of every sequence's
context, at 4.24 TB/s; bound tok/s = batch / mean bound step time over the
decode steps, compared with the decode figure. The weight memory of each rollout
model (linear weights and total, state dict and resident) is printed as well.
"""

from __future__ import annotations

import argparse
import math
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_profile import generate, profile_decode  # noqa: E402
from bench.device_peaks import decode_bound_tok_s, hbm_bytes_per_s  # noqa: E402
from bench.device_sync import free_memory, sync  # noqa: E402

HBM_BYTES_PER_S = hbm_bytes_per_s()  # this machine's copy bandwidth (bench/device_peaks.py)
#: INT4 goal: linear weights of the rollout model >= 3.5x smaller than bf16
INT4_GOAL = 3.5

def full_shape(model: str) -> dict:
    """The Qwen3 ``model`` shape (``bench/small_m.py``'s table) as transformers config kwargs; 8B unties the head."""
    from bench import small_m

    hidden, inter, heads, kv_heads, head_dim, layers = small_m.MODELS[model]
    return dict(
        vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        tie_word_embeddings=model != "8b", max_position_embeddings=40960,
    )


def tiny_shape(hidden: int) -> dict:
    """Hidden 64 (default), 2 layers, vocab 512; ``--tiny-hidden 128`` makes FP8-eligible dims."""
    return dict(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, tie_word_embeddings=True,
        max_position_embeddings=4096,
    )


class Unusable(Exception):
    """A precision that cannot run here; the message says why."""


#: precision variants: the kernel switches that select the path each one measures
VARIANTS = {
    "int4:tinygemm": {"int4_cuda_layout": "tinygemm"},
    "int4:rows": {"int4_tile_rows": 0},
    "fp8:unfused": {"fp8_small_m": 0},
    "fp8:fp16-products": {"fp8_small_m_mma": 0},
}


def variant_switches(label: str):
    """A variant's kernel switches for the duration of its engine (restored after)."""
    import importlib

    from miles_host.kernels import switches

    for module in ("miles_fp8.kernel_switches", "miles_int4.kernel_switches"):
        importlib.import_module(module)  # declares the plugins' switches
    return switches.switched(**VARIANTS.get(label, {}))


# ---------------------------------------------------------------------- checkpoint


def build_checkpoint(shape: dict, dtype: torch.dtype, device: str, folder: str) -> int:
    """A random-init Qwen3 of ``shape`` saved to ``folder``; returns its parameter count."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**shape, eos_token_id=shape["vocab_size"] - 1, pad_token_id=0)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config).to(dtype).eval()
    model.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    del model
    free_memory(device)
    return params






# ---------------------------------------------------------------------- precisions


def precision_flags(name: str, args) -> dict:
    """The run flags (as config attributes) each recipe reads."""
    if name == "int4":
        return dict(int4_group_size=args.int4_group_size, int4_target="all", int4_rollout_gemm="packed",
                    true_on_policy=False)
    if name == "fp8":
        return dict(fp8_format="e4m3", fp8_recipe="blockwise", fp8_power_of_two_scales=False)
    return {}


def lora_flags(rank: int) -> dict:
    """The LoRA flags of a ``--lora-rank rank --lora-sync adapter`` run on every linear (rank 0: none)."""
    if not rank:
        return {}
    return dict(lora_rank=rank, lora_alpha=2 * rank, lora_dropout=0.0, lora_sync="adapter", target_modules=None,
                exclude_modules=None, lora_adapter_path=None)


@torch.no_grad()
def randomize_adapters(model: torch.nn.Module) -> None:
    """Non-zero ``lora_B`` (PEFT starts them at zero): the adapters of a trained run."""
    generator = torch.Generator(device="cpu").manual_seed(2)
    for name, parameter in model.named_parameters():
        if ".lora_B." in name:
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 1e-3)


def rollout_preparer(name: str, flags: dict):
    """``prepare(model) -> model`` as the embedded rollout backend builds it for ``--precision name``
    (with ``lora_rank`` in ``flags``: the LoRA layers of ``--lora-sync adapter`` after the recipe)."""
    from miles_host.plugin_manager import create_plugin_manager

    try:
        manager = create_plugin_manager(plugins=[] if name == "bf16" else [name])
        record = manager.registries.precisions.get(name)
    except Exception as error:  # noqa: BLE001 - report and skip this precision
        raise Unusable(f"plugin {name!r} not usable: {type(error).__name__}: {error}") from None
    config = SimpleNamespace(precision=name, **flags)

    def prepare(model):
        if record.prepare_rollout_model is not None:
            model = record.prepare_rollout_model(model, config) or model
        if getattr(config, "lora_rank", 0):
            from miles_host.lora.sync import prepare_engine_model

            model = prepare_engine_model(model, config)
            randomize_adapters(model)
        manager.hook.miles_prepare_model(model=model, role="rollout", config=config)
        return model

    return prepare


def quantized_classes() -> dict[str, type]:
    """The plugins' rollout linear classes that are importable here."""
    classes = {}
    try:
        from miles_int4.rollout import Int4Linear

        classes["int4"] = Int4Linear
    except Exception:  # noqa: BLE001
        pass
    try:
        from miles_fp8.linear import Fp8InferenceLinear

        classes["fp8"] = Fp8InferenceLinear
    except Exception:  # noqa: BLE001
        pass
    return classes


@torch.no_grad()
def check_quantized(model: torch.nn.Module, name: str) -> str:
    """Compare one quantized linear of the prepared model with its plugin's float reference."""
    classes = quantized_classes()
    if name == "bf16":
        return "-"
    kind = classes.get(name)
    modules = [m for m in model.modules() if kind is not None and isinstance(m, kind)]
    if not modules:
        raise Unusable(f"{name}: the recipe quantized no linear at this shape (e.g. FP8 needs dims that are "
                       "multiples of 128; try --tiny-hidden 128)")
    module = modules[0]
    dtype = model.embed_tokens.weight.dtype
    device = model.embed_tokens.weight.device
    generator = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(8, module.in_features, generator=generator).to(device=device, dtype=dtype)
    if name == "int4":
        from miles_int4.quant import dequantize_packed

        if not module.use_kernel:
            raise Unusable("int4: torch's int4 kernel does not take these weights here (the packed path would "
                           "fall back to dequantize + matmul)")
        from miles_int4.rollout import Int4Linear

        # the packed module keeps only the kernel layout: check the kernel on a linear of the same
        # shape against the dequantized compressed-tensors form of the same weights
        source = torch.nn.Linear(module.in_features, module.out_features, bias=False).to(device=device, dtype=dtype)
        reference = Int4Linear(source, module.group_size, use_kernel=False)
        checked = Int4Linear(source, module.group_size, use_kernel=True)
        checked.refresh(dtype)
        expected = F.linear(x.float(), dequantize_packed(reference.weight_packed, reference.weight_scale, torch.float32))
        module = checked
    else:
        from miles_fp8.gemm import block_scaled_mm_ref
        from miles_fp8.quant import quantize_act_ref

        x_q, x_s = quantize_act_ref(x.float())
        expected = block_scaled_mm_ref(x_q, x_s, module.weight, module.weight_scale_inv, torch.float32)
    got = module(x).float()
    error = float((got - expected).abs().max() / expected.abs().max().clamp(min=1e-30))
    if not error < 2e-2:  # NaN fails too
        raise Unusable(f"{name}: the rollout linear disagrees with the plugin's float reference "
                       f"(max relative error {error:.2e}); its kernel is not usable on this device")
    return f"{error:.1e}"


# ---------------------------------------------------------------------- weight memory


def weight_memory(model: torch.nn.Module, precision: str) -> dict:
    """Bytes of the rollout model's weights.

    ``linear_state``: linear weights in the synced (compressed-tensors) form, what weight
    sync and checkpoints move; ``linear_resident``: what the module holds in memory (its
    tensors plus, on the INT4 packed path, the kernel-layout weights it keeps instead of
    the compressed buffers); ``linear_read``: what one forward reads;
    ``other``: the remaining parameters (tied embedding/lm_head, norms).
    """
    classes = tuple(quantized_classes().values())
    linear_state = linear_held = linear_kernel = linear_read = 0
    linear_params: set[int] = set()
    num_linears = num_quantized = 0
    for name, module in model.named_modules():
        is_quantized = isinstance(module, classes) if classes else False
        if not (is_quantized or isinstance(module, torch.nn.Linear)) or name.endswith("lm_head"):
            continue
        num_linears += 1
        num_quantized += int(is_quantized)
        own = [t for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)] if t is not None]
        held = sum(t.numel() * t.element_size() for t in own)
        linear_params.update(id(t) for t in own)
        # names a module loads itself (miles-int4's packed path): synced, but held only in the kernel layout
        sinks = module.miles_weight_sinks() if hasattr(module, "miles_weight_sinks") else {}
        synced = sum(math.prod(sink.shape) * torch.empty((), dtype=sink.dtype).element_size() for sink in sinks.values())
        kernel = 0
        kernel_copies = getattr(module, "_kernel_copies", None) if getattr(module, "use_kernel", False) else None
        for packs in (kernel_copies or {}).values():  # miles-int4's kernel-layout weights (PackedInt4 each)
            for pack in packs:
                kernel += pack.weight.numel() * pack.weight.element_size()
                kernel += pack.scales.numel() * pack.scales.element_size()
        state = held + synced
        linear_state += state
        linear_held += held
        linear_kernel += kernel
        if kernel:
            bias = getattr(module, "bias", None)
            linear_read += kernel + (bias.numel() * bias.element_size() if bias is not None else 0)
        else:
            linear_read += state
    other = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in linear_params)
    return dict(
        precision=precision, num_linears=num_linears, num_quantized=num_quantized,
        linear_state=linear_state, linear_resident=linear_held + linear_kernel, linear_read=linear_read,
        other=other, total_state=linear_state + other, total_resident=linear_held + linear_kernel + other,
        step_read=linear_read + other - _untied_embedding_bytes(model),
    )


def _untied_embedding_bytes(model: torch.nn.Module) -> int:
    """Bytes of an input embedding that is not also the LM head (a decode step gathers a few rows of it)."""
    embedding = model.embed_tokens.weight
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    if head is not None and head.data_ptr() == embedding.data_ptr():
        return 0
    return embedding.numel() * embedding.element_size()


# ---------------------------------------------------------------------- timing


def timed(fn, device: str, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def bench_precision(label, args, folder, dtype, device, prompts_by_batch, engine_kwargs) -> dict:
    """Build the engine for one precision (``name`` or ``name:variant``), check it, time every batch; free it."""
    with variant_switches(label):
        return _bench_precision(label, args, folder, dtype, device, prompts_by_batch, engine_kwargs)


def _bench_precision(label, args, folder, dtype, device, prompts_by_batch, engine_kwargs) -> dict:
    from miles_host.rollout import Engine

    name = label.partition(":")[0]
    prepare = rollout_preparer(name, {**precision_flags(name, args), **lora_flags(args.lora_rank)})
    info: dict = {}

    def prepare_and_measure(model):
        model = prepare(model)
        free_memory(device)
        info["memory"] = weight_memory(model, label)
        info["cuda_allocated"] = torch.cuda.memory_allocated() - info["baseline"] if device == "cuda" else None
        info["check"] = check_quantized(model, name)
        return model

    info["baseline"] = torch.cuda.memory_allocated() if device == "cuda" else 0
    start = time.perf_counter()
    engine = Engine.from_pretrained(folder, dtype=dtype, device=device, tokenizer=None,
                                    prepare_model=prepare_and_measure, **engine_kwargs)
    try:
        build_s = time.perf_counter() - start
        memory = info["memory"]
        print(f"[{label}] engine built in {build_s:.1f} s: {memory['num_quantized']}/{memory['num_linears']} linears "
              f"quantized, check vs plugin reference: max rel err {info['check']}; attention="
              f"{engine.config.attention_backend}, cuda_graphs={bool(engine.runner.graphs)}, KV cache "
              f"{engine.num_kv_cache_tokens} tokens ({engine.kv_cache.num_bytes / 2**30:.2f} GiB), "
              f"{engine.kv_bytes_per_token} B/token", flush=True)
        rows = []
        for batch, prompts in prompts_by_batch.items():
            full = timed(lambda: generate(engine, prompts, args.new_tokens), device, args.repeats)
            prefill = timed(lambda: generate(engine, prompts, 1), device, args.repeats)
            t_full, t_prefill = statistics.median(full), statistics.median(prefill)
            wall = batch * args.new_tokens / t_full
            decode = batch * (args.new_tokens - 1) / (t_full - t_prefill) if t_full > t_prefill else float("nan")
            bound = decode_bound_tok_s(batch, args.prompt_len, args.new_tokens, memory["step_read"],
                                       engine.kv_bytes_per_token)
            rows.append(dict(precision=label, batch=batch, full_s=t_full, prefill_s=t_prefill, wall_tok_s=wall,
                             decode_tok_s=decode, bound_tok_s=bound, linear_read=memory["linear_read"],
                             step_read=memory["step_read"]))
            print(f"[{label}] batch {batch:>2}: {t_full:.3f} s ({wall:,.0f} tok/s), prefill+1 {t_prefill:.3f} s, "
                  f"decode {decode:,.0f} tok/s, bound {bound:,.0f} tok/s", flush=True)
        if args.profile and device == "cuda":
            profile_decode(engine, next(iter(prompts_by_batch.values())), args.new_tokens, label)
        return dict(rows=rows, memory=memory, cuda_allocated=info["cuda_allocated"], build_s=build_s)
    finally:
        engine = None  # drop the engine before the next precision builds its own
        free_memory(device)


# ---------------------------------------------------------------------- report


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.3f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.3f} MB"


def print_tables(results: dict, skipped: dict, args) -> None:
    rows = [row for result in results.values() for row in result["rows"]]
    base = {row["batch"]: row for row in results.get("bf16", {}).get("rows", [])}
    print()
    lora = f" LoRA rank {args.lora_rank} adapters over each base (--lora-sync adapter)." if args.lora_rank else ""
    print(f"Decode throughput,{lora} {args.prompt_len}-token prompts, {args.new_tokens} new tokens, T=1, ignore_eos; "
          f"median of {args.repeats} after a warm-up. HBM bound at {HBM_BYTES_PER_S / 1e12:.2f} TB/s "
          "(weights read per step + KV), compared with the decode figure."
          + (" --tiny: 'bf16' is the plain model dtype (float32) and the bound is the H200's, meaningless on CPU."
             if args.tiny else ""))
    print()
    print("| precision | batch | tok/s (wall) | decode tok/s (prefill excl.) | speedup vs bf16 (wall / decode) "
          "| linear-weight bytes read/step | HBM bound tok/s | decode / bound |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        ref = base.get(row["batch"])
        speedup = (f"{row['wall_tok_s'] / ref['wall_tok_s']:.2f}x / {row['decode_tok_s'] / ref['decode_tok_s']:.2f}x"
                   if ref else "-")
        print(f"| {row['precision']} | {row['batch']} | {row['wall_tok_s']:,.0f} | {row['decode_tok_s']:,.0f} | "
              f"{speedup} | {_gb(row['linear_read'])} | {row['bound_tok_s']:,.0f} | "
              f"{row['decode_tok_s'] / row['bound_tok_s']:.2%} |")
    for name, why in skipped.items():
        print(f"| {name} | - | skipped: {why} | | | | | |")

    print()
    print("Weight memory of the rollout model (state dict: what weight sync and checkpoints hold; resident: plus "
          "kernel-layout copies kept by the INT4 packed path; total adds the tied embedding/lm_head and norms):")
    print()
    bf16 = results.get("bf16", {}).get("memory")
    print("| precision | quantized linears | linear weights (state dict) | vs bf16 | linear weights resident "
          "| vs bf16 | total (state dict) | total resident | vs bf16 | CUDA allocated after prepare |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, result in results.items():
        m = result["memory"]

        def ratio(key):
            return f"{bf16[key] / m[key]:.2f}x" if bf16 else "-"

        cuda = _gb(result["cuda_allocated"]) if result["cuda_allocated"] is not None else "-"
        print(f"| {name} | {m['num_quantized']}/{m['num_linears']} | {_gb(m['linear_state'])} | "
              f"{ratio('linear_state')} | {_gb(m['linear_resident'])} | {ratio('linear_resident')} | "
              f"{_gb(m['total_state'])} | {_gb(m['total_resident'])} | {ratio('total_resident')} | {cuda} |")
    if bf16 and "int4" in results:
        m = results["int4"]["memory"]
        state, resident = bf16["linear_state"] / m["linear_state"], bf16["linear_resident"] / m["linear_resident"]
        verdict = lambda r: "met" if r >= INT4_GOAL else "missed"  # noqa: E731
        print()
        print(f"INT4 goal (linear weights >= {INT4_GOAL}x smaller than bf16): state dict {state:.2f}x "
              f"({verdict(state)}); resident incl. kernel copies {resident:.2f}x ({verdict(resident)})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run with a tiny model (float32)")
    parser.add_argument("--tiny-hidden", type=int, default=64, choices=[64, 128],
                        help="hidden size of --tiny (128 gives FP8 128-divisible dims)")
    parser.add_argument("--model", default="1.7b", choices=["1.7b", "4b", "8b"],
                        help="Qwen3 shape on the GPU (8B: untied head; hidden 4096, 36 layers)")
    parser.add_argument("--precisions", default="bf16,int4,fp8",
                        help=f"comma list of bf16, int4, fp8 and the variants {', '.join(VARIANTS)}")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128 (--tiny: 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256 (--tiny: 32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--int4-group-size", type=int, default=None, choices=[32, 64, 128],
                        help="default 128 (--tiny: 32)")
    parser.add_argument("--mem-fraction-static", type=float, default=0.5)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--no-overlap", action="store_true", help="read each decode step before launching the next")
    parser.add_argument("--profile", action="store_true",
                        help="also print each precision's GPU kernel time per decode step, by kernel (first batch)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="LoRA adapters of this rank on every linear of each rollout model (--lora-sync adapter; "
                        "alpha 2 x rank); 0: none")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    if args.tiny:
        device, dtype, shape = "cpu", torch.float32, tiny_shape(args.tiny_hidden)
        defaults = dict(prompt_len=16, new_tokens=32, int4_group_size=32)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (use --tiny for a CPU smoke run)")
        device, dtype, shape = "cuda", torch.bfloat16, full_shape(args.model)
        defaults = dict(prompt_len=128, new_tokens=256, int4_group_size=128)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be >= 2 (the decode figure subtracts a max_new_tokens=1 run)")
    batches = [int(b) for b in args.batches.split(",")]
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in precisions if p not in ("bf16", "int4", "fp8", *VARIANTS)]
    if unknown:
        raise SystemExit(f"unknown precisions {unknown}; use bf16, int4, fp8, {', '.join(VARIANTS)}")
    if max(batches) > args.max_num_seqs:
        raise SystemExit(f"batch {max(batches)} > --max-num-seqs {args.max_num_seqs}")

    engine_kwargs = dict(max_num_seqs=args.max_num_seqs, mem_fraction_static=args.mem_fraction_static,
                         enable_prefix_caching=False, enforce_eager=args.enforce_eager, overlap_schedule=False if args.no_overlap else None)
    if device == "cpu":
        engine_kwargs["kv_cache_tokens"] = max(batches) * (args.prompt_len + args.new_tokens) + 1024

    rng = random.Random(0)
    vocab = shape["vocab_size"]
    prompts_by_batch = {
        b: [[rng.randrange(1, vocab - 1) for _ in range(args.prompt_len)] for _ in range(b)] for b in batches
    }
    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    results: dict = {}
    skipped: dict = {}
    with tempfile.TemporaryDirectory() as folder:
        params = build_checkpoint(shape, dtype, device, folder)
        print(f"{device_name}, torch {torch.__version__}: random Qwen3 (hidden {shape['hidden_size']}, "
              f"{shape['num_hidden_layers']} layers, vocab {vocab}), {params / 1e6:.1f}M params, {dtype}; "
              f"precisions {', '.join(precisions)}; batches {batches}; INT4 group {args.int4_group_size}"
              + (f"; LoRA rank {args.lora_rank} on every linear (--lora-sync adapter)" if args.lora_rank else ""),
              flush=True)
        for name in precisions:
            try:
                results[name] = bench_precision(name, args, folder, dtype, device, prompts_by_batch,
                                                engine_kwargs)
            except Unusable as error:
                skipped[name] = str(error)
            except Exception as error:  # noqa: BLE001 - one precision failing must not stop the others
                lines = traceback.format_exception_only(type(error), error)
                skipped[name] = f"{name} failed: {lines[-1].strip()}"
                traceback.print_exc()
            if name in skipped:
                print(f"[{name}] skipped: {skipped[name]}", flush=True)
            free_memory(device)
            if device == "cuda":
                print(f"[{name}] CUDA memory allocated after freeing the engine: "
                      f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB", flush=True)

    print_tables(results, skipped, args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": device_name, "torch": torch.__version__, "shape": shape, "args": vars(args),
                       "results": results, "skipped": skipped}, handle, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
