"""CPU: the swapped-A/B kernels of both arches compile, with the instructions we mean and
no spills (CI runs this; sm_100a gets no other check here)."""
from __future__ import annotations

import dataclasses
import re

import pytest

from indexer_q import jit
from indexer_q.kernels.gemm_base import GemmConfig
from test_compile import _resources, _sass


def _ptx(ck) -> str:
    with open(ck.artifacts["ptx"]) as f:
        return f.read()


def _spills(ck) -> int:
    """Local memory and spills in the cubin the DSL built (test_compile._resources)."""
    res = _resources(ck)
    return res["spills"] + res["local"]


# TP8's 16-token tile (the tables' at M = 128) with its descriptors made before the tile loop
TP8_TILE = dict(tile_m=16, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True,
                tensor_core_hadamard=True, act_quant_lanes=4)

SM90_CASES = [
    dict(tile_m=8, fused_act_quant=True, split_k=2),
    dict(tile_m=16, fused_act_quant=False, split_k=4),
    dict(tile_m=32, fused_act_quant=True, split_k=1, epilogue_warpgroups=2),
    dict(tile_m=64, fused_act_quant=True, split_k=2, epilogue_warpgroups=2, out_format="fp8"),
    dict(tile_m=64, fused_act_quant=False, split_k=4, out_format="fp8-unscaled"),
    dict(tile_m=16, fused_act_quant=True, split_k=2, epilogue_warpgroups=2),
    dict(tile_m=16, fused_act_quant=True, split_k=2, epilogue_warpgroups=2, pipelined_promotion=True),
    dict(tile_m=32, fused_act_quant=False, split_k=4, pipelined_promotion=True),
    dict(tile_m=16, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True),
    dict(tile_m=64, fused_act_quant=True, split_k=2, epilogue_warpgroups=2, pipelined_promotion=True),
    dict(tile_m=16, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True, cluster_n=2),
    dict(tile_m=8, fused_act_quant=True, split_k=1, epilogue_warpgroups=1, cluster_n=4),
    dict(tile_m=32, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True, cluster_n=2),
    dict(tile_m=64, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True, cluster_n=4),
    dict(tile_m=8, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True, cluster_m=2),
    dict(tile_m=16, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True, cluster_m=2),
    dict(tile_m=32, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True, cluster_m=2),
    dict(tile_m=16, fused_act_quant=False, split_k=1, epilogue_warpgroups=1, cluster_m=2),
    # the Hadamard's H16 factor on the tensor cores at 8 lanes a row
    dict(tile_m=32, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True, cluster_n=2,
         tensor_core_hadamard=True),
    dict(tile_m=8, fused_act_quant=True, split_k=4, epilogue_warpgroups=2, pipelined_promotion=True,
         tensor_core_hadamard=True, out_format="fp8"),
    dict(tile_m=64, fused_act_quant=True, split_k=2, epilogue_warpgroups=1, pipelined_promotion=True,
         tensor_core_hadamard=True),
    # the fused quantizer at 4 lanes a unit: qr staged (8-16 tokens) and loaded (32-64),
    # shared by heads, with token tiles sharing the weight, with a K split
    dict(tile_m=16, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True, cluster_n=2,
         tensor_core_hadamard=True, act_quant_lanes=4),
    dict(tile_m=8, fused_act_quant=True, split_k=4, epilogue_warpgroups=2, pipelined_promotion=True,
         act_quant_lanes=4),
    dict(tile_m=32, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True, cluster_m=2,
         act_quant_lanes=4),
    dict(tile_m=64, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True, cluster_n=4,
         act_quant_lanes=4),
    # 8-16-token tiles whose quantizers load qr themselves (stage_qr=False: a deeper ring):
    # weight pairs, the tables' heads pairs (V4-Pro M = 9-32), 16 lanes (its later tiles' 24
    # units a batch), 8 tokens split in 4
    dict(tile_m=16, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True, cluster_m=2,
         tensor_core_hadamard=True, act_quant_lanes=4, stage_qr=False),
    dict(tile_m=16, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True, cluster_n=2,
         tensor_core_hadamard=True, act_quant_lanes=4, stage_qr=False),
    dict(tile_m=16, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True,
         stage_qr=False),
    dict(tile_m=8, fused_act_quant=True, split_k=4, epilogue_warpgroups=2, pipelined_promotion=True,
         stage_qr=False),
    # the first tile's weight scales loaded before the consumer's PDL wait: the tables' 32-token
    # head pair, and 64 tokens in a reduce-scatter split
    dict(tile_m=32, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True, cluster_n=2,
         tensor_core_hadamard=True, act_quant_lanes=4, scales_before_pdl_wait=True),
    dict(tile_m=64, fused_act_quant=True, split_k=2, epilogue_warpgroups=2, pipelined_promotion=True,
         act_quant_lanes=4, scales_before_pdl_wait=True),
    # each block's descriptors made from warp-uniform addresses: TP8's 16-token tile (whose
    # hoisted descriptors the case below moves), 8 tokens split in 4, 64 tokens in two commit
    # groups a block, the plain loop, the separate quantizer (B from the ring)
    TP8_TILE | dict(uniform_descriptors=True),
    TP8_TILE,
    dict(tile_m=8, fused_act_quant=True, split_k=4, epilogue_warpgroups=2, pipelined_promotion=True,
         uniform_descriptors=True),
    dict(tile_m=64, fused_act_quant=True, split_k=2, epilogue_warpgroups=2, pipelined_promotion=True,
         uniform_descriptors=True),
    dict(tile_m=16, fused_act_quant=True, split_k=2, epilogue_warpgroups=2, uniform_descriptors=True),
    dict(tile_m=32, fused_act_quant=False, split_k=1, pipelined_promotion=True, uniform_descriptors=True),
    # V4's 32-token pair of heads, where the weight's scales were moved to uniform registers
    # at their loads before they were spread over the lanes (NOTES version 116)
    dict(tile_m=32, fused_act_quant=True, split_k=1, epilogue_warpgroups=2, pipelined_promotion=True, cluster_n=2,
         tensor_core_hadamard=True, act_quant_lanes=4, uniform_descriptors=True),
]


def _descriptor_moves(sass: str) -> int:
    """R2UR instructions (vector to uniform register) whose uniform register is part of the
    descriptor pair (gdesc[URn]: URn to URn+3) of one of the next two WGMMAs (QGMMA) within
    48 instructions: the moves, a block at a time, of descriptors kept in vector registers."""
    lines = sass.splitlines()
    moves = 0
    for i, line in enumerate(lines):
        move = re.search(r"R2UR UR(\d+),", line)
        if not move:
            continue
        reg, seen = int(move.group(1)), 0
        for later in lines[i + 1:i + 49]:
            desc = re.search(r"QGMMA\S* \S+, gdesc\[UR(\d+)\]", later)
            if desc:
                if int(desc.group(1)) <= reg <= int(desc.group(1)) + 3:
                    moves += 1
                    break
                seen += 1
                if seen == 2:
                    break
    return moves


def _loads_moved_to_uniform(sass: str) -> int:
    """R2UR moves of a register that a global load (LDG) wrote within the 12 instructions
    before: the load's value taken into the uniform datapath at once, so the warp waits for
    the load there (the weight's scales under the 29th session's uniform descriptors: 6-10
    such moves in V4's head pairs; NOTES version 116)."""
    lines = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", line)]
    moved = 0
    for i, line in enumerate(lines):
        load = re.search(r"\bLDG\.E(?:\.(64|128))?\S* R(\d+),", line)
        if not load:
            continue
        first = int(load.group(2))
        written = range(first, first + {None: 1, "64": 2, "128": 4}[load.group(1)])
        for later in lines[i + 1:i + 13]:
            move = re.search(r"R2UR UR\d+, R(\d+)", later)
            if move and int(move.group(1)) in written:
                moved += 1
    return moved


@pytest.mark.parametrize("case", SM90_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sm90_swap_ab_compiles(case, tmp_path):
    """Tokens on the WGMMA's N (m64n{T}k32, 8 a K block: the head's two m64 halves x 4),
    the fused quantizer's loads, the K split's DSMEM stores, no spills."""
    from indexer_q.kernels.gemm_sm90_swap_ab import Sm90SwapABFusedIndexerQ

    cfg = GemmConfig(kind="swap_ab", hadamard=True, **case)
    ck = jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path))
    ptx = _ptx(ck)
    wgmma = f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_m}k32.f32.e4m3.e4m3"
    scatter = Sm90SwapABFusedIndexerQ.reduce_scatters(cfg)
    assert scatter == (cfg.split_k > 1 and (cfg.tile_m // 8) % cfg.split_k == 0)
    # a gathering K split has two consumer roles (rank 0 "reduce", the others "send"); a
    # reduce-scatter one role on every rank, each thread storing its T / 4 chunks of 16 bytes
    roles = 2 if cfg.split_k > 1 and not scatter else 1
    if scatter:
        assert " ".join(ptx.split()).count("st.async.shared::cluster") == cfg.tile_m // 4
    # pipelined: the K loop unrolled (K = 1536: 12 blocks over the split), one wait for all
    # but the newest group between blocks
    # (64 tokens: each block's two m64 halves are commit groups of their own, two waits a block)
    blocks = 12 // cfg.split_k if cfg.pipelined_promotion else 1
    assert ptx.count(wgmma) == 8 * blocks * roles, ptx.count(wgmma)
    if cfg.pipelined_promotion:
        waits = 2 * blocks - 1 if cfg.tile_m > 32 else blocks - 1
        assert len(re.findall(r"wgmma.wait_group.sync.aligned\s+1;", ptx)) == waits * roles
    assert "m64n128k32" not in ptx  # not the native kernel's shape
    flat = " ".join(ptx.split())
    assert ("st.async.shared::cluster" in flat) == (cfg.split_k > 1 or cfg.cluster_n > 1)
    if cfg.cluster_n > 1:  # heads sharing the first tile's quantizer: a lane's 8 e4m3 bytes, a scale
        assert "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32" in flat
        assert "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32" in flat
    # token tiles sharing the weight: its loads multicast to the cluster; otherwise none are
    assert ("multicast::cluster" in flat) == (cfg.cluster_m > 1)
    # the tensor-core Hadamard: two bf16 MMAs a 64-column half of a row pass; none otherwise
    mma_sync = ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    assert (mma_sync > 0 and mma_sync % 4 == 0) if cfg.tensor_core_hadamard else mma_sync == 0, mma_sync
    if cfg.fused_act_quant:  # the e4m3 conversion in the kernel
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
        assert "griddepcontrol.launch_dependents" in ptx  # lets the next grid start early (PDL)
    if cfg.fused_act_quant and Sm90SwapABFusedIndexerQ.stages_qr_by_tma(cfg):
        # qr by TMA into the staging buffer (a box a K block, beside the weight's), read back
        # 16 bytes at a time; no 16-byte global loads of it (the epilogue's cos/sin may have some)
        assert ptx.count("ld.global.nc.v4.f32") <= 2 and ptx.count("ld.shared.v4") >= 8
    elif cfg.fused_act_quant:  # qr's 16-byte global loads
        assert ptx.count("ld.global.nc.v4.f32") > 8
    if cfg.fused_act_quant:  # the quantizer's amax: butterfly stages over 16 lanes (xor 1, 2, 4, 8) or
        # over 4 (xor 1, 2); nothing else in the kernel shuffles across 8 lanes
        wide = re.search(r"shfl\.sync\.bfly\.b32 %r\d+, %r\d+, 8, ", flat)
        assert bool(wide) == (cfg.act_quant_lanes == 16)
    # uniform_descriptors: each block's descriptors formed in the uniform datapath beside its
    # WGMMAs, no move from vector registers (the hoisted ones of TP8's 16-token tile: more
    # than two a WGMMA; NOTES version 115)
    sass = _sass(ck)
    assert sass.count("QGMMA.64x%dx32.F32.E4M3.E4M3" % cfg.tile_m) == ptx.count(wgmma)
    moves = _descriptor_moves(sass)
    if cfg.uniform_descriptors:
        assert moves == 0, moves
        assert _loads_moved_to_uniform(sass) == 0  # the weight's scales stay in vector registers
    elif case == TP8_TILE:
        assert moves > 2 * ptx.count(wgmma), moves
    assert _spills(ck) == 0


@pytest.mark.parametrize("m,n,k", [(16, 8192, 4096), (16, 8192, 8192)])
def test_sm90_heuristic_compiles_at_large_k(m, n, k, tmp_path):
    """Where the staged qr does not fit the shared memory unsplit (large K), the heuristic
    falls back (a split, or the separate quantizer) to a tactic that compiles."""
    from indexer_q.tactics import heuristic

    tactic = heuristic("sm_90a", m, n, k)
    cfg = tactic.to_config("sm_90a", hadamard=True, fp4_rounding="floor-ties", out_format="mxfp4",
                           positions_dtype="int64")
    ck = jit.compile_fused(cfg, n, k, keep_dir=str(tmp_path))
    assert "wgmma.mma_async" in _ptx(ck)


@pytest.mark.parametrize("out_format,hadamard", [("mxfp4", True), ("fp8", False), ("fp8", True)])
def test_sm100_swap_ab_compiles(out_format, hadamard, tmp_path):
    """tcgen05.mma block_scale with the weight as A: a 128 x 128 x 32 MMA atom in the
    kernel's signature, the accumulator read 32 columns at a time (tcgen05.ld 32x32b.x32)
    and transposed through shared memory; no spills."""
    from indexer_q.kernels.gemm_sm100_swap_ab import Sm100SwapABFusedIndexerQ

    cfg = GemmConfig(arch="sm_100a", kind="swap_ab", tile_m=128, out_format=out_format, hadamard=hadamard)
    ck = jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path))
    ptx = _ptx(ck)
    assert ".target sm_100a" in ptx
    assert "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32" in ptx
    assert "Sm100SwapABFusedIndexerQ" in ptx and "ShapeMNK12812832" in ptx
    assert "tcgen05.ld.sync.aligned.32x32b.x32" in ptx and "tcgen05.ld.sync.aligned.32x32b.x128" not in ptx
    assert Sm100SwapABFusedIndexerQ.ptx_signature[1] in ptx
    # PDL as the native kernel: the weight (A) and its scale factors first, then the wait,
    # then the tokens (B, SFB); 16-byte output stores
    k = Sm100SwapABFusedIndexerQ(cfg)
    before = ptx.split("griddepcontrol.wait;")[0]
    assert before.count("cp.async.bulk.tensor") == 2 * min(k.stages, 1536 // 128)
    assert "st.global.v4.b32" in ptx
    assert _spills(ck) == 0


def test_swap_ab_limits():
    from indexer_q.kernels.gemm_sm90_swap_ab import Sm90SwapABFusedIndexerQ as S90
    from indexer_q.kernels.gemm_sm100_swap_ab import Sm100SwapABFusedIndexerQ as S100
    from indexer_q.kernels.gemm_sm90 import Sm90FusedIndexerQ as S90N

    sw = dict(kind="swap_ab")
    assert S90.can_implement(GemmConfig(tile_m=16, **sw), 8192, 1536)
    assert not S90.can_implement(GemmConfig(tile_m=128, **sw), 8192, 1536)  # tokens on N: 8..64
    assert not S90.can_implement(GemmConfig(tile_m=16, split_k=8, **sw), 8192, 1536)  # 12 K blocks
    assert S90.can_implement(GemmConfig(tile_m=16, split_k=8, **sw), 8192, 1024)
    # token tiles sharing the weight: pairs of tiles of any size, alone on their axis
    assert S90.can_implement(GemmConfig(tile_m=16, cluster_m=2, **sw), 8192, 1536)
    assert not S90.can_implement(GemmConfig(tile_m=16, cluster_m=4, **sw), 8192, 1536)
    assert S90.can_implement(GemmConfig(tile_m=64, cluster_m=2, pipelined_promotion=True, fused_act_quant=True, **sw),
                             8192, 1536)
    assert not S90.can_implement(GemmConfig(tile_m=16, cluster_m=2, split_k=2, **sw), 8192, 1536)
    # shared memory: a gathering split of 6 keeps 5 slots of the 64-token tile (160 KB); a
    # reduce-scattering one (8 ranks, one group of 8 tokens each) keeps 8 slots of 8 tokens
    assert not S90.can_implement(GemmConfig(tile_m=64, split_k=6, fused_act_quant=True, **sw), 1024, 1536)
    assert S90.can_implement(GemmConfig(tile_m=64, split_k=8, fused_act_quant=True, **sw), 1024, 1024)
    assert not S90.can_implement(GemmConfig(tile_m=16), 8192, 1536)  # kind native
    # a second partial accumulator fits up to 32-token tiles; at 64 the m64 halves pipeline,
    # with the fused quantizer only (the separate one's scales a block ahead spill there)
    assert S90.can_implement(GemmConfig(tile_m=32, pipelined_promotion=True, **sw), 8192, 1536)
    assert S90.can_implement(GemmConfig(tile_m=64, pipelined_promotion=True, fused_act_quant=True, **sw), 8192, 1536)
    assert not S90.can_implement(GemmConfig(tile_m=64, pipelined_promotion=True, **sw), 8192, 1536)
    # 16-token pipelined tiles with the separate quantizer: up to 8 K blocks a CTA (12 spilled)
    pipe16 = dict(tile_m=16, pipelined_promotion=True, **sw)
    assert S90.can_implement(GemmConfig(**pipe16), 8192, 1024)
    assert S90.can_implement(GemmConfig(split_k=2, **pipe16), 8192, 1536)
    assert S90.can_implement(GemmConfig(fused_act_quant=True, **pipe16), 8192, 1536)
    assert not S90.can_implement(GemmConfig(**pipe16), 8192, 1536)
    assert not S90.can_implement(GemmConfig(cluster_m=2, epilogue_warpgroups=2, **pipe16), 1024, 1536)
    # the fused quantizer at 16 or 4 lanes a unit; the separate one is the act_quant kernel's 16
    assert S90.can_implement(GemmConfig(tile_m=16, fused_act_quant=True, act_quant_lanes=4, **sw), 8192, 1536)
    assert not S90.can_implement(GemmConfig(tile_m=16, fused_act_quant=True, act_quant_lanes=8, **sw), 8192, 1536)
    assert not S90.can_implement(GemmConfig(tile_m=16, act_quant_lanes=4, **sw), 8192, 1536)
    assert "act_quant_lanes=4" in " ".join(S90.config_problems(GemmConfig(tile_m=16, act_quant_lanes=4, **sw)))
    # qr loaded by the quantizers instead of staged: only where it would be staged (fused,
    # up to 16 tokens); its 48 KB at K = 1536 go to the ring (8 -> 11 stages at 16 tokens)
    fused16 = GemmConfig(tile_m=16, fused_act_quant=True, **sw)
    loaded16 = dataclasses.replace(fused16, stage_qr=False)
    assert S90.can_implement(loaded16, 8192, 1536)
    assert (S90.stages_that_fit(fused16, 1536), S90.stages_that_fit(loaded16, 1536)) == (8, 11)
    assert not S90.can_implement(GemmConfig(tile_m=32, fused_act_quant=True, stage_qr=False, **sw), 8192, 1536)
    assert not S90.can_implement(GemmConfig(tile_m=16, stage_qr=False, **sw), 8192, 1536)
    assert "stage_qr=False" in " ".join(S90.config_problems(GemmConfig(tile_m=16, stage_qr=False, **sw)))
    # the weight's scales before the consumer's PDL wait: its pipelined K loops load them ahead
    early = dict(fused_act_quant=True, pipelined_promotion=True, scales_before_pdl_wait=True, **sw)
    assert S90.can_implement(GemmConfig(tile_m=32, **early), 8192, 1024)
    assert not S90.can_implement(GemmConfig(tile_m=32, **(early | {"pipelined_promotion": False})), 8192, 1024)
    assert not S90.can_implement(GemmConfig(tile_m=32, pdl=False, **early), 8192, 1024)
    assert "scales_before_pdl_wait" in " ".join(S90.config_problems(GemmConfig(tile_m=32, pdl=False, **early)))
    assert not S90N.can_implement(GemmConfig(tile_m=64, pipelined_promotion=True, scales_before_pdl_wait=True),
                                  8192, 1024)
    # warp-uniform descriptors: the sm_90a swapped kernel only
    assert S90.can_implement(GemmConfig(tile_m=64, uniform_descriptors=True, **sw), 8192, 1536)
    assert not S90N.can_implement(GemmConfig(tile_m=64, uniform_descriptors=True), 8192, 1536)
    assert "uniform_descriptors" in " ".join(S90N.config_problems(GemmConfig(tile_m=64, uniform_descriptors=True)))
    # the phase-clock trace: the swapped kernel's probe, or the kernel whole (stamps after q)
    assert S90.can_implement(GemmConfig(tile_m=16, epilogue=False, trace=True, **sw), 8192, 1536)
    assert S90.can_implement(GemmConfig(tile_m=16, trace=True, **sw), 8192, 1536)
    assert not S100.can_implement(GemmConfig(tile_m=128, trace=True, **dict(sw, arch="sm_100a")), 8192, 1536)
    s100 = dict(arch="sm_100a", kind="swap_ab")
    assert S100.can_implement(GemmConfig(tile_m=128, **s100), 8192, 1536)
    assert not S100.can_implement(GemmConfig(tile_m=64, **s100), 8192, 1536)
    assert not S100.can_implement(GemmConfig(tile_m=256, **s100), 8192, 1536)
    assert not S100.can_implement(GemmConfig(tile_m=128, fused_act_quant=True, **s100), 8192, 1536)
    assert not S100.can_implement(GemmConfig(tile_m=128, act_quant_lanes=4, **s100), 8192, 1536)
    assert not S100.can_implement(GemmConfig(tile_m=128, stage_qr=False, **s100), 8192, 1536)
    assert not S100.can_implement(GemmConfig(tile_m=128, pipelined_promotion=True, scales_before_pdl_wait=True,
                                             **s100), 8192, 1536)
    assert not S100.can_implement(GemmConfig(tile_m=128, uniform_descriptors=True, **s100), 8192, 1536)


def test_sm90_scales_before_pdl_wait_moves_only_the_wait(tmp_path):
    """scales_before_pdl_wait changes the consumer's code (its PDL wait after the first
    tile's weight-scale loads), not what the kernel computes: the same instructions but
    that order, one consumer wait either way."""
    base = dict(kind="swap_ab", hadamard=True, tile_m=32, fused_act_quant=True, epilogue_warpgroups=2,
                pipelined_promotion=True, cluster_n=2, tensor_core_hadamard=True, act_quant_lanes=4)
    ptx = {}
    for early in (False, True):
        ck = jit.compile_fused(GemmConfig(scales_before_pdl_wait=early, **base), 8192, 1024,
                               keep_dir=str(tmp_path / str(early)))
        ptx[early] = _ptx(ck)
        assert _spills(ck) == 0
    assert ptx[True] != ptx[False]
    assert ptx[True].count("griddepcontrol.wait") == ptx[False].count("griddepcontrol.wait")

    def instructions(text):
        return sorted(line.split()[0] for line in text.splitlines() if line.strip() and not line.strip().startswith(
            ("//", "$", "{", "}", ".", "@")) and not line.rstrip().endswith(":"))
    # the same multiset of opcodes (register numbering and the branch around the wait aside)
    a, b = instructions(ptx[False]), instructions(ptx[True])
    assert abs(len(a) - len(b)) <= 8, (len(a), len(b))


def test_sm90_swap_ab_trace_probe_compiles(tmp_path):
    """tuning/trace_decode's probe: clock stamps at the phase boundaries (global timer at
    the consumer's start and hand-off); the plain probe has none; traced whole (--whole),
    the kernel with its epilogue stamps the same phases and the epilogue's first tile."""
    cfg = GemmConfig(kind="swap_ab", tile_m=16, split_k=2, fused_act_quant=True, epilogue=False, trace=True)
    ptx = _ptx(jit.compile_fused(cfg, 8192, 1536, keep_dir=str(tmp_path / "trace")))
    assert ptx.count("%globaltimer") == 2 and ptx.count("%clock64") >= 8
    plain = _ptx(jit.compile_fused(dataclasses.replace(cfg, trace=False), 8192, 1536, keep_dir=str(tmp_path / "plain")))
    assert "%globaltimer" not in plain and "%clock64" not in plain
    whole = _ptx(jit.compile_fused(dataclasses.replace(cfg, epilogue=True), 8192, 1536,
                                   keep_dir=str(tmp_path / "whole")))
    assert whole.count("%globaltimer") == 2 and whole.count("%clock64") >= ptx.count("%clock64")


def test_sm90_swap_ab_trace_stamps_each_k_block(tmp_path):
    """The pipelined K loop's trace stamps each of the first tile's 12 K blocks three times
    (the producer's request, the consumer's wait begun and over: trace_decode's
    kb*_requested / kb*_wait_began / kb*_in_smem) on top of the phases."""
    base = dict(kind="swap_ab", tile_m=32, cluster_n=2, fused_act_quant=True, pipelined_promotion=True,
                epilogue_warpgroups=2, act_quant_lanes=4, uniform_descriptors=True, trace=True)
    pipelined = _ptx(jit.compile_fused(GemmConfig(**base), 8192, 1536, keep_dir=str(tmp_path / "pipelined")))
    plain = _ptx(jit.compile_fused(GemmConfig(**dict(base, pipelined_promotion=False)), 8192, 1536,
                                   keep_dir=str(tmp_path / "plain")))
    assert pipelined.count("%clock64") >= plain.count("%clock64") + 2 * 12
