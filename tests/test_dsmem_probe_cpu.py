"""tuning/dsmem_probe.py compiles on the CPU for sm_90a, and each way of sending is what it
says: per-thread st.async with byte completion, one bulk CTA-to-cluster copy, 16-byte global
stores read back from L2, or remote arrivals alone."""
import os

import pytest

pytest.importorskip("cutlass")


def _ptx(probe, tmp_path) -> str:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    os.makedirs(tmp_path, exist_ok=True)
    scratch = make_fake_compact_tensor(cutlass.Int32, (2, probe.values // 4, 128, 4), assumed_align=16)
    cute.compile(probe, make_fake_compact_tensor(cutlass.Int64, (2, 3), assumed_align=16), scratch, 2,
                 options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}")
    (ptx,) = [f for f in os.listdir(tmp_path) if f.endswith(".ptx")]
    return " ".join(open(os.path.join(tmp_path, ptx)).read().split())


@pytest.mark.parametrize("method", ["st_async", "bulk", "global", "remote_arrive"])
def test_dsmem_probe_sends_as_named(method, tmp_path):
    from tuning.dsmem_probe import DsmemProbe

    ptx = _ptx(DsmemProbe(method, 8 * 1024), tmp_path)
    st_async = ptx.count("st.async")
    bulk = ptx.count("cp.async.bulk.shared::cluster.shared::cta")
    l2 = ptx.count("ld.global.cg.v4.b32")
    assert (st_async > 0, bulk > 0, l2 > 0) == {"st_async": (True, False, False), "bulk": (False, True, False),
                                                "global": (False, False, True),
                                                "remote_arrive": (False, False, False)}[method]
    assert "mapa" in ptx and "barrier.cluster.arrive" in ptx
