"""Hopper (sm_90a) fused indexer-Q kernel, native tactic.

Persistent, warp-specialized block-scaled FP8 GEMM: one TMA producer warp fills a
ring of (A tile, W tile) stages; 1 or 2 consumer warpgroups each own 64 token rows x
128 columns (= one head). Per 128-wide K block each consumer issues 4 WGMMAs
(m64n128k32, e4m3 x e4m3 -> fp32) into a partial accumulator, waits, and promotes it
into the main one with that block's scales (activation scale per row x weight scale
per 128x128 block). The two consumers interleave, so one's promotion runs under the
other's WGMMAs (DeepGEMM's sm90 scheme).

The epilogue runs in its own warpgroup(s) so that it overlaps the next tile's mainloop:
consumers round the finished tile to bf16 (SPEC step 2's rounding) into one of two
shared-memory buffers and go on; the epilogue warpgroups read it back (4 lanes a row
with one warpgroup, 8 with two) and apply kernels/epilogue.py (RoPE, Hadamard, MXFP4 /
FP8) and write the outputs.
Warpgroups: 0 = TMA producer, 1..C = MMA consumers, C+1.. = epilogue.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass._mlir.dialects import nvvm
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from . import epilogue as epi
from .gemm_base import SCALE_BLOCK_K, FusedIndexerQGemmBase, GemmConfig

WARPGROUP = 128
ROWS_PER_CONSUMER = 64
SMEM_CAPACITY = 227 * 1024
EPI_BUFFERS = 2  # bf16 tiles in flight between the consumers and the epilogue warpgroup
# The epilogue's row layout by its warpgroup count: 4 lanes a row (32 values a thread),
# or 8 lanes a row (16 values) so that two warpgroups fit the registers one had.
EPI_LAYOUTS = {1: epi.SM90_EPI_ROW_LAYOUT, 2: epi.SM90_EPI8_ROW_LAYOUT}
WORDS_PER_ROW = 64  # a head row of bf16, two a 32-bit word
HADAMARD_BYTES = epi.HEAD_DIM * epi.HEAD_DIM * 2  # the bf16 +-1 matrix of the tensor-core Hadamard
BAR_HADAMARD_READY = 1  # named barrier (0 is the CTA's): the epilogue's +-1 matrix is in shared memory


class Sm90FusedIndexerQ(FusedIndexerQGemmBase):
    arch = "sm_90a"
    supported_kinds = ("native",)
    split_k_choices = (1, 2, 4)  # rank 0 holds split_k - 1 partial tiles in shared memory
    epilogue_warpgroup_choices = tuple(EPI_LAYOUTS)
    has_tensor_core_hadamard = True
    ptx_signature = ("wgmma.mma_async e4m3", "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3")

    @classmethod
    def config_problems(cls, config: GemmConfig) -> list[str]:
        out = super().config_problems(config)
        if config.tile_m not in (64, 128):
            out.append(f"tile_m={config.tile_m} (sm_90a native: 64 or 128)")
        if config.mma_per_promotion not in (1, 2, 4):
            out.append(f"mma_per_promotion={config.mma_per_promotion} (1, 2 or 4)")
        if config.cluster_m not in (1, 2) or config.cluster_n not in (1, 2):
            out.append(f"cluster {config.cluster_m}x{config.cluster_n} (each 1 or 2)")
        if config.split_k > 1 and (config.tile_m != 64 or config.cluster_m * config.cluster_n > 1
                                   or config.pipelined_promotion):
            out.append("split_k > 1 needs tile_m=64, no multicast cluster and no pipelined_promotion "
                       "(its cluster is the K split; one consumer warpgroup sends one partial)")
        if config.uses_tensor_core_hadamard and config.epilogue_warpgroups != 1:
            out.append("tensor_core_hadamard needs epilogue_warpgroups=1 (its 64x128 accumulator "
                       "does not fit two epilogue warpgroups' registers)")
        if config.pipelined_promotion and (config.tile_m != 64 or config.mma_per_promotion != 4):
            out.append("pipelined_promotion needs tile_m=64 and mma_per_promotion=4 (two partial "
                       "accumulators fit only in one consumer warpgroup's registers)")
        return out

    @staticmethod
    def max_stages(config: GemmConfig) -> int:
        stage_bytes = (config.tile_m + epi.HEAD_DIM) * SCALE_BLOCK_K
        epi_bytes = EPI_BUFFERS * config.tile_m * epi.HEAD_DIM * 2
        if config.uses_tensor_core_hadamard:
            epi_bytes += HADAMARD_BYTES
        return (SMEM_CAPACITY - epi_bytes - Sm90FusedIndexerQ.reduce_bytes(config) - 2048) // stage_bytes

    @staticmethod
    def reduce_bytes(config: GemmConfig) -> int:
        """Rank 0's slots for the other K-split ranks' fp32 partial tiles."""
        return (config.split_k - 1) * config.tile_m * epi.HEAD_DIM * 4

    def __init__(self, config: GemmConfig):
        super().__init__(config)
        self.stages = config.stages or self.max_stages(config)
        self.tile_shape_mnk = (config.tile_m, epi.HEAD_DIM, SCALE_BLOCK_K)
        self.num_consumers = config.tile_m // ROWS_PER_CONSUMER
        self.epi_wg = 1 + self.num_consumers  # the first epilogue warpgroup
        self.epi_wgs = config.epilogue_warpgroups
        self.threads = WARPGROUP * (1 + self.num_consumers + self.epi_wgs)
        self.split_k = config.split_k
        # The launch cluster: the K split's ranks, or the multicast partners.
        self.cluster_shape_mn = (config.split_k, 1) if config.split_k > 1 else (config.cluster_m, config.cluster_n)
        self.row_layout = EPI_LAYOUTS[self.epi_wgs]
        self.lanes_per_row = self.row_layout.lanes_per_row
        self.rows_per_pass = self.epi_wgs * WARPGROUP // self.lanes_per_row
        # 64-row tiles serve decode, where the partial tile is most of the work: their
        # epilogue skips warps whose rows are all past M (~1 us at M <= 4 on the H200).
        # 128-row tiles keep one branch-free copy of the epilogue: with the skip as a second
        # copy, M = 16384 took 606 us instead of 560.
        self.skip_rows_past_m = config.tile_m == 64
        self.tc_hadamard = config.uses_tensor_core_hadamard
        self._split_registers()

    def _split_registers(self):
        """setmaxnreg budgets. They move registers inside the CTA's launch allocation
        (ptxas's entry register count, 65536 / threads rounded down to 8, x threads): a
        split that needs more makes the consumers' increase wait forever (seen on the
        H200). tests/test_compile.py checks the split against the entry count ptxas chose."""
        launch = (65536 // self.threads) // 8 * 8
        self.launch_regs = launch
        pool = launch * self.threads
        # The tensor-core Hadamard keeps a 64-value accumulator and 32 words of A operand
        # live in the epilogue: it takes the producer's spare registers.
        self.producer_regs = 40 if self.epi_wgs == 1 and not self.tc_hadamard else 24
        if self.num_consumers == 1:
            self.consumer_regs = 232
        else:  # two accumulators of 64 a thread, plus addressing
            self.consumer_regs = 168 if self.epi_wgs == 1 else 160  # 152 spills
        rest = pool - WARPGROUP * (self.producer_regs + self.num_consumers * self.consumer_regs)
        self.epilogue_regs = min(160 if self.tc_hadamard else 128, rest // (WARPGROUP * self.epi_wgs) // 8 * 8)
        total = WARPGROUP * (self.producer_regs + self.num_consumers * self.consumer_regs
                             + self.epi_wgs * self.epilogue_regs)
        assert total <= pool and self.epilogue_regs >= 64, (
            f"setmaxnreg budgets: {total} of {pool} registers, epilogue {self.epilogue_regs}")

    def operand_args(self, m, n: int, k: int) -> list:
        """fp8 A [M, K], f32 activation scales [M, K/128], fp8 W [N, K], f32 W scales."""
        import cutlass
        from cutlass.cute.runtime import make_fake_compact_tensor

        rowmaj = (1, 0)
        return [
            make_fake_compact_tensor(cutlass.Float8E4M3FN, (m, k), stride_order=rowmaj, assumed_align=16),
            make_fake_compact_tensor(cutlass.Float32, (m, k // 128), stride_order=rowmaj, assumed_align=16),
            make_fake_compact_tensor(cutlass.Float8E4M3FN, (n, k), stride_order=rowmaj, assumed_align=16),
            make_fake_compact_tensor(cutlass.Float32, (n // 128, k // 128), stride_order=rowmaj, assumed_align=16),
        ]

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # fp8 [M, K], K-major
        a_scale: cute.Tensor,  # f32 [M, K/128]
        w: cute.Tensor,  # fp8 [N, K], K-major
        w_scale: cute.Tensor,  # f32 [N/128, K/128]
        positions: cute.Tensor,  # int32/int64 [M]
        cos_sin: cute.Tensor,  # f32 [P, 64]
        out_q: cute.Tensor,  # int32 words [M, N/8] (packed mxfp4) or [M, N/4] (e4m3 bytes)
        out_scale: cute.Tensor,  # int32 [M, H] (UE8M0 words, or fp32 bits of 2^e)
        max_active_clusters: cutlass.Constexpr,
        stream,
    ):
        self.a_dtype = a.element_type
        self.b_dtype = w.element_type
        a_layout = utils.LayoutEnum.from_tensor(a)
        b_layout = utils.LayoutEnum.from_tensor(w)

        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.a_dtype,
            self.b_dtype,
            a_layout.sm90_mma_major_mode(),
            b_layout.sm90_mma_major_mode(),
            Float32,
            (self.num_consumers, 1, 1),
            tiler_mn=(ROWS_PER_CONSUMER, epi.HEAD_DIM),
        )
        bm, bn, bk = self.tile_shape_mnk
        stages = self.stages
        a_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(a_layout, self.a_dtype, bk), self.a_dtype
        )
        self.a_smem_staged = cute.tile_to_shape(a_atom, (bm, bk, stages), order=(0, 1, 2))
        b_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(b_layout, self.b_dtype, bk), self.b_dtype
        )
        self.b_smem_staged = cute.tile_to_shape(b_atom, (bn, bk, stages), order=(0, 1, 2))

        # The tensor-core Hadamard: one warpgroup, 64 rows x 128 columns, bf16 A from
        # registers, the +-1 matrix as B ([N, K], K-major like the weight).
        self.h_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, (1, 1, 1), tiler_mn=(ROWS_PER_CONSUMER, epi.HEAD_DIM),
            a_source=cute.nvgpu.warpgroup.OperandSource.RMEM,
        )
        h_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, cutlass.BFloat16, epi.HEAD_DIM),
            cutlass.BFloat16,
        )
        self.h_smem_layout = cute.tile_to_shape(h_atom, (epi.HEAD_DIM, epi.HEAD_DIM), order=(0, 1))

        a_smem = cute.slice_(self.a_smem_staged, (None, None, 0))
        b_smem = cute.slice_(self.b_smem_staged, (None, None, 0))
        a_op = (
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            if self.config.cluster_n > 1
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        )
        tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            a_op, a, a_smem, (bm, bk), num_multicast=self.config.cluster_n
        )
        b_op = (
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            if self.config.cluster_m > 1
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        )
        tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            b_op, w, b_smem, (bn, bk), num_multicast=self.config.cluster_m
        )

        m = a.shape[0]
        n = w.shape[0]
        # With a K split, cluster rank r of M tile i takes scheduler tile i * split_k + r.
        tiles_mnl = (cute.ceil_div(m, bm) * self.split_k, n // bn, 1)
        sched_params = utils.PersistentTileSchedulerParams(
            tiles_mnl,
            (*self.cluster_shape_mn, 1),
            self.config.swizzle,
            self.config.raster_along_m,
        )
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched_params, max_active_clusters)

        epi_words = EPI_BUFFERS * bm * WORDS_PER_ROW
        reduce_words = max(1, (self.split_k - 1) * bm * bn)

        @cute.struct
        class SharedStorage:
            pipeline_mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
            epi_mbar: cute.struct.MemRange[cutlass.Int64, EPI_BUFFERS * 2]
            # K split: [0, split_k - 1) "slot full" (rank 0), [split_k - 1] "slot free" (others)
            reduce_mbar: cute.struct.MemRange[cutlass.Int64, self.split_k]
            sReduce: cute.struct.Align[cute.struct.MemRange[Int32, reduce_words], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[Int32, epi_words], 1024]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem_staged)], 1024
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem_staged)], 1024
            ]

        @cute.struct
        class SharedStorageWithHadamard:
            pipeline_mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
            epi_mbar: cute.struct.MemRange[cutlass.Int64, EPI_BUFFERS * 2]
            reduce_mbar: cute.struct.MemRange[cutlass.Int64, self.split_k]
            sReduce: cute.struct.Align[cute.struct.MemRange[Int32, reduce_words], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[Int32, epi_words], 1024]
            sH: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self.h_smem_layout)], 1024]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem_staged)], 1024
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem_staged)], 1024
            ]

        self.shared_storage = SharedStorageWithHadamard if self.tc_hadamard else SharedStorage
        self.kernel(
            tma_atom_a,
            tma_a,
            tma_atom_b,
            tma_b,
            a_scale,
            w_scale,
            positions,
            cos_sin,
            out_q,
            out_scale,
            self.tiled_mma,
            self.a_smem_staged,
            self.b_smem_staged,
            sched_params,
            self.h_mma,
            self.h_smem_layout,
        ).launch(
            grid=grid,
            block=[self.threads, 1, 1],
            cluster=(*self.cluster_shape_mn, 1),
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=self.config.pdl,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        a_scale: cute.Tensor,
        w_scale: cute.Tensor,
        positions: cute.Tensor,
        cos_sin: cute.Tensor,
        out_q: cute.Tensor,
        out_scale: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        sched_params: utils.PersistentTileSchedulerParams,
        h_mma: cute.TiledMma,
        h_smem_layout: cute.ComposedLayout,
    ):
        bm, bn, bk = self.tile_shape_mnk
        stages = self.stages
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)

        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        # Multicast partners (a K-split cluster has none: each rank loads its own K blocks).
        cta_layout_mnk = cute.make_layout((self.config.cluster_m, self.config.cluster_n, 1))
        cluster_coord = (0, 0, 0) if self.split_k > 1 else cta_layout_mnk.get_flat_coord(cta_rank)
        # The weight tile is shared along the cluster's M, the activation tile along its N.
        a_mcast_mask = 0
        b_mcast_mask = 0
        if cutlass.const_expr(self.config.cluster_n > 1):
            a_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1)
        if cutlass.const_expr(self.config.cluster_m > 1):
            b_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)

        a_smem = cute.slice_(a_smem_staged, (None, None, 0))
        b_smem = cute.slice_(b_smem_staged, (None, None, 0))
        tx_bytes = cute.size_in_bytes(self.a_dtype, a_smem) + cute.size_in_bytes(self.b_dtype, b_smem)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # Each consumer warp releases a stage to every CTA that multicasts into it.
        consumer_arrivals = (self.config.cluster_m + self.config.cluster_n - 1) * self.num_consumers * 4
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.pipeline_mbar.data_ptr(),
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_arrivals),
            tx_count=tx_bytes,
            # A K-split rank releases its stages to itself only: with the cluster along
            # M and multicast mode (M only), the one signalling lane targets its own CTA.
            cta_layout_vmnk=cute.make_layout((1, *self.cluster_shape_mn, 1)),
            mcast_mode_mn=(1, 0) if self.split_k > 1 else (1, 1),
            defer_sync=True,
        )
        epi_pipeline = pipeline.PipelineAsync.create(
            barrier_storage=storage.epi_mbar.data_ptr(),
            num_stages=EPI_BUFFERS,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumers * WARPGROUP),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.epi_wgs * WARPGROUP),
            defer_sync=True,
        )
        reduce_full = storage.reduce_mbar.data_ptr()  # + slot, in rank 0
        reduce_free = reduce_full + (self.split_k - 1)  # in ranks 1.., arrived on by rank 0
        if cutlass.const_expr(self.split_k > 1):
            if tidx == 0:
                for slot in cutlass.range_constexpr(self.split_k - 1):
                    cute.arch.mbarrier_init(reduce_full + slot, 1)
                cute.arch.mbarrier_init(reduce_free, WARPGROUP)
        pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)
        # fp32 partial tiles [slot, chunk, consumer thread, 4]: 16-byte chunks, thread-minor.
        sReduce = storage.sReduce.get_tensor(cute.make_layout(
            (max(1, self.split_k - 1), bm * bn // (WARPGROUP * 4), WARPGROUP, 4),
            stride=(bm * bn, WARPGROUP * 4, 4, 1)))
        # bf16 tiles for the epilogue: [buffer, row, word], 16-byte chunks XOR-swizzled by row.
        sQ = storage.sQ.get_tensor(cute.make_layout((EPI_BUFFERS, bm, WORDS_PER_ROW),
                                                    stride=(bm * WORDS_PER_ROW, WORDS_PER_ROW, 1)))

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        # (bM, bK, tiles_m, tiles_k) and (bN, bK, tiles_n, tiles_k)
        gA = cute.local_tile(mA, (bm, bk), (None, None))
        gB = cute.local_tile(mB, (bn, bk), (None, None))
        a_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape)
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_atom_a,
            cluster_coord[1],
            a_cta_layout,
            cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2),
        )
        b_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape)
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b,
            cluster_coord[0],
            b_cta_layout,
            cute.group_modes(sB, 0, 2),
            cute.group_modes(gB, 0, 2),
        )
        k_tiles = cute.size(gA, mode=[3])
        # This CTA's K blocks: all of them, or its rank's share of the split.
        k_begin, k_end = 0, k_tiles
        if cutlass.const_expr(self.split_k > 1):
            k_begin = cta_rank * k_tiles // self.split_k
            k_end = (cta_rank + 1) * k_tiles // self.split_k
        reduce = (reduce_full, reduce_free, sReduce)
        pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)

        warpgroup = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self._producer(
                    ab_pipeline, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB,
                    a_mcast_mask, b_mcast_mask, k_begin, k_end, sched_params,
                )
        elif warpgroup >= self.epi_wg:
            # setmaxnreg.dec may only lower the count (raising is an illegal instruction)
            if cutlass.const_expr(self.epilogue_regs > self.launch_regs):
                cute.arch.setmaxregister_increase(self.epilogue_regs)
            else:
                cute.arch.setmaxregister_decrease(self.epilogue_regs)
            if cta_rank == 0 or cutlass.const_expr(self.split_k == 1):  # K-split rank 0 writes
                if cutlass.const_expr(self.tc_hadamard):
                    sH = storage.sH.get_tensor(h_smem_layout.outer, swizzle=h_smem_layout.inner)
                    self._epilogue_tc_hadamard(
                        epi_pipeline, sQ, sH, h_mma, tidx - self.epi_wg * WARPGROUP, sched_params,
                        positions, cos_sin, out_q, out_scale, a_scale.shape[0],
                    )
                else:
                    self._epilogue(
                        epi_pipeline, sQ, tidx - self.epi_wg * WARPGROUP, sched_params,
                        positions, cos_sin, out_q, out_scale, a_scale.shape[0],
                    )
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            args = (ab_pipeline, epi_pipeline, sQ, tiled_mma, sA, sB, warpgroup - 1, tidx - WARPGROUP,
                    k_begin, k_end, sched_params, a_scale, w_scale, reduce)
            if cutlass.const_expr(self.split_k == 1):
                self._consumer(*args, role="whole")
            elif cta_rank == 0:
                self._consumer(*args, role="reduce")
            else:
                self._consumer(*args, role="send")

    @cute.jit
    def _producer(
        self, ab_pipeline, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, a_mcast_mask,
        b_mcast_mask, k_begin, k_end, sched_params,
    ):
        sched = utils.StaticPersistentTileScheduler.create(
            sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        work = sched.initial_work_tile_info()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        # PDL: the first tile's weight blocks (as many as the ring holds) are requested before
        # waiting for the activation quantizer; their stages then get the activation blocks.
        # (The weight is read before the wait: run_fused launches the quantizer, which
        # writes only the activation, right before this kernel, and that launch waits for
        # all earlier work in the stream.)
        early = 0
        if cutlass.const_expr(self.config.pdl):
            early = min(self.stages, k_end) if cutlass.const_expr(self.split_k == 1) else 0
            a_state = state.clone()
            if work.is_valid_tile:
                tBgB_n = tBgB[(None, work.tile_idx[1], None)]
                for kt in cutlass.range_constexpr(early):
                    ab_pipeline.producer_acquire(state)
                    cute.copy(
                        tma_atom_b, tBgB_n[(None, kt)], tBsB[(None, state.index)],
                        tma_bar_ptr=ab_pipeline.producer_get_barrier(state), mcast_mask=b_mcast_mask,
                    )
                    state.advance()
            cute.arch.griddepcontrol_wait()
            if work.is_valid_tile:
                tAgA_m = tAgA[(None, self._m_tile(work.tile_idx), None)]
                for kt in cutlass.range_constexpr(early):
                    cute.copy(
                        tma_atom_a, tAgA_m[(None, kt)], tAsA[(None, a_state.index)],
                        tma_bar_ptr=ab_pipeline.producer_get_barrier(a_state), mcast_mask=a_mcast_mask,
                    )
                    a_state.advance()
        while work.is_valid_tile:
            tile = work.tile_idx
            tAgA_m = tAgA[(None, self._m_tile(tile), None)]
            tBgB_n = tBgB[(None, tile[1], None)]
            for kt in range(k_begin + early, k_end):
                ab_pipeline.producer_acquire(state)
                bar = ab_pipeline.producer_get_barrier(state)
                cute.copy(
                    tma_atom_a, tAgA_m[(None, kt)], tAsA[(None, state.index)],
                    tma_bar_ptr=bar, mcast_mask=a_mcast_mask,
                )
                cute.copy(
                    tma_atom_b, tBgB_n[(None, kt)], tBsB[(None, state.index)],
                    tma_bar_ptr=bar, mcast_mask=b_mcast_mask,
                )
                ab_pipeline.producer_commit(state)
                state.advance()
            early = 0  # only the first tile had its first blocks issued above
            sched.advance_to_next_work()
            work = sched.get_current_work()
        ab_pipeline.producer_tail(state)

    @cute.jit
    def _consumer(
        self, ab_pipeline, epi_pipeline, sQ, tiled_mma, sA, sB, consumer_idx, ctidx, k_begin, k_end,
        sched_params, a_scale, w_scale, reduce, role: cutlass.Constexpr,
    ):
        """role: "whole" (all K blocks), or in a K split "reduce" (rank 0: adds the other
        ranks' partial tiles, then hands the tile to the epilogue) or "send" (ranks 1..)."""
        bm, bn, bk = self.tile_shape_mnk
        thr_mma = tiled_mma.get_slice(ctidx)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        acc_shape = thr_mma.partition_shape_C((bm, bn))
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        partial = cute.make_rmem_tensor(acc_shape, Float32)
        # The pipelined mainloop alternates two partial accumulators.
        partial2 = cute.make_rmem_tensor(acc_shape, Float32) if self.config.pipelined_promotion else None
        mma_per_stage = cute.size(tCrA, mode=[2])

        m = a_scale.shape[0]
        if cutlass.const_expr(self.config.pdl):
            cute.arch.griddepcontrol_wait()  # the activation scales come from the quantizer
        lane = cute.arch.lane_idx()
        warp_in_wg = (ctidx // 32) % 4
        quad_lane = lane % 4
        # Row of this thread's first accumulator row inside the tile (the second is 8 below).
        row_in_tile = consumer_idx * ROWS_PER_CONSUMER + warp_in_wg * 16 + lane // 4

        sched = utils.StaticPersistentTileScheduler.create(
            sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        work = sched.initial_work_tile_info()
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        epi_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, EPI_BUFFERS)
        tiles_done = Int32(0)
        while work.is_valid_tile:
            tile = work.tile_idx
            head = tile[1]
            # Scale rows are clamped so that rows past M never read out of bounds.
            m_tile = self._m_tile(tile)
            srow0 = cutlass.min(m_tile * bm + row_in_tile, m - 1)
            srow1 = cutlass.min(m_tile * bm + row_in_tile + 8, m - 1)
            acc.fill(0.0)
            if cutlass.const_expr(self.config.pipelined_promotion):
                read_state = self._mainloop_pipelined(
                    ab_pipeline, read_state, tiled_mma, tCrA, tCrB, acc, partial, partial2, k_end,
                    a_scale, w_scale, srow0, srow1, head,
                )
            else:
                # Scales are loaded one K block ahead so their latency hides under the
                # previous block's WGMMAs instead of stalling the promotion.
                sa0 = a_scale[srow0, k_begin]
                sa1 = a_scale[srow1, k_begin]
                sw = w_scale[head, k_begin]
                for kt in range(k_begin, k_end):
                    s0 = sa0 * sw
                    s1 = sa1 * sw
                    nxt = cutlass.min(kt + 1, k_end - 1)
                    sa0 = a_scale[srow0, nxt]
                    sa1 = a_scale[srow1, nxt]
                    sw = w_scale[head, nxt]
                    ab_pipeline.consumer_wait(read_state)
                    per = self.config.mma_per_promotion
                    for group in cutlass.range_constexpr(mma_per_stage // per):
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                        cute.nvgpu.warpgroup.fence()
                        for kb in cutlass.range_constexpr(group * per, (group + 1) * per):
                            coord = (None, None, kb, read_state.index)
                            cute.gemm(tiled_mma, partial, tCrA[coord], tCrB[coord], partial)
                            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                        cute.nvgpu.warpgroup.commit_group()
                        cute.nvgpu.warpgroup.wait_group(0)
                        if cutlass.const_expr(group == mma_per_stage // per - 1):
                            ab_pipeline.consumer_release(read_state)
                        # Fragment value i = v + 2h + 4j: column 8j + 2q + v, row + 8h.
                        for i in cutlass.range_constexpr(cute.size(acc)):
                            if cutlass.const_expr((i // 2) % 2 == 0):
                                acc[i] = acc[i] + partial[i] * s0
                            else:
                                acc[i] = acc[i] + partial[i] * s1
                    read_state.advance()

            if cutlass.const_expr(role == "send"):
                self._send_partial(acc, reduce, ctidx, tiles_done)
            if cutlass.const_expr(role == "reduce"):
                self._add_partials(acc, reduce, ctidx, tiles_done)
            tiles_done += 1
            if cutlass.const_expr(role != "send"):
                self._hand_to_epilogue(acc, epi_pipeline, epi_state, sQ, row_in_tile, quad_lane)
                epi_state.advance()
            sched.advance_to_next_work()
            work = sched.get_current_work()
        if cutlass.const_expr(role == "send"):
            # Rank 0 arrives on this CTA's "slot free" barrier after its last read: wait
            # for that before exiting, so no remote arrive targets an exited CTA.
            cute.arch.mbarrier_wait(reduce[1], (tiles_done & 1) ^ 1)

    def _hand_to_epilogue(self, acc, epi_pipeline, epi_state, sQ, row_in_tile, quad_lane):
        """The finished tile to the epilogue warpgroup as bf16 (SPEC step 2's rounding)."""
        epi_pipeline.producer_acquire(epi_state)
        for h in range(2):
            r = row_in_tile + 8 * h
            for j in range(16):
                word = epi.bf16x2_word(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1])
                sQ[epi_state.index, r, self._swizzled_word(r, j * 4 + quad_lane)] = word
        epi_pipeline.producer_commit(epi_state)

    @cute.jit
    def _send_partial(self, acc, reduce, ctidx, tiles_done):
        """K-split rank r >= 1: once rank 0 has freed slot r-1, store this thread's fp32
        accumulators into it (st.async, completing bytes on rank 0's "slot full" barrier)."""
        full, free, sReduce = reduce
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        slot = rank - 1
        cute.arch.mbarrier_wait(free, (tiles_done & 1) ^ 1)
        for c in cutlass.range_constexpr(cute.size(sReduce, mode=[1])):
            words = tuple(acc[4 * c + j].bitcast(Int32) for j in range(4))
            dst = sReduce[(slot, c, ctidx, None)].iterator
            cute.arch.store_async_dsmem(dst, words, full + slot, 0)

    @cute.jit
    def _add_partials(self, acc, reduce, ctidx, tiles_done):
        """K-split rank 0: add ranks 1.. partial tiles in rank order, then free their slots."""
        full, free, sReduce = reduce
        slots = cute.size(sReduce, mode=[0])
        if ctidx == 0:
            for slot in cutlass.range_constexpr(slots):
                cute.arch.mbarrier_arrive_and_expect_tx(full + slot, self.tile_shape_mnk[0] * self.tile_shape_mnk[1] * 4)
        for slot in cutlass.range_constexpr(slots):
            cute.arch.mbarrier_wait(full + slot, tiles_done & 1)
            for c in cutlass.range_constexpr(cute.size(sReduce, mode=[1])):
                for j in cutlass.range_constexpr(4):
                    acc[4 * c + j] = acc[4 * c + j] + sReduce[slot, c, ctidx, j].bitcast(Float32)
        for slot in cutlass.range_constexpr(slots):
            # cluster scope: the reads above must be done before rank slot+1 overwrites
            cute.arch.mbarrier_arrive(free, peer_cta_rank_in_cluster=slot + 1, scope=nvvm.MemScopeKind.CLUSTER)

    @staticmethod
    def _promote(acc, partial, s0, s1):
        # Fragment value i = v + 2h + 4j: column 8j + 2q + v, row + 8h (trace-time loop).
        for i in range(cute.size(acc)):
            acc[i] = acc[i] + partial[i] * (s0 if (i // 2) % 2 == 0 else s1)

    @cute.jit
    def _mainloop_pipelined(self, ab_pipeline, read_state, tiled_mma, tCrA, tCrB, acc, p0, p1, k_tiles,
                            a_scale, w_scale, srow0, srow1, head):
        """K blocks 0..k_tiles-1 (an even count) with the promotion of block j under block
        j+1's WGMMAs: blocks alternate between partials p0 (even j) and p1 (odd j); a block's
        scales are loaded when its WGMMAs are issued and used after they complete. Every
        pipeline-state step is unconditional (the last pair is peeled), so the states stay
        plain loop-carried values. (The WGMMA issue is written out four times: the MMA
        atom's accumulate flag must be rebound in this function's own loop body.)"""
        mma_per_stage = cute.size(tCrA, mode=[2])
        issue_state = read_state.clone()
        ab_pipeline.consumer_wait(issue_state)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(mma_per_stage):
            cute.gemm(tiled_mma, p0, tCrA[None, None, kb, issue_state.index], tCrB[None, None, kb, issue_state.index], p0)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        issue_state.advance()
        e0 = a_scale[srow0, 0] * w_scale[head, 0]
        e1 = a_scale[srow1, 0] * w_scale[head, 0]
        # Fully unrolled (K is a compile-time constant): a WGMMA still in flight across a
        # loop back-edge makes ptxas copy its accumulators there and serialize every WGMMA
        # (its C7514 report).
        for kp in cutlass.range_constexpr(0, k_tiles - 2, 2):
            # block kp+1 -> p1, then promote block kp (p0)
            ab_pipeline.consumer_wait(issue_state)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range_constexpr(mma_per_stage):
                cute.gemm(tiled_mma, p1, tCrA[None, None, kb, issue_state.index], tCrB[None, None, kb, issue_state.index], p1)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.commit_group()
            issue_state.advance()
            cute.nvgpu.warpgroup.wait_group(1)
            o0 = a_scale[srow0, kp + 1] * w_scale[head, kp + 1]
            o1 = a_scale[srow1, kp + 1] * w_scale[head, kp + 1]
            ab_pipeline.consumer_release(read_state)
            read_state.advance()
            self._promote(acc, p0, e0, e1)
            # block kp+2 -> p0, then promote block kp+1 (p1)
            ab_pipeline.consumer_wait(issue_state)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range_constexpr(mma_per_stage):
                cute.gemm(tiled_mma, p0, tCrA[None, None, kb, issue_state.index], tCrB[None, None, kb, issue_state.index], p0)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.commit_group()
            issue_state.advance()
            cute.nvgpu.warpgroup.wait_group(1)
            e0 = a_scale[srow0, kp + 2] * w_scale[head, kp + 2]
            e1 = a_scale[srow1, kp + 2] * w_scale[head, kp + 2]
            ab_pipeline.consumer_release(read_state)
            read_state.advance()
            self._promote(acc, p1, o0, o1)
        # the last pair: block k_tiles-1 -> p1, promote k_tiles-2 (p0), then k_tiles-1 (p1)
        last = k_tiles - 1
        ab_pipeline.consumer_wait(issue_state)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(mma_per_stage):
            cute.gemm(tiled_mma, p1, tCrA[None, None, kb, issue_state.index], tCrB[None, None, kb, issue_state.index], p1)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        o0 = a_scale[srow0, last] * w_scale[head, last]
        o1 = a_scale[srow1, last] * w_scale[head, last]
        cute.nvgpu.warpgroup.wait_group(1)
        ab_pipeline.consumer_release(read_state)
        read_state.advance()
        self._promote(acc, p0, e0, e1)
        cute.nvgpu.warpgroup.wait_group(0)
        ab_pipeline.consumer_release(read_state)
        read_state.advance()
        self._promote(acc, p1, o0, o1)
        return read_state

    def _m_tile(self, tile):
        """The token tile of a scheduler tile: a K split's ranks share one (see __call__)."""
        return tile[0] // self.split_k

    @staticmethod
    def _swizzled_word(row, word):
        """Word index inside a row of the bf16 tile: the 16-byte chunk is XORed with
        row % 8, so the consumers' 4-byte and the epilogue's 16-byte accesses are both
        free of bank conflicts."""
        return ((word >> 2) ^ (row & 7)) * 4 + (word & 3)

    @cute.jit
    def _epilogue(self, epi_pipeline, sQ, etidx, sched_params, positions, cos_sin, out_q, out_scale, m):
        bm = self.tile_shape_mnk[0]
        layout = self.row_layout
        num_pos = cos_sin.shape[0]
        lane = cute.arch.lane_idx()
        lane_in_row = lane % self.lanes_per_row
        row_in_pass = (etidx // 32) * (32 // self.lanes_per_row) + lane // self.lanes_per_row
        lane_cols = layout.column_lane_bits(lane_in_row)
        passes = bm // self.rows_per_pass
        # cos/sin rows are requested this many passes ahead; one when the epilogue has
        # fewer than 128 registers (two warpgroups beside two consumers: 64, no spills)
        ahead = 2 if self.epilogue_regs >= 128 else 1
        if cutlass.const_expr(self.config.pdl):
            # positions / cos_sin are read only after the previous grid (the quantizer),
            # so nothing launched before it can still be writing them; no cost: the
            # first tile needs the quantizer's output anyway.
            cute.arch.griddepcontrol_wait()

        sched = utils.StaticPersistentTileScheduler.create(
            sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        work = sched.initial_work_tile_info()
        epi_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, EPI_BUFFERS)
        while work.is_valid_tile:
            tile = work.tile_idx
            head = tile[1]
            rows = [self._m_tile(tile) * bm + p * self.rows_per_pass + row_in_pass for p in range(passes)]
            # Everything below is one basic block (stores are predicated), and the cos/sin
            # rows are requested before the tile is ready, so their latency overlaps the wait.
            cs = [epi.load_cos_sin(layout, rows[p], m, num_pos, positions, cos_sin, lane_cols)
                  for p in range(min(ahead, passes) if self.config.epilogue else 0)]
            epi_pipeline.consumer_wait(epi_state)
            # The profiling probe (epilogue=False) only takes the tile and gives the buffer back.
            if cutlass.const_expr(self.config.epilogue):
                tile_row0 = self._m_tile(tile) * bm
                if cutlass.const_expr(not self.skip_rows_past_m):
                    self._epilogue_passes(sQ, epi_state.index, rows, cs, ahead, row_in_pass, lane_in_row,
                                          lane_cols, head, m, num_pos, positions, cos_sin, out_q, out_scale, None)
                elif tile_row0 + bm <= m:
                    self._epilogue_passes(sQ, epi_state.index, rows, list(cs), ahead, row_in_pass, lane_in_row,
                                          lane_cols, head, m, num_pos, positions, cos_sin, out_q, out_scale, None)
                else:
                    # The last, partial tile: a warp skips the passes where all its rows
                    # are past M (decode: M = 1 runs one warp's pass, not the whole tile's).
                    warp_row0 = tile_row0 + cute.arch.make_warp_uniform(etidx // 32) * (32 // self.lanes_per_row)
                    self._epilogue_passes(sQ, epi_state.index, rows, list(cs), ahead, row_in_pass, lane_in_row,
                                          lane_cols, head, m, num_pos, positions, cos_sin, out_q, out_scale,
                                          warp_row0)
            epi_pipeline.consumer_release(epi_state)
            epi_state.advance()
            sched.advance_to_next_work()
            work = sched.get_current_work()

    @cute.jit
    def _epilogue_tc_hadamard(self, epi_pipeline, sQ, sH, h_mma, etidx, sched_params, positions, cos_sin,
                              out_q, out_scale, m):
        """The epilogue with the Hadamard on the tensor cores, 64 rows at a time: each thread
        takes the bf16 values the consumer thread of the same index wrote (the WGMMA
        accumulator's layout is also the register A operand's), applies RoPE in registers,
        multiplies by the column-permuted +-1 matrix (one m64n128k16 WGMMA per 16 columns)
        and quantizes whole MXFP4 blocks (or FP8 head quarters) it alone holds."""
        bm = self.tile_shape_mnk[0]
        in_layout = epi.SM90_MMA_ROW_LAYOUT
        num_pos = cos_sin.shape[0]
        lane = cute.arch.lane_idx()
        quad_lane = lane % 4
        warp = cute.arch.make_warp_uniform(etidx // 32)
        row_in_chunk = warp * 16 + lane // 4  # and 8 below it
        in_cols = in_layout.column_lane_bits(quad_lane)
        chunks = bm // ROWS_PER_CONSUMER

        # The +-1 matrix as B[n, k] = H[k][output column of n], built once.
        out_col = epi.hadamard_output_column(etidx)
        for kk in cutlass.range(epi.HEAD_DIM, unroll=8):
            sH[etidx, kk] = epi.sylvester_sign(kk, out_col).to(cutlass.BFloat16)
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> WGMMA reads
        cute.arch.barrier(barrier_id=BAR_HADAMARD_READY, number_of_threads=WARPGROUP)

        thr = h_mma.get_slice(etidx)
        tHrB = h_mma.make_fragment_B(thr.partition_B(sH))
        tHrA = h_mma.make_fragment_A(thr.partition_shape_A((ROWS_PER_CONSUMER, epi.HEAD_DIM)))
        a_words = cute.recast_tensor(tHrA, Int32)  # word h + 2j: row + 8h, columns 8j + 2q + {0, 1}
        acc = cute.make_rmem_tensor(thr.partition_shape_C((ROWS_PER_CONSUMER, epi.HEAD_DIM)), Float32)
        if cutlass.const_expr(self.config.pdl):
            cute.arch.griddepcontrol_wait()  # see _epilogue

        sched = utils.StaticPersistentTileScheduler.create(
            sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        work = sched.initial_work_tile_info()
        epi_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, EPI_BUFFERS)
        # cos/sin of the chunk to come, requested one chunk ahead (across tiles too: the
        # next tile's first chunk loads under this tile's last quantization). A row past M
        # (or of a tile past the last) reads row M - 1's, never out of bounds.
        cs = self._tc_cos_sin(self._m_tile(work.tile_idx) * bm + row_in_chunk, m, num_pos, positions, cos_sin,
                              in_cols)
        while work.is_valid_tile:
            tile = work.tile_idx
            head = tile[1]
            row0 = self._m_tile(tile) * bm + row_in_chunk
            sched.advance_to_next_work()
            nxt = sched.get_current_work()
            next_row0 = self._m_tile(nxt.tile_idx) * bm + row_in_chunk
            epi_pipeline.consumer_wait(epi_state)
            if cutlass.const_expr(not self.config.epilogue):
                epi_pipeline.consumer_release(epi_state)  # the profiling probe takes the tile only
            else:
                for c in cutlass.range_constexpr(chunks):
                    self._tc_hadamard_chunk(c, cs, epi_pipeline, epi_state, sQ, h_mma, tHrA, tHrB, a_words, acc,
                                            row_in_chunk, quad_lane)
                    cs = self._tc_cos_sin(row0 + (c + 1) * ROWS_PER_CONSUMER if c + 1 < chunks else next_row0,
                                          m, num_pos, positions, cos_sin, in_cols)
                    if cutlass.const_expr(self.skip_rows_past_m):
                        # decode: a warp whose 16 rows are all past M skips its quantization
                        if row0 - lane // 4 + c * ROWS_PER_CONSUMER < m:
                            self._tc_hadamard_quantize(acc, quad_lane, row0 + c * ROWS_PER_CONSUMER, m, head,
                                                       out_q, out_scale)
                    else:
                        self._tc_hadamard_quantize(acc, quad_lane, row0 + c * ROWS_PER_CONSUMER, m, head, out_q,
                                                   out_scale)
            epi_state.advance()
            work = nxt

    @staticmethod
    def _tc_cos_sin(row0, m, num_pos, positions, cos_sin, in_cols):
        """cos/sin of rows row0 and row0 + 8 (a thread's two rows of a chunk), flat:
        [cos row0, sin row0, cos row0+8, sin row0+8], 8 values each."""
        out = []
        for h in range(2):
            c, s = epi.load_cos_sin_scalar(epi.SM90_MMA_ROW_LAYOUT, row0 + 8 * h, m, num_pos, positions, cos_sin,
                                           in_cols)
            out.extend(c + s)
        return out

    def _tc_hadamard_chunk(self, c, cs, epi_pipeline, epi_state, sQ, h_mma, tHrA, tHrB, a_words, acc,
                           row_in_chunk, quad_lane):
        """Chunk c (64 rows) of the tile: bf16 rows from the buffer, RoPE into the A
        registers, then the Hadamard's WGMMAs into acc (waited for)."""
        in_layout = epi.SM90_MMA_ROW_LAYOUT
        for h in range(2):
            r = c * ROWS_PER_CONSUMER + row_in_chunk + 8 * h
            words = [sQ[epi_state.index, r, self._swizzled_word(r, 4 * j + quad_lane)] for j in range(16)]
            pairs = in_layout.rope_pairs()
            for k, (local, _) in enumerate(pairs):
                x, y = epi.bf16x2_unpack(words[local // 2])
                cos_k, sin_k = cs[2 * h * len(pairs) + k], cs[(2 * h + 1) * len(pairs) + k]
                words[local // 2] = epi.rope_pair_word(x, y, cos_k, sin_k)
            for j in range(16):
                a_words[h + 2 * j] = words[j]
        if c == self.tile_shape_mnk[0] // ROWS_PER_CONSUMER - 1:
            epi_pipeline.consumer_release(epi_state)  # the tile's bf16 values are all in registers
        h_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        cute.nvgpu.warpgroup.fence()
        for kb in range(cute.size(tHrA, mode=[2])):
            cute.gemm(h_mma, acc, tHrA[None, None, kb], tHrB[None, None, kb], acc)
            h_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(0)

    def _tc_hadamard_quantize(self, acc, quad_lane, row0, m, head, out_q, out_scale):
        """Scale, bf16, quantize and store the chunk's two rows a thread (row0, row0 + 8)."""
        out_layout = epi.SM90_MMA_HADAMARD_OUT_LAYOUT
        for h in range(2):
            # Accumulator value v + 2h + 4j is local 2j + v of the output layout.
            vals = [acc[4 * (t // 2) + 2 * h + t % 2] for t in range(out_layout.num_local)]
            vals = epi.hadamard_scale_round(vals)
            epi.quantize_store_row(vals, out_layout, quad_lane, self.config, row0 + 8 * h, m, head, out_q,
                                   out_scale, vector=True)

    @cute.jit
    def _epilogue_passes(self, sQ, buf, rows, cs, ahead, row_in_pass, lane_in_row, lane_cols, head, m,
                         num_pos, positions, cos_sin, out_q, out_scale, warp_row0):
        """The tile's passes of rows. warp_row0 None: a full tile, one basic block (stores
        predicated); else each pass runs only in warps that hold a row below M."""
        layout = self.row_layout
        passes = len(rows)
        for p in cutlass.range_constexpr(passes):
            if cutlass.const_expr(p + ahead < passes):
                cs.append(epi.load_cos_sin(layout, rows[p + ahead], m, num_pos, positions, cos_sin, lane_cols))
            r = p * self.rows_per_pass + row_in_pass
            if cutlass.const_expr(warp_row0 is None):
                vals = self._load_row(sQ, buf, r, layout, lane_cols)
                epi.head_row_epilogue(vals, layout, lane_in_row, cs[p], self.config, rows[p], m, head,
                                      out_q, out_scale)
            else:
                if warp_row0 + p * self.rows_per_pass < m:
                    vals = self._load_row(sQ, buf, r, layout, lane_cols)
                    epi.head_row_epilogue(vals, layout, lane_in_row, cs[p], self.config, rows[p], m, head,
                                          out_q, out_scale)

    def _load_row(self, sQ, buf, r, layout, lane_cols):
        """The thread's 32 bf16 values of row r (local order), as exact fp32."""
        vals = [None] * layout.num_local
        for local in range(0, layout.num_local, 2):
            word = (lane_cols + layout.column_static(local)) >> 1
            vals[local], vals[local + 1] = epi.bf16x2_unpack(sQ[buf, r, self._swizzled_word(r, word)])
        return vals
