"""Blackwell (sm_100a) fused indexer-Q kernel, native tactic. Compiled and checked on the
CPU (tcgen05 block-scaled MMA in its PTX); no Blackwell GPU has run it yet.

Persistent, warp-specialized: the TMA warp loads A (e4m3 activation), B (e4m3 weight)
and their UE8M0 scale factors (the SPEC's 1x128 / 128x128 scales replicated per 32 K into
the 128x4 scale-factor atom layout) into a ring of shared-memory stages; the MMA warp
copies the scale factors into tensor memory and issues `tcgen05.mma ...
kind::mxf8f6f4.block_scale` into a TMEM accumulator (two stages, so the next tile's MMAs
run while the epilogue drains this one); the epilogue warps load the accumulator one row
a thread (`tcgen05.ld 32x32b`, 128 columns = one head) and run the shared epilogue
(kernels/epilogue.py, SM100_ROW_LAYOUT: every column thread-local, no shuffles) with
16-byte stores and the Hadamard's butterflies as packed fp32x2 adds.

Warps: 0 .. 4 * epilogue_warpgroups - 1 run the epilogue, then the MMA warp, then the TMA
warp. With `epilogue_warpgroups=2` the two epilogue warpgroups take turns, tile by tile:
warpgroup g drains accumulator stage g, so each has two tiles' mainloop time for its
tile, and two warps share each SM sub-partition (README, "Blackwell": the epilogue's
instructions per tile against the mainloop's).

PDL (`pdl=True`, as on sm_90a): the kernel is launched as a programmatic dependent of the
activation quantizer. The TMA warp requests the first tile's weight blocks and their
scale factors (as many stages as the ring holds), then waits for the quantizer's grid
(`griddepcontrol.wait`) before it loads the activation or its scale factors; the
epilogue warps wait before they read positions or cos/sin.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from . import epilogue as epi
from .gemm_base import SCALE_BLOCK_K, FusedIndexerQGemmBase, GemmConfig

SF_VEC = 32  # MXF8 block scaling: one UE8M0 byte per 32 K
SMEM_CAPACITY = 227 * 1024
EPI_WARPS = (0, 1, 2, 3)  # one epilogue warpgroup (epilogue_warpgroups=1)
MMA_WARP = 4  # (with epilogue_warpgroups=1; see Sm100FusedIndexerQ.mma_warp)
TMA_WARP = 5
ACC_STAGES = 2
TMEM_COLUMNS = 512


def sf_atom_offset(row: int, k_block32: int, k: int) -> int:
    """Byte offset of a scale factor in the 128x4 atom layout (rows padded to 128):
    [row // 128][k_block32 // 4][row % 32][(row // 32) % 4][k_block32 % 4]."""
    return (((row // 128) * (k // 128) + k_block32 // 4) * 512
            + (row % 32) * 16 + ((row // 32) % 4) * 4 + k_block32 % 4)


def _bf16_words(regs) -> list:
    """A row of fp32 accumulator registers, rounded to bf16, as bf16x2 words."""
    return [epi.bf16x2_word(regs[c], regs[c + 1]) for c in range(0, epi.HEAD_DIM, 2)]


# ---------------------------------------------------------------- packed fp32x2 arithmetic
@dsl_user_op
def _f32x2(op: str, a0: Float32, a1: Float32, b0: Float32, b1: Float32, *, loc=None, ip=None):
    """(a0 op b0, a1 op b1) as one `op.rn.f32x2` (sm_100+: FADD2 / FMUL2): two IEEE fp32
    operations, each rounded on its own, so the results are those of two scalar ones."""
    pair = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32(), T.f32()]),
        [Float32(x).ir_value(loc=loc, ip=ip) for x in (a0, a1, b0, b1)],
        "{ .reg .b64 a, b, d; mov.b64 a, {$2, $3}; mov.b64 b, {$4, $5}; "
        f"{op}.rn.f32x2 d, a, b; mov.b64 {{$0, $1}}, d; }}",
        "=f,=f,f,f,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return (Float32(llvm.extractvalue(T.f32(), pair, [0], loc=loc, ip=ip)),
            Float32(llvm.extractvalue(T.f32(), pair, [1], loc=loc, ip=ip)))


_bf16_word = epi.bf16x2_word  # (a name here, so a CPU test can model the row in numpy)


def hadamard_row_packed(vals: list) -> list:
    """SPEC step 4 on a whole row in one thread (SM100_ROW_LAYOUT), bit for bit
    epi.hadamard_sums + epi.hadamard_scale_round: the butterflies over column bit 0 one by
    one, then those over bits 1..6 two at a time as packed fp32x2 adds (columns 2j and
    2j + 1 side by side: each stage's pairs keep that packing), then fp32(128^-0.5) as
    packed multiplies and the bf16 rounding, to bf16x2 words. Every value sees the same
    fp32 operations in the same order as the reference's; only the instruction count
    changes (7 x 128 adds -> 128 + 6 x 64)."""
    n = len(vals)
    cur = list(vals)
    for i in range(0, n, 2):  # bit 0: within a packed pair
        cur[i], cur[i + 1] = cur[i] + cur[i + 1], cur[i] - cur[i + 1]
    for b in range(1, 7):
        m = 1 << b
        nxt = list(cur)
        for i in range(0, n, 2):
            if not i & m:
                nxt[i], nxt[i + 1] = _f32x2("add", cur[i], cur[i + 1], cur[i | m], cur[(i | m) + 1])
                nxt[i | m], nxt[(i | m) + 1] = _f32x2("sub", cur[i], cur[i + 1], cur[i | m], cur[(i | m) + 1])
        cur = nxt
    s = epi.HADAMARD_SCALE
    out = []
    for i in range(0, n, 2):
        lo, hi = _f32x2("mul", cur[i], cur[i + 1], s, s)
        out.append(_bf16_word(lo, hi))
    return out


def row_epilogue(words: list, cos_sin_vals, config: GemmConfig, row, m, head, out_q, out_scale) -> None:
    """SPEC steps 3-6 on one head row held whole by this thread (SM100_ROW_LAYOUT) and its
    stores: epi.head_row_epilogue's steps, with the Hadamard as hadamard_row_packed and the
    q stores 16 bytes wide (the row's words are 16 (MXFP4), 32 (FP8) or 64 (bf16) consecutive
    words from a 16-byte aligned head offset: _store_row_v4's precondition)."""
    layout = epi.SM100_ROW_LAYOUT
    zero = Int32(0)
    words = epi.rope_hadamard(words, layout, zero, cos_sin_vals, config.hadamard, hadamard_row_packed)
    epi.quantize_store_row(words, layout, zero, config, row, m, head, out_q, out_scale, vector=True)


def sf_tmem_tensors(tiled_mma, mma_tiler, acc, sfa_smem_staged, sfb_smem_staged):
    """The scale factors' TMEM tensors and their first columns, (tCtSFA, tCtSFB, sfa_col,
    sfb_col), columns counted from the accumulator's: SFA right after the accumulator
    stages, SFB right after SFA. Both offsets come from the TMEM layouts
    (tcgen05.find_tmem_tensor_col_offset), as in NVIDIA's dense_blockscaled_gemm_persistent,
    so they follow the MMA tiler's K (a 128-row SFA takes tile K / MMA K columns: 4 for the
    128-K tile) instead of assuming the 128-K tile."""
    sf_dtype = cutlass.Float8E8M0FNU
    sfa_layout = blockscaled_utils.make_tmem_layout_sfa(
        tiled_mma, mma_tiler, SF_VEC, cute.slice_(sfa_smem_staged, (None, None, None, 0)))
    sfb_layout = blockscaled_utils.make_tmem_layout_sfb(
        tiled_mma, mma_tiler, SF_VEC, cute.slice_(sfb_smem_staged, (None, None, None, 0)))
    sfa_col = tcgen05.find_tmem_tensor_col_offset(acc)
    tCtSFA = cute.make_tensor(cute.recast_ptr(acc.iterator + sfa_col, dtype=sf_dtype), sfa_layout)
    sfb_col = sfa_col + tcgen05.find_tmem_tensor_col_offset(tCtSFA)
    tCtSFB = cute.make_tensor(cute.recast_ptr(acc.iterator + sfb_col, dtype=sf_dtype), sfb_layout)
    return tCtSFA, tCtSFB, sfa_col, sfb_col


class Sm100FusedIndexerQ(FusedIndexerQGemmBase):
    arch = "sm_100a"
    supported_kinds = ("native",)
    ptx_signature = ("tcgen05.mma block_scale", "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale")
    # Implemented by this class's device code; a subclass that brings its own (kernel,
    # _producer, _epilogue) offers 1 epilogue warpgroup unless it declares more itself.
    epilogue_warpgroup_choices = (1, 2)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.epilogue_warpgroup_choices = vars(cls).get("epilogue_warpgroup_choices", (1,))

    @classmethod
    def config_problems(cls, config: GemmConfig) -> list[str]:
        out = super().config_problems(config)
        if config.tile_m != 128:
            out.append(f"tile_m={config.tile_m} (sm_100a: 128, one MMA M)")
        if config.cluster_m != 1 or config.cluster_n != 1:
            out.append("clusters are not implemented on sm_100a yet")
        if config.mma_per_promotion != 4:
            out.append("sm_100a applies the block scales in the MMA (no promotion knob)")
        if config.pipelined_promotion:
            out.append("pipelined_promotion (sm_100a applies the block scales in the MMA: nothing to pipeline)")
        if not config.epilogue:
            out.append("epilogue=False (the profiling probe is sm_90a only; here it would run the full epilogue)")
        return out

    @staticmethod
    def max_stages(config: GemmConfig) -> int:
        ab = (config.tile_m + epi.HEAD_DIM) * SCALE_BLOCK_K
        sf = (config.tile_m + epi.HEAD_DIM) * SCALE_BLOCK_K // SF_VEC
        return (SMEM_CAPACITY - 2048) // (ab + sf)

    def __init__(self, config: GemmConfig):
        super().__init__(config)
        self.stages = config.stages or min(self.max_stages(config), 8)
        self.mma_tiler_mn = (config.tile_m, epi.HEAD_DIM)
        self.epi_warpgroups = config.epilogue_warpgroups
        self.epi_threads = 128 * self.epi_warpgroups
        self.mma_warp = 4 * self.epi_warpgroups
        self.tma_warp = self.mma_warp + 1
        if self.epi_warpgroups == 1:
            self.threads = 32 * (self.tma_warp + 1)
            self.launch_regs = self.other_regs = self.epilogue_regs = None  # no setmaxnreg
        else:
            # Two epilogue warps share each SM sub-partition with one warp of the last
            # warpgroup (MMA, TMA, two idle), whose registers they take: setmaxnreg moves
            # them inside the launch allocation (ptxas's entry count, 65536 / threads
            # rounded down to 8, x threads). A whole row a thread needs more than the 168
            # an even split gives (it spills there).
            self.threads = 128 * (self.epi_warpgroups + 1)
            self.launch_regs = (65536 // self.threads) // 8 * 8
            self.other_regs = 40
            pool = self.launch_regs * self.threads // 128  # per thread of each warpgroup
            self.epilogue_regs = (pool - self.other_regs) // self.epi_warpgroups // 8 * 8
        self.row_layout = epi.SM100_ROW_LAYOUT
        self.acc_stages = ACC_STAGES
        self.weight_is_a = False  # the weight is the MMA's B here, its A in the swapped-A/B kernel
        self.epilog_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.epi_threads)
        self.tmem_alloc_barrier = pipeline.NamedBarrier(barrier_id=2, num_threads=self.epi_threads + 32)

    def _tiled_mma(self, a_dtype, b_dtype, sf_dtype, tiler_mn):
        return sm100_utils.make_blockscaled_trivial_tiled_mma(
            a_dtype, b_dtype, OperandMajorMode.K, OperandMajorMode.K, sf_dtype, SF_VEC,
            tcgen05.CtaGroup.ONE, tiler_mn,
        )

    def operand_args(self, m, n: int, k: int) -> list:
        """fp8 A [M, K], its UE8M0 bytes in the atom layout (rows padded to 128, flat),
        fp8 W [N, K], its UE8M0 bytes likewise."""
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_compact_tensor

        rowmaj = (1, 0)
        return [
            make_fake_compact_tensor(cutlass.Float8E4M3FN, (m, k), stride_order=rowmaj, assumed_align=16),
            make_fake_compact_tensor(cutlass.Uint8, (cute.sym_int(),), assumed_align=128),
            make_fake_compact_tensor(cutlass.Float8E4M3FN, (n, k), stride_order=rowmaj, assumed_align=16),
            make_fake_compact_tensor(cutlass.Uint8, (n * k // SF_VEC,), assumed_align=128),
        ]

    @cute.jit
    def _setup_operands(self, a_mk, sfa_bytes, b_nk, sfb_bytes):
        """The MMA, the staged shared-memory layouts (self.*_smem_staged, self.mma_tiler,
        self.tx_bytes) and the TMA atoms of A [rows, K] and B [rows, K] (K-major) with their
        UE8M0 scale-factor bytes in the atom layout: the native kernel passes the
        activation as A and the weight as B, the swapped-A/B kernel the other way round.
        Returns (tiled_mma, (tma_a, mA), (tma_b, mB), (tma_sfa, mSFA), (tma_sfb, mSFB))."""
        k = a_mk.shape[1]
        ra, rb = a_mk.shape[0], b_nk.shape[0]
        a_dtype, b_dtype, sf_dtype = a_mk.element_type, b_nk.element_type, cutlass.Float8E8M0FNU
        # (rows, K, L = 1) views, K-major, as the tcgen05 helpers expect
        a3 = cute.make_tensor(a_mk.iterator, cute.make_layout((ra, k, 1), stride=(k, 1, ra * k)))
        b3 = cute.make_tensor(b_nk.iterator, cute.make_layout((rb, k, 1), stride=(k, 1, rb * k)))
        sfa = cute.make_tensor(cute.recast_ptr(sfa_bytes.iterator, dtype=sf_dtype),
                               blockscaled_utils.tile_atom_to_shape_SF(a3.shape, SF_VEC))
        sfb = cute.make_tensor(cute.recast_ptr(sfb_bytes.iterator, dtype=sf_dtype),
                               blockscaled_utils.tile_atom_to_shape_SF(b3.shape, SF_VEC))

        tiled_mma = self._tiled_mma(a_dtype, b_dtype, sf_dtype, self.mma_tiler_mn)
        mma_k = cute.size(tiled_mma.shape_mnk, mode=[2])
        self.mma_tiler = (*self.mma_tiler_mn, mma_k * (SCALE_BLOCK_K // mma_k))
        self.cluster_layout_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))
        stages = self.stages
        self.a_smem_staged = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, a_dtype, stages)
        self.b_smem_staged = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, b_dtype, stages)
        self.sfa_smem_staged = blockscaled_utils.make_smem_layout_sfa(tiled_mma, self.mma_tiler, SF_VEC, stages)
        self.sfb_smem_staged = blockscaled_utils.make_smem_layout_sfb(tiled_mma, self.mma_tiler, SF_VEC, stages)

        def tma(load_b, op_tensor, smem_staged, internal=None):
            smem = cute.slice_(smem_staged, (None, None, None, 0))
            make = cute.nvgpu.make_tiled_tma_atom_B if load_b else cute.nvgpu.make_tiled_tma_atom_A
            op = (sm100_utils.cluster_shape_to_tma_atom_B if load_b else sm100_utils.cluster_shape_to_tma_atom_A)(
                (1, 1), tiled_mma.thr_id)
            atom, tensor = make(op, op_tensor, smem, self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape,
                                internal_type=internal)
            return atom, tensor, smem

        tma_a, mA, a_smem = tma(False, a3, self.a_smem_staged)
        tma_b, mB, b_smem = tma(True, b3, self.b_smem_staged)
        tma_sfa, mSFA, sfa_smem = tma(False, sfa, self.sfa_smem_staged, cutlass.Int16)
        tma_sfb, mSFB, sfb_smem = tma(True, sfb, self.sfb_smem_staged, cutlass.Int16)
        self.tx_bytes = (cute.size_in_bytes(a_dtype, a_smem) + cute.size_in_bytes(b_dtype, b_smem)
                         + cute.size_in_bytes(sf_dtype, sfa_smem) + cute.size_in_bytes(sf_dtype, sfb_smem))
        return tiled_mma, (tma_a, mA), (tma_b, mB), (tma_sfa, mSFA), (tma_sfb, mSFB)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # fp8 [M, K], K-major
        sfa_bytes: cute.Tensor,  # uint8, the activation's UE8M0 bytes in the atom layout
        w: cute.Tensor,  # fp8 [N, K], K-major
        sfw_bytes: cute.Tensor,  # uint8, the weight's UE8M0 bytes in the atom layout
        positions: cute.Tensor,  # int32/int64 [M]
        cos_sin: cute.Tensor,  # f32 [P, 64]
        out_q: cute.Tensor,  # int32 words [M, N/8] (packed mxfp4), [M, N/4] (e4m3) or [M, N/2] (bf16)
        out_scale: cute.Tensor,  # int32 [M, H]
        max_active_clusters: cutlass.Constexpr,
        stream,
    ):
        m, k = a.shape
        n = w.shape[0]
        operands = self._setup_operands(a, sfa_bytes, w, sfw_bytes)
        tiles_mnl = (cute.ceil_div(m, self.mma_tiler[0]), n // self.mma_tiler[1], 1)
        self.shared_storage = self._shared_storage(a.element_type, w.element_type)
        self._launch(operands, tiles_mnl, positions, cos_sin, out_q, out_scale, m, max_active_clusters, stream)

    def _launch(self, operands, tiles_mnl, positions, cos_sin, out_q, out_scale, m, max_active_clusters, stream):
        """The persistent launch over scheduler tiles `tiles_mnl`, one CTA a cluster, with
        the operands _setup_operands made (self.shared_storage set by the caller)."""
        tiled_mma, (tma_a, mA), (tma_b, mB), (tma_sfa, mSFA), (tma_sfb, mSFB) = operands
        sched_params = utils.PersistentTileSchedulerParams(tiles_mnl, (1, 1, 1), self.config.swizzle,
                                                           self.config.raster_along_m)
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched_params, max_active_clusters)
        self.kernel(
            tiled_mma, self.cluster_layout_vmnk, tma_a, mA, tma_b, mB, tma_sfa, mSFA, tma_sfb, mSFB,
            self.a_smem_staged, self.b_smem_staged, self.sfa_smem_staged, self.sfb_smem_staged,
            sched_params, positions, cos_sin, out_q, out_scale, m,
        ).launch(grid=grid, block=[self.threads, 1, 1], cluster=(1, 1, 1), stream=stream, min_blocks_per_mp=1,
                 use_pdl=self.config.pdl)

    def _shared_storage(self, a_dtype, b_dtype, hand_off_words: int = 0):
        """The CTA's shared memory: barriers, the TMEM address, then 1024-aligned buffers:
        the bf16 hand-off tile when the kernel has one (swapped A/B), the A and B rings and
        their scale factors'."""
        sf_dtype = cutlass.Float8E8M0FNU

        def buf(dtype, n):
            return cute.struct.Align[cute.struct.MemRange[dtype, n], 1024]

        fields = {
            "ab_full": cute.struct.MemRange[cutlass.Int64, self.stages],
            "ab_empty": cute.struct.MemRange[cutlass.Int64, self.stages],
            "acc_full": cute.struct.MemRange[cutlass.Int64, self.acc_stages],
            "acc_empty": cute.struct.MemRange[cutlass.Int64, self.acc_stages],
            "tmem_holding": cutlass.Int32,
        }
        if hand_off_words:
            fields["sQ"] = buf(Int32, hand_off_words)
        fields["sA"] = buf(a_dtype, cute.cosize(self.a_smem_staged.outer))
        fields["sB"] = buf(b_dtype, cute.cosize(self.b_smem_staged.outer))
        fields["sSFA"] = buf(sf_dtype, cute.cosize(self.sfa_smem_staged))
        fields["sSFB"] = buf(sf_dtype, cute.cosize(self.sfb_smem_staged))
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self, tiled_mma: cute.TiledMma, cluster_layout_vmnk: cute.Layout, tma_a: cute.CopyAtom,
        mA: cute.Tensor, tma_b: cute.CopyAtom,
        mB: cute.Tensor, tma_sfa: cute.CopyAtom, mSFA: cute.Tensor, tma_sfb: cute.CopyAtom, mSFB: cute.Tensor,
        a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout, sfa_smem_staged: cute.Layout,
        sfb_smem_staged: cute.Layout, sched_params: utils.PersistentTileSchedulerParams,
        positions: cute.Tensor, cos_sin: cute.Tensor, out_q: cute.Tensor, out_scale: cute.Tensor, m: Int32,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == self.tma_warp:
            for atom in (tma_a, tma_b, tma_sfa, tma_sfb):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
        (storage, ab_pipeline, acc_pipeline, tmem, k_tiles, loads, tCrA, tCrB, sSFA, sSFB,
         tCtAcc_fake) = self._device_setup(
            tiled_mma, cluster_layout_vmnk, tma_a, mA, tma_b, mB, tma_sfa, mSFA, tma_sfb, mSFB,
            a_smem_staged, b_smem_staged, sfa_smem_staged, sfb_smem_staged)

        if warp_idx >= self.mma_warp:  # MMA, TMA (and with two epilogue warpgroups two idle warps)
            if cutlass.const_expr(self.epilogue_regs is not None):
                cute.arch.setmaxregister_decrease(self.other_regs)  # the whole last warpgroup
            if warp_idx == self.tma_warp:
                self._producer(ab_pipeline, k_tiles, sched_params, *loads)
            if warp_idx == self.mma_warp:
                tmem.wait_for_alloc()
                acc_ptr = tmem.retrieve_ptr(Float32)
                self._mma(tiled_mma, ab_pipeline, acc_pipeline, k_tiles, sched_params, acc_ptr, tCtAcc_fake,
                          tCrA, tCrB, sSFA, sSFB, sfa_smem_staged, sfb_smem_staged)
        else:
            if cutlass.const_expr(self.epilogue_regs is not None):
                cute.arch.setmaxregister_increase(self.epilogue_regs)
            tmem.allocate(TMEM_COLUMNS)
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            self._epilogue(acc_pipeline, sched_params, cute.make_tensor(acc_ptr, tCtAcc_fake.layout), tidx,
                           positions, cos_sin, out_q, out_scale, m)
            tmem.relinquish_alloc_permit()
            self.epilog_barrier.arrive_and_wait()
            tmem.free(acc_ptr)

    def _device_setup(self, tiled_mma, cluster_layout_vmnk, tma_a, mA, tma_b, mB, tma_sfa, mSFA, tma_sfb, mSFB,
                      a_smem_staged, b_smem_staged, sfa_smem_staged, sfb_smem_staged):
        """What the warps of every sm_100a kernel share, straight-line code traced in the
        kernel (no dynamic branch, so a plain method): shared memory, the operand and
        accumulator pipelines, the TMEM allocator, the TMA partitions ("loads": (atom,
        global, shared) of A, B, SFA, SFB), the MMA fragments and the accumulator's TMEM
        layout (self.acc_stages stages)."""
        storage = utils.SmemAllocator().allocate(self.shared_storage)
        ab_pipeline = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_full.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.tx_bytes,
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        # Each accumulator stage is drained by one epilogue warpgroup: 128 threads release it.
        acc_pipeline = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_full.data_ptr(),
            num_stages=self.acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        tmem = utils.TmemAllocator(storage.tmem_holding.ptr, barrier_for_retrieve=self.tmem_alloc_barrier,
                                   allocator_warp_id=0)
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sSFA = storage.sSFA.get_tensor(sfa_smem_staged)
        sSFB = storage.sSFB.get_tensor(sfb_smem_staged)
        # (bM, bK, tiles_m, tiles_k, L) etc., then the MMA's view of them
        gA = cute.local_tile(mA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        gSFA = cute.local_tile(mSFA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        gSFB = cute.local_tile(mSFB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        k_tiles = cute.size(gA, mode=[3])
        thr_mma = tiled_mma.get_slice(0)
        one_cta = cute.make_layout(1)

        def partition(atom, s, g_mma):
            return cute.nvgpu.cpasync.tma_partition(atom, 0, one_cta, cute.group_modes(s, 0, 3),
                                                    cute.group_modes(g_mma, 0, 3))

        tAsA, tAgA = partition(tma_a, sA, thr_mma.partition_A(gA))
        tBsB, tBgB = partition(tma_b, sB, thr_mma.partition_B(gB))
        tAsSFA, tAgSFA = partition(tma_sfa, sSFA, thr_mma.partition_A(gSFA))
        tBsSFB, tBgSFB = partition(tma_sfb, sSFB, thr_mma.partition_B(gSFB))
        tAsSFA, tAgSFA = cute.filter_zeros(tAsSFA), cute.filter_zeros(tAgSFA)
        tBsSFB, tBgSFB = cute.filter_zeros(tBsSFB), cute.filter_zeros(tBgSFB)
        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.acc_stages))
        pipeline_init_wait(cluster_shape_mn=(1, 1))
        loads = ((tma_a, tAgA, tAsA), (tma_b, tBgB, tBsB), (tma_sfa, tAgSFA, tAsSFA), (tma_sfb, tBgSFB, tBsSFB))
        return storage, ab_pipeline, acc_pipeline, tmem, k_tiles, loads, tCrA, tCrB, sSFA, sSFB, tCtAcc_fake

    @cute.jit
    def _producer(self, ab_pipeline, k_tiles, sched_params, load_a, load_b, load_sfa, load_sfb):
        """TMA warp. A load is (atom, global partition, shared partition). A scheduler tile
        is (token tile, head): the weight's operand and scale factors (B and SFB here, A and
        SFA in the swapped-A/B kernel: self.weight_is_a) take the head, the activation's
        the token tile."""
        head_a = 1 if self.weight_is_a else 0  # the tile mode that indexes A (and SFA)
        weight, act = ((load_b, load_sfb), (load_a, load_sfa))
        if cutlass.const_expr(self.weight_is_a):
            weight, act = act, weight
        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                           cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        # PDL: the first tile's weight blocks and their scale factors (as many stages as
        # the ring holds) are requested before waiting for the activation quantizer; those
        # stages get the activation's blocks after the wait (each stage's barrier expects
        # all four copies' bytes). The weight may be read before the wait: run_fused
        # launches the quantizer, which writes only the activation and its scale factors,
        # right before this kernel, and that launch waits for all earlier work.
        early = 0
        if cutlass.const_expr(self.config.pdl):
            early = min(self.stages, k_tiles)
            act_state = state.clone()
            if work.is_valid_tile:
                w_loads = [(atom, g[(None, work.tile_idx[1], None, 0)], sm) for atom, g, sm in weight]
                for kt in cutlass.range_constexpr(early):
                    ab_pipeline.producer_acquire(state)
                    bar = ab_pipeline.producer_get_barrier(state)
                    for atom, g, sm in w_loads:
                        cute.copy(atom, g[(None, kt)], sm[(None, state.index)], tma_bar_ptr=bar)
                    state.advance()
            cute.arch.griddepcontrol_wait()
            if work.is_valid_tile:
                a_loads = [(atom, g[(None, work.tile_idx[0], None, 0)], sm) for atom, g, sm in act]
                for kt in cutlass.range_constexpr(early):
                    bar = ab_pipeline.producer_get_barrier(act_state)
                    for atom, g, sm in a_loads:
                        cute.copy(atom, g[(None, kt)], sm[(None, act_state.index)], tma_bar_ptr=bar)
                    act_state.advance()
        while work.is_valid_tile:
            tile = work.tile_idx
            srcs = [(atom, g[(None, tile[mode], None, 0)], sm)
                    for (atom, g, sm), mode in ((load_a, head_a), (load_b, 1 - head_a), (load_sfa, head_a),
                                                (load_sfb, 1 - head_a))]
            for kt in range(early, k_tiles):
                ab_pipeline.producer_acquire(state)
                bar = ab_pipeline.producer_get_barrier(state)
                for atom, g, sm in srcs:
                    cute.copy(atom, g[(None, kt)], sm[(None, state.index)], tma_bar_ptr=bar)
                state.advance()
            early = 0  # only the first tile had its first blocks issued above
            sched.advance_to_next_work()
            work = sched.get_current_work()
        ab_pipeline.producer_tail(state)

    def _s2t(self, s_sf, t_sf):
        """Shared -> tensor memory copy of one stage's scale factors (tcgen05.cp)."""
        s_compact = cute.filter_zeros(s_sf)
        t_compact = cute.filter_zeros(t_sf)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), cutlass.Float8E8M0FNU)
        copy = tcgen05.make_s2t_copy(atom, t_compact)
        thr = copy.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(copy, thr.partition_S(s_compact))
        return copy, src, thr.partition_D(t_compact)

    @cute.jit
    def _mma(self, tiled_mma, ab_pipeline, acc_pipeline, k_tiles, sched_params, acc_ptr, tCtAcc_fake,
             tCrA, tCrB, sSFA, sSFB, sfa_smem_staged, sfb_smem_staged):
        acc = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
        tCtSFA, tCtSFB, _, _ = sf_tmem_tensors(tiled_mma, self.mma_tiler, acc, sfa_smem_staged,
                                               sfb_smem_staged)
        copy_sfa, s2t_sfa_src, s2t_sfa_dst = self._s2t(sSFA, tCtSFA)
        copy_sfb, s2t_sfb_src, s2t_sfb_dst = self._s2t(sSFB, tCtSFB)

        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                           cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.acc_stages)
        while work.is_valid_tile:
            tile_acc = acc[(None, None, None, acc_state.index)]
            acc_pipeline.producer_acquire(acc_state)
            for kt in range(k_tiles):
                ab_pipeline.consumer_wait(ab_state)
                stage = (None, None, None, None, ab_state.index)
                cute.copy(copy_sfa, s2t_sfa_src[stage], s2t_sfa_dst)
                cute.copy(copy_sfb, s2t_sfb_src[stage], s2t_sfb_dst)
                tiled_mma.set(tcgen05.Field.ACCUMULATE, kt != 0)
                crd = (None, None, None, ab_state.index)
                cute.gemm(tiled_mma, tile_acc, [tCrA[crd], tCtSFA], [tCrB[crd], tCtSFB], tile_acc)
                ab_pipeline.consumer_release(ab_state)
                ab_state.advance()
            acc_pipeline.producer_commit(acc_state)
            acc_state.advance()
            sched.advance_to_next_work()
            work = sched.get_current_work()
        acc_pipeline.producer_tail(acc_state)

    @cute.jit
    def _epilogue(self, acc_pipeline, sched_params, acc, tidx, positions, cos_sin, out_q, out_scale, m):
        # One TMEM lane (= tile row) a thread, all 128 columns: tcgen05.ld 32x32b x128.
        tile_mn = self.mma_tiler[:2]
        wgs = self.epi_warpgroups
        wg = cute.arch.make_warp_uniform(tidx // 128)  # this thread's epilogue warpgroup
        lane_row = tidx % 128  # its TMEM lane (warp w reads lanes 32 (w % 4) ..)
        atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x128), Float32)
        acc_tile = acc[((None, None), 0, 0, None)]
        t2r = tcgen05.make_tmem_copy(atom, acc_tile[(None, None, 0)])
        thr = t2r.get_slice(lane_row)
        tTR_tAcc = thr.partition_S(acc_tile)
        tTR_cAcc = thr.partition_D(cute.make_identity_tensor(tile_mn))
        regs = cute.make_rmem_tensor(tTR_cAcc.shape, Float32)
        layout = self.row_layout
        num_pos = cos_sin.shape[0]
        zero = Int32(0)
        if cutlass.const_expr(self.config.pdl):
            # positions / cos_sin are read only after the quantizer's grid has completed,
            # as on sm_90a (nothing launched before it can still be writing them).
            cute.arch.griddepcontrol_wait()

        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                           cute.arch.grid_dim())
        # Warpgroup g takes this CTA's tiles g, g + wgs, ...: those whose accumulator is
        # stage g (the MMA warp fills the stages in turn), so its consumer state stays on
        # stage g and flips its phase once per tile it drains.
        if cutlass.const_expr(wgs > 1):
            sched.advance_to_next_work(advance_count=wg)
        work = sched.get_current_work()
        acc_state = pipeline.PipelineState(ACC_STAGES, Int32(0), Int32(wg), Int32(0))
        while work.is_valid_tile:
            tile = work.tile_idx
            row = tile[0] * tile_mn[0] + lane_row
            cs = epi.load_cos_sin(layout, row, m, num_pos, positions, cos_sin, zero)
            acc_pipeline.consumer_wait(acc_state)
            cute.copy(t2r, tTR_tAcc[(None, None, None, acc_state.index)], regs)
            cute.arch.fence_view_async_tmem_load()
            acc_pipeline.consumer_release(acc_state)  # the MMA warp may reuse this stage now
            for _ in cutlass.range_constexpr(wgs):
                acc_state.advance()
            words = _bf16_words(regs)  # SPEC step 2's bf16 rounding
            row_epilogue(words, cs, self.config, row, m, tile[1], out_q, out_scale)
            sched.advance_to_next_work(advance_count=wgs)
            work = sched.get_current_work()
