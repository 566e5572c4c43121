"""tuning/wgmma_pace.py compiles on the CPU for sm_90a, and its RS variant is what it says: e4m3
WGMMAs whose A operand is registers filled by ldmatrix from the swizzled K-major tile."""
import os
import re

import pytest

pytest.importorskip("cutlass")


def _ptx(variant, tmp_path) -> str:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    os.makedirs(tmp_path, exist_ok=True)
    cute.compile(variant, make_fake_compact_tensor(cutlass.Int64, (4,), assumed_align=16),
                 options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}")
    (ptx,) = [f for f in os.listdir(tmp_path) if f.endswith(".ptx")]
    return open(os.path.join(tmp_path, ptx)).read()


@pytest.mark.parametrize("a_in_registers", [False, True])
def test_wgmma_pace_compiles_both_operand_sources(a_in_registers, tmp_path):
    from tuning.wgmma_pace import BLOCKS, WgmmaPace

    ptx = _ptx(WgmmaPace(16, a_in_registers, writers=True), tmp_path)
    wgmmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n16k32\.f32\.e4m3\.e4m3 \{[^}]*\}, (\{[^}]*\}|%rd\d+)",
                        ptx)
    assert len(wgmmas) == BLOCKS * 8  # 2 m64 halves x 4 k32 slices a block, unrolled
    register_a = [a for a in wgmmas if a.startswith("{")]
    assert len(register_a) == (len(wgmmas) if a_in_registers else 0)
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == (BLOCKS * 8 if a_in_registers else 0)
    assert "wgmma.wait_group.sync.aligned 1;" in " ".join(ptx.split())
