"""CPU-only: every kernel compiles for its arch without a GPU, and the PTX holds the
instructions we mean (CI runs this; it is the only check sm_100a gets here)."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from indexer_q import dispatch, jit
from indexer_q.kernels.gemm_base import GemmConfig

WGMMA_E4M3 = "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"


def _ptx(ck) -> str:
    with open(ck.artifacts["ptx"]) as f:
        return f.read()


def _ptxas_report(ck, arch: str) -> str:
    """ptxas -v's resource report for the kernel's PTX; skips when this ptxas is older
    than the PTX ISA the DSL emits (it cannot judge registers or spills then)."""
    p = subprocess.run(["ptxas", f"-arch={arch}", "-v", ck.artifacts["ptx"], "-o", "/dev/null"],
                       capture_output=True, text=True)
    if p.returncode and "Unsupported .version" in p.stderr:
        pytest.skip(f"ptxas too old for this PTX: {p.stderr.strip()[:120]}")
    assert p.returncode == 0, p.stderr
    return p.stderr


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_act_quant_compiles(arch, tmp_path):
    ck = jit.compile_act_quant(arch, keep_dir=str(tmp_path))
    ptx = _ptx(ck)
    assert f".target {arch}" in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx


SM90_EPILOGUES = [(64, 1, False), (128, 1, False), (64, 2, False), (128, 2, False), (64, 1, True), (128, 1, True)]


@pytest.mark.parametrize("tile_m,epilogue_warpgroups,tensor_core_hadamard", SM90_EPILOGUES)
@pytest.mark.parametrize("out_format,hadamard", [("mxfp4", True), ("fp8", False), ("fp8", True)])
def test_sm90_fused_compiles_to_wgmma_e4m3(tile_m, epilogue_warpgroups, tensor_core_hadamard, out_format, hadamard,
                                           tmp_path):
    if out_format == "fp8" and hadamard and not tensor_core_hadamard:
        pytest.skip("the butterfly epilogue's FP8 code differs from mxfp4's only after the Hadamard")
    if tensor_core_hadamard and not hadamard:
        pytest.skip("without the Hadamard the knob builds the plain kernel")
    cfg = GemmConfig(arch="sm_90a", tile_m=tile_m, out_format=out_format, hadamard=hadamard,
                     epilogue_warpgroups=epilogue_warpgroups, tensor_core_hadamard=tensor_core_hadamard)
    ck = jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path))
    ptx = _ptx(ck)
    assert ".target sm_90a" in ptx
    assert WGMMA_E4M3 in ptx
    assert "setmaxnreg" in ptx  # warp-specialized register split
    if shutil.which("ptxas"):  # the resource report
        rep = _ptxas_report(ck, "sm_90a")
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", rep)]
        assert spills and max(spills) == 0, rep  # no spills, ever
        # setmaxnreg only moves registers inside the CTA's launch allocation (the entry
        # register count ptxas picked x threads); a larger split hangs the kernel.
        from indexer_q.kernels.gemm_sm90 import WARPGROUP, Sm90FusedIndexerQ

        k = Sm90FusedIndexerQ(cfg)
        entry = int(re.findall(r"Used (\d+) registers", rep)[-1])
        split = WARPGROUP * (k.producer_regs + k.num_consumers * k.consumer_regs + k.epi_wgs * k.epilogue_regs)
        assert split <= entry * k.threads, f"setmaxnreg split {split} > {entry} x {k.threads}"
        # .dec may only lower a warp's count and .inc only raise it (else: illegal instruction)
        for kind, regs in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx):
            assert (int(regs) <= entry) if kind == "dec" else (int(regs) >= entry), (kind, regs, entry)
    if cfg.uses_tensor_core_hadamard:  # the Hadamard's bf16 WGMMAs, A from registers
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16 \{[^}]*\}, \{", ptx)


@pytest.mark.skipif(not shutil.which("ptxas"), reason="needs ptxas")
def test_sm90_pipelined_promotion_keeps_one_wgmma_group_in_flight(tmp_path):
    """The pipelined mainloop waits for all but the newest WGMMA group before promoting,
    and ptxas does not serialize the WGMMAs (C7514) or spill."""
    cfg = GemmConfig(arch="sm_90a", tile_m=64, pipelined_promotion=True, hadamard=True)
    ck = jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path))
    ptx = _ptx(ck)
    assert ptx.count(WGMMA_E4M3) == 12 * 4  # every K block's WGMMAs, unrolled
    assert "wgmma.wait_group.sync.aligned 1;" in " ".join(ptx.split())
    rep = _ptxas_report(ck, "sm_90a")
    assert "C7514" not in rep, rep
    assert max(int(x) for x in re.findall(r"(\d+) bytes spill stores", rep)) == 0, rep


def _role_regions(ptx: str) -> dict:
    """The kernel's PTX cut at each setmaxnreg, keyed by the register count it sets (each
    warp role's code follows its own setmaxnreg)."""
    parts = re.split(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx)
    return {int(regs): code for regs, code in zip(parts[1::2], parts[2::2])}


@pytest.mark.parametrize("tile_m,epilogue_warpgroups,split_k", [(128, 1, 1), (64, 2, 1), (64, 2, 4)])
def test_sm90_pdl_waits_for_the_activation_quantizer(tile_m, epilogue_warpgroups, split_k, tmp_path):
    """PDL: the quantizer lets the GEMM launch early. In the GEMM, the producer issues
    only the first tile's weight blocks (one a stage; none in a K split) before
    griddepcontrol.wait, and the consumers (activation scales) and the epilogue
    (positions, cos/sin) load nothing from global memory before theirs. pdl=False has no
    wait."""
    from indexer_q.kernels.gemm_sm90 import Sm90FusedIndexerQ

    aq = _ptx(jit.compile_act_quant("sm_90a", keep_dir=str(tmp_path / "aq")))
    assert "griddepcontrol.launch_dependents;" in aq
    for pdl in (True, False):
        cfg = GemmConfig(arch="sm_90a", tile_m=tile_m, epilogue_warpgroups=epilogue_warpgroups,
                         split_k=split_k, pdl=pdl)
        ptx = _ptx(jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path / str(pdl))))
        if not pdl:
            assert "griddepcontrol.wait;" not in ptx
            continue
        k = Sm90FusedIndexerQ(cfg)
        regions = _role_regions(ptx)
        roles = {"producer": k.producer_regs, "consumer": k.consumer_regs, "epilogue": k.epilogue_regs}
        assert len(set(roles.values())) == 3 and set(roles.values()) <= set(regions), (roles, list(regions))
        for role, regs in roles.items():
            code = regions[regs]
            assert "griddepcontrol.wait;" in code, role
            before = code.split("griddepcontrol.wait;")[0]  # (ptxas may duplicate a path)
            if role == "producer":
                early = 0 if split_k > 1 else min(k.stages, 1536 // 128)
                assert before.count("cp.async.bulk.tensor") == early, before.count("cp.async.bulk.tensor")
            else:
                assert "ld.global" not in before and "cp.async.bulk.tensor" not in before, role


@pytest.mark.parametrize("split_k", [2, 4])
def test_sm90_split_k_reduces_through_distributed_shared_memory(split_k, tmp_path):
    """Ranks 1.. send their fp32 partial tile with st.async (16 x 16 bytes a thread),
    rank 0 frees the slots with cluster-scoped release arrives; no spills."""
    cfg = GemmConfig(arch="sm_90a", tile_m=64, split_k=split_k, hadamard=True)
    ck = jit.compile_fused(cfg, 1024, 1536, keep_dir=str(tmp_path))
    ptx = " ".join(_ptx(ck).split())
    assert ptx.count("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32") == 16
    assert "mbarrier.arrive.release.cluster.shared::cluster.b64" in ptx
    if shutil.which("ptxas"):
        rep = _ptxas_report(ck, "sm_90a")
        assert max(int(x) for x in re.findall(r"(\d+) bytes spill stores", rep)) == 0, rep


@pytest.mark.parametrize("out_format,hadamard", [("mxfp4", True), ("fp8", False)])
def test_sm100_fused_compiles_to_tcgen05_block_scaled_mma(out_format, hadamard, tmp_path):
    from indexer_q.kernels.gemm_sm100 import Sm100FusedIndexerQ

    cfg = GemmConfig(arch="sm_100a", tile_m=128, out_format=out_format, hadamard=hadamard)
    ck = jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path))
    ptx = _ptx(ck)
    assert ".target sm_100a" in ptx
    assert "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32" in ptx
    for op in ("tcgen05.cp", "tcgen05.ld.sync.aligned.32x32b.x128", "tcgen05.alloc", "tcgen05.dealloc"):
        assert op in ptx, op
    assert Sm100FusedIndexerQ.ptx_signature[1] in ptx
    if shutil.which("ptxas"):
        rep = _ptxas_report(ck, "sm_100a")
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", rep)]
        assert spills and max(spills) == 0, rep


def test_config_rejections():
    from indexer_q.kernels.gemm_sm90 import Sm90FusedIndexerQ

    assert Sm90FusedIndexerQ.can_implement(GemmConfig(), 8192, 1536)
    assert not Sm90FusedIndexerQ.can_implement(GemmConfig(tile_m=96), 8192, 1536)
    assert not Sm90FusedIndexerQ.can_implement(GemmConfig(stages=40), 8192, 1536)
    assert not Sm90FusedIndexerQ.can_implement(GemmConfig(arch="sm_100a"), 8192, 1536)
    from indexer_q.kernels.gemm_sm100 import Sm100FusedIndexerQ

    assert Sm100FusedIndexerQ.can_implement(GemmConfig(arch="sm_100a"), 8192, 1536)
    assert not Sm100FusedIndexerQ.can_implement(GemmConfig(arch="sm_100a", tile_m=64), 8192, 1536)
    assert not Sm90FusedIndexerQ.can_implement(GemmConfig(cluster_n=2), 1152, 1536)  # 9 heads
    assert not Sm90FusedIndexerQ.can_implement(GemmConfig(), 8192, 1000)
    # the tensor-core Hadamard: one epilogue warpgroup, sm_90a only
    had = dict(hadamard=True, tensor_core_hadamard=True)
    assert Sm90FusedIndexerQ.can_implement(GemmConfig(**had), 8192, 1536)
    assert not Sm90FusedIndexerQ.can_implement(GemmConfig(epilogue_warpgroups=2, **had), 8192, 1536)
    assert Sm90FusedIndexerQ.can_implement(GemmConfig(epilogue_warpgroups=2, tensor_core_hadamard=True), 8192, 1536)
    assert not Sm100FusedIndexerQ.can_implement(GemmConfig(arch="sm_100a", **had), 8192, 1536)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compile_for_arch_reports_checks(arch, tmp_path):
    records = dispatch.compile_for_arch(arch, tmp_path)
    assert {r["kernel"] for r in records} >= {"act_quant_fp8", "fused_native_tile_m128"}
    assert all(r["checks"] and all(r["checks"].values()) for r in records)
