"""CPU-only: every kernel compiles for its arch without a GPU, and the PTX holds the
instructions we mean (CI runs this; it is the only check sm_100a gets here)."""
from __future__ import annotations

import dataclasses
import re

import pytest

from indexer_q import dispatch, jit
from indexer_q.kernels.gemm_base import GemmConfig

WGMMA_E4M3 = "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"


def _ptx(ck) -> str:
    with open(ck.artifacts["ptx"]) as f:
        return f.read()


def _sass(ck) -> str:
    from tuning.sass_mix import cubin_sass, cuda_tool

    if cuda_tool("cuobjdump") is None:
        pytest.skip("needs cuobjdump (on PATH or Triton's)")
    return cubin_sass(ck.artifacts["cubin"])


def _resources(ck) -> dict:
    """The kernel's registers, stack and local memory in the cubin the DSL built, plus the
    local loads and stores (spills) in its SASS. The DSL's own ptxas (CUDA 13 with the cu13
    libraries, as on the GPU machines) allocates the registers that run; it can spill where
    a standalone ptxas on the same PTX does not (4-stage rings did: 479 local accesses with
    the kit's, 2 with CUDA 13.0's ptxas), and its PTX is newer than a standalone one reads."""
    from tuning.sass_mix import cubin_resources

    _sass(ck)  # skips without cuobjdump
    return cubin_resources(ck.artifacts["cubin"])


def _assert_no_spills(ck) -> dict:
    res = _resources(ck)
    assert res["spills"] == 0 and res["local"] == 0, res  # no spills, ever
    return res


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_act_quant_compiles(arch, tmp_path):
    ck = jit.compile_act_quant(arch, keep_dir=str(tmp_path))
    ptx = _ptx(ck)
    assert f".target {arch}" in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx


SM90_EPILOGUES = [(64, 1, False), (128, 1, False), (64, 2, False), (128, 2, False), (64, 1, True), (128, 1, True),
                  (64, 2, True), (128, 2, True)]


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
    entry = _assert_no_spills(ck)["regs"]
    # setmaxnreg only moves registers inside the CTA's launch allocation (the entry
    # register count ptxas picked x threads); a larger split hangs the kernel.
    from indexer_q.kernels.gemm_sm90 import WARPGROUP, Sm90FusedIndexerQ

    k = Sm90FusedIndexerQ(cfg)
    split = WARPGROUP * (k.producer_regs + k.num_consumers * k.consumer_regs + k.epi_wgs * k.epilogue_regs)
    assert split <= entry * k.threads, f"setmaxnreg split {split} > {entry} x {k.threads}"
    # .dec may only lower a warp's count and .inc only raise it (else: illegal instruction)
    for kind, regs in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx):
        assert (int(regs) <= entry) if kind == "dec" else (int(regs) >= entry), (kind, regs, entry)
    mma_sync = ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    if cfg.uses_tensor_core_hadamard and epilogue_warpgroups == 1:
        # the Hadamard's H16 factor, two rows a thread: 16 bf16 mma.sync a chunk of 64 rows
        assert mma_sync == 16 * (tile_m // 64)
    elif cfg.uses_tensor_core_hadamard:
        # one row a thread (hmma.tc_hadamard_row): 8 a row's code, one copy a pass shape
        # (the epilogue warpgroups' and, for 128-row tiles, the consumers' helper rows)
        assert mma_sync > 0 and mma_sync % 8 == 0, mma_sync
    else:
        assert mma_sync == 0
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16" not in ptx


@pytest.mark.parametrize("stages", [3, 4, 5])
@pytest.mark.parametrize("tensor_core_hadamard", [False, True])
def test_sm90_stage_rings_do_not_spill(stages, tensor_core_hadamard, tmp_path):
    """Every ring the tuner times compiles without spills in the binary that runs: with a
    stage count that divides the 12 K blocks the compiler used to fold the stage indices
    and spill (kernels/sm90_parts.opaque_stage)."""
    for ewg in ((1, 2) if tensor_core_hadamard else (2,)):
        cfg = GemmConfig(arch="sm_90a", tile_m=128, hadamard=True, stages=stages,
                         tensor_core_hadamard=tensor_core_hadamard, epilogue_warpgroups=ewg)
        _assert_no_spills(jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path / str(ewg))))


def test_sm90_pipelined_promotion_keeps_one_wgmma_group_in_flight(tmp_path):
    """The pipelined mainloop waits for all but the newest WGMMA group before promoting,
    and ptxas does not serialize the WGMMAs (its C7514: every wait would then be for all
    groups, none for all but one) or spill."""
    cfg = GemmConfig(arch="sm_90a", tile_m=64, pipelined_promotion=True, hadamard=True)
    ck = jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path))
    ptx = _ptx(ck)
    assert ptx.count(WGMMA_E4M3) == 12 * 4  # every K block's WGMMAs, unrolled
    assert "wgmma.wait_group.sync.aligned 1;" in " ".join(ptx.split())
    _assert_no_spills(ck)
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in _sass(ck)


@pytest.mark.parametrize("tile_m,loads_in_flight", [(64, 3), (128, 2)])
def test_sm90_loads_in_flight_paces_the_producer(tile_m, loads_in_flight, tmp_path):
    """loads_in_flight: the producer requests at most that many K blocks before the PDL wait
    and, in its loop, waits on the full barrier of the block issued that many before: an
    mbarrier wait the unlimited ring's producer does not have; no spills."""
    from indexer_q.kernels.gemm_sm90 import Sm90FusedIndexerQ

    waits = {}
    for lif in (0, loads_in_flight):
        cfg = GemmConfig(arch="sm_90a", tile_m=tile_m, epilogue_warpgroups=2, loads_in_flight=lif)
        ck = jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path / str(lif)))
        _assert_no_spills(ck)
        producer = _role_regions(_ptx(ck))[Sm90FusedIndexerQ(cfg).producer_regs]
        waits[lif] = producer.count("mbarrier.try_wait.parity")
        early = producer.split("griddepcontrol.wait;")[0].count("cp.async.bulk.tensor")
        assert early == min(lif or 99, 3 if tile_m == 128 else 99, Sm90FusedIndexerQ(cfg).stages), early
    assert waits[loads_in_flight] > waits[0], waits
    with pytest.raises(Exception, match="loads_in_flight"):
        jit.compile_fused(GemmConfig(arch="sm_90a", tile_m=64, stages=4, loads_in_flight=4), 8192, 1536)


def test_sm90_swap_ab_loads_in_flight_paces_the_producer(tmp_path):
    """The swapped kernel's producer takes the same limit: an extra full-barrier wait in its
    loop (with the fused quantizer, whose weight blocks before the PDL wait are unrolled
    alike in both builds); no spills. sm_100a refuses it."""
    from indexer_q.kernels.gemm_sm90_swap_ab import Sm90SwapABFusedIndexerQ

    counts = {}
    for lif in (0, 2):
        cfg = GemmConfig(arch="sm_90a", kind="swap_ab", tile_m=16, epilogue_warpgroups=2, pipelined_promotion=True,
                         fused_act_quant=True, loads_in_flight=lif)
        ck = jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path / str(lif)))
        _assert_no_spills(ck)
        producer = _role_regions(_ptx(ck))[Sm90SwapABFusedIndexerQ(cfg).producer_regs]
        counts[lif] = producer.count("mbarrier.try_wait.parity")
    assert counts[2] > counts[0], counts
    with pytest.raises(Exception, match="loads_in_flight"):
        jit.compile_fused(GemmConfig(arch="sm_100a", loads_in_flight=2), 8192, 1536)


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
        # the early trigger runs only where the grid's CTA count (%nctaid) is at most half the device's
        trigger = ptx.index("griddepcontrol.launch_dependents;")
        assert "%nctaid.x" in ptx[:trigger] and "setp.gt.s32" in ptx[ptx.index("%nctaid.x"):trigger]
        k = Sm90FusedIndexerQ(cfg)
        regions = _role_regions(ptx)
        roles = {"producer": k.producer_regs, "consumer": k.consumer_regs, "epilogue": k.epilogue_regs}
        assert len(set(roles.values())) == 3 and set(roles.values()) <= set(regions), (roles, list(regions))
        for role, regs in roles.items():
            code = regions[regs]
            assert "griddepcontrol.wait;" in code, role
            before = code.split("griddepcontrol.wait;")[0]  # (ptxas may duplicate a path)
            if role == "producer":
                early = 0 if split_k > 1 else min(k.stages, 1536 // 128, 3 if tile_m == 128 else 99)
                assert before.count("cp.async.bulk.tensor") == early, before.count("cp.async.bulk.tensor")
                # ... and triggers the next launch once every load is issued
                assert code.rindex("griddepcontrol.launch_dependents;") > code.rindex("cp.async.bulk.tensor")
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
    _assert_no_spills(ck)


@pytest.mark.parametrize("tile_m,split_k", [(128, 1), (64, 2)])
def test_sm90_native_trace_probe_compiles(tile_m, split_k, tmp_path):
    """tuning/trace_decode's native probe: clock stamps at the phase boundaries (global
    timer at the consumer's start and hand-off: a K split's consumer is built twice, its
    sending ranks' without a hand-off); the plain probe has none."""
    cfg = GemmConfig(tile_m=tile_m, split_k=split_k, epilogue_warpgroups=2, epilogue=False, trace=True)
    ptx = _ptx(jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path / "trace")))
    # clock64: consumer start, PDL wait, 6 K blocks (the unrolled loop), K loop done,
    # hand-off; producer start, PDL wait, all issued: 13. A K split's loop is not unrolled
    # (one K-block stamp) and its consumer is built twice, the sending ranks' without a
    # hand-off: 5 + 4 + 3 = 12.
    assert ptx.count("%globaltimer") == (2 if split_k == 1 else 3) and ptx.count("%clock64") >= 12
    plain = _ptx(jit.compile_fused(dataclasses.replace(cfg, trace=False), 8192, 1536,
                                   keep_dir=str(tmp_path / "plain")))
    assert "%globaltimer" not in plain and "%clock64" not in plain


# Every sm_100a variant: output format x Hadamard x epilogue warpgroups (1, or 2 taking
# turns by tile). pdl only moves loads around a wait (test_sm100_pdl_...).
SM100_VARIANTS = [(f, h, e) for f in ("mxfp4", "fp8", "fp8-unscaled") for h in (True, False) for e in (1, 2)]


@pytest.mark.parametrize("out_format,hadamard,epilogue_warpgroups", SM100_VARIANTS)
def test_sm100_fused_compiles_to_tcgen05_block_scaled_mma(out_format, hadamard, epilogue_warpgroups, tmp_path):
    """tcgen05 block-scaled MMA and TMEM traffic; the q row stored with 16-byte stores
    (16 words MXFP4, 32 FP8: 4 or 8 st.global.v4, the 4-byte store only for the scale);
    the Hadamard's butterflies over bits 1-6 and its scaling as packed fp32x2 (6 x 32 adds,
    6 x 32 subs, 64 muls); with two epilogue warpgroups a setmaxnreg split that fits
    the launch allocation; ptxas: no spills."""
    from indexer_q.kernels.gemm_sm100 import Sm100FusedIndexerQ

    cfg = GemmConfig(arch="sm_100a", tile_m=128, out_format=out_format, hadamard=hadamard,
                     epilogue_warpgroups=epilogue_warpgroups)
    ck = jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path))
    ptx = _ptx(ck)
    assert ".target sm_100a" in ptx
    assert "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32" in ptx
    for op in ("tcgen05.cp", "tcgen05.ld.sync.aligned.32x32b.x128", "tcgen05.alloc", "tcgen05.dealloc"):
        assert op in ptx, op
    assert Sm100FusedIndexerQ.ptx_signature[1] in ptx
    v4, b32 = ptx.count("st.global.v4.b32"), ptx.count("st.global.b32")
    assert (v4, b32) == ((4, 1) if out_format == "mxfp4" else (8, int(out_format == "fp8"))), (v4, b32)
    packed = [ptx.count(f"{op}.rn.f32x2") for op in ("add", "sub", "mul")]
    assert packed == ([192, 192, 64] if hadamard else [0, 0, 0]), packed
    k = Sm100FusedIndexerQ(cfg)
    regs = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx)
    if epilogue_warpgroups == 1:
        assert not regs and k.threads == 192
    else:
        assert sorted(regs) == [("dec", str(k.other_regs)), ("inc", str(k.epilogue_regs))], regs
    entry = _assert_no_spills(ck)["regs"]
    if epilogue_warpgroups > 1:  # setmaxnreg moves registers inside the launch allocation only
        assert entry == k.launch_regs and 128 * (k.other_regs + k.epi_warpgroups * k.epilogue_regs) \
            <= entry * k.threads, (entry, k.other_regs, k.epilogue_regs)


def _tma_copies(ptx: str) -> list:
    """(position, operand) of every TMA load in the PTX; the operand ("A", "B", "SFA", "SFB")
    from its descriptor, a 128-byte kernel parameter (in the kernel's argument order)."""
    descs = re.findall(r"\.param \.align 64 \.b8 (\w+)\[128\]", ptx)
    assert len(descs) == 4, descs
    role = dict(zip(descs, ("A", "B", "SFA", "SFB")))
    reg = {r: role[p] for r, p in re.findall(r"mov\.b64\s+(%rd\d+), (\w+);", ptx) if p in role}
    for dst, src in re.findall(r"cvta\.param\.u64\s+(%rd\d+), (%rd\d+);", ptx):
        if src in reg:
            reg[dst] = reg[src]
    return [(m.start(), reg[m.group(1)])
            for m in re.finditer(r"cp\.async\.bulk\.tensor\.\S+ \[[^\]]*\], \[(%rd\d+),", ptx)]


@pytest.mark.parametrize("epilogue_warpgroups", [1, 2])
def test_sm100_pdl_waits_for_the_activation_quantizer(epilogue_warpgroups, tmp_path):
    """PDL on sm_100a as on sm_90a: the GEMM is launched as a programmatic dependent
    (use_pdl) of the quantizer, which lets it start (griddepcontrol.launch_dependents).
    Before the TMA warp's griddepcontrol.wait it loads only the first tile's weight and
    weight scale factors (B, SFB: one pair a stage, as many stages as the ring holds);
    every activation load (A, SFA) comes after it; the epilogue warps load nothing from
    global memory (positions, cos/sin) before their own wait. pdl=False has no wait."""
    from indexer_q.kernels.gemm_sm100 import Sm100FusedIndexerQ

    aq = _ptx(dispatch.compile_act_quant_sf("sm_100a", keep_dir=str(tmp_path / "aq")))
    assert "griddepcontrol.launch_dependents;" in aq
    for pdl in (True, False):
        cfg = GemmConfig(arch="sm_100a", tile_m=128, pdl=pdl, epilogue_warpgroups=epilogue_warpgroups)
        ptx = _ptx(jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path / str(pdl))))
        copies = _tma_copies(ptx)
        assert {r for _, r in copies} == {"A", "B", "SFA", "SFB"}
        waits = [m.start() for m in re.finditer(r"griddepcontrol\.wait;", ptx)]
        if not pdl:
            assert not waits
            continue
        assert len(waits) == 2, len(waits)  # the TMA warp's, the epilogue's
        early = min(Sm100FusedIndexerQ(cfg).stages, 1536 // 128)
        before = [r for pos, r in copies if pos < waits[0]]
        assert before == ["B", "SFB"] * early, before
        assert all(pos > waits[0] for pos, r in copies if r in ("A", "SFA"))
        assert "ld.global" not in ptx[:waits[1]]


def test_sm100_act_quant_writes_scale_factor_words(tmp_path):
    """The sm_100a quantizer (what run_fused launches before the GEMM): e4m3 conversion,
    per unit two data words and one scale-factor word (ITEMS units a half-warp), lets the
    GEMM start early; no spills."""
    from indexer_q.kernels.act_quant import ITEMS, WORDS_PER_LANE_OUT

    ck = dispatch.compile_act_quant_sf("sm_100a", keep_dir=str(tmp_path))
    ptx = _ptx(ck)
    assert ".target sm_100a" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "griddepcontrol.launch_dependents;" in ptx
    assert ptx.count("st.global.b32") == ITEMS * (WORDS_PER_LANE_OUT + 1)
    _assert_no_spills(ck)


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
    # the tensor-core Hadamard: one or two epilogue warpgroups (two or one rows a thread), sm_90a only
    had = dict(hadamard=True, tensor_core_hadamard=True)
    assert Sm90FusedIndexerQ.can_implement(GemmConfig(**had), 8192, 1536)
    assert Sm90FusedIndexerQ.can_implement(GemmConfig(epilogue_warpgroups=2, **had), 8192, 1536)
    assert Sm90FusedIndexerQ.can_implement(GemmConfig(epilogue_warpgroups=2, tensor_core_hadamard=True), 8192, 1536)
    assert not Sm100FusedIndexerQ.can_implement(GemmConfig(arch="sm_100a", **had), 8192, 1536)
    # the phase-clock trace: a probe's (it writes into the q output), not the pipelined loop's
    assert Sm90FusedIndexerQ.can_implement(GemmConfig(epilogue=False, trace=True), 8192, 1536)
    assert not Sm90FusedIndexerQ.can_implement(GemmConfig(trace=True), 8192, 1536)
    assert not Sm90FusedIndexerQ.can_implement(
        GemmConfig(tile_m=64, pipelined_promotion=True, epilogue=False, trace=True), 8192, 1536)
    assert not Sm100FusedIndexerQ.can_implement(GemmConfig(arch="sm_100a", epilogue=False, trace=True), 8192, 1536)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compile_for_arch_reports_checks(arch, tmp_path):
    records = dispatch.compile_for_arch(arch, tmp_path)
    assert {r["kernel"] for r in records} >= {"act_quant_fp8", "fused_native_tile_m128"}
    assert all(r["checks"] and all(r["checks"].values()) for r in records)


# out_format="bf16" through every epilogue shape: the shared epilogue's row stores with
# no quantization (the row's bf16 words only, no scale store), for both arches and kinds.
BF16_CASES = [
    dict(arch="sm_90a", tile_m=128),
    dict(arch="sm_90a", tile_m=64, epilogue_warpgroups=2),
    dict(arch="sm_90a", tile_m=128, tensor_core_hadamard=True),
    dict(arch="sm_90a", kind="swap_ab", tile_m=16, split_k=2, fused_act_quant=True),
    dict(arch="sm_100a", tile_m=128),
    dict(arch="sm_100a", kind="swap_ab", tile_m=128),
]


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_bf16_format_compiles(case, tmp_path):
    """The row leaves as bf16x2 words (cvt.rn.bf16x2.f32, exact on bf16 values): no e4m3
    conversion outside the fused activation quantizer; every layout stores a thread's words
    as 16-byte stores and nothing else (no scale)."""
    cfg = GemmConfig(out_format="bf16", hadamard=True, **case)
    ck = jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path))
    ptx = _ptx(ck)
    assert f".target {cfg.arch}" in ptx
    assert "cvt.rn.bf16x2.f32" in ptx
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == cfg.fused_act_quant
    v4, b32 = ptx.count("st.global.v4.b32"), ptx.count("st.global.b32")
    if cfg.arch == "sm_100a":
        assert (v4, b32) == (16, 0), (v4, b32)  # one thread owns the row: 64 words
    elif cfg.tensor_core_hadamard:
        assert (v4, b32) == (16, 0), (v4, b32)  # 4 passes x a lane's 32 columns (16 words)
    else:
        # a row's 64 words over 4 lanes (16 each: runs of 8 at columns 16q.. and 64 + 16q..) or
        # 8 lanes (the swapped-A/B kernel's, 8 each: runs of 4), 16-byte stores of 4 words
        words = 64 // (8 if cfg.kind == "swap_ab" else 4)
        assert b32 == 0 and v4 > 0 and v4 % (words // 4) == 0, (v4, b32)
    _assert_no_spills(ck)


@pytest.mark.parametrize("epilogue_warpgroups", [1, 2])
def test_gemm_only_format_stores_y_and_nothing_else(epilogue_warpgroups, tmp_path):
    """out_format "gemm-bf16" (the two-kernel tactic's GEMM): the tile's bf16 rows go out
    as they came in: no cos/sin loads (16-byte read-only loads), no shuffles of the
    Hadamard or the amax, no e4m3 conversion, no scale."""
    cfg = GemmConfig(out_format="gemm-bf16", epilogue_warpgroups=epilogue_warpgroups)
    ck = jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path))
    ptx = _ptx(ck)
    assert WGMMA_E4M3 in ptx
    assert "ld.global.nc.v4.f32" not in ptx
    assert "shfl.sync.bfly" not in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" not in ptx
    assert "cvt.rn.bf16x2.f32" in ptx
    assert GemmConfig(out_format="gemm-bf16", hadamard=True).problems(8192, 1536)
    assert GemmConfig(arch="sm_100a", out_format="gemm-bf16").problems(8192, 1536)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("out_format,hadamard,lanes", [("mxfp4", True, 4), ("mxfp4", False, 8), ("fp8", True, 4),
                                                       ("bf16", True, 8)])
def test_row_epilogue_compiles(arch, out_format, hadamard, lanes, tmp_path):
    """The two-kernel tactic's second launch: 16-byte loads of y, the Hadamard's butterfly
    where asked, the format's conversion, no spills; arch-neutral code."""
    cfg = GemmConfig(arch=arch, out_format=out_format, hadamard=hadamard)
    ck = jit.compile_row_epilogue(cfg, 8192, lanes_per_row=lanes, keep_dir=str(tmp_path))
    ptx = _ptx(ck)
    assert f".target {arch}" in ptx
    assert "ld.global.nc.v4.f32" in ptx
    assert "griddepcontrol.wait" in ptx
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == (out_format == "fp8")
    assert "shfl.sync.bfly" in ptx  # the amax (and the Hadamard's butterfly where asked)
    _assert_no_spills(ck)


def test_row_epilogue_rejects_its_input_format():
    from indexer_q.kernels.row_epilogue import RowEpilogue

    with pytest.raises(ValueError, match="gemm-bf16"):
        RowEpilogue(GemmConfig(out_format="gemm-bf16"), 8192)
    with pytest.raises(ValueError, match="lanes_per_row"):
        RowEpilogue(GemmConfig(), 8192, lanes_per_row=2)
