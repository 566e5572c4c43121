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
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from . import epilogue as epi
from .epilogue_sm90 import Sm90EpilogueRoles
from .gemm_base import SCALE_BLOCK_K, GemmConfig
from .native_kloop_sm90 import Sm90NativeKLoops
from .sm90_parts import (EPI_BUFFERS, ROWS_PER_CONSUMER, SMEM_CAPACITY, WARPGROUP, WORDS_PER_ROW,
                         Sm90KernelBase, add_partials, issue_wgmmas, opaque_stage, pace_loads, reduce_tensor,
                         send_partial, shared_storage)

# The epilogue's lanes a row by its warpgroup count: 4 (32 values a thread) with one or two
# (two at 72 registers a thread, beside consumers at 152, without spills). 8 lanes a row
# (16 values) take ~4.5 more instructions a value in cross-lane butterflies and amax
# (NOTES version 89).
EPI_LANES_PER_ROW = {1: 4, 2: 4}
# Weight blocks a 128-row tile requests before the PDL wait: more compete for DRAM with the
# activation quantizer the wait is for (3 against 5: 0.1-0.8 us at M = 128-4096, NOTES 70, 73).
EARLY_WEIGHT_BLOCKS_TILE128 = 3
# trace (probe only, GemmConfig.trace): TRACE_SLOTS int64 a CTA in the q output, as the
# swapped-A/B kernel's where the phases match. Consumer (its first thread): 0 globaltimer
# at its start, 1 clock64 at its start, 2 after the PDL wait, 4..9 the first tile's K
# blocks 0..5 in shared memory, 10 its K loop done, 12 it handed to the epilogue, 13
# globaltimer then; producer: 14 its start, 3 after its PDL wait, 15 every load issued.


class Sm90FusedIndexerQ(Sm90NativeKLoops, Sm90EpilogueRoles, Sm90KernelBase):
    supported_kinds = ("native",)
    split_k_choices = (1, 2, 4)  # rank 0 holds split_k - 1 partial tiles in shared memory
    epilogue_warpgroup_choices = tuple(EPI_LANES_PER_ROW)
    has_tensor_core_hadamard = True
    limits_loads_in_flight = True
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
        if config.pipelined_promotion and (config.tile_m != 64 or config.mma_per_promotion != 4):
            out.append("pipelined_promotion needs tile_m=64 and mma_per_promotion=4 (two partial "
                       "accumulators fit only in one consumer warpgroup's registers)")
        return out

    @staticmethod
    def max_stages(config: GemmConfig) -> int:
        stage_bytes = (config.tile_m + epi.HEAD_DIM) * SCALE_BLOCK_K
        epi_bytes = EPI_BUFFERS * config.tile_m * epi.HEAD_DIM * 2
        return (SMEM_CAPACITY - epi_bytes - Sm90FusedIndexerQ.reduce_bytes(config) - 2048) // stage_bytes

    @staticmethod
    def reduce_bytes(config: GemmConfig) -> int:
        """Rank 0's slots for the other K-split ranks' fp32 partial tiles."""
        return (config.split_k - 1) * config.tile_m * epi.HEAD_DIM * 4

    def __init__(self, config: GemmConfig):
        super().__init__(config)
        self.stages = config.stages or self.max_stages(config)
        self.loads_in_flight = self._loads_in_flight(self.stages)
        self.tile_shape_mnk = (config.tile_m, epi.HEAD_DIM, SCALE_BLOCK_K)
        self.tile_rows = config.tile_m
        self.num_consumers = config.tile_m // ROWS_PER_CONSUMER
        self.epi_wgs = config.epilogue_warpgroups
        self.split_k = config.split_k
        # The launch cluster: the K split's ranks, or the multicast partners.
        self.cluster_shape_mn = (config.split_k, 1) if config.split_k > 1 else (config.cluster_m, config.cluster_n)
        # 64-row tiles serve decode, where the partial tile is most of the work: their
        # epilogue skips warps whose rows are all past M (~1 us at M <= 4 on the H200).
        # 128-row tiles keep one branch-free copy of the epilogue: with the skip as a second
        # copy, M = 16384 took 606 us instead of 560.
        self.skip_rows_past_m = config.tile_m == 64
        # The tensor-core Hadamard: with one epilogue warpgroup two rows a thread (its own
        # passes, _epilogue_tc_hadamard: 64 sums a thread); with two, one row a thread in the
        # butterfly's passes (hmma.tc_hadamard_row: 32 sums, within their 72 registers).
        self.tc_hadamard = config.uses_tensor_core_hadamard and self.epi_wgs == 1
        self.tc_hadamard_rows = config.uses_tensor_core_hadamard and self.epi_wgs == 2
        self._setup_roles(EPI_LANES_PER_ROW[self.epi_wgs])
        # The CTA's last tile (its only one where M <= ~16K / heads): the consumers, idle once
        # they have handed it over, finish its second half. 128-row tiles of one CTA, the
        # epilogue passes of one row a thread.
        if config.tile_m == 128 and config.split_k == 1 and not self.tc_hadamard and config.epilogue:
            self.helper_rows = config.tile_m // 2

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
        self.device_ctas = max_active_clusters * self.cluster_shape_mn[0] * self.cluster_shape_mn[1]

        epi_words = EPI_BUFFERS * bm * WORDS_PER_ROW
        reduce_words = max(1, (self.split_k - 1) * bm * bn)

        self.shared_storage = shared_storage(
            stages=stages, split_k=self.split_k, reduce_words=reduce_words, epi_words=epi_words,
            operands=[("sA", self.a_dtype, cute.cosize(self.a_smem_staged)),
                      ("sB", self.b_dtype, cute.cosize(self.b_smem_staged))])
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
    ):
        bm, bn, bk = self.tile_shape_mnk
        stages = self.stages
        if cutlass.const_expr(self.config.pdl):
            # A grid on at most half the SMs (TP8 M = 257-512, V4 M <= 128 on 128-row tiles): the
            # next call's activation quantizer may start on the SMs it leaves free (it waits for
            # our completion before it reads or writes). On a fuller GPU it would compete with our
            # CTAs (lost 0.4-1.2 us at V4 M = 128-512, NOTES versions 62, 68 and 73).
            grid_x, grid_y, grid_z = cute.arch.grid_dim()
            if grid_x * grid_y * grid_z * 2 <= self.device_ctas:
                cute.arch.griddepcontrol_launch_dependents()
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
        sReduce = reduce_tensor(storage, self.split_k, bm * bn // WARPGROUP)
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
        trace = self._trace_tensor(out_q)

        warpgroup = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self._producer(
                    ab_pipeline, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB,
                    a_mcast_mask, b_mcast_mask, k_begin, k_end, sched_params, trace,
                )
        elif warpgroup >= self.epi_wg:
            self._set_epilogue_registers()
            if cta_rank == 0 or cutlass.const_expr(self.split_k == 1):  # K-split rank 0 writes
                if cutlass.const_expr(self.tc_hadamard):
                    self._epilogue_tc_hadamard(
                        epi_pipeline, sQ, tidx - self.epi_wg * WARPGROUP, sched_params,
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
                    k_begin, k_end, sched_params, a_scale, w_scale, reduce, (positions, cos_sin, out_q, out_scale),
                    trace)
            if cutlass.const_expr(self.split_k == 1):
                self._consumer(*args, role="whole")
            elif cta_rank == 0:
                self._consumer(*args, role="reduce")
            else:
                self._consumer(*args, role="send")

    @cute.jit
    def _producer(
        self, ab_pipeline, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, a_mcast_mask,
        b_mcast_mask, k_begin, k_end, sched_params, trace,
    ):
        lane = 0  # the producer warp's lane, read only for the trace's stamps
        if cutlass.const_expr(trace is not None):
            lane = cute.arch.lane_idx()
        self._stamp(trace, 14, lane)
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
        in_flight = self.loads_in_flight
        if cutlass.const_expr(self.config.pdl):
            early = min(self.stages, k_end) if cutlass.const_expr(self.split_k == 1) else 0
            if cutlass.const_expr(self.config.tile_m == 128):
                early = min(early, EARLY_WEIGHT_BLOCKS_TILE128)
            early = min(early, in_flight)
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
            self._stamp(trace, 3, lane)
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
                pace_loads(ab_pipeline, state, in_flight)
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
        self._stamp(trace, 15, lane)
        if cutlass.const_expr(self.config.pdl):
            # A last round of tiles on at most half the CTAs (V4 M = 257-384 on 128-row tiles):
            # once every load is issued, the next call's activation quantizer may spread over
            # the SMs the idle CTAs left and wait there for our completion, so its launch is off
            # the critical path (-1 us at V4-Pro M = 384). On a fuller last round its CTAs would
            # crowd the few SMs freed first (+0.3-0.6 us at M = 256 and 1024; NOTES version 74).
            # One thread's trigger counts for the CTA.
            clusters = sched.num_persistent_clusters
            last_round = cute.size(sched.params.problem_layout_ncluster_mnl) % clusters
            if last_round != 0 and last_round * 2 <= clusters:
                cute.arch.griddepcontrol_launch_dependents()
        ab_pipeline.producer_tail(state)

    @cute.jit
    def _consumer(
        self, ab_pipeline, epi_pipeline, sQ, tiled_mma, sA, sB, consumer_idx, ctidx, k_begin, k_end,
        sched_params, a_scale, w_scale, reduce, epi_args, trace, role: cutlass.Constexpr,
    ):
        """role: "whole" (all K blocks), or in a K split "reduce" (rank 0: adds the other
        ranks' partial tiles, then hands the tile to the epilogue) or "send" (ranks 1..).
        epi_args: (positions, cos_sin, out_q, out_scale), for the last tile's helpers."""
        bm, bn, bk = self.tile_shape_mnk
        thr_mma = tiled_mma.get_slice(ctidx)
        # A warpgroup's shared-memory descriptors depend only on which consumer it is: sliced
        # by that warp-uniform index they are built in uniform registers (by this thread's
        # index, each WGMMA waited on two R2UR moves).
        wg_mma = tiled_mma.get_slice(consumer_idx * WARPGROUP)
        tCsA = wg_mma.partition_A(sA)
        tCsB = wg_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        acc_shape = thr_mma.partition_shape_C((bm, bn))
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        partial = cute.make_rmem_tensor(acc_shape, Float32)
        # The pipelined mainloop alternates two partial accumulators.
        partial2 = cute.make_rmem_tensor(acc_shape, Float32) if self.config.pipelined_promotion else None
        mma_per_stage = cute.size(tCrA, mode=[2])

        m = a_scale.shape[0]
        self._stamp(trace, 0, ctidx, global_timer=True)
        self._stamp(trace, 1, ctidx)
        if cutlass.const_expr(self.config.pdl):
            cute.arch.griddepcontrol_wait()  # the activation scales come from the quantizer
        self._stamp(trace, 2, ctidx)
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
            read_state = opaque_stage(read_state)
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
                # previous block's WGMMAs instead of stalling the promotion. Unsplit, K is a
                # compile-time constant: unrolled, the loads take immediate offsets and the
                # loop control goes (with version 77's descriptors: mainloop -8 to -17%).
                sa0 = a_scale[srow0, k_begin]
                sa1 = a_scale[srow1, k_begin]
                sw = w_scale[head, k_begin]
                for kt in cutlass.range(k_begin, k_end, unroll_full=self.split_k == 1):
                    s0 = sa0 * sw
                    s1 = sa1 * sw
                    nxt = cutlass.min(kt + 1, k_end - 1)
                    sa0 = a_scale[srow0, nxt]
                    sa1 = a_scale[srow1, nxt]
                    sw = w_scale[head, nxt]
                    ab_pipeline.consumer_wait(read_state)
                    if cutlass.const_expr(trace is not None):
                        if tiles_done == 0 and kt - k_begin < 6:
                            self._stamp(trace, 4 + kt - k_begin, ctidx)
                    per = self.config.mma_per_promotion
                    for group in cutlass.range_constexpr(mma_per_stage // per):
                        tiled_mma = issue_wgmmas(tiled_mma, partial, tCrA, tCrB, range(group * per, (group + 1) * per),
                                     read_state.index)
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

            if cutlass.const_expr(trace is not None):
                if tiles_done == 0:
                    self._stamp(trace, 10, ctidx)
            if cutlass.const_expr(role == "send"):
                send_partial(acc, reduce, ctidx, tiles_done)
            if cutlass.const_expr(role == "reduce"):
                add_partials(acc, reduce, ctidx, tiles_done, bm * bn * 4)
            tiles_done += 1
            buf = epi_state.index
            if cutlass.const_expr(role != "send"):
                self._hand_to_epilogue(acc, epi_pipeline, epi_state, sQ, row_in_tile, quad_lane)
                epi_state.advance()
                if cutlass.const_expr(trace is not None):
                    if tiles_done == 1:
                        self._stamp(trace, 12, ctidx)
                        self._stamp(trace, 13, ctidx, global_timer=True)
            sched.advance_to_next_work()
            work = sched.get_current_work()
            if cutlass.const_expr(self.helper_rows > 0):
                if not work.is_valid_tile:
                    self._help_last_tile(sQ, buf, ctidx, m_tile * bm, head, m, *epi_args)
        if cutlass.const_expr(role == "send"):
            # Rank 0 arrives on this CTA's "slot free" barrier after its last read: wait
            # for that before exiting, so no remote arrive targets an exited CTA.
            cute.arch.mbarrier_wait(reduce[1], (tiles_done & 1) ^ 1)

    def _m_tile(self, tile):
        """The token tile of a scheduler tile: a K split's ranks share one (see __call__)."""
        return tile[0] // self.split_k
