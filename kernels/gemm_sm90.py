"""Hopper (sm_90a) fused indexer-Q kernel, native tactic.

Persistent, warp-specialized block-scaled FP8 GEMM: one TMA producer warp fills a
ring of (A tile, W tile) stages; 1 or 2 consumer warpgroups each own 64 token rows x
128 columns (= one head). Per 128-wide K block each consumer issues 4 WGMMAs
(m64n128k32, e4m3 x e4m3 -> fp32) into a partial accumulator, waits, and promotes it
into the main one with that block's scales (activation scale per row x weight scale
per 128x128 block). The two consumers interleave, so one's promotion runs under the
other's WGMMAs (DeepGEMM's sm90 scheme). The epilogue (kernels/epilogue.py) then
turns each thread's two head rows into RoPE'd, optionally rotated, quantized bytes.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Uint8
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from . import epilogue as epi
from .gemm_base import SCALE_BLOCK_K, FusedIndexerQGemmBase, GemmConfig

WARPGROUP = 128
ROWS_PER_CONSUMER = 64
SMEM_CAPACITY = 227 * 1024


class Sm90FusedIndexerQ(FusedIndexerQGemmBase):
    arch = "sm_90a"
    supported_kinds = ("native",)

    @classmethod
    def config_problems(cls, config: GemmConfig) -> list[str]:
        out = super().config_problems(config)
        if config.tile_m not in (64, 128):
            out.append(f"tile_m={config.tile_m} (sm_90a native: 64 or 128)")
        if config.mma_per_promotion not in (1, 2, 4):
            out.append(f"mma_per_promotion={config.mma_per_promotion} (1, 2 or 4)")
        if config.cluster_m not in (1, 2):
            out.append(f"cluster_m={config.cluster_m} (1 or 2)")
        stage_bytes = (config.tile_m + epi.HEAD_DIM) * SCALE_BLOCK_K
        if not 2 <= config.stages or config.stages * stage_bytes + 4096 > SMEM_CAPACITY:
            out.append(f"stages={config.stages} does not fit shared memory")
        return out

    def __init__(self, config: GemmConfig):
        super().__init__(config)
        self.tile_shape_mnk = (config.tile_m, epi.HEAD_DIM, SCALE_BLOCK_K)
        self.num_consumers = config.tile_m // ROWS_PER_CONSUMER
        self.threads = WARPGROUP * (1 + self.num_consumers)
        self.cluster_shape_mn = (config.cluster_m, 1)
        self.producer_regs = 40
        self.consumer_regs = 232 if self.num_consumers == 2 else 240
        self.row_layout = epi.SM90_ROW_LAYOUT

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
        out_q: cute.Tensor,  # uint8 [M, N/2] (mxfp4) or [M, N] (fp8 bytes)
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
        stages = self.config.stages
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
        tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), a, a_smem, (bm, bk)
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
        tiles_mnl = (cute.ceil_div(m, bm), n // bn, 1)
        sched_params = utils.PersistentTileSchedulerParams(
            tiles_mnl,
            (*self.cluster_shape_mn, 1),
            self.config.swizzle,
            self.config.raster_along_m,
        )
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched_params, max_active_clusters)

        @cute.struct
        class SharedStorage:
            pipeline_mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem_staged)], 1024
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem_staged)], 1024
            ]

        self.shared_storage = SharedStorage
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
        stages = self.config.stages
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)

        cta_layout_mnk = cute.make_layout((*self.cluster_shape_mn, 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        b_mcast_mask = 0
        if cutlass.const_expr(self.config.cluster_m > 1):
            b_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)

        a_smem = cute.slice_(a_smem_staged, (None, None, 0))
        b_smem = cute.slice_(b_smem_staged, (None, None, 0))
        tx_bytes = cute.size_in_bytes(self.a_dtype, a_smem) + cute.size_in_bytes(self.b_dtype, b_smem)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        consumer_arrivals = self.config.cluster_m * self.num_consumers * 4
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.pipeline_mbar.data_ptr(),
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_arrivals),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        # (bM, bK, tiles_m, tiles_k) and (bN, bK, tiles_n, tiles_k)
        gA = cute.local_tile(mA, (bm, bk), (None, None))
        gB = cute.local_tile(mB, (bn, bk), (None, None))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
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
        pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)

        warpgroup = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self._producer(
                    ab_pipeline, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB,
                    b_mcast_mask, k_tiles, sched_params,
                )
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self._consumer(
                ab_pipeline, tiled_mma, sA, sB, warpgroup - 1, tidx - WARPGROUP, k_tiles,
                sched_params, a_scale, w_scale, positions, cos_sin, out_q, out_scale,
            )

    @cute.jit
    def _producer(
        self, ab_pipeline, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, b_mcast_mask,
        k_tiles, sched_params,
    ):
        sched = utils.StaticPersistentTileScheduler.create(
            sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        work = sched.initial_work_tile_info()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.stages)
        while work.is_valid_tile:
            tile = work.tile_idx
            tAgA_m = tAgA[(None, tile[0], None)]
            tBgB_n = tBgB[(None, tile[1], None)]
            for kt in range(k_tiles):
                ab_pipeline.producer_acquire(state)
                bar = ab_pipeline.producer_get_barrier(state)
                cute.copy(tma_atom_a, tAgA_m[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                cute.copy(
                    tma_atom_b, tBgB_n[(None, kt)], tBsB[(None, state.index)],
                    tma_bar_ptr=bar, mcast_mask=b_mcast_mask,
                )
                ab_pipeline.producer_commit(state)
                state.advance()
            sched.advance_to_next_work()
            work = sched.get_current_work()
        ab_pipeline.producer_tail(state)

    @cute.jit
    def _consumer(
        self, ab_pipeline, tiled_mma, sA, sB, consumer_idx, ctidx, k_tiles, sched_params,
        a_scale, w_scale, positions, cos_sin, out_q, out_scale,
    ):
        bm, bn, bk = self.tile_shape_mnk
        thr_mma = tiled_mma.get_slice(ctidx)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        acc_shape = thr_mma.partition_shape_C((bm, bn))
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        partial = cute.make_rmem_tensor(acc_shape, Float32)
        mma_per_stage = cute.size(tCrA, mode=[2])

        m = a_scale.shape[0]
        num_pos = cos_sin.shape[0]
        lane = cute.arch.lane_idx()
        warp_in_wg = (ctidx // 32) % 4
        lane_in_row = lane % 4
        # Row of this thread's first value inside the tile (the second is 8 below).
        row_in_tile = consumer_idx * ROWS_PER_CONSUMER + warp_in_wg * 16 + lane // 4

        sched = utils.StaticPersistentTileScheduler.create(
            sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        work = sched.initial_work_tile_info()
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.stages)
        while work.is_valid_tile:
            tile = work.tile_idx
            row0 = tile[0] * bm + row_in_tile
            head = tile[1]
            # Scale rows are clamped so that rows past M never read out of bounds.
            srow0 = cutlass.min(row0, m - 1)
            srow1 = cutlass.min(row0 + 8, m - 1)
            acc.fill(0.0)
            # Scales are loaded one K block ahead so their latency hides under the
            # previous block's WGMMAs instead of stalling the promotion.
            sa0 = a_scale[srow0, 0]
            sa1 = a_scale[srow1, 0]
            sw = w_scale[head, 0]
            for kt in range(k_tiles):
                s0 = sa0 * sw
                s1 = sa1 * sw
                nxt = cutlass.min(kt + 1, k_tiles - 1)
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

            for h in cutlass.range_constexpr(2):
                row = row0 + 8 * h
                vals = [acc[(i % 2) + 2 * h + 4 * (i // 2)] for i in range(32)]
                self._epilogue_row(
                    vals, row, head, m, num_pos, lane_in_row, positions, cos_sin, out_q, out_scale
                )
            sched.advance_to_next_work()
            work = sched.get_current_work()

    @cute.jit
    def _epilogue_row(
        self, vals, row, head, m, num_pos, lane_in_row, positions, cos_sin, out_q, out_scale
    ):
        layout = self.row_layout
        vals = epi.bf16_round_row(vals)
        safe_row = cutlass.min(row, m - 1)
        pos = positions[safe_row]
        pos_ok = (pos >= 0) & (pos < num_pos)
        pos_idx = Int32(cutlass.select_(pos_ok, pos, type(pos)(0)))
        use_identity = pos_ok == False  # noqa: E712  (DSL boolean, not Python's)

        def cos_sin_of(pair):
            return cos_sin[pos_idx, pair], cos_sin[pos_idx, pair + 32]

        vals = epi.rope_row(vals, layout, lane_in_row, cos_sin_of, use_identity)
        if cutlass.const_expr(self.config.hadamard):
            vals = epi.hadamard_row(vals, layout, lane_in_row)

        if cutlass.const_expr(self.config.out_format_id == epi.OUT_MXFP4):
            packed, scale_word = epi.mxfp4_row(vals, layout, self.config.rne)
        else:
            packed, e = epi.fp8_row(vals, layout, self.config.out_format_id == epi.OUT_FP8)
            scale_word = (e + 127) << 23  # fp32 bits of 2^e
        if row < m:
            self._store_row(row, head, lane_in_row, packed, scale_word, out_q, out_scale)

    def _store_row(self, row, head, lane_in_row, packed, scale_word, out_q, out_scale):
        """Plain trace-time helper (called under the row guard): byte stores of one row."""
        layout = self.row_layout
        lane_cols = layout.column_lane_bits(lane_in_row)
        if self.config.out_format_id == epi.OUT_MXFP4:
            base = head * (epi.HEAD_DIM // 2) + (lane_cols >> 1)
            for p in range(len(packed)):
                out_q[row, base + layout.column_static(2 * p) // 2] = Uint8(packed[p])
        else:
            base = head * epi.HEAD_DIM + lane_cols
            for p in range(len(packed)):
                col = base + layout.column_static(2 * p)
                out_q[row, col] = Uint8(packed[p] & 0xFF)
                out_q[row, col + 1] = Uint8((packed[p] >> 8) & 0xFF)
        if self.config.out_format_id != epi.OUT_FP8_UNSCALED:
            self._store_scale(lane_in_row, row, head, scale_word, out_scale)

    @cute.jit
    def _store_scale(self, lane_in_row, row, head, scale_word, out_scale):
        if lane_in_row == 0:
            out_scale[row, head] = scale_word
