"""The swapped-A/B kernel's K loops and hand-off (sm_90a): a token tile's K blocks of
WGMMAs (the weight's 128 rows as A, the tokens as B) with their per-block promotion, in
three schedules, and the finished tile's bf16 hand-off to the epilogue.

- plain: a block's WGMMAs, their wait, its promotion, in series;
- `pipelined_promotion` up to TWO_PARTIALS_MAX_TILE tokens: two partials, block kb promoted
  under block kb+1's WGMMAs;
- `pipelined_promotion` at 64 tokens (no registers for a second partial): each block's two
  m64 halves are commit groups of their own on one partial, a half promoted under the
  other half's WGMMAs.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from . import epilogue as epi
from .sm90_parts import ACCUMULATE, TRACE_BLOCKS, issue_wgmmas, swizzled_word, uniform_view

# pipelined_promotion: up to this tile two partials (block kb promoted under block kb+1's
# WGMMAs); at 64 tokens two partials and the accumulator would take 192 registers, so there
# the tile's two m64 halves are separate commit groups on one partial instead (a half
# promoted under the other half's WGMMAs)
TWO_PARTIALS_MAX_TILE = 32
PIPELINED_MAX_TILE = 64


class Sm90SwapABKLoops:
    """Mixin of Sm90SwapABFusedIndexerQ: uses its tile_rows, k_blocks, fused, config and
    _stamp."""

    @cute.jit
    def _k_loop_plain(self, ab_pipeline, read_state, tiled_mma, tCrA, tCrB, acc, partial, w_scale, sActScale,
                      a_scale, head, row0, m, tokens, k_begin, trace, ctidx, tiles_done, operands):
        """One partial: a block's WGMMAs, their wait, then its promotion, in series."""
        t = self.tile_rows
        mma_per_stage = cute.size(tCrA, mode=[2])
        # The block's scale per token column of this thread; from global memory (the
        # separate quantizer's) loaded one block ahead up to 32-token tiles, so their
        # latency hides under the previous block's WGMMAs (at 64 tokens the 16 extra
        # registers made the K split's consumer spill: loaded in the block there).
        ahead_loads = not self.fused and t <= 32
        nxt_sa = [Float32(1.0) for _ in tokens]
        nxt_sw = w_scale[head, k_begin]
        if cutlass.const_expr(ahead_loads):
            nxt_sa = [a_scale[cutlass.min(row0 + tok, m - 1), k_begin] for tok in tokens]
        for kb in range(self.k_blocks):
            kt = k_begin + kb
            if cutlass.const_expr(self.fused):
                scales = [nxt_sw * sActScale[kb, tok] for tok in tokens]
            elif cutlass.const_expr(ahead_loads):
                scales = [nxt_sw * sa for sa in nxt_sa]
                ahead = k_begin + cutlass.min(kb + 1, self.k_blocks - 1)
                nxt_sa = [a_scale[cutlass.min(row0 + tok, m - 1), ahead] for tok in tokens]
            else:
                scales = [nxt_sw * a_scale[cutlass.min(row0 + tok, m - 1), kt] for tok in tokens]
            nxt_sw = w_scale[head, k_begin + cutlass.min(kb + 1, self.k_blocks - 1)]
            ab_pipeline.consumer_wait(read_state)
            if tiles_done == 0 and kb < 6:
                self._stamp(trace, 4 + kb, ctidx)
            tiled_mma = self._issue_block(read_state, tiled_mma, partial, tCrA, tCrB, kb, mma_per_stage, operands)
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipeline.consumer_release(read_state)
            self._promote(acc, partial, scales)
            read_state.advance()
        return read_state, tiled_mma

    @cute.jit
    def _k_loop_pipelined(self, ab_pipeline, read_state, tiled_mma, tCrA, tCrB, acc, partials, w_scales,
                          sActScale, a_scale, row0, m, tokens, k_begin, trace, ctidx, tiles_done, operands):
        """The tile's K blocks with block kb's promotion under block kb+1's WGMMAs: the
        blocks alternate between the two partials, a block's scales are read when its
        WGMMAs are issued and used once they complete. Unrolled (K is a compile-time
        constant): no WGMMA is in flight across a loop back-edge."""
        mma_per_stage = cute.size(tCrA, mode=[2])
        issue_state = read_state.clone()
        self._stamp_block(trace, 24, 0, tiles_done, ctidx)
        ab_pipeline.consumer_wait(issue_state)
        if tiles_done == 0:
            self._stamp(trace, 4, ctidx)
        self._stamp_block(trace, 36, 0, tiles_done, ctidx)
        tiled_mma = self._issue_block(issue_state, tiled_mma, partials[0], tCrA, tCrB, 0, mma_per_stage, operands)
        issue_state.advance()
        scales = self._block_scales(0, w_scales, sActScale, a_scale, row0, m, tokens, k_begin)
        for kb in cutlass.range_constexpr(self.k_blocks):
            upcoming = scales
            if cutlass.const_expr(kb + 1 < self.k_blocks):
                self._stamp_block(trace, 24, kb + 1, tiles_done, ctidx)
                ab_pipeline.consumer_wait(issue_state)
                if cutlass.const_expr(kb + 1 < 6):
                    if tiles_done == 0:
                        self._stamp(trace, 5 + kb, ctidx)
                self._stamp_block(trace, 36, kb + 1, tiles_done, ctidx)
                tiled_mma = self._issue_block(issue_state, tiled_mma, partials[(kb + 1) % 2], tCrA, tCrB, kb + 1,
                                              mma_per_stage, operands)
                issue_state.advance()
                upcoming = self._block_scales(kb + 1, w_scales, sActScale, a_scale, row0, m, tokens, k_begin)
                cute.nvgpu.warpgroup.wait_group(1)
            else:
                cute.nvgpu.warpgroup.wait_group(0)
            ab_pipeline.consumer_release(read_state)
            read_state.advance()
            self._promote(acc, partials[kb % 2], scales)
            scales = upcoming
        return read_state, tiled_mma

    @cute.jit
    def _stamp_block(self, trace, base: cutlass.Constexpr, kb: cutlass.Constexpr, tiles_done, ctidx):
        """Trace only: slot base + kb for the first tile's K block kb < TRACE_BLOCKS."""
        if cutlass.const_expr(trace is not None and kb < TRACE_BLOCKS):
            if tiles_done == 0:
                self._stamp(trace, base + kb, ctidx)

    def _issue_block(self, issue_state, tiled_mma, partial, tCrA, tCrB, kb, mma_per_stage, operands):
        """Block kb's WGMMAs into `partial` (one commit group)."""
        a, b, stage, stage_b = self._block_operands(operands, tiled_mma, tCrA, tCrB, issue_state.index, kb)
        return issue_wgmmas(tiled_mma, partial, a, b, range(mma_per_stage), stage, stage_b)

    def _block_operands(self, operands, tiled_mma, tCrA, tCrB, stage, kb):
        """Block kb's WGMMA operands as (A, B, A's stage, B's stage) for issue_wgmmas: the
        fragments made before the tile loop with their stage coordinates (`operands` None),
        or (GemmConfig.uniform_descriptors: `operands` = (thr_mma, sW, sB, W's swizzle, B's
        swizzle)) fragments of this block's stages made here from warp-uniform addresses,
        whose descriptors ptxas then forms in uniform registers next to the WGMMAs."""
        stage_b = kb if self.fused else stage
        if cutlass.const_expr(operands is None):
            return tCrA, tCrB, stage, stage_b
        thr_mma, sW, sB, swizzle_w, swizzle_b = operands
        a = tiled_mma.make_fragment_A(thr_mma.partition_A(uniform_view(sW[None, None, stage], swizzle_w)))
        b = tiled_mma.make_fragment_B(thr_mma.partition_B(uniform_view(sB[None, None, stage_b], swizzle_b)))
        return a, b, None, None

    @cute.jit
    def _k_loop_halves(self, ab_pipeline, read_state, tiled_mma, tCrA, tCrB, acc, partial, w_scales, sActScale,
                       a_scale, row0, m, tokens, k_begin, trace, ctidx, tiles_done, operands):
        """64-token tiles: each K block's two m64 halves (the head's dims 0-63 and 64-127)
        are separate commit groups on one partial; half 0 of block kb is promoted under
        half 1's WGMMAs, half 1 under block kb+1's half 0. No second partial (no registers
        to spare at 64 tokens). Unrolled (K is a compile-time constant)."""
        issue_state = read_state.clone()
        ab_pipeline.consumer_wait(issue_state)
        if tiles_done == 0:
            self._stamp(trace, 4, ctidx)
        for mi in cutlass.range_constexpr(2):
            tiled_mma = self._issue_half(tiled_mma, partial, tCrA, tCrB, operands, mi, issue_state.index, 0)
        issue_state.advance()
        scales = self._block_scales(0, w_scales, sActScale, a_scale, row0, m, tokens, k_begin)
        for kb in cutlass.range_constexpr(self.k_blocks):
            upcoming = scales
            cute.nvgpu.warpgroup.wait_group(1)  # block kb's half 0 (its half 1 may still run)
            self._promote(acc, partial, scales, half=0)
            if cutlass.const_expr(kb + 1 < self.k_blocks):
                ab_pipeline.consumer_wait(issue_state)
                if cutlass.const_expr(kb + 1 < 6):
                    if tiles_done == 0:
                        self._stamp(trace, 5 + kb, ctidx)
                tiled_mma = self._issue_half(tiled_mma, partial, tCrA, tCrB, operands, 0, issue_state.index, kb + 1)
                upcoming = self._block_scales(kb + 1, w_scales, sActScale, a_scale, row0, m, tokens, k_begin)
                cute.nvgpu.warpgroup.wait_group(1)  # block kb's half 1 (block kb+1's half 0 may run)
            else:
                cute.nvgpu.warpgroup.wait_group(0)
            ab_pipeline.consumer_release(read_state)  # both halves of block kb have read it
            read_state.advance()
            self._promote(acc, partial, scales, half=1)
            if cutlass.const_expr(kb + 1 < self.k_blocks):
                tiled_mma = self._issue_half(tiled_mma, partial, tCrA, tCrB, operands, 1, issue_state.index, kb + 1)
                issue_state.advance()
            scales = upcoming
        return read_state, tiled_mma

    def _issue_half(self, tiled_mma, partial, tCrA, tCrB, operands, mi, stage, kb):
        """One commit group: m64 half `mi` of a K block's WGMMAs into that half of `partial`
        (A and C sliced to one M block, viewed with a unit M mode for cute.gemm)."""
        tCrA, tCrB, stage, stage_b = self._block_operands(operands, tiled_mma, tCrA, tCrB, stage, kb)
        tiled_mma.set(ACCUMULATE, False)
        cute.nvgpu.warpgroup.fence()
        c_half = partial[(None, mi, None)]
        c = cute.make_tensor(c_half.iterator, cute.make_layout(
            (c_half.shape[0], 1, 1), stride=(c_half.stride[0], 0, 0)))
        for ks in range(cute.size(tCrA, mode=[2])):
            a_slot = tCrA[(None, mi, ks)] if stage is None else tCrA[(None, mi, ks, stage)]
            a = cute.make_tensor(a_slot.iterator, cute.make_layout((a_slot.shape[0], 1), stride=(a_slot.stride[0], 0)))
            cute.gemm(tiled_mma, c, a, tCrB[(None, None, ks)] if stage_b is None else tCrB[(None, None, ks, stage_b)], c)
            tiled_mma.set(ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        return tiled_mma

    def _weight_scales(self, w_scale, head, k_begin):
        """The pipelined loops' weight block scales of the tile, loaded before the quantizer
        so that their latency hides under it: a register per block, or (uniform_descriptors)
        a register per 32 blocks, lane l holding block l (+ 32 j), read back by a shuffle
        (_block_scales). With the uniform descriptors ptxas moved the tile's 8-12 per-block
        values into uniform registers right after their loads, so every consumer thread
        waited for them before quantizing (SASS: R2UR after the LDGs; ncu of V4-Flash M = 32:
        the K loop's long-scoreboard stalls doubled; 30th session)."""
        if cutlass.const_expr(not self.config.uniform_descriptors):
            return [w_scale[head, k_begin + kb] for kb in range(self.k_blocks)]
        lane = cute.arch.lane_idx()
        return [w_scale[head, k_begin + cutlass.min(lane + 32 * j, self.k_blocks - 1)]
                for j in range((self.k_blocks + 31) // 32)]

    def _block_scales(self, kb, w_scales, sActScale, a_scale, row0, m, tokens, k_begin):
        """Block kb's scale per token column of this thread (weight x activation)."""
        if cutlass.const_expr(self.config.uniform_descriptors):
            w = cute.arch.shuffle_sync(w_scales[kb // 32], kb % 32)
        else:
            w = w_scales[kb]
        if cutlass.const_expr(self.fused):
            return [w * sActScale[kb, tok] for tok in tokens]
        return [w * a_scale[cutlass.min(row0 + tok, m - 1), k_begin + kb] for tok in tokens]

    def _promote(self, acc, partial, scales, half=None):
        """acc += partial x the block's scale of each value's token column; `half`: only
        the values of that m64 half (value i = v + 2h + 4j + (T/2) mi)."""
        t = self.tile_rows
        values = range(cute.size(acc)) if half is None else range(half * (t // 2), (half + 1) * (t // 2))
        for i in values:  # straight-line code (a plain method: not rewritten)
            col = (i % (t // 2)) // 4 * 2 + i % 2  # (j, v) of value i
            acc[i] = acc[i] + partial[i] * scales[col]

    def _hand_to_epilogue(self, acc, epi_pipeline, epi_state, sQ16, dim0, quad_lane, groups):
        """The finished tile (`groups` groups of 8 tokens: the whole tile, or this rank's
        slice of it) to the epilogue as bf16 (SPEC step 2's rounding), transposed: the
        hand-off buffer holds token rows, as the native kernel's does."""
        epi_pipeline.producer_acquire(epi_state)
        for mi in range(2):
            for h in range(2):
                d = 64 * mi + 8 * h + dim0
                for j in range(groups):
                    i = 4 * j + 2 * h + 4 * groups * mi
                    word = epi.bf16x2_word(acc[i], acc[i + 1])  # tokens 8j + 2q (low) and + 1
                    for v in range(2):
                        tok = 8 * j + 2 * quad_lane + v
                        half = swizzled_word(tok, d >> 1) * 2 + (d & 1)
                        sQ16[epi_state.index, tok, half] = cutlass.Int16(word >> (16 * v))
        epi_pipeline.producer_commit(epi_state)
