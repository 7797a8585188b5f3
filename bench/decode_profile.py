"""Decode-step measurements the decode benchmarks share: one checked ``generate`` call, the GPU
kernel time per token by kernel (torch profiler) and the host time per step by Python
function (cProfile)."""

from __future__ import annotations

import time

import torch


def generate(engine, prompts: list[list[int]], new_tokens: int) -> int:
    """Completion tokens of one ``generate`` call; raises when a request was rejected or cut short."""
    sampling = [{"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True} for _ in prompts]
    results = engine.generate(prompts, sampling)
    tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    if tokens != len(prompts) * new_tokens:
        reasons = {str(r["meta_info"].get("finish_reason")) for r in results}
        raise RuntimeError(f"expected {len(prompts) * new_tokens} completion tokens, got {tokens}: {reasons}")
    return tokens


def profile_decode(engine, prompts: list[list[int]], new_tokens: int, label: str, top: int = 25) -> None:
    """GPU kernel time per decode step, by kernel (torch.profiler over one generate of the first batch)."""
    from torch.profiler import ProfilerActivity, profile

    generate(engine, prompts, new_tokens)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate(engine, prompts, new_tokens)
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time)
    total = sum(sum(times) for times in kernels.values())
    print(f"[{label}] profile, batch {len(prompts)}: {total / 1e3:.2f} ms of GPU kernels over {new_tokens} tokens "
          f"({total / new_tokens:.1f} us per token); top kernels (us per token, calls per token):", flush=True)
    ranked = sorted(kernels.items(), key=lambda item: -sum(item[1]))
    for name, times in ranked[:top]:
        print(f"[{label}]   {sum(times) / new_tokens:8.1f} {len(times) / new_tokens:6.1f}  {name[:110]}", flush=True)


def host_profile_decode(engine, prompts: list[list[int]], new_tokens: int, label: str, top: int = 30) -> None:
    """Host time of a decode step, by Python function (cProfile over one generate): a step
    whose host work outlasts its GPU work leaves the GPU waiting between graph replays; the
    time spent waiting for the GPU's results says how much of the step the GPU set."""
    import cProfile
    import io
    import pstats

    generate(engine, prompts, new_tokens)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    generate(engine, prompts, new_tokens)
    profiler.disable()
    wall = time.perf_counter() - start
    print(f"[{label}] host profile, batch {len(prompts)}: {wall / new_tokens * 1e6:.1f} us per token of wall time "
          "(under cProfile)", flush=True)
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(top)
        print(f"[{label}] by {order}:\n" + text.getvalue().split("ncalls", 1)[-1][:6000], flush=True)
