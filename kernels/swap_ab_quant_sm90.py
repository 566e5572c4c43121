"""The swapped-A/B kernel's fused activation quantizer (sm_90a, `fused_act_quant`).

SPEC step 1 inside the GEMM's launch: the bf16 rows of a CTA's token tile are quantized
with kernels/act_quant.py's arithmetic (e4m3 values, one power-of-two scale a 128-K block)
straight into the swizzled B layout the WGMMAs read, with the scales beside it in shared
memory. The first tile is quantized by the consumer and the epilogue warpgroups together
(the epilogue is idle until then); a later token tile by the consumer alone.

Its loads of qr go first, so they do not queue behind the weight's stream: the producer
requests WEIGHT_BLOCKS_BEFORE_QR weight blocks, then either brings the tile's qr rows into
shared memory by TMA itself (tiles up to QR_TMA_MAX_TILE, unless `stage_qr` is off) or, for larger tiles whose
quantizers load qr themselves, waits until they have issued their first loads (named
barrier BAR_QR_LOADS_ISSUED) before requesting the rest.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
from cutlass import Int32

from . import epilogue as epi
from .act_quant import quantize_unit, quantize_words
from .gemm_base import SCALE_BLOCK_K
from .sm90_parts import WARPGROUP

BAR_ACT_READY = 2  # named barrier of the consumer warpgroup: the quantized tile is in shared memory
BAR_FIRST_ACT_READY = 3  # the same for the first tile, quantized by the consumer and the epilogue warpgroups
# fused_act_quant: the producer requests this many of the first tile's weight blocks, then
# waits (named barrier BAR_QR_LOADS_ISSUED) until the quantizers have issued their first
# loads of qr before requesting the rest: behind the whole weight's requests (12.6 MB at
# V4-Pro) those loads waited 2.8-7.5 us (tuning/trace_decode.py, T = 8..64), ahead of them
# they take one round trip. So only these first blocks overlap the previous grid under PDL
# (the quantizers wait for that grid before loading qr).
WEIGHT_BLOCKS_BEFORE_QR = 1
BAR_QR_LOADS_ISSUED = 4
QUANT_LANES = 16  # lanes a (token, 128-K block) unit, 8 values a lane (as kernels/act_quant.py)
# GemmConfig.act_quant_lanes: 16 as above, or 4 (a lane takes four of those 16 lanes'
# values): two shuffle stages instead of four and one exponent a 32 values instead of a 8
ACT_QUANT_LANE_CHOICES = (16, 4)
QUANT_RESERVED_REGS = 64  # a consumer thread's registers kept for addressing while it quantizes
# Token tiles up to this size have their bf16 rows brought into shared memory by TMA (the
# producer issues them right after the first weight block): no register budget or load
# batches, and the weight's remaining requests follow at once instead of waiting for the
# quantizers' loads to issue (trace, T = 16: the producer's requests done at 0.8 us, not
# 1.8). Tuner, same run: tiles of 8-16 without a K split 0.3-0.6 us faster (V4-Pro M = 8
# 6.16 -> 5.60 us, M = 16 6.99 -> 6.53), with one about even; tiles of 32 0.5 us slower
# (their 49 KB staging buffer), so they load qr themselves, as do tiles of 64 (98 KB).
# GemmConfig.stage_qr=False makes tiles up to this size load it too, the buffer's space going
# to the weight's ring (the tables' choice at V4-Pro M = 9-32 in the 26th session).
QR_TMA_MAX_TILE = 16
# GemmConfig.prefetch_qr: a tile's rows split over this many heads' CTAs (row r by head r mod it)
QR_PREFETCH_GROUPS = 4


class Sm90SwapABQuantizer:
    """Mixin of Sm90SwapABFusedIndexerQ: uses its tile_rows, k_blocks, epi_wgs, register
    budgets and _m_tile."""

    @staticmethod
    def stages_qr_by_tma(config) -> bool:
        return config.fused_act_quant and config.tile_m <= QR_TMA_MAX_TILE and config.stage_qr

    @cute.jit
    def _quantizer_barriers(self, storage, tidx, cta_rank):
        """Thread 0 initializes the quantizer's barriers; returns (staging, share):
        staging, where qr is staged by TMA: (qr_full, qr_empty, the staging buffer as
        words), else None; share, with cluster_n > 1: (this CTA's rank among the heads, the
        barrier its peers' bytes complete on), else None."""
        staging = None
        if cutlass.const_expr(self.stages_qr_by_tma(self.config)):
            qr_full = storage.qr_mbar.data_ptr()
            if tidx == 0:
                cute.arch.mbarrier_init(qr_full, 1)
                cute.arch.mbarrier_init(qr_full + 1, 1)
            sQrw = cute.make_tensor(cute.recast_ptr(storage.sQr.data_ptr(), dtype=Int32),
                                    cute.make_layout(self.tile_rows * SCALE_BLOCK_K // 2 * self.k_blocks))
            staging = (qr_full, qr_full + 1, sQrw)
        share = None
        if cutlass.const_expr(self.share > 1):
            peer_full = storage.peer_mbar.data_ptr()
            if tidx == 0:
                cute.arch.mbarrier_init(peer_full, 1)
            share = (cta_rank, peer_full)
        return staging, share

    @staticmethod
    def qr_staging_layout(t: int, k_blocks: int):
        """The rank's bf16 rows of qr in shared memory: [token, 128 K, K block], each
        block's rows of 256 bytes (no swizzle: a half-warp reads one row's 256 bytes)."""
        return cute.make_layout((t, SCALE_BLOCK_K, k_blocks), stride=(SCALE_BLOCK_K, 1, t * SCALE_BLOCK_K))

    @cute.jit
    def _stage_qr(self, tma_q, tQgQ, tQsQ, staging, m_tile, k_begin, staged):
        """Producer warp: TMA the token tile's rows of qr (the rank's K blocks) into the
        staging buffer, once the quantizers are done with the previous tile's (`staged`:
        tiles staged before). Rows past M arrive as zeros."""
        qr_full, qr_empty, _ = staging
        if staged > 0:
            cute.arch.mbarrier_wait(qr_empty, (staged - 1) & 1)
        if cutlass.const_expr(self.config.pdl):
            cute.arch.griddepcontrol_wait()  # qr may come from the previous grid
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(qr_full, self.tile_rows * SCALE_BLOCK_K * 2 * self.k_blocks)
        for kb in cutlass.range_constexpr(self.k_blocks):
            cute.copy(tma_q, tQgQ[(None, m_tile, k_begin + kb)], tQsQ[(None, kb)], tma_bar_ptr=qr_full)

    @cute.jit
    def _prefetch_first_rows(self, qr, row0, head, k_begin, lane):
        """An idle warp of the producer's warpgroup, before any PDL wait (GemmConfig.prefetch_qr):
        the L2 fetches rows row0 + r of qr (the rank's K range), r = head mod G, + G, ... (G =
        QR_PREFETCH_GROUPS heads cover the tile; each CTA asks for its share, so one starting
        late leaves little undone), one bulk prefetch a row by one lane. A hint only: the rows
        are read after the wait, from the L2 that the previous grid's writes reach."""
        groups = min(QR_PREFETCH_GROUPS, self.heads)
        row_bytes = self.k_blocks * SCALE_BLOCK_K * 2
        for i in cutlass.range_constexpr((self.tile_rows + 32 * groups - 1) // (32 * groups)):
            r = (lane + 32 * i) * groups + head % groups
            if r < self.tile_rows:
                if row0 + r < qr.shape[0]:
                    ptr = qr.iterator + cute.crd2idx((row0 + r, k_begin * SCALE_BLOCK_K), qr.layout)
                    cute.arch.inline_ptx("cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};",
                                         read_only_args=[ptr, Int32(row_bytes)])

    def _wait_for_qr_loads(self):
        """Producer warp: until every quantizer thread of the first tile has issued its
        first loads of qr (they arrive, not sync: another instruction than this one)."""
        cute.arch.barrier(barrier_id=BAR_QR_LOADS_ISSUED, number_of_threads=32 + (1 + self.epi_wgs) * WARPGROUP)

    @cute.jit
    def _help_quantize_first_tile(self, qr, sB_ptr, sActScale, staging, k_begin, sched_params, qtidx, share):
        """An epilogue thread's share of the CTA's first token tile (qtidx counts from the
        consumer's 128 threads on)."""
        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        if work.is_valid_tile:
            if cutlass.const_expr(self.config.pdl and staging is None):
                cute.arch.griddepcontrol_wait()  # qr may come from the previous grid
            self._quantize_tile(qr, sB_ptr, sActScale, self._m_tile(work.tile_idx) * self.tile_rows, qr.shape[0],
                                k_begin, qtidx, 1 + self.epi_wgs, staging, Int32(0), helper=True, share=share)

    @cute.jit
    def _quantize_tile(self, qr, sB_ptr, sActScale, row0, m, k_begin, qtidx, helpers: cutlass.Constexpr,
                       staging, staged, helper: cutlass.Constexpr = False, share=None, trace=None):
        """SPEC step 1 for the rank's K blocks of token rows row0.. by `helpers` warpgroups
        (1: the consumer; more: with the epilogue warpgroups, first tile only): each (row,
        128-K block) unit is GemmConfig.act_quant_lanes lanes' (16: a half-warp, 8 values a
        lane; 4: 32 values a lane), quantized with the act_quant kernel's arithmetic and
        stored as e4m3 in the WGMMA's swizzled B layout (128 bytes a row, 16-byte chunks
        XORed with row % 8), its scale 2^e beside it. Only the rows
        below M are quantized: the columns of the rows past it hold whatever the buffer
        held, and nothing computed from them is stored (a column of the MMA depends on its
        own token only, and so does every epilogue step). A helper (epilogue) thread only
        signals its part done; the consumer waits for every part. `staging`: (qr_full,
        qr_empty, the staging buffer as words) where the producer brought the rows into
        shared memory by TMA (`staged`: tiles quantized before), else None: loads from
        global memory. `share` (the first tile, cluster_n > 1): (this CTA's rank r among the
        cluster's heads, the barrier its peers' bytes complete on): it quantizes K blocks r,
        r + cluster_n, ... only and also sends their e4m3 bytes and scales to every peer's
        shared memory (st.async), while the peers send it theirs."""
        t = self.tile_rows
        blocks = self.k_blocks if share is None else self.k_blocks // self.share  # this CTA quantizes
        lanes = self.config.act_quant_lanes
        taken = QUANT_LANES // lanes  # the 16-lane layout's lanes (8 values each) a thread takes
        groups = helpers * WARPGROUP // lanes
        rounds = (t * blocks + groups - 1) // groups  # a full tile's
        live = cutlass.min(t, m - row0)  # rows below M (row0 < M)
        if cutlass.const_expr(self.weight_sharers > 1):
            # none in a tile wholly past M (the last of a cluster of token tiles sharing the
            # weight, where the tiles run out): it only takes part in the weight's loads
            live = cutlass.max(0, live)
        units = live * blocks
        live_rounds = (units + groups - 1) // groups
        half = qtidx // lanes
        lane_q = qtidx % lanes
        sBw = cute.make_tensor(cute.recast_ptr(sB_ptr, dtype=Int32), cute.make_layout(t * self.k_blocks * 32))
        bar = BAR_ACT_READY if helpers == 1 else BAR_FIRST_ACT_READY
        if cutlass.const_expr(share is not None and not helper):
            if qtidx == 0:  # the peers' blocks: 128 e4m3 bytes and a 4-byte scale a (row, block)
                cute.arch.mbarrier_arrive_and_expect_tx(
                    share[1], live * (self.k_blocks - blocks) * (SCALE_BLOCK_K + 4))
        if cutlass.const_expr(helpers == 1):
            # every thread is past its last read of the previous tile's scales and operands
            cute.arch.barrier(barrier_id=bar, number_of_threads=WARPGROUP)
        if cutlass.const_expr(staging is not None):
            cute.arch.mbarrier_wait(staging[0], staged & 1)
        self._stamp(trace, 16, qtidx)
        # Units loaded at once: each load is a DRAM round trip, so as many as the registers
        # beside the accumulators hold (4 a unit; one batch up to T = 32 at split 2).
        regs = self.consumer_regs - 2 * t
        if cutlass.const_expr(self.config.pipelined_promotion):  # the weight's scales (and a second partial)
            # (a register a block; with uniform_descriptors they take one a 32 blocks, but the
            # budget is kept as tuned: NOTES, thirtieth session's reading (b))
            regs = regs - self.k_blocks - (t if self.two_partials else 0)
        if cutlass.const_expr(helpers > 1):
            regs = min(regs, self.epilogue_regs)
        # The rounds in batches of even size (with the largest batch that fits, the last
        # one could be mostly clamped units: 32 rounds in 4 x 10). Any size works: the
        # loop's last batch may run past the live units, which are clamped and not stored.
        budget = max(1, (regs - QUANT_RESERVED_REGS) // (4 * taken))
        if cutlass.const_expr(staging is not None):  # shared-memory loads: a few for overlap
            budget = min(budget, max(1, 4 // taken))
        batches = (rounds + budget - 1) // budget
        batch = (rounds + batches - 1) // batches
        if cutlass.const_expr(helpers > 1 and staging is None and self.weight_sharers > 1):
            if live_rounds == 0:  # nothing to load: the producer's wait must not hang on us
                cute.arch.barrier_arrive(barrier_id=BAR_QR_LOADS_ISSUED,
                                         number_of_threads=32 + helpers * WARPGROUP, aligned=False)
        for first in cutlass.range(0, live_rounds, batch, unroll=1):  # a loop: unrolled it spilled at T = 64
            loaded = []
            for it in cutlass.range_constexpr(batch):
                # past the last live unit: a live unit's values, computed (the unit's lanes'
                # shuffles need every lane) and not stored
                unit = cutlass.min((first + it) * groups + half, units - 1)
                stored = (first + it) * groups + half < units
                r = unit // blocks
                b = unit - r * blocks
                if cutlass.const_expr(share is not None):  # this CTA's j-th block
                    b = b * self.share + share[0]
                row = row0 + r
                # the 16-lane layout's lanes this thread takes: lane_q, lane_q + lanes, ...;
                # at 4 lanes a unit, odd units take them in the other order, so a quarter
                # warp's two units read different 64-byte quarters of their staged rows (no
                # bank conflict)
                lane16s = [lane_q] if taken == 1 else [lane_q + lanes * (v ^ (half & 1)) for v in range(taken)]
                words = []
                for lane16 in lane16s:
                    if cutlass.const_expr(staging is not None):
                        word = (b * t + r) * (SCALE_BLOCK_K // 2) + lane16 * 4
                        words.extend(staging[2][word + i] for i in range(4))
                    else:
                        col = (k_begin + b) * SCALE_BLOCK_K + lane16 * 8
                        words.extend(epi.load_f32x4(qr.iterator + cute.crd2idx((row, col), qr.layout)))
                loaded.append((r, b, lane16s, words, stored))
            if cutlass.const_expr(helpers > 1 and staging is None):  # the first tile: let the weight's requests follow
                if first == 0:
                    cute.arch.barrier_arrive(barrier_id=BAR_QR_LOADS_ISSUED,
                                             number_of_threads=32 + helpers * WARPGROUP, aligned=False)
            if cutlass.const_expr(trace is not None):  # slot 23: the first batch's qr has landed
                # in a block of its own after the arrive (ptxas schedules within blocks: the xor
                # would otherwise be placed above the arrive, holding it until the loads land)
                if row0 < m:  # always, in a live round
                    if first == 0:
                        landed = Int32(0)
                        for _, _, _, words, _ in loaded:
                            for w in words:
                                landed = landed ^ w.bitcast(Int32)
                        if (landed & 1) * (m >> 30) == 0:  # always true, once the loads are in
                            self._stamp(trace, 23, qtidx)
            for r, b, lane16s, words, stored in loaded:
                if cutlass.const_expr(taken == 1):
                    out, scale = quantize_unit(words)
                else:
                    out, scale = quantize_words([w.bitcast(Int32) for w in words],
                                                tuple(x for x in (1, 2, 4, 8) if x < lanes))
                places = [b * (t * SCALE_BLOCK_K) + r * SCALE_BLOCK_K + ((((lane16 >> 1) ^ (r & 7)) << 4)
                                                                         + (lane16 & 1) * 8) for lane16 in lane16s]
                if stored:
                    for v, lane16 in enumerate(lane16s):
                        byte = places[v]
                        sBw[byte >> 2] = out[2 * v]
                        sBw[(byte >> 2) + 1] = out[2 * v + 1]
                        if lane16 == 0:
                            sActScale[b, r] = scale
                        if cutlass.const_expr(share is not None):
                            self._send_to_peers(sBw, byte, out[2 * v:2 * v + 2], sActScale, b, r, scale, lane16,
                                                share)
            if cutlass.const_expr(trace is not None):  # a batch's units stored and sent (slots 20..22)
                for j in cutlass.range_constexpr(3):
                    if first == j * batch:
                        self._stamp(trace, 20 + j, qtidx)
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> WGMMA reads
        # Arrive, not sync, in the helpers: bar.sync is .aligned (every thread meeting the
        # barrier at the same instruction), and the helpers' copy of this code is another
        # instruction than the consumer's (compute-sanitizer synccheck flags that)
        if cutlass.const_expr(helper):
            cute.arch.barrier_arrive(barrier_id=bar, number_of_threads=helpers * WARPGROUP)
        else:
            cute.arch.barrier(barrier_id=bar, number_of_threads=helpers * WARPGROUP)
            if cutlass.const_expr(staging is not None):
                if qtidx == 0:  # every quantizer is past its reads: the producer may stage the next tile
                    cute.arch.mbarrier_arrive(staging[1])
            self._stamp(trace, 17, qtidx)
            if cutlass.const_expr(share is not None):
                # the peers' blocks are in (phase 0: only the first tile is shared); their
                # bytes came by st.async, made visible to the WGMMAs' reads as the local ones are
                cute.arch.mbarrier_wait(share[1], 0)
                cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def _send_to_peers(self, sBw, byte, out, sActScale, b, r, scale, lane16, share):
        """8 e4m3 bytes of a shared block, those of the 16-lane layout's lane `lane16` (and,
        for lane16 0, the unit's scale), to the same place in every peer's shared memory,
        completing on its bytes barrier."""
        # the operand as 8-byte pairs of words (st.async.v2 needs the 8-byte alignment)
        sBpairs = cute.make_tensor(sBw.iterator, cute.make_layout((cute.size(sBw) // 2, 2), stride=(2, 1)))
        for peer in cutlass.range_constexpr(self.share):
            if peer != share[0]:
                cute.arch.store_async_dsmem(sBpairs[(byte >> 3, None)].iterator, (out[0], out[1]), share[1], peer)
                if lane16 == 0:
                    cute.arch.store_async_dsmem((sActScale.iterator + (b * self.tile_rows + r)),
                                                scale.bitcast(Int32), share[1], peer)
