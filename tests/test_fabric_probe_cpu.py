"""tuning/fabric_probe.py's kernels compile on the CPU for sm_90 and read the way their names
say: 16-byte global loads (`lsu`) and TMA boxes (`tma`, `weight` in both layouts)."""
import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tuning import fabric_probe as fp  # noqa: E402


def _ptx(fn, signature: dict, constexprs: dict) -> str:
    # pointers 16-byte aligned, as Triton specializes them at launch on the GPU
    aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind.startswith("*")}
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    kernel = triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs, attrs=aligned),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    return kernel.asm["ptx"]


def test_lsu_reader_uses_16_byte_loads():
    ptx = _ptx(fp._read_lsu, {"src": "*i32", "out": "*i32"}, {"SLICE_WORDS": fp.SLICE // 4, "SHARE": 2, "BLOCK": 8192})
    assert "ld.global.v4" in ptx and "cp.async.bulk" not in ptx


@pytest.mark.parametrize("blocked", [False, True])
def test_weight_reader_uses_tma_boxes(blocked):
    ptx = _ptx(fp._read_weight, {"desc": "tensordesc<i32[128, 32]>", "out": "*i32"},
               {"BLOCKS": 12, "SHARE": 2, "BLOCKED": blocked, "STAGES": 10})
    assert "cp.async.bulk.tensor.2d" in ptx


def test_tma_reader_uses_tma_boxes():
    ptx = _ptx(fp._read_tma, {"desc": "tensordesc<i32[128, 32]>", "out": "*i32"},
               {"BLOCKS": 12, "SHARE": 1, "BOX_ROWS": 128, "BOX_WORDS": 32})
    assert "cp.async.bulk.tensor.2d" in ptx
