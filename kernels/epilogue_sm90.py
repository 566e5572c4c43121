"""The sm_90a epilogue warpgroup(s), shared by the native and the swapped-A/B kernels.

The consumers hand each finished tile over as bf16 rows of one head (SPEC step 2's
rounding) in one of EPI_BUFFERS shared-memory buffers, [buffer, token row, word], the
16-byte chunks swizzled by row (sm90_parts.swizzled_word). The epilogue warpgroup(s)
read it back a row at a time (4 or 8 lanes a row) and run kernels/epilogue.py: RoPE,
the Hadamard (a butterfly of shuffles, or its H16 factor as bf16 mma.sync against a +-1
matrix) and MXFP4 / FP8 quantization with their stores. Everything here overlaps the next
tile's mainloop.

A kernel class that mixes this in sets: tile_rows (token rows of a tile), row_layout,
lanes_per_row, rows_per_pass, epilogue_regs, skip_rows_past_m, config and _m_tile(); it may
set epi_rows and _epi_row0() (the rows this CTA finishes: a K split that reduce-scatters
gives each rank a slice of the tile), and helper_rows with num_consumers: the consumer
warpgroups, idle once they have handed over the CTA's last tile, finish that tile's last
helper_rows rows (_help_last_tile) while the epilogue warpgroups finish the others.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass import Int32

from . import epilogue as epi
from . import hadamard_mma_sm90 as hmma
from .sm90_parts import BAR_LAST_TILE_HANDED, EPI_BUFFERS, ROWS_PER_CONSUMER, WARPGROUP, swizzled_word


class Sm90EpilogueRoles:
    helper_rows = 0  # rows of the CTA's last tile that its consumers finish (0: none)
    # the Hadamard's H16 factor on the tensor cores, one row a thread (hmma.tc_hadamard_row)
    tc_hadamard_rows = False

    @property
    def epi_rows(self):
        """Token rows this CTA's epilogue finishes a tile: the whole tile by default."""
        return self.tile_rows

    def _epi_row0(self, tile):
        """The first token row this CTA's epilogue finishes of a scheduler tile."""
        return self._m_tile(tile) * self.epi_rows

    @cute.jit
    def _epilogue(self, epi_pipeline, sQ, etidx, sched_params, positions, cos_sin, out_q, out_scale, m, trace=None):
        """`trace` (a traced kernel's stamps, else None): the first tile taken and finished."""
        bm = self.epi_rows
        layout = self.row_layout
        num_pos = cos_sin.shape[0]
        lane = cute.arch.lane_idx()
        lane_in_row = lane % self.lanes_per_row
        row_in_pass = (etidx // 32) * (32 // self.lanes_per_row) + lane // self.lanes_per_row
        lane_cols = layout.column_lane_bits(lane_in_row)
        # A tile smaller than a pass (swapped-A/B decode tiles): one pass, warps past the tile skip it.
        passes = max(1, bm // self.rows_per_pass)
        small_tile = bm < self.rows_per_pass
        # cos/sin rows are requested this many passes ahead; one when the epilogue has
        # fewer than 128 registers (two warpgroups beside two consumers: 64, no spills)
        ahead = 2 if self.epilogue_regs >= 128 else 1
        if cutlass.const_expr(self.tc_hadamard_rows):
            # the +-1 matrix's B fragments, in registers for the kernel's life (_finish_row)
            self._tc_row_b_words = hmma.tc_row_b_words(lane, layout)
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
        if cutlass.const_expr(trace is not None):
            first_tile = work.tile_idx  # the stamps are of the CTA's first tile
        while work.is_valid_tile:
            tile = work.tile_idx
            head = tile[1]
            rows = [self._epi_row0(tile) + p * self.rows_per_pass + row_in_pass for p in range(passes)]
            # Everything below is one basic block (stores are predicated), and the cos/sin
            # rows are requested before the tile is ready, so their latency overlaps the wait.
            cs = [self._cos_sin(layout, rows[p], m, num_pos, positions, cos_sin, lane_cols)
                  for p in range(min(ahead, passes) if self.config.epilogue else 0)]
            epi_pipeline.consumer_wait(epi_state)
            if cutlass.const_expr(trace is not None):
                self._stamp_first_tile(trace, 18, etidx, tile, first_tile)
            # The profiling probe (epilogue=False) only takes the tile and gives the buffer back.
            if cutlass.const_expr(self.config.epilogue):
                tile_row0 = self._epi_row0(tile)
                local = [p * self.rows_per_pass + row_in_pass for p in range(passes)]
                if cutlass.const_expr(self.helper_rows > 0):
                    # The CTA's last tile: the consumers finish its last helper_rows rows.
                    own = passes - self.helper_rows // self.rows_per_pass
                    self._epilogue_passes(sQ, epi_state.index, rows, local, cs, ahead, range(own), lane_in_row,
                                          lane_cols, head, m, num_pos, positions, cos_sin, out_q, out_scale, None)
                    sched.advance_to_next_work()
                    if sched.get_current_work().is_valid_tile:
                        self._epilogue_passes(sQ, epi_state.index, rows, local, list(cs), ahead, range(own, passes),
                                              lane_in_row, lane_cols, head, m, num_pos, positions, cos_sin, out_q,
                                              out_scale, None)
                elif cutlass.const_expr(not self.skip_rows_past_m):
                    self._epilogue_passes(sQ, epi_state.index, rows, local, cs, ahead, range(passes), lane_in_row,
                                          lane_cols, head, m, num_pos, positions, cos_sin, out_q, out_scale, None)
                elif cutlass.const_expr(small_tile):
                    warp_row0 = tile_row0 + cute.arch.make_warp_uniform(etidx // 32) * (32 // self.lanes_per_row)
                    self._epilogue_passes(sQ, epi_state.index, rows, local, list(cs), ahead, range(passes),
                                          lane_in_row, lane_cols, head, cutlass.min(m, tile_row0 + bm), num_pos,
                                          positions, cos_sin, out_q, out_scale, warp_row0)
                elif tile_row0 + bm <= m:
                    self._epilogue_passes(sQ, epi_state.index, rows, local, list(cs), ahead, range(passes),
                                          lane_in_row, lane_cols, head, m, num_pos, positions, cos_sin, out_q,
                                          out_scale, None)
                else:
                    # The last, partial tile: a warp skips the passes where all its rows
                    # are past M (decode: M = 1 runs one warp's pass, not the whole tile's).
                    warp_row0 = tile_row0 + cute.arch.make_warp_uniform(etidx // 32) * (32 // self.lanes_per_row)
                    self._epilogue_passes(sQ, epi_state.index, rows, local, list(cs), ahead, range(passes),
                                          lane_in_row, lane_cols, head, m, num_pos, positions, cos_sin, out_q,
                                          out_scale, warp_row0)
            epi_pipeline.consumer_release(epi_state)
            if cutlass.const_expr(trace is not None):
                self._stamp_first_tile(trace, 19, etidx, tile, first_tile)
            epi_state.advance()
            if cutlass.const_expr(self.helper_rows == 0):
                sched.advance_to_next_work()
            work = sched.get_current_work()

    @cute.jit
    def _stamp_first_tile(self, trace, slot, thread, tile, first_tile):
        """Trace only: _stamp, in the CTA's first tile."""
        if tile[0] == first_tile[0]:
            if tile[1] == first_tile[1]:
                self._stamp(trace, slot, thread)

    @cute.jit
    def _help_last_tile(self, sQ, buf, ctidx, tile_row0, head, m, positions, cos_sin, out_q, out_scale):
        """A consumer thread's share of the CTA's last tile, once every consumer has handed
        it over: rows [tile_rows - helper_rows, tile_rows) of buffer `buf`, at the epilogue
        warpgroups' lanes a row. The consumers' registers are free by then (two cos/sin
        rows ahead), and their warps double those that run the tile's tail."""
        layout = self.row_layout
        lanes = self.lanes_per_row
        consumer_threads = self.num_consumers * WARPGROUP
        lane = cute.arch.lane_idx()
        lane_in_row = lane % lanes
        lane_cols = layout.column_lane_bits(lane_in_row)
        rows_per_pass = consumer_threads // lanes
        row_in_pass = (ctidx // 32) * (32 // lanes) + lane // lanes
        passes = self.helper_rows // rows_per_pass
        local = [self.tile_rows - self.helper_rows + p * rows_per_pass + row_in_pass for p in range(passes)]
        rows = [tile_row0 + r for r in local]
        num_pos = cos_sin.shape[0]
        cs = [self._cos_sin(layout, rows[p], m, num_pos, positions, cos_sin, lane_cols)
              for p in range(min(2, passes))]
        if cutlass.const_expr(self.tc_hadamard_rows):
            self._tc_row_b_words = hmma.tc_row_b_words(lane, layout)  # this role's own (_finish_row)
        # every consumer's bf16 rows are in the buffer
        cute.arch.barrier(barrier_id=BAR_LAST_TILE_HANDED, number_of_threads=consumer_threads)
        self._epilogue_passes(sQ, buf, rows, local, cs, 2, range(passes), lane_in_row, lane_cols, head, m,
                              num_pos, positions, cos_sin, out_q, out_scale, None)

    @cute.jit
    def _epilogue_tc_hadamard(self, epi_pipeline, sQ, etidx, sched_params, positions, cos_sin, out_q, out_scale,
                              m):
        """The epilogue with the Hadamard's H16 factor on the tensor cores (mma.sync; see
        kernels/hadamard_mma_sm90.py), 64 rows at a time: a warp's quads take rows g and g + 8 of
        its 16, in SM90_EPI_ROW_LAYOUT (16-byte loads), apply RoPE, and end with whole
        MXFP4 blocks (or FP8 head quarters) a lane."""
        bm = self.tile_rows
        in_layout = epi.SM90_EPI_ROW_LAYOUT
        num_pos = cos_sin.shape[0]
        lane = cute.arch.lane_idx()
        quad_lane = lane % 4
        warp = cute.arch.make_warp_uniform(etidx // 32)
        row_in_chunk = warp * 16 + lane // 4  # and 8 below it
        in_cols = in_layout.column_lane_bits(quad_lane)
        chunks = bm // ROWS_PER_CONSUMER
        b_words = hmma.tc_b_words(lane)  # the +-1 matrix, in registers for the kernel's life
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
                    sums = self._tc_hadamard_chunk(c, cs, epi_pipeline, epi_state, sQ, b_words, row_in_chunk,
                                                   in_cols)
                    cs = self._tc_cos_sin(row0 + (c + 1) * ROWS_PER_CONSUMER if c + 1 < chunks else next_row0,
                                          m, num_pos, positions, cos_sin, in_cols)
                    if cutlass.const_expr(self.skip_rows_past_m):
                        # decode: a warp whose 16 rows are all past M skips its quantization
                        if row0 - lane // 4 + c * ROWS_PER_CONSUMER < m:
                            self._tc_hadamard_quantize(sums, quad_lane, row0 + c * ROWS_PER_CONSUMER, m, head,
                                                       out_q, out_scale)
                    else:
                        self._tc_hadamard_quantize(sums, quad_lane, row0 + c * ROWS_PER_CONSUMER, m, head, out_q,
                                                   out_scale)
            epi_state.advance()
            work = nxt

    @staticmethod
    def _tc_cos_sin(row0, m, num_pos, positions, cos_sin, in_cols):
        """cos/sin of rows row0 and row0 + 8 (a thread's two rows of a chunk): [(cos, sin)]."""
        return [epi.load_cos_sin(epi.SM90_EPI_ROW_LAYOUT, row0 + 8 * h, m, num_pos, positions, cos_sin, in_cols)
                for h in range(2)]

    def _tc_hadamard_chunk(self, c, cs, epi_pipeline, epi_state, sQ, b_words, row_in_chunk, in_cols):
        """Chunk c (64 rows) of the tile: bf16 rows from the buffer, RoPE, then the
        Hadamard's sums (hmma.tc_hadamard_rows)."""
        in_layout = epi.SM90_EPI_ROW_LAYOUT
        words = []
        for h in range(2):
            r = c * ROWS_PER_CONSUMER + row_in_chunk + 8 * h
            row = [sQ[epi_state.index, r, swizzled_word(r, (in_cols + in_layout.column_static(2 * p)) >> 1)]
                   for p in range(16)]
            cos_vals, sin_vals = cs[h]
            for k, (local, _) in enumerate(in_layout.rope_pairs()):
                x, y = epi.bf16x2_unpack(row[local // 2])
                row[local // 2] = epi.rope_pair_word(x, y, cos_vals[k], sin_vals[k])
            words.append(row)
        if c == self.tile_rows // ROWS_PER_CONSUMER - 1:
            epi_pipeline.consumer_release(epi_state)  # the tile's bf16 values are all in registers
        return hmma.tc_hadamard_rows(words, b_words)

    def _tc_hadamard_quantize(self, sums, quad_lane, row0, m, head, out_q, out_scale):
        """Scale, bf16, quantize and store the chunk's two rows a thread (row0, row0 + 8)."""
        for h in range(2):
            words = epi.hadamard_scale_round(sums[h])
            epi.quantize_store_row(words, hmma.SM90_MMA_HADAMARD_OUT_LAYOUT, quad_lane, self.config, row0 + 8 * h, m,
                                   head, out_q, out_scale, vector=True)

    @cute.jit
    def _epilogue_passes(self, sQ, buf, rows, local, cs, ahead, pass_range, lane_in_row, lane_cols, head, m,
                         num_pos, positions, cos_sin, out_q, out_scale, warp_row0):
        """Passes `pass_range` of the tile's: pass p finishes token row rows[p], row local[p]
        of buffer `buf`, with cos/sin cs[p] (pass p requests those of pass p + ahead). warp_row0
        None: one basic block (stores predicated); else each pass runs only in warps that
        hold a row below M."""
        layout = self.row_layout
        passes = len(rows)
        for p in cutlass.range_constexpr(pass_range.start, pass_range.stop):
            if cutlass.const_expr(p + ahead < passes):
                cs.append(self._cos_sin(layout, rows[p + ahead], m, num_pos, positions, cos_sin, lane_cols))
            r = local[p]
            if cutlass.const_expr(warp_row0 is None):
                self._finish_row(sQ, buf, r, layout, lane_in_row, lane_cols, cs[p], rows[p], m, head, out_q,
                                 out_scale)
            else:
                if warp_row0 + p * self.rows_per_pass < m:
                    self._finish_row(sQ, buf, r, layout, lane_in_row, lane_cols, cs[p], rows[p], m, head, out_q,
                                     out_scale)

    def _finish_row(self, sQ, buf, r, layout, lane_in_row, lane_cols, cs, row, m, head, out_q, out_scale):
        """Row r of buffer `buf` (token row `row`) through SPEC steps 3-6 and out; with
        out_format "gemm-bf16" (the two-kernel tactic's GEMM) its bf16 words go out as they
        are, 16 bytes a store: each lane's 8-column runs make whole 32-byte sectors."""
        if cutlass.const_expr(self.config.out_format_id == epi.OUT_GEMM_BF16):
            words = [sQ[buf, r, swizzled_word(r, (lane_cols + layout.column_static(local)) >> 1)]
                     for local in range(0, layout.num_local, 2)]
            epi.store_row(layout, epi.OUT_BF16, row, m, head, lane_in_row, lane_cols, words, Int32(0), out_q,
                          None, vector=True)
        elif cutlass.const_expr(self.tc_hadamard_rows):
            words = epi.rope_row_words(self._load_row(sQ, buf, r, layout, lane_cols), layout, cs[0], cs[1])
            sums = hmma.tc_hadamard_row(words, self._tc_row_b_words, lane_in_row, layout)
            epi.quantize_store_row(epi.hadamard_scale_round(sums), layout, lane_in_row, self.config, row, m, head,
                                   out_q, out_scale)
        else:
            words = self._load_row(sQ, buf, r, layout, lane_cols)
            epi.head_row_epilogue(words, layout, lane_in_row, cs, self.config, row, m, head, out_q, out_scale)

    def _cos_sin(self, layout, row, m, num_pos, positions, cos_sin, lane_cols):
        """Row `row`'s cos/sin for this thread's RoPE pairs; None where the kernel stores the
        GEMM's own output (out_format "gemm-bf16": no RoPE, nothing to load)."""
        if self.config.out_format_id == epi.OUT_GEMM_BF16:
            return None
        return epi.load_cos_sin(layout, row, m, num_pos, positions, cos_sin, lane_cols)

    def _load_row(self, sQ, buf, r, layout, lane_cols):
        """The thread's bf16 values of row r as bf16x2 words (word p: locals 2p, 2p + 1)."""
        return [sQ[buf, r, swizzled_word(r, (lane_cols + layout.column_static(local)) >> 1)]
                for local in range(0, layout.num_local, 2)]
