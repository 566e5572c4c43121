"""The native sm_90a kernel's consumer pieces: the pipelined K loop (block j promoted under
block j+1's WGMMAs, two partials), the promotion of a partial with its block's scales, and
the finished tile's bf16 hand-off to the epilogue warpgroup(s). A mixin of
Sm90FusedIndexerQ (kernels/gemm_sm90.py), as kernels/swap_ab_kloop_sm90.py is of the
swapped-A/B kernel.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from . import epilogue as epi
from .sm90_parts import issue_wgmmas, swizzled_word


class Sm90NativeKLoops:
    """Mixin of Sm90FusedIndexerQ."""

    def _hand_to_epilogue(self, acc, epi_pipeline, epi_state, sQ, row_in_tile, quad_lane):
        """The finished tile to the epilogue warpgroup as bf16 (SPEC step 2's rounding)."""
        epi_pipeline.producer_acquire(epi_state)
        for h in range(2):
            r = row_in_tile + 8 * h
            for j in range(16):
                word = epi.bf16x2_word(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1])
                sQ[epi_state.index, r, swizzled_word(r, j * 4 + quad_lane)] = word
        epi_pipeline.producer_commit(epi_state)

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
        plain loop-carried values."""
        mma_per_stage = cute.size(tCrA, mode=[2])
        issue_state = read_state.clone()
        ab_pipeline.consumer_wait(issue_state)
        tiled_mma = issue_wgmmas(tiled_mma, p0, tCrA, tCrB, range(mma_per_stage), issue_state.index)
        issue_state.advance()
        e0 = a_scale[srow0, 0] * w_scale[head, 0]
        e1 = a_scale[srow1, 0] * w_scale[head, 0]
        # Fully unrolled (K is a compile-time constant): a WGMMA still in flight across a
        # loop back-edge makes ptxas copy its accumulators there and serialize every WGMMA
        # (its C7514 report).
        for kp in cutlass.range_constexpr(0, k_tiles - 2, 2):
            # block kp+1 -> p1, then promote block kp (p0)
            ab_pipeline.consumer_wait(issue_state)
            tiled_mma = issue_wgmmas(tiled_mma, p1, tCrA, tCrB, range(mma_per_stage), issue_state.index)
            issue_state.advance()
            cute.nvgpu.warpgroup.wait_group(1)
            o0 = a_scale[srow0, kp + 1] * w_scale[head, kp + 1]
            o1 = a_scale[srow1, kp + 1] * w_scale[head, kp + 1]
            ab_pipeline.consumer_release(read_state)
            read_state.advance()
            self._promote(acc, p0, e0, e1)
            # block kp+2 -> p0, then promote block kp+1 (p1)
            ab_pipeline.consumer_wait(issue_state)
            tiled_mma = issue_wgmmas(tiled_mma, p0, tCrA, tCrB, range(mma_per_stage), issue_state.index)
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
        tiled_mma = issue_wgmmas(tiled_mma, p1, tCrA, tCrB, range(mma_per_stage), issue_state.index)
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
