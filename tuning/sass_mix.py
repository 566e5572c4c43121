"""The shared epilogue's SASS instruction mix a value, on the CPU (no GPU): `python -m
tuning.sass_mix [--lanes 4] [--units 2]`. Compiles kernels/row_epilogue.py (which runs
kernels/epilogue.py's code alone, one (row, head) unit of 128 / lanes values a lane) for
each numerics case and counts the instructions of the cubin the DSL built (its own ptxas,
as on the GPU machines) by opcode, divided by the values a lane finishes: the count that
the epilogue's cost follows (the row epilogue is issue-bound, `ncu_sm90_2026-12-02_s16.md`).
cuobjdump comes from PATH or from Triton's bundled CUDA tools."""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import tempfile

CASES = (("mxfp4", True), ("mxfp4", False), ("fp8", True), ("bf16", True), ("bf16", False))


def cuda_tool(name: str) -> str | None:
    """`name` on PATH, else in Triton's bundled CUDA binaries, else None."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import triton

        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
        return path if os.path.exists(path) else None
    except ImportError:
        return None


def opcode_counts(sass: str) -> collections.Counter:
    """Instructions of a cuobjdump -sass listing by opcode (predicates and modifiers dropped)."""
    ops = collections.Counter()
    for line in sass.splitlines():
        line = line.strip()
        if not line.startswith("/*") or "*/" not in line:
            continue
        words = line.split("*/", 1)[1].strip().rstrip(";").split()
        if words and words[0].startswith("@"):
            words = words[1:]
        if words and not words[0].startswith("/*"):
            ops[words[0].split(".")[0].rstrip(";")] += 1
    return ops


def cubin_sass(cubin: str) -> str:
    """cuobjdump's SASS listing of a cubin."""
    return subprocess.run([cuda_tool("cuobjdump"), "-sass", cubin], check=True, capture_output=True,
                          text=True).stdout


def cubin_resources(cubin: str) -> dict:
    """The one kernel's registers, stack and local memory (cuobjdump -res-usage) and the
    local loads and stores (spills) in its SASS."""
    usage = subprocess.run([cuda_tool("cuobjdump"), "-res-usage", cubin], check=True, capture_output=True,
                           text=True).stdout
    found = re.findall(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    assert len(found) == 1, usage
    regs, stack, local = (int(v) for v in found[0])
    spills = len(re.findall(r"\b(?:STL|LDL)\b", cubin_sass(cubin)))
    return dict(regs=regs, stack=stack, local=local, spills=spills)


def mix(out_format: str, hadamard: bool, lanes: int, units: int, arch: str = "sm_90a") -> tuple[int, dict]:
    """(instructions, {opcode: count a value}) of the row epilogue for these numerics."""
    from indexer_q import jit
    from indexer_q.kernels.gemm_base import GemmConfig

    with tempfile.TemporaryDirectory() as d:
        ck = jit.compile_row_epilogue(GemmConfig(arch=arch, out_format=out_format, hadamard=hadamard), 8192,
                                      lanes_per_row=lanes, units_per_group=units, keep_dir=d)
        sass = cubin_sass(ck.artifacts["cubin"])
    ops = opcode_counts(sass)
    values = 128 // lanes * units
    return sum(ops.values()), {op: n / values for op, n in ops.most_common()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--units", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ.setdefault("INDEXER_Q_DISK_CACHE", "0")
    for out_format, hadamard in CASES:
        total, per_value = mix(out_format, hadamard, args.lanes, args.units)
        values = 128 // args.lanes * args.units
        top = " ".join(f"{op} {v:.2f}" for op, v in list(per_value.items())[:14])
        print(f"{out_format:6s} hadamard={hadamard!s:5s} {total / values:6.2f} a value: {top}")


if __name__ == "__main__":
    main()
