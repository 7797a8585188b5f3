"""Sweep the launches of the one-pair expert GEMV (``--moe-gemv-tokens``) on a decode step's shapes.

One token routed to its top-k experts: the gate_up GEMV (gate and up rows, SiLU-and-mul), the down
GEMV and the down GEMV with the top-k sum (``down_combine``, :func:`moe_gemv_combine`), each with every :class:`~miles_host.kernels.moe_configs.GemvLaunch` of
:data:`~miles_host.kernels.moe_configs.SWEEP_GEMV`, inside one CUDA graph of ``--calls`` launches whose
routings choose disjoint experts (no call reads weights an earlier one left in the L2, as the layers of a
decode step), replayed (:func:`bench.small_m.graph_seconds`, the median of ``--replays``). The figure is
microseconds per launch and expert bytes read per second; the default launch
(:data:`~miles_host.kernels.moe_configs.GEMV_LAUNCHES`) is marked. Every candidate's output is checked
against a float64 GEMV first.

    python -m bench.moe_gemv_sweep --shapes qwen3,dsv3
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from bench.small_m import graph_seconds, write_rows

#: name -> (experts, hidden, moe intermediate, top-k)
SHAPES = {"qwen3": (128, 2048, 768, 8), "dsv3": (256, 7168, 2048, 8), "tiny": (8, 256, 128, 2)}


def routings(num_experts: int, top_k: int, calls: int, device):
    """``calls`` one-token routings over disjoint expert sets (wrapping once the experts run out)."""
    from miles_host.kernels.moe_grouped import route

    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(0))
    result = []
    for call in range(calls):
        ids = order[(call * top_k + torch.arange(top_k)) % num_experts].sort().values
        result.append(route(ids.view(1, top_k).to(device), torch.full((1, top_k), 1.0 / top_k, device=device),
                            num_experts, 16))
    return result


def reference(x: torch.Tensor, w_ENK: torch.Tensor, ids: list[int], gated: bool) -> torch.Tensor:
    """The float64 rows of one routing's pairs (gate_up: SiLU(gate) * up)."""
    rows = []
    for slot, expert in enumerate(ids):
        a = (x[0] if x.shape[0] == 1 else x[slot]).double()
        y = w_ENK[expert].double() @ a
        if gated:
            gate, up = y.chunk(2)
            y = torch.nn.functional.silu(gate) * up
        rows.append(y)
    return torch.stack(rows)


def sweep(name: str, calls: int, replays: int, device: torch.device) -> list[dict]:
    from miles_host.kernels import _moe_grouped_triton
    from miles_host.kernels.moe_configs import GEMV_LAUNCHES, SWEEP_GEMV, GemvLaunch

    num_experts, hidden, inter, top_k = SHAPES[name]
    generator = torch.Generator(device=device).manual_seed(0)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16, generator=generator)
    down = torch.randn(num_experts, hidden, inter, device=device, dtype=torch.bfloat16, generator=generator)
    gate_up.mul_(hidden ** -0.5)
    down.mul_(inter ** -0.5)
    plans = routings(num_experts, top_k, calls, device)
    rows = plans[0].row_token_R.shape[0]
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16, generator=generator)
    act = torch.randn(rows, inter, device=device, dtype=torch.bfloat16, generator=generator)
    projections = {  # name -> (input, weights, output columns, gather, activation, bytes per launch)
        "gate_up": (x, gate_up, inter, True, "silu", top_k * 2 * inter * hidden * 2),
        "down": (act, down, hidden, False, None, top_k * hidden * inter * 2),
        "down_combine": (act, down, hidden, False, None, top_k * hidden * inter * 2),
    }
    results = []
    for projection, (a, w, n, gather, activation, nbytes) in projections.items():
        combined = projection == "down_combine"
        out = torch.empty(1 if combined else rows, n, device=device, dtype=torch.bfloat16)
        ids = plans[0].block_expert_B  # the expert of each padded row's block
        pair_rows = plans[0].pair_row_TK[0].tolist()
        experts = [int(ids[row // plans[0].block_m]) for row in pair_rows]
        inputs = a if gather else a[pair_rows]
        expected = reference(inputs, w, experts, activation is not None)
        if combined:  # the gate-weighted sum of the rows
            expected = (plans[0].weights_TK[0].double()[:, None] * expected).sum(0, keepdim=True)

        def launch_once(plan, launch):
            if combined:
                _moe_grouped_triton.moe_gemv_combine(a, plan, w, out, launch)
            else:
                _moe_grouped_triton.moe_gemv(a, plan, w, out, gather, activation, launch)

        default = GEMV_LAUNCHES[projection]
        candidates = [("default", default)] + [
            (f"n{n_} k{k_} w{w_}", GemvLaunch(n_, k_, w_)) for n_, k_, w_ in SWEEP_GEMV
            if (w.shape[2] % k_ == 0) and GemvLaunch(n_, k_, w_) != default]
        for label, launch in candidates:
            try:
                launch_once(plans[0], launch)
                got = out.double() if combined else out[pair_rows].double()
                error = (got - expected).abs().max().item() / expected.abs().max().item()
                if error > 2e-2:
                    print(f"{name} {projection} {label}: WRONG (relative error {error:.3g})", flush=True)
                    continue
                seconds = graph_seconds(lambda: [launch_once(plan, launch) for plan in plans], device,
                                        replays) / calls
                results.append(dict(shape=name, projection=projection, launch=label, us=seconds * 1e6,
                                    tb_s=nbytes / seconds / 1e12, fields=dataclasses.asdict(launch)))
                print(f"  {name} {projection} {label}: {seconds * 1e6:.2f} us", flush=True)  # as measured
            except Exception as error:  # noqa: BLE001 - a candidate that does not build is reported, skipped
                print(f"{name} {projection} {label}: failed: {str(error).splitlines()[0][:160]}", flush=True)
    return results


def fastest_launches(path: str, shape: str = "qwen3") -> dict:
    """``{projection: GemvLaunch}``: the fastest launch of each projection of ``shape`` in a ``--json``
    file (for :data:`~miles_host.kernels.moe_configs.GEMV_LAUNCHES`, as ``bench/moe.py --gemv-table``)."""
    from miles_host.kernels.moe_configs import GemvLaunch

    with open(path) as f:
        rows = [row for row in json.load(f) if row["shape"] == shape]
    table = {}
    for projection in dict.fromkeys(row["projection"] for row in rows):
        best = min((row for row in rows if row["projection"] == projection), key=lambda row: row["us"])
        table[projection] = GemvLaunch(**best["fields"])
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3", help=f"comma separated, of {', '.join(SHAPES)}")
    parser.add_argument("--calls", type=int, default=16, help="launches per graph (disjoint experts)")
    parser.add_argument("--replays", type=int, default=30, help="timed replays (their median)")
    parser.add_argument("--top", type=int, default=8, help="launches printed per projection, fastest first")
    parser.add_argument("--device", default="cuda", help="cpu: the Triton interpreter (TRITON_INTERPRET=1; the tiny shape)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for name in args.shapes.split(","):
        found = sweep(name, args.calls, args.replays, torch.device(args.device))
        for projection in ("gate_up", "down", "down_combine"):
            ranked = sorted((r for r in found if r["projection"] == projection), key=lambda r: r["us"])
            shown = ranked[:args.top] + [r for r in ranked[args.top:] if r["launch"] == "default"]
            for r in shown:
                print(f"{name} {projection:<8} {r['launch']:<14} {r['us']:7.2f} us  {r['tb_s']:5.2f} TB/s", flush=True)
        rows += found
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
