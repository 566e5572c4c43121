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

    @staticmethod
    def _block_scales(a_scale, w_scale, srow0, srow1, head, kb):
        """K block kb's promotion scales of a thread's two accumulator rows."""
        return a_scale[srow0, kb] * w_scale[head, kb], a_scale[srow1, kb] * w_scale[head, kb]

    def _issue_then_promote(self, ab_pipeline, issue_state, read_state, tiled_mma, tCrA, tCrB, acc, into, done,
                            done_scales, scales_args, kb):
        """Block kb's WGMMAs into partial `into`; once the previous block's have completed,
        its stage is released and partial `done` promoted with `done_scales`. Returns
        (tiled_mma, block kb's scales)."""
        ab_pipeline.consumer_wait(issue_state)
        tiled_mma = issue_wgmmas(tiled_mma, into, tCrA, tCrB, range(cute.size(tCrA, mode=[2])), issue_state.index)
        issue_state.advance()
        cute.nvgpu.warpgroup.wait_group(1)
        scales = self._block_scales(*scales_args, kb)
        ab_pipeline.consumer_release(read_state)
        read_state.advance()
        self._promote(acc, done, *done_scales)
        return tiled_mma, scales

    @cute.jit
    def _mainloop_pipelined(self, ab_pipeline, read_state, tiled_mma, tCrA, tCrB, acc, p0, p1, k_tiles,
                            a_scale, w_scale, srow0, srow1, head):
        """K blocks 0..k_tiles-1 (an even count) with the promotion of block j under block
        j+1's WGMMAs: blocks alternate between partials p0 (even j) and p1 (odd j); a block's
        scales are loaded when its WGMMAs are issued and used after they complete. Every
        pipeline-state step is unconditional (the last pair is peeled), so the states stay
        plain loop-carried values."""
        scales_args = (a_scale, w_scale, srow0, srow1, head)
        issue_state = read_state.clone()
        ab_pipeline.consumer_wait(issue_state)
        tiled_mma = issue_wgmmas(tiled_mma, p0, tCrA, tCrB, range(cute.size(tCrA, mode=[2])), issue_state.index)
        issue_state.advance()
        even = self._block_scales(*scales_args, 0)
        # Fully unrolled (K is a compile-time constant): a WGMMA still in flight across a
        # loop back-edge makes ptxas copy its accumulators there and serialize every WGMMA
        # (its C7514 report).
        for kp in cutlass.range_constexpr(0, k_tiles - 2, 2):
            # block kp+1 -> p1, promote block kp (p0); block kp+2 -> p0, promote block kp+1 (p1)
            tiled_mma, odd = self._issue_then_promote(ab_pipeline, issue_state, read_state, tiled_mma, tCrA, tCrB,
                                                      acc, p1, p0, even, scales_args, kp + 1)
            tiled_mma, even = self._issue_then_promote(ab_pipeline, issue_state, read_state, tiled_mma, tCrA, tCrB,
                                                       acc, p0, p1, odd, scales_args, kp + 2)
        # the last pair: block k_tiles-1 -> p1, promote k_tiles-2 (p0), then k_tiles-1 (p1)
        tiled_mma, odd = self._issue_then_promote(ab_pipeline, issue_state, read_state, tiled_mma, tCrA, tCrB, acc,
                                                  p1, p0, even, scales_args, k_tiles - 1)
        cute.nvgpu.warpgroup.wait_group(0)
        ab_pipeline.consumer_release(read_state)
        read_state.advance()
        self._promote(acc, p1, *odd)
        return read_state
