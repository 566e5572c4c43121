"""tuning/fabric_probe.py's kernels compile on the CPU for sm_90 and read the way their names
say: 16-byte global loads (`lsu`) and TMA boxes (`tma`, `weight` in both layouts).

Compiled in a child process: importing Triton here (without TRITON_INTERPRET) would fix its
mode for the whole session, and tests/test_peer_triton.py runs the peer in the interpreter."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

ROOT = Path(__file__).resolve().parents[1]

COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tuning import fabric_probe as fp


def ptx(fn, signature, constexprs):
    # pointers 16-byte aligned, as Triton specializes them at launch on the GPU
    aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind.startswith("*")}
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    src = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]


box = {"desc": "tensordesc<i32[128, 32]>", "out": "*i32"}
out = {
    "lsu": ptx(fp._read_lsu, {"src": "*i32", "out": "*i32"}, {"SLICE_WORDS": fp.SLICE // 4, "SHARE": 2, "BLOCK": 8192}),
    "tma": ptx(fp._read_tma, box, {"BLOCKS": 12, "SHARE": 1, "BOX_ROWS": 128, "BOX_WORDS": 32}),
    "weight": ptx(fp._read_weight, box, {"BLOCKS": 12, "SHARE": 2, "BLOCKED": False, "STAGES": 10}),
    "weight_blocked": ptx(fp._read_weight, box, {"BLOCKS": 12, "SHARE": 2, "BLOCKED": True, "STAGES": 10}),
}
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def probe_ptx() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_lsu_reader_uses_16_byte_loads(probe_ptx):
    assert "ld.global.v4" in probe_ptx["lsu"] and "cp.async.bulk" not in probe_ptx["lsu"]


@pytest.mark.parametrize("reader", ["tma", "weight", "weight_blocked"])
def test_box_readers_use_tma(probe_ptx, reader):
    assert "cp.async.bulk.tensor.2d" in probe_ptx[reader]
