"""MoE rollout throughput: the fused MoE kernels against the per-expert loop, bf16 / fp8 / int4.

    python bench/moe.py                                  # H200: Qwen3-30B-A3B shape, 8 layers, bf16 loop+fused, fp8, int4
    python bench/moe.py --shapes dsv3 --precisions bf16  # DeepSeek-V3 shape (MLA, 256 experts, 4 layers)
    python bench/moe.py --sweep --json $OUT/moe_sweep.json   # tile sweep: prints the TUNED entries
    python bench/moe.py --tiny [--shapes qwen3_30b,dsv3] # CPU smoke run of the same code (float32, tiny shapes)
    python bench/moe.py --precisions bf16 --kernels fused --routers fused,torch --batches 1,8,32 --prefill-seqs 0
                                                         # decode with the fused router and with the eager one
    python bench/moe.py --router-timing                  # one MoE block, graph-timed, fused vs eager router
    python bench/moe.py --train                          # also run bench/moe_train.py (training half), when present

Models are random-init miles models built from an HF config dict through the model
family adapters (no checkpoint on disk), served by ``miles_host.rollout.Engine``
(CUDA graphs, paged KV cache) with ``--moe-kernel`` loop or fused (and, for fused,
each of ``--routers``: the one-launch fused router of ``miles_host.kernels.moe_router``
or the eager router and ``plan``, set on the model by ``set_moe_router`` before the
engine captures its graphs; the label says ``fused/torch-router`` for the latter). fp8 / int4 rollout
models are prepared by the precision plugins' recipes as a run's rollout backend
does it (fp8: every 128-divisible linear incl. the experts; int4: the routed experts,
group 128).

Decode: B sequences of ``--prompt-len`` random tokens, ``--new-tokens`` new tokens,
temperature 1, ignore_eos; decode tok/s = B * (new - 1) / (t(full) - t(max_new_tokens=1)),
medians of ``--repeats`` after a warm-up. HBM bound of a decode step: the bytes of
every weight the step reads once (all non-expert weights but the input embedding,
plus the experts touched: per MoE layer ``E * (1 - (1 - K/E)^B)`` experts, the
expectation under uniform routing: exact at B = 1, all experts from B ~ 2E/K on)
plus the KV cache of every sequence, at 4.24 TB/s. Prefill: ``--prefill-seqs`` x
``--prefill-len`` tokens in one ``max_new_tokens=1`` call; compute bound
2 * active params * tokens + causal attention FLOPs at 790 TFLOP/s (bf16 dense peak).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import decode_launches  # noqa: E402
from bench.device_peaks import bf16_flops, decode_bound_tok_s, hbm_bytes_per_s  # noqa: E402
from bench.device_sync import free_memory, sync  # noqa: E402
from bench.moe_models import SHAPES, attention_flops, build_model, build_prepared, expert_stacks, step_bytes  # noqa: E402

HBM_BYTES_PER_S = hbm_bytes_per_s()  # this machine's copy bandwidth (bench/device_peaks.py)
BF16_FLOPS = bf16_flops()


# ---------------------------------------------------------------------- timing


def timed(fn, device: str, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def generate(engine, prompts, new_tokens: int) -> int:
    sampling = [{"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True} for _ in prompts]
    results = engine.generate(prompts, sampling, return_logprob=False)
    tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    if tokens != len(prompts) * new_tokens:
        raise RuntimeError(f"expected {len(prompts) * new_tokens} completion tokens, got {tokens}")
    return tokens


def bench_engine(shape, precision, kernel, args, dtype, device, router="fused") -> list[dict]:
    from miles_host.models.mlp import set_moe_router
    from miles_host.rollout import Engine

    label = f"{shape}/{precision}/{kernel_label(kernel, router)}"
    start = time.perf_counter()
    model = build_prepared(shape, dtype, device, precision)
    set_moe_router(model, router)
    free_memory(device)
    max_len = max(args.prompt_len + args.new_tokens, max(args.prefill_len) + 1) + 16
    engine = Engine(model, tokenizer=None, max_num_seqs=max(args.batches), max_model_len=max_len,
                    enable_prefix_caching=False, moe_kernel=kernel,
                    mem_fraction_static=args.mem_fraction)
    print(f"[{label}] engine built in {time.perf_counter() - start:.1f} s, cuda_graphs={bool(engine.runner.graphs)}, "
          f"KV {engine.num_kv_cache_tokens} tokens, {engine.kv_bytes_per_token} B/token", flush=True)
    rows = []
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    try:
        graphed_sampling = engine.runner.sampling_graphs
        for batch in args.batches:
            prompts = torch.randint(1, vocab - 1, (batch, args.prompt_len), generator=generator).tolist()
            for sampling in ("graphed", "eager") if args.compare_eager_sampling else ("graphed",):
                engine.runner.sampling_graphs = graphed_sampling if sampling == "graphed" else None
                suffix = "" if sampling == "graphed" else " (eager sampling)"
                t_full = timed(lambda: generate(engine, prompts, args.new_tokens), device, args.repeats)
                t_first = timed(lambda: generate(engine, prompts, 1), device, args.repeats)
                decode = batch * (args.new_tokens - 1) / (t_full - t_first) if t_full > t_first else float("nan")
                weight_bytes, _ = step_bytes(model, batch)
                lengths = (batch, args.prompt_len, args.new_tokens)
                bound = decode_bound_tok_s(*lengths, weight_bytes, engine.kv_bytes_per_token)
                row = dict(shape=shape, precision=precision, kernel=kernel_label(kernel, router),
                           case=f"decode b{batch}{suffix}", tok_s=decode, bound_tok_s=bound,
                           fraction=decode / bound, weight_bytes=weight_bytes,
                           kv_bytes_per_token=engine.kv_bytes_per_token)
                rows.append(row)
                print(f"[{label}] decode batch {batch:>3}{suffix}: {decode:,.0f} tok/s, HBM bound {bound:,.0f} tok/s "
                      f"({decode / bound:.1%}); step weights {weight_bytes / 1e9:.2f} GB, "
                      f"KV {engine.kv_bytes_per_token:,} B/token", flush=True)
        engine.runner.sampling_graphs = graphed_sampling
        if args.profile_batch and device == "cuda":
            from bench.decode_profile import profile_decode

            prompts = torch.randint(1, vocab - 1, (args.profile_batch, args.prompt_len), generator=generator).tolist()
            profile_decode(engine, prompts, args.new_tokens, label, top=args.profile_top)
        if args.host_profile_batch:
            from bench.decode_profile import host_profile_decode

            prompts = torch.randint(1, vocab - 1, (args.host_profile_batch, args.prompt_len), generator=generator).tolist()
            host_profile_decode(engine, prompts, args.new_tokens, label)
        if args.prefill_seqs:
            rows += bench_prefill(engine, model, args, label, device, generator,
                                  dict(shape=shape, precision=precision, kernel=kernel_label(kernel, router)))
    finally:
        engine = model = None
        free_memory(device)
    return rows


def bench_prefill(engine, model, args, label, device, generator, keys: dict) -> list[dict]:
    """Prefill tok/s of ``--prefill-seqs`` prompts at each ``--prefill-len``, once per value of
    ``--prefill-switch`` (the switch set before each timing, the same engine and weights), against the
    compute bound."""
    from miles_host.kernels import switches

    name, values = args.prefill_switch or (None, [None])
    vocab, rows = model.config.vocab_size, []
    _, active = step_bytes(model, 1)
    for length in args.prefill_len:
        prompts = torch.randint(1, vocab - 1, (args.prefill_seqs, length), generator=generator).tolist()
        for value in values:
            variant = "" if name is None else f" {name}={value}"
            with switches.switched(**({} if name is None else {name: value})):
                t_prefill = timed(lambda: generate(engine, prompts, 1), device, args.repeats)
            tokens = args.prefill_seqs * length
            flops = 2 * active * tokens + attention_flops(model, args.prefill_seqs, length)
            bound = tokens / (flops / BF16_FLOPS)
            rows.append(dict(keys, case=f"prefill {args.prefill_seqs}x{length}{variant}", tok_s=tokens / t_prefill,
                             bound_tok_s=bound, fraction=tokens / t_prefill / bound))
            print(f"[{label}] prefill {args.prefill_seqs}x{length}{variant}: {tokens / t_prefill:,.0f} tok/s, "
                  f"compute bound {bound:,.0f} tok/s ({tokens / t_prefill / bound:.1%})", flush=True)
    return rows


def kernel_label(kernel: str, router: str) -> str:
    """The row label of a case: ``fused`` (fused router), ``fused/torch-router`` (eager router), ``loop``."""
    return f"{kernel}/{router}-router" if kernel == "fused" and router != "fused" else kernel


def router_timing(args, dtype, device) -> list[dict]:
    """One MoE block of each shape (gate linear, router, experts, shared experts), graph-timed per token
    count with the fused router and with the eager router + ``plan``: the router's share of a decode step."""
    from miles_host.models.mlp import MoE, set_moe_router, uses_fused_router

    rows = []
    for shape in args.shapes.split(","):
        model = build_model(shape, dtype, device)
        block = next(m for m in model.modules() if isinstance(m, MoE))
        for tokens in args.router_tokens:
            x = torch.randn(tokens, model.config.hidden_size, device=device, dtype=dtype)
            times = {}
            with torch.no_grad():
                for router in ("fused", "torch"):
                    set_moe_router(block, router)
                    if router == "fused" and not uses_fused_router(block, x):
                        times[router] = float("nan")  # e.g. more tokens than the fused router takes
                        continue
                    times[router] = _graph_time(lambda: block(x), device, inner=20, repeats=10)
            rows.append(dict(shape=shape, case=f"moe block T={tokens}", fused_us=times["fused"] * 1e6,
                             torch_us=times["torch"] * 1e6))
            print(f"[router {shape}] MoE block T={tokens}: fused router {times['fused'] * 1e6:.1f} us, eager router "
                  f"+ plan {times['torch'] * 1e6:.1f} us (saves {(times['torch'] - times['fused']) * 1e6:.1f} us "
                  f"per layer)", flush=True)
        model = block = None
        free_memory(device)
    return rows


# ---------------------------------------------------------------------- tile sweep


def _graph_time(fn, device: str, inner: int = 10, repeats: int = 5) -> float:
    """Seconds per call of ``fn`` replayed from a CUDA graph of ``inner`` calls (no launch overhead)."""
    fn()
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        graph.replay()
        sync(device)
        times.append((time.perf_counter() - start) / inner)
    return min(times)


def sweep(args, dtype, device) -> dict:
    """Time every tile candidate of each projection per token bucket; return the TUNED entries."""
    from miles_host.kernels import moe_configs
    from miles_host.kernels.moe_grouped import plan

    model = build_prepared(args.sweep_shape, dtype, device, args.sweep_precision)
    module = expert_stacks(model)[0][0]
    gemms = _gemms_of(module)
    e, h, inter, top_k = gemms.num_experts, gemms.hidden, gemms.inter, model.config.moe.top_k
    entries = {}
    for tokens in args.sweep_tokens:
        x = torch.randn(tokens, h, device=device, dtype=dtype)
        ids = torch.stack([torch.randperm(e, device=device)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, device=device)
        best = None
        base = moe_configs.pick_block_m(tokens * top_k, e)
        for block_m in [b for b in moe_configs.SWEEP_BLOCK_M if base <= b <= base * 2]:
            routing = plan(ids, weights, e, block_m)
            rows = routing.row_token_R.shape[0]
            act = torch.empty(rows, inter, device=device, dtype=dtype)
            out = torch.empty(rows, h, device=device, dtype=dtype)
            timings = {}
            for which, n in (("gate_up", inter), ("down", h)):
                results = []
                for bn, bk, warps, stages in moe_configs.SWEEP_GEMMS:
                    config = moe_configs.GemmConfig(block_m, bn, bk, warps, stages)
                    call = (lambda c=config: gemms.gate_up(x, routing, act, c)) if which == "gate_up" else (
                        lambda c=config: gemms.down(act, routing, out, c))
                    try:
                        results.append((_graph_time(call, device), (bn, bk, warps, stages)))
                    except Exception as error:  # noqa: BLE001 - a tile that does not compile here is skipped
                        print(f"  skip {which} {config}: {type(error).__name__}: {str(error)[:80]}")
                timings[which] = min(results)
            total = timings["gate_up"][0] + timings["down"][0]
            print(f"[sweep {args.sweep_precision}] T={tokens} block_m={block_m}: gate_up {timings['gate_up'][0] * 1e6:.1f} us "
                  f"{timings['gate_up'][1]}, down {timings['down'][0] * 1e6:.1f} us {timings['down'][1]}", flush=True)
            if best is None or total < best[0]:
                best = (total, block_m, timings["gate_up"][1], timings["down"][1])
        default = moe_configs.default_tiles(tokens, top_k, e, h, inter, dtype)
        default_s = sum(_time_tiles(gemms, x, ids, weights, default, device))
        entries[moe_configs.token_bucket(tokens)] = best[1:]
        print(f"[sweep {args.sweep_precision}] T={tokens}: best {best[0] * 1e6:.1f} us {best[1:]}; default tiles "
              f"{default_s * 1e6:.1f} us", flush=True)
    key = (e, h, inter, gemms.weight_format)
    print(f"TUNED[{key!r}] = {entries!r}", flush=True)
    model = module = None
    free_memory(device)
    return {repr(key): entries}


def _time_tiles(gemms, x, ids, weights, tiles, device) -> tuple[float, float]:
    from miles_host.kernels.moe_grouped import plan

    routing = plan(ids, weights, gemms.num_experts, tiles.block_m)
    rows = routing.row_token_R.shape[0]
    act = torch.empty(rows, gemms.inter, device=device, dtype=x.dtype)
    out = torch.empty(rows, gemms.hidden, device=device, dtype=x.dtype)
    return (_graph_time(lambda: gemms.gate_up(x, routing, act, tiles.gate_up), device),
            _graph_time(lambda: gemms.down(act, routing, out, tiles.down), device))


def _gemms_of(module):
    """The ExpertGemms the module's fused forward builds."""
    from miles_host.kernels.moe_grouped import DenseExpertGemms

    if hasattr(module, "_fused_operands"):
        from miles_int4.moe_fused import Int4ExpertGemms

        return Int4ExpertGemms(*module._fused_operands("gate_up_proj"), *module._fused_operands("down_proj"),
                               module.act_name)
    if hasattr(module, "gate_up_proj_scale_inv"):
        from miles_fp8.moe_fused import Fp8ExpertGemms

        return Fp8ExpertGemms(module.gate_up_proj, module.gate_up_proj_scale_inv, module.down_proj,
                              module.down_proj_scale_inv, module.act_name, module.power_of_two)
    return DenseExpertGemms(module.gate_up_proj, module.down_proj, module.act_name)


# ---------------------------------------------------------------------- main


def _import_switch_owner(name: str) -> None:
    """Declare kernel switch ``name``: import its plugin's switches by its prefix, else declare every host
    switch from its record (as a run's process start does)."""
    from miles_host.kernels import switches

    owners = {"fp8_": "miles_fp8.kernel_switches", "int4_": "miles_int4.kernel_switches"}
    owner = next((module for prefix, module in owners.items() if name.startswith(prefix)), None)
    if owner is None:
        switches.host_switches()
    else:
        importlib.import_module(owner)


def _switch_value(raw: str):
    """A switch value as given on the command line: a count or a choice."""
    return int(raw) if raw.lstrip("-").isdigit() else raw


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3_30b", help="comma list of " + ", ".join(SHAPES))
    parser.add_argument("--precisions", default="bf16,fp8,int4")
    parser.add_argument("--kernels", default="loop,fused", help="--moe-kernel values to run (loop: bf16 only "
                        "unless --loop-all)")
    parser.add_argument("--loop-all", action="store_true", help="the loop baseline for fp8/int4 too")
    parser.add_argument("--routers", default="fused", help="MoE routers of the fused kernel's cases: fused (one "
                        "launch, decode batches) and/or torch (the eager router + plan), comma list")
    parser.add_argument("--router-timing", action="store_true", help="graph-time one MoE block per --shapes with "
                        "the fused and the eager router instead of the engine benchmark")
    parser.add_argument("--router-tokens", default="1,8,32,64,128")
    parser.add_argument("--batches", default="1,32,128,256")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers of every --shapes shape (0: the "
                        "shape's own; e.g. 2 to fit the DeepSeek-V3 shape's bf16 experts on an 80 GB GPU)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-seqs", type=int, default=16)
    parser.add_argument("--prefill-len", default="1024", help="prompt length of the prefill cases, comma list")
    parser.add_argument("--prefill-switch", default=None, metavar="NAME=V1,V2",
                        help="time each prefill case once per value of this kernel switch, in the same engine "
                        "(e.g. mla_prefill=absorbed,expanded)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mem-fraction", type=float, default=0.85)
    decode_launches.add_arguments(parser)
    parser.add_argument("--switch", action="append", default=[], metavar="NAME=VALUE",
                        help="set a kernel switch for every case (repeatable; e.g. int4_moe_gemv_tokens=0)")
    parser.add_argument("--compare-eager-sampling", action="store_true",
                        help="each decode batch also with the sampling graphs off (the eager sampler), same engine")
    parser.add_argument("--host-profile-batch", type=int, default=0,
                        help="host time per decode step at this batch, by Python function (cProfile)")
    parser.add_argument("--profile-batch", type=int, default=0, help="GPU kernel time per token at this batch "
                        "(torch.profiler, after the timed cases)")
    parser.add_argument("--profile-top", type=int, default=10, help="kernels listed by --profile-batch")
    parser.add_argument("--sweep", action="store_true", help="tile sweep instead of the engine benchmark")
    parser.add_argument("--sweep-shape", default="qwen3_30b")
    parser.add_argument("--sweep-precision", default="bf16")
    parser.add_argument("--sweep-tokens", default="1,32,128,256,1024,8192")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shape, float32")
    parser.add_argument("--train", action="store_true", help="also run bench/moe_train.py (training half) if present")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.sweep_tokens = [int(t) for t in args.sweep_tokens.split(",")]
    args.router_tokens = [int(t) for t in args.router_tokens.split(",")]
    args.prefill_len = [int(n) for n in str(args.prefill_len).split(",")]
    if args.prefill_switch:
        name, _, values = args.prefill_switch.partition("=")
        if not values:
            parser.error(f"--prefill-switch {args.prefill_switch!r}: expected NAME=V1,V2 (e.g. mla_prefill=absorbed,expanded)")
        args.prefill_switch = (name, values.split(","))
    if args.tiny:
        tiny = {"qwen3_30b": "tiny", "dsv3": "tiny_dsv3"}
        args.shapes = ",".join(tiny.get(shape, shape) for shape in args.shapes.split(","))
        args.batches, args.prompt_len, args.new_tokens = [1, 4], 8, 12  # decode time well above the first token's
        args.prefill_seqs, args.prefill_len, args.repeats = 2, [16], 1
    if args.layers:
        for shape in args.shapes.split(","):
            SHAPES[shape] = {**SHAPES[shape], "num_hidden_layers": args.layers}
            print(f"{shape}: {args.layers} decoder layers")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from miles_host.kernels import switches

    decode_launches.apply(args)
    for setting in args.switch:  # plugins declare their switches on import
        name, _, raw = setting.partition("=")
        _import_switch_owner(name)
        switches.setVALUES(**{name: _switch_value(raw)})
        print(f"kernel switch {name} = {switches.value(switches.declared(name))}")
    if args.prefill_switch:
        name, values = args.prefill_switch
        _import_switch_owner(name)
        args.prefill_switch = (name, [switches.declared(name).check(_switch_value(raw)) for raw in values])
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.sweep:
        result = sweep(args, dtype, device)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    if args.router_timing:
        if device != "cuda":
            print("--router-timing graph-times on CUDA; no GPU here")
            return 1
        result = router_timing(args, dtype, device)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    rows, failures = [], []
    for shape in args.shapes.split(","):
        for precision in args.precisions.split(","):
            for kernel in args.kernels.split(","):
                if kernel == "loop" and precision != "bf16" and not args.loop_all:
                    continue
                for router in args.routers.split(",") if kernel == "fused" else ["fused"]:
                    try:
                        rows.extend(bench_engine(shape, precision, kernel, args, dtype, device, router))
                    except Exception as error:  # noqa: BLE001 - report, go on with the others
                        traceback.print_exc()
                        failures.append(f"{shape}/{precision}/{kernel_label(kernel, router)}: "
                                        f"{type(error).__name__}: {error}")
                        free_memory(device)
    print("\n| shape | precision | kernel | case | tok/s | bound tok/s | of bound | vs loop |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        loop = next((r for r in rows if r["shape"] == row["shape"] and r["precision"] == "bf16"
                     and r["kernel"] == "loop" and r["case"] == row["case"]), None)
        speedup = f"{row['tok_s'] / loop['tok_s']:.2f}x" if loop and not math.isnan(loop["tok_s"]) else "-"
        print(f"| {row['shape']} | {row['precision']} | {row['kernel']} | {row['case']} | {row['tok_s']:,.0f} | "
              f"{row['bound_tok_s']:,.0f} | {row['fraction']:.1%} | {speedup} |")
    for failure in failures:
        print("FAILED", failure)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.train:
        train = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_train.py")
        if os.path.exists(train):
            import runpy

            runpy.run_path(train, run_name="__main__")
        else:
            print("bench/moe_train.py (the training half) is not here")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
