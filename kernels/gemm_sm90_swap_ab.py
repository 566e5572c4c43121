"""Hopper (sm_90a) fused indexer-Q kernel, swapped-A/B tactic (small M, decode).

q^T = W * a^T: the weight is the WGMMA's A operand and the tokens its B operand, so the
weight's 128 rows of one head fill the MMA's M side (two m64 blocks) and a tile of 8-64
tokens sits on its N side. One CTA owns (one head, one token tile, its share of a K
split over a cluster). Per 128-wide K block the consumer warpgroup issues 8 WGMMAs
(m64nTk32, e4m3 x e4m3 -> fp32) into a partial accumulator, waits, and promotes it with
the block's scales: the weight's is one scalar per (head, K block), the activation's one
per token column.

The activation reaches shared memory in one of two ways:
- from the activation quantizer's output, by TMA beside the weight (the quantizer runs
  as its own launch before this one, with programmatic dependent launch);
- `fused_act_quant`: the kernel quantizes the bf16 rows of its token tile itself (SPEC
  step 1, the act_quant kernel's arithmetic) straight into the swizzled layout its
  WGMMAs read, while the producer's first weight loads are in flight. The first tile is
  quantized by the consumer and the epilogue warpgroups together (these are idle until
  the first tile is done, and on K-split ranks 1.. throughout); a later token tile by the
  consumer alone. The tile stays resident for every head the CTA takes with the same
  tokens. One launch (the quantizer: kernels/swap_ab_quant_sm90.py).

The finished tile [128 dims x tokens] is rounded to bf16 (SPEC step 2) and written to
shared memory transposed to token rows, so that the epilogue warpgroup(s) of
kernels/epilogue_sm90.py run on it unchanged (8 lanes a row, every output format).
A K split sends ranks 1..'s fp32 partials to rank 0 through distributed shared memory,
or, where the split divides the tile's groups of 8 tokens, reduce-scatters them: rank d
sums and finishes tokens [d T / S, (d + 1) T / S), so every rank's epilogue takes T / S rows
(sm90_parts.scatter_partial; the same summation order, so the same bytes).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from . import epilogue as epi
from .epilogue_sm90 import Sm90EpilogueRoles
from .gemm_base import SCALE_BLOCK_K, GemmConfig
from .sm90_parts import (EPI_BUFFERS, ROWS_PER_CONSUMER, TRACE_BLOCKS, WARPGROUP, WORDS_PER_ROW,
                         Sm90KernelBase, add_partials, gather_partials, pace_loads, reduce_tensor,
                         scatter_partial, scatter_tensor, send_partial, shared_storage)
from .swap_ab_kloop_sm90 import TWO_PARTIALS_MAX_TILE, Sm90SwapABKLoops
from .swap_ab_limits_sm90 import Sm90SwapABLimits
from .swap_ab_quant_sm90 import ACT_QUANT_LANE_CHOICES, QR_TMA_MAX_TILE, WEIGHT_BLOCKS_BEFORE_QR, Sm90SwapABQuantizer

LANES_PER_ROW = 8  # the epilogue's: a 16-row pass per warpgroup, so small tiles fill it
# trace (GemmConfig.trace): TRACE_SLOTS int64 a CTA (sm90_parts._trace_tensor). Consumer: 0 globaltimer at its
# start, 1 clock64 at its start, 2 after the PDL wait, 3 first tile quantized, 4..9 first
# tile's K blocks 0..5 in shared memory, 10 K loop done, 11 K split reduced, 12 tile
# handed to the epilogue, 13 globaltimer then; producer: 14 its start, 15 every load issued;
# consumer again: 16 first tile's qr in shared memory (staged) or its quantizer's start, 17 its
# own units quantized (with cluster_n > 1, slot 3 then also waits for the peers' bytes);
# epilogue: 18 first tile taken, 19 its rows stored; 20..22 the first tile's quantizer (slot
# 16's thread) past its batches 0..2 of rounds (a batch's units loaded, then stored and sent);
# 23 its first batch's qr in registers (loads landed, or words read from the staging buffer);
# first tile, K block kb < TRACE_BLOCKS (pipelined K loop): 24 + kb the consumer's wait for it
# began, 36 + kb it was in shared memory; 48 + kb the producer requested it.


class Sm90SwapABFusedIndexerQ(Sm90SwapABLimits, Sm90SwapABKLoops, Sm90SwapABQuantizer, Sm90EpilogueRoles,
                              Sm90KernelBase):
    ptx_signature = ("wgmma.mma_async e4m3, tokens on N", "wgmma.mma_async.sync.aligned.m64n{tile}k32.f32.e4m3.e4m3")
    has_tensor_core_hadamard = True  # one row a thread at 8 lanes (hmma.tc_hadamard_row), 1 or 2 epilogue warpgroups
    limits_loads_in_flight = True
    act_quant_lane_choices = ACT_QUANT_LANE_CHOICES
    qr_staging_max_tile = QR_TMA_MAX_TILE
    orders_scales_before_pdl_wait = True
    makes_uniform_descriptors = True
    prefetches_qr = True
    traces_with_epilogue = True

    def __init__(self, config: GemmConfig):
        super().__init__(config)
        self.tile_rows = config.tile_m
        self.num_consumers = 1  # both m64 halves of the head: 2T accumulator values a thread
        self.epi_wgs = config.epilogue_warpgroups
        self.split_k = config.split_k
        self.share = config.cluster_n  # heads sharing the first token tile's quantizer
        self.weight_sharers = config.cluster_m  # token tiles sharing a head's weight (multicast)
        # the cluster: a K split's ranks, or token tiles sharing the weight, along M (never
        # both); heads sharing the quantizer along N
        self.cluster_shape_mn = (config.split_k * config.cluster_m, config.cluster_n)
        self.skip_rows_past_m = True
        self.tc_hadamard = False  # the native kernel's two rows a thread (one epilogue warpgroup, its own passes)
        self.tc_hadamard_rows = config.uses_tensor_core_hadamard
        self.fused = config.fused_act_quant
        self.scatter = self.reduce_scatters(config)
        self.two_partials = config.pipelined_promotion and config.tile_m <= TWO_PARTIALS_MAX_TILE
        self._setup_roles(LANES_PER_ROW)

    def operand_args(self, m, n: int, k: int) -> list:
        """fused_act_quant: bf16 qr [M, K]; else fp8 A [M, K] and its f32 scales [M, K/128];
        then fp8 W [N, K] and its f32 scales [N/128, K/128]."""
        from cutlass.cute.runtime import make_fake_compact_tensor

        rowmaj = (1, 0)
        weight = [
            make_fake_compact_tensor(cutlass.Float8E4M3FN, (n, k), stride_order=rowmaj, assumed_align=16),
            make_fake_compact_tensor(cutlass.Float32, (n // 128, k // 128), stride_order=rowmaj, assumed_align=16),
        ]
        if self.fused:
            return [make_fake_compact_tensor(cutlass.BFloat16, (m, k), stride_order=rowmaj, assumed_align=16),
                    *weight]
        return [
            make_fake_compact_tensor(cutlass.Float8E4M3FN, (m, k), stride_order=rowmaj, assumed_align=16),
            make_fake_compact_tensor(cutlass.Float32, (m, k // 128), stride_order=rowmaj, assumed_align=16),
            *weight,
        ]

    # ------------------------------------------------------------------ host side
    def entry_point(self):
        """What cute.compile compiles: __call__, or with fused_act_quant call_fused_quant."""
        return self.call_fused_quant if self.fused else self

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # fp8 [M, K], K-major (the activation quantizer's output)
        a_scale: cute.Tensor,  # f32 [M, K/128]
        w: cute.Tensor,  # fp8 [N, K], K-major
        w_scale: cute.Tensor,  # f32 [N/128, K/128]
        positions: cute.Tensor,  # int32/int64 [M]
        cos_sin: cute.Tensor,  # f32 [P, 64]
        out_q: cute.Tensor,  # int32 words [M, N/8] (packed mxfp4) or [M, N/4] (e4m3 bytes)
        out_scale: cute.Tensor,  # int32 [M, H]
        max_active_clusters: cutlass.Constexpr,
        stream,
    ):
        self._launch(a, a_scale, w, w_scale, positions, cos_sin, out_q, out_scale, max_active_clusters, stream)

    @cute.jit
    def call_fused_quant(
        self,
        qr: cute.Tensor,  # bf16 [M, K], K-major: quantized inside the kernel
        w: cute.Tensor,
        w_scale: cute.Tensor,
        positions: cute.Tensor,
        cos_sin: cute.Tensor,
        out_q: cute.Tensor,
        out_scale: cute.Tensor,
        max_active_clusters: cutlass.Constexpr,
        stream,
    ):
        self._launch(qr, None, w, w_scale, positions, cos_sin, out_q, out_scale, max_active_clusters, stream)

    @cute.jit
    def _launch(self, act, a_scale, w, w_scale, positions, cos_sin, out_q, out_scale, max_active_clusters, stream):
        t, bk = self.tile_rows, SCALE_BLOCK_K
        fp8 = w.element_type
        m, k = act.shape
        n = w.shape[0]
        self.heads = n // epi.HEAD_DIM
        k_tiles = k // bk
        self.k_blocks = k_tiles // self.split_k  # per rank (the split is even)
        kmajor = utils.LayoutEnum.ROW_MAJOR
        # A = the weight (a head's 128 rows as two m64 blocks), B = the token tile.
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            fp8, fp8, kmajor.sm90_mma_major_mode(), kmajor.sm90_mma_major_mode(), Float32, (1, 1, 1),
            tiler_mn=(ROWS_PER_CONSUMER, t),
        )
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(kmajor, fp8, bk), fp8)
        stages = self.stages_that_fit(self.config, k)
        if cutlass.const_expr(self.config.stages):
            stages = self.config.stages
        self.stages = stages
        self.loads_in_flight = self._loads_in_flight(stages)
        self.w_smem_staged = cute.tile_to_shape(atom, (epi.HEAD_DIM, bk, stages), order=(0, 1, 2))
        # B: a ring stage per K block, or (fused_act_quant) the rank's K blocks resident
        self.b_smem = cute.tile_to_shape(atom, (t, bk, self.k_blocks if self.fused else stages), order=(0, 1, 2))
        w_op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        if cutlass.const_expr(self.weight_sharers > 1):
            w_op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
        tma_w, mW = cute.nvgpu.cpasync.make_tiled_tma_atom(
            w_op, w, cute.slice_(self.w_smem_staged, (None, None, 0)), (epi.HEAD_DIM, bk),
            num_multicast=self.weight_sharers)
        tma_a, mA = tma_w, mW  # fused_act_quant: qr's staging TMA, or unused (the kernel loads qr)
        tx_bytes = epi.HEAD_DIM * bk
        if cutlass.const_expr(self.stages_qr_by_tma(self.config)):
            tma_a, mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), act,
                cute.slice_(self.qr_staging_layout(t, self.k_blocks), (None, None, 0)), (t, bk))
        if cutlass.const_expr(not self.fused):
            tma_a, mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), act, cute.slice_(self.b_smem, (None, None, 0)), (t, bk))
            tx_bytes += t * bk
            self.act_scale = a_scale
        else:
            self.act_scale = w_scale  # unused placeholder: the kernel keeps the scales in shared memory
        self.tx_bytes = tx_bytes

        # With a K split, cluster rank r of token tile i takes scheduler tile i * split_k + r.
        tiles_mnl = (cute.ceil_div(m, t) * self.split_k, n // epi.HEAD_DIM, 1)
        sched_params = utils.PersistentTileSchedulerParams(
            tiles_mnl, (*self.cluster_shape_mn, 1), self.config.swizzle, self.config.raster_along_m)
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched_params, max_active_clusters)
        extra = []
        if cutlass.const_expr(self.fused):
            extra = [("sActScale", Float32, self.k_blocks * t)]
        if cutlass.const_expr(self.stages_qr_by_tma(self.config)):
            extra += [("qr_mbar", Int64, 2), ("sQr", cutlass.BFloat16, t * bk * self.k_blocks)]
        if cutlass.const_expr(self.share > 1):  # the peers' share of the first tile arrived
            extra += [("peer_mbar", Int64, 1)]
        self.shared_storage = shared_storage(
            stages=stages, split_k=self.split_k, reduce_words=max(1, self._reduce_words(self.config)),
            epi_words=EPI_BUFFERS * t * WORDS_PER_ROW, extra=extra,
            operands=[("sA", fp8, cute.cosize(self.w_smem_staged)), ("sB", fp8, cute.cosize(self.b_smem))])
        self.kernel(
            tma_w, mW, tma_a, mA, act, self.act_scale, w_scale, positions, cos_sin, out_q, out_scale,
            self.tiled_mma, self.w_smem_staged, self.b_smem, sched_params,
        ).launch(
            grid=grid, block=[self.threads, 1, 1], cluster=(*self.cluster_shape_mn, 1), min_blocks_per_mp=1,
            stream=stream, use_pdl=self.config.pdl,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        tma_w: cute.CopyAtom,
        mW: cute.Tensor,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        act: cute.Tensor,  # the fp8 activation, or (fused_act_quant) the bf16 qr
        a_scale: cute.Tensor,  # f32 [M, K/128] (unused with fused_act_quant)
        w_scale: cute.Tensor,
        positions: cute.Tensor,
        cos_sin: cute.Tensor,
        out_q: cute.Tensor,
        out_scale: cute.Tensor,
        tiled_mma: cute.TiledMma,
        w_smem_staged: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        sched_params: utils.PersistentTileSchedulerParams,
    ):
        t = self.tile_rows
        if cutlass.const_expr(self.config.pdl):
            # Let the next grid in the stream (launched with PDL) start as our CTAs finish:
            # its prologue and first weight loads overlap our tail; it waits for this grid's
            # completion (griddepcontrol.wait) before it reads anything we write.
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        qr_tma = self.stages_qr_by_tma(self.config)
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_w)
            if cutlass.const_expr(not self.fused or qr_tma):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        if cutlass.const_expr(self.config.prefetch_qr):
            # an idle warp of the producer's warpgroup, before anything waits: off the producer's path
            if warp_idx == 1:
                sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                                   cute.arch.grid_dim())
                work = sched.initial_work_tile_info()
                if work.is_valid_tile:
                    k_first = cta_rank * self.k_blocks if self.split_k > 1 else 0
                    self._prefetch_first_rows(act, self._m_tile(work.tile_idx) * t, work.tile_idx[1], k_first,
                                              cute.arch.lane_idx())

        storage = utils.SmemAllocator().allocate(self.shared_storage)
        # A K split's ranks and heads sharing the quantizer each load and release their own
        # stages: the mode picked is the one along which the cluster has a single CTA. Token
        # tiles sharing the weight (along M) each write part of every stage of all of them,
        # so each consumer warp releases a stage to every CTA of the cluster (mode N: the
        # CTAs of its head).
        release_mode = (1, 0) if self.share == 1 else (0, 1)
        if cutlass.const_expr(self.weight_sharers > 1):
            release_mode = (0, 1)
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.pipeline_mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # the consumer's warps, each arriving once for every CTA it releases to
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.weight_sharers),
            tx_count=self.tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, *self.cluster_shape_mn, 1)),
            mcast_mode_mn=release_mode,
            defer_sync=True,
        )
        epi_pipeline = pipeline.PipelineAsync.create(
            barrier_storage=storage.epi_mbar.data_ptr(),
            num_stages=EPI_BUFFERS,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WARPGROUP),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.epi_wgs * WARPGROUP),
            defer_sync=True,
        )
        reduce_full = storage.reduce_mbar.data_ptr()  # + slot, in rank 0
        reduce_free = reduce_full + (self.split_k - 1)  # in ranks 1.., arrived on by rank 0
        if cutlass.const_expr(self.scatter):
            # one "slots full" barrier (every rank's bytes) and one "slots free" (every
            # rank's consumer threads, once they have summed their slots)
            reduce_free = reduce_full + 1
            if tidx == 0:
                cute.arch.mbarrier_init(reduce_full, 1)
                cute.arch.mbarrier_init(reduce_free, self.split_k * WARPGROUP)
        elif cutlass.const_expr(self.split_k > 1):
            if tidx == 0:
                for slot in cutlass.range_constexpr(self.split_k - 1):
                    cute.arch.mbarrier_init(reduce_full + slot, 1)
                cute.arch.mbarrier_init(reduce_free, WARPGROUP)
        staging, share = self._quantizer_barriers(storage, tidx, cta_rank)
        pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)
        if cutlass.const_expr(self.scatter):
            sReduce = scatter_tensor(storage, self.split_k, t // self.split_k)
        else:
            sReduce = reduce_tensor(storage, self.split_k, t)
        sQ = storage.sQ.get_tensor(cute.make_layout((EPI_BUFFERS, t, WORDS_PER_ROW),
                                                    stride=(t * WORDS_PER_ROW, WORDS_PER_ROW, 1)))
        sW = storage.sA.get_tensor(w_smem_staged.outer, swizzle=w_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        self._swizzles = (w_smem_staged.inner, b_smem.inner)
        k_begin = cta_rank * self.k_blocks if self.split_k > 1 else 0
        reduce = (reduce_full, reduce_free, sReduce)
        pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)

        trace = self._trace_tensor(out_q)
        warpgroup = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                sQr = None
                if cutlass.const_expr(qr_tma):
                    sQr = storage.sQr.get_tensor(self.qr_staging_layout(t, self.k_blocks))
                self._producer(ab_pipeline, tma_w, mW, sW, tma_a, mA, sB, sQr, staging, k_begin, sched_params,
                               trace, cute.arch.lane_idx())
        elif warpgroup >= self.epi_wg:
            self._set_epilogue_registers()
            if cutlass.const_expr(self.fused):
                sActScale = storage.sActScale.get_tensor(cute.make_layout((self.k_blocks, t), stride=(t, 1)))
                self._help_quantize_first_tile(act, storage.sB.data_ptr(), sActScale, staging, k_begin,
                                               sched_params, tidx - (self.epi_wg - 1) * WARPGROUP, share)
            if cta_rank == 0 or cutlass.const_expr(self.split_k == 1 or self.scatter):  # who finishes rows
                self._epilogue(epi_pipeline, sQ, tidx - self.epi_wg * WARPGROUP, sched_params,
                               positions, cos_sin, out_q, out_scale, act.shape[0], trace)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            sActScale = None
            if cutlass.const_expr(self.fused):
                sActScale = storage.sActScale.get_tensor(cute.make_layout((self.k_blocks, t), stride=(t, 1)))
            args = (ab_pipeline, epi_pipeline, sQ, tiled_mma, sW, sB, storage.sB.data_ptr(), sActScale, staging,
                    tidx - WARPGROUP, k_begin, sched_params, act, a_scale, w_scale, reduce, trace, share)
            if cutlass.const_expr(self.split_k == 1):
                self._consumer(*args, role="whole")
            elif cutlass.const_expr(self.scatter):
                self._consumer(*args, role="scatter")
            elif cta_rank == 0:
                self._consumer(*args, role="reduce")
            else:
                self._consumer(*args, role="send")

    def _m_tile(self, tile):
        """The token tile of a scheduler tile: a K split's ranks share one."""
        return tile[0] // self.split_k

    @property
    def epi_rows(self):
        return self.tile_rows // self.split_k if self.scatter else self.tile_rows

    def _epi_row0(self, tile):
        row0 = self._m_tile(tile) * self.tile_rows
        if self.scatter:  # this rank's slice
            row0 = row0 + cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()) * self.epi_rows
        return row0

    @cute.jit
    def _producer(self, ab_pipeline, tma_w, mW, sW, tma_a, mA, sB, sQr, staging, k_begin, sched_params, trace,
                  lane):
        t, bk = self.tile_rows, SCALE_BLOCK_K
        self._stamp(trace, 14, lane)
        one_cta = cute.make_layout(1)
        # (TMA view, heads, K blocks) and (TMA view, token tiles, K blocks). Token tiles
        # sharing the weight: this CTA's slice of each block, multicast to the cluster.
        w_ctas, w_coord, w_mask = one_cta, 0, None
        if cutlass.const_expr(self.weight_sharers > 1):
            w_ctas = cute.make_layout(self.weight_sharers)
            w_coord = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            w_mask = cute.make_layout_image_mask(cute.make_layout((self.weight_sharers, 1, 1)), (w_coord, 0, 0),
                                                 mode=0)  # every CTA of the cluster
        tWsW, tWgW = cute.nvgpu.cpasync.tma_partition(
            tma_w, w_coord, w_ctas, cute.group_modes(sW, 0, 2),
            cute.group_modes(cute.local_tile(mW, (epi.HEAD_DIM, bk), (None, None)), 0, 2))
        tAsB, tAgA = tWsW, tWgW  # placeholders where nothing else is loaded by TMA
        if cutlass.const_expr(not self.fused):
            tAsB, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_a, 0, one_cta, cute.group_modes(sB, 0, 2),
                cute.group_modes(cute.local_tile(mA, (t, bk), (None, None)), 0, 2))
        qr_tma = staging is not None
        if cutlass.const_expr(qr_tma):  # (TMA view, token tiles, K blocks) of qr and of its staging buffer
            tAsB, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_a, 0, one_cta, cute.group_modes(sQr, 0, 2),
                cute.group_modes(cute.local_tile(mA, (t, bk), (None, None)), 0, 2))
        staged = Int32(0)  # qr_tma: token tiles staged
        staged_tile = Int32(-1)
        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        # The first tile's weight blocks (as many as the ring holds) are requested before
        # waiting for the previous grid (PDL): the weight is not written by the kernel
        # launched before this one (the activation quantizer, or the caller's previous
        # op); the activation is read only after the wait.
        early = min(self.stages, self.k_blocks, self.loads_in_flight)
        before_qr = min(early, WEIGHT_BLOCKS_BEFORE_QR)
        a_state = state.clone()
        if work.is_valid_tile:
            tWgW_n = tWgW[(None, work.tile_idx[1], None)]
            for kb in cutlass.range_constexpr(early + 1):  # the qr step once, before block before_qr
                if cutlass.const_expr(self.fused and kb == before_qr):
                    if cutlass.const_expr(qr_tma):
                        staged_tile = self._m_tile(work.tile_idx)
                        self._stage_qr(tma_a, tAgA, tAsB, staging, staged_tile, k_begin, staged)
                        staged += 1
                    else:
                        self._wait_for_qr_loads()
                if cutlass.const_expr(kb < early):
                    ab_pipeline.producer_acquire(state)
                    if cutlass.const_expr(kb < TRACE_BLOCKS):
                        self._stamp(trace, 48 + kb, lane)
                    self._load_weight(tma_w, tWgW_n[(None, k_begin + kb)], tWsW[(None, state.index)],
                                      ab_pipeline.producer_get_barrier(state), w_mask)
                    state.advance()
        if cutlass.const_expr(self.config.pdl):
            cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(not self.fused):
            if work.is_valid_tile:
                tAgA_m = tAgA[(None, self._m_tile(work.tile_idx), None)]
                for kb in cutlass.range_constexpr(early):
                    cute.copy(tma_a, tAgA_m[(None, k_begin + kb)], tAsB[(None, a_state.index)],
                              tma_bar_ptr=ab_pipeline.producer_get_barrier(a_state))
                    a_state.advance()
        first = early
        while work.is_valid_tile:
            tile = work.tile_idx
            tWgW_n = tWgW[(None, tile[1], None)]
            tAgA_m = tAgA[(None, self._m_tile(tile), None)]
            if cutlass.const_expr(qr_tma):
                if self._m_tile(tile) != staged_tile:  # a later token tile (the first was staged above)
                    staged_tile = self._m_tile(tile)
                    self._stage_qr(tma_a, tAgA, tAsB, staging, staged_tile, k_begin, staged)
                    staged += 1
            for kb in range(first, self.k_blocks):
                pace_loads(ab_pipeline, state, self.loads_in_flight)
                ab_pipeline.producer_acquire(state)
                if cutlass.const_expr(trace is not None):
                    if first > 0 and kb < TRACE_BLOCKS:  # the first tile (its first blocks were early)
                        self._stamp(trace, 48 + kb, lane)
                bar = ab_pipeline.producer_get_barrier(state)
                self._load_weight(tma_w, tWgW_n[(None, k_begin + kb)], tWsW[(None, state.index)], bar, w_mask)
                if cutlass.const_expr(not self.fused):
                    cute.copy(tma_a, tAgA_m[(None, k_begin + kb)], tAsB[(None, state.index)], tma_bar_ptr=bar)
                ab_pipeline.producer_commit(state)
                state.advance()
            first = 0  # only the first tile had its first blocks issued above
            sched.advance_to_next_work()
            work = sched.get_current_work()
        self._stamp(trace, 15, lane)
        ab_pipeline.producer_tail(state)

    def _load_weight(self, tma_w, src, dst, bar, mask):
        """A weight block (or, shared by token tiles, this CTA's slice of it for all of them)."""
        if cutlass.const_expr(mask is None):
            cute.copy(tma_w, src, dst, tma_bar_ptr=bar)
        else:
            cute.copy(tma_w, src, dst, tma_bar_ptr=bar, mcast_mask=mask)

    @cute.jit
    def _consumer(self, ab_pipeline, epi_pipeline, sQ, tiled_mma, sW, sB, sB_ptr, sActScale, staging, ctidx,
                  k_begin, sched_params, act, a_scale, w_scale, reduce, trace, share, role: cutlass.Constexpr):
        """role: "whole" (all K blocks), or in a K split "reduce" (rank 0: adds the other
        ranks' partial tiles, then hands the tile to the epilogue), "send" (ranks 1..) or
        "scatter" (every rank: reduce-scatter, then hands its T / S rows to its epilogue).
        `share`: cluster_n > 1, (this CTA's rank among the heads, the peers' bytes barrier)."""
        t = self.tile_rows
        thr_mma = tiled_mma.get_slice(ctidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sW))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        # GemmConfig.uniform_descriptors: each block's fragments made from its stages'
        # warp-uniform addresses (Sm90SwapABKLoops._block_operands); else the ones above
        operands = (thr_mma, sW, sB) + self._swizzles if self.config.uniform_descriptors else None
        acc_shape = thr_mma.partition_shape_C((epi.HEAD_DIM, t))
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        partial = cute.make_rmem_tensor(acc_shape, Float32)
        partial2 = cute.make_rmem_tensor(acc_shape, Float32) if self.two_partials else None
        groups = t // 8  # token groups of 8 the hand-off takes
        mine = acc
        if cutlass.const_expr(role == "scatter"):
            groups = t // 8 // self.split_k
            mine = cute.make_rmem_tensor(cute.make_layout(t // self.split_k), Float32)
        m = act.shape[0]
        self._stamp(trace, 0, ctidx, global_timer=True)
        self._stamp(trace, 1, ctidx)
        scales_first = self.config.scales_before_pdl_wait
        if cutlass.const_expr(self.config.pdl and not scales_first):
            cute.arch.griddepcontrol_wait()  # the activation (or its scales) come from the previous grid
        if cutlass.const_expr(not scales_first):
            self._stamp(trace, 2, ctidx)
        lane = cute.arch.lane_idx()
        quad_lane = lane % 4
        # Accumulator value i = v + 2h + 4j + (T/2) mi: dim 64 mi + 16 warp + lane / 4 + 8h,
        # token 8j + 2 quad_lane + v.
        dim0 = (ctidx // 32) * 16 + lane // 4
        tokens = [8 * j + 2 * quad_lane + v for j in range(t // 8) for v in range(2)]
        sQ16 = cute.make_tensor(cute.recast_ptr(sQ.iterator, dtype=cutlass.Int16),
                                cute.make_layout((EPI_BUFFERS, t, 2 * WORDS_PER_ROW),
                                                 stride=(t * 2 * WORDS_PER_ROW, 2 * WORDS_PER_ROW, 1)))

        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        epi_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, EPI_BUFFERS)
        tiles_done = Int32(0)
        quantized = Int32(-1)  # the token tile whose activation is in shared memory
        tiles_quantized = Int32(0)
        while work.is_valid_tile:
            tile = work.tile_idx
            head = tile[1]
            m_tile = self._m_tile(tile)
            row0 = m_tile * t
            pipelined = self.config.pipelined_promotion
            # pipelined: the weight's block scales of the whole tile, loaded before the
            # quantizer so that their latency hides under it
            w_scales = self._weight_scales(w_scale, head, k_begin) if pipelined else []
            if cutlass.const_expr(scales_first):
                if tiles_done == 0:
                    # GemmConfig.scales_before_pdl_wait: the weight's scales are not the previous
                    # grid's output, so their loads may land during its tail
                    if cutlass.const_expr(self.config.pdl):
                        cute.arch.griddepcontrol_wait()  # the activation comes from the previous grid
                    self._stamp(trace, 2, ctidx)
            if cutlass.const_expr(self.fused):
                if m_tile != quantized:
                    if tiles_done == 0:
                        self._quantize_tile(act, sB_ptr, sActScale, row0, m, k_begin, ctidx, 1 + self.epi_wgs,
                                            staging, tiles_quantized, share=share, trace=trace)
                    else:
                        self._quantize_tile(act, sB_ptr, sActScale, row0, m, k_begin, ctidx, 1, staging,
                                            tiles_quantized)
                    quantized = m_tile
                    tiles_quantized += 1
            if tiles_done == 0:
                self._stamp(trace, 3, ctidx)
            acc.fill(0.0)
            if cutlass.const_expr(pipelined and t > TWO_PARTIALS_MAX_TILE):
                read_state, tiled_mma = self._k_loop_halves(
                    ab_pipeline, read_state, tiled_mma, tCrA, tCrB, acc, partial, w_scales, sActScale,
                    a_scale, row0, m, tokens, k_begin, trace, ctidx, tiles_done, operands)
            elif cutlass.const_expr(pipelined):
                read_state, tiled_mma = self._k_loop_pipelined(
                    ab_pipeline, read_state, tiled_mma, tCrA, tCrB, acc, (partial, partial2), w_scales, sActScale,
                    a_scale, row0, m, tokens, k_begin, trace, ctidx, tiles_done, operands)
            else:
                read_state, tiled_mma = self._k_loop_plain(
                    ab_pipeline, read_state, tiled_mma, tCrA, tCrB, acc, partial, w_scale, sActScale, a_scale,
                    head, row0, m, tokens, k_begin, trace, ctidx, tiles_done, operands)
            if tiles_done == 0:
                self._stamp(trace, 10, ctidx)
            if cutlass.const_expr(role == "send"):
                send_partial(acc, reduce, ctidx, tiles_done)
            if cutlass.const_expr(role == "reduce"):
                add_partials(acc, reduce, ctidx, tiles_done, epi.HEAD_DIM * t * 4)
            if cutlass.const_expr(role == "scatter"):
                scatter_partial(acc, reduce, ctidx, tiles_done, groups, t // 2)
                gather_partials(mine, reduce, ctidx, tiles_done, epi.HEAD_DIM * (t // self.split_k) * 4)
            if tiles_done == 0:
                self._stamp(trace, 11, ctidx)
            tiles_done += 1
            if cutlass.const_expr(role != "send"):
                self._hand_to_epilogue(mine, epi_pipeline, epi_state, sQ16, dim0, quad_lane, groups)
                epi_state.advance()
            if tiles_done == 1:
                self._stamp(trace, 12, ctidx)
                self._stamp(trace, 13, ctidx, global_timer=True)
            sched.advance_to_next_work()
            work = sched.get_current_work()
        if cutlass.const_expr(role == "send" or role == "scatter"):
            # Rank 0 (every rank, reduce-scatter) arrives on this CTA's "slot free" barrier
            # after its last read: wait for that before exiting, so no remote arrive
            # targets an exited CTA.
            cute.arch.mbarrier_wait(reduce[1], (tiles_done & 1) ^ 1)
