"""Compile a Triton kernel of this repository for sm_90 here (no GPU) and count its machine code.

    python scripts/sass_stats.py int4-gemv               # the INT4 one-token GEMV, default tile
    python scripts/sass_stats.py int4-gemv --block-n 128 --warps 8
    python scripts/sass_stats.py int4-mma fp8-act-quant  # several presets
    python scripts/sass_stats.py int4-gemv --dump out.sass

For each preset: registers, stack and shared memory per thread block (``cuobjdump -res-usage``)
and, for every loop of the SASS (a backward branch), its instruction count and the most common
opcodes, with the weights (or elements) one thread handles per iteration when the preset knows
them: instructions per weight is what bounds a memory-bound kernel's issue rate (an H200 SM
issues 4 warp instructions per clock and must take ~18 bytes per clock from HBM). Uses Triton's
bundled ``ptxas`` and ``cuobjdump``; the numbers are the compiler's, not a measurement.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, *sorted((ROOT / "plugins").glob("*"))):
    sys.path.insert(0, str(path))


@dataclass
class Preset:
    """A kernel and the launch it is compiled for (every argument 16-divisible but ``unaligned``)."""

    module: str
    kernel: str
    signature: dict
    constexprs: dict
    num_warps: int
    num_stages: int
    unaligned: tuple = ()
    #: weights (or elements) one thread handles per loop iteration, for the per-weight figure
    per_thread: int | None = None
    notes: list = field(default_factory=list)


def presets(block_n: int | None = None, warps: int | None = None) -> dict[str, Preset]:
    from miles_int4 import decode_gemm

    gemv_n, gemv_warps = block_n or decode_gemm.GEMV_BLOCK_N, warps or decode_gemm.GEMV_WARPS
    mma = decode_gemm.small_m_config(1)
    int4_signature = {"x_ptr": "*bf16", "s_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "sem_ptr": "*i32"}
    return {
        "int4-gemv": Preset(
            "miles_int4.decode_gemm", "_int4_gemv_kernel",
            {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32",
             "sem_ptr": "*i32", "N": "i32", "stride_tile": "i32", "stride_row": "i32",
             "stride_group": "i32", "stride_sn": "i32"},
            dict(GROUPS_PER_SPLIT=8, SPLIT_K=4, REDUCE_IN_KERNEL=True, EMULATE=False, EVEN_N=True,
                 BLOCK_N=gemv_n, GROUP=128, HALF=64, TILE=128),
            gemv_warps, 3, per_thread=gemv_n * 128 // (32 * gemv_warps),
        ),
        "int4-mma": Preset(
            "miles_int4.decode_gemm", "_int4_small_m_kernel",
            {"x_ptr": "*bf16", "w_ptr": "*u8", **{k: v for k, v in int4_signature.items() if k != "x_ptr"},
             "M": "i32", "N": "i32", "stride_xm": "i32", "stride_tile": "i32", "stride_row": "i32",
             "stride_group": "i32", "stride_sn": "i32", "stride_ym": "i32"},
            dict(GROUPS_PER_SPLIT=4, SPLIT_K=8, REDUCE_IN_KERNEL=True, EMULATE=False, EVEN_N=True,
                 BLOCK_M=mma.block_m, BLOCK_N=block_n or mma.block_n, GROUP=128, HALF=64, TILE=128),
            warps or mma.num_warps, mma.num_stages, unaligned=("M",),
            per_thread=(block_n or mma.block_n) * 128 // (32 * (warps or mma.num_warps)),
        ),
        "fp8-act-quant": Preset(
            "miles_fp8.triton_kernels", "_quantize_act_kernel",
            {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "rows": "i32", "stride_xm": "i32",
             "stride_qm": "i32", "stride_sm": "i32"},
            dict(POW2=False, GROUP=128, BLOCK_R=32, EMULATE=False), 4, 1, unaligned=("rows",),
            per_thread=32 * 128 // 128,
        ),
    }


def _tools() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_cubin(preset: Preset) -> bytes:
    """The sm_90 cubin of a preset (Triton's compiler and bundled ptxas)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(preset.module), preset.kernel)
    names = list(preset.signature)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name not in preset.unaligned}
    signature = {**preset.signature, **{name: "constexpr" for name in preset.constexprs}}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=preset.constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": preset.num_warps, "num_stages": preset.num_stages})
    return compiled.asm["cubin"]


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        return subprocess.run([str(_tools() / "cuobjdump"), *flags, handle.name], capture_output=True, text=True,
                              check=True).stdout


def resources(cubin: bytes) -> dict[str, int]:
    """Registers, stack, shared and local memory of the kernel (``cuobjdump -res-usage``)."""
    text = _cuobjdump(cubin, "-res-usage")
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def loops(sass: str) -> list[tuple[int, int, collections.Counter]]:
    """``(start, end, opcode counts)`` of each loop: the instructions from a backward branch's target to it."""
    instructions = [(int(address, 16), text) for address, text in
                    re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    found = []
    for address, text in instructions:
        branch = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            body = [t for a, t in instructions if start <= a <= address]
            opcodes = collections.Counter(re.sub(r"^@!?U?P[T\d]+\s+", "", t).split()[0].split(".")[0] for t in body)
            found.append((start, address, opcodes))
    return found


def report(name: str, preset: Preset, dump: str | None = None) -> str:
    cubin = compile_cubin(preset)
    sass = _cuobjdump(cubin, "-sass")
    if dump:
        Path(dump).write_text(sass)
    usage = resources(cubin)
    lines = [f"{name}: {preset.module}.{preset.kernel}, {preset.num_warps} warps, constexprs {preset.constexprs}",
             f"  registers {usage.get('REG')}, stack {usage.get('STACK')}, shared {usage.get('SHARED')} bytes, "
             f"local {usage.get('LOCAL')}"]
    for start, end, opcodes in loops(sass):
        count = sum(opcodes.values())
        per = f", {count / preset.per_thread:.2f} per weight/element ({preset.per_thread} per thread)" \
            if preset.per_thread else ""
        top = ", ".join(f"{op} {n}" for op, n in opcodes.most_common(12))
        lines.append(f"  loop {start:#06x}-{end:#06x}: {count} instructions{per}: {top}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("presets", nargs="+", help="int4-gemv, int4-mma, fp8-act-quant")
    parser.add_argument("--block-n", type=int, default=None, help="rows per program (int4 presets)")
    parser.add_argument("--warps", type=int, default=None)
    parser.add_argument("--dump", help="also write the (last) preset's SASS here")
    args = parser.parse_args(argv)
    table = presets(args.block_n, args.warps)
    unknown = [name for name in args.presets if name not in table]
    if unknown:
        parser.error(f"unknown preset(s) {unknown}; choose from {sorted(table)}")
    for name in args.presets:
        print(report(name, table[name], args.dump))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
