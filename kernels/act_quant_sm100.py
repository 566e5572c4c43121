"""SPEC step 1 for the sm_100a fused kernel: kernels/act_quant.py's quantizer (the same
`quantize_unit` arithmetic, so the same e4m3 bytes), with the scales written straight into
the tcgen05 scale-factor layout that the GEMM's TMA reads, instead of fp32 scales [M, K/128]
that the host would convert to UE8M0 and reshuffle (5-6 small torch kernels a call, which
also stood between the quantizer and a PDL launch of the GEMM).

A (row, 128-K block) unit's four scale-factor bytes (one per 32 K, all equal: the SPEC's
1x128 scale replicated) are consecutive in the atom layout and start 4-byte aligned, so
lane 0 of the unit's half-warp writes them as one int32 word (`sf_word_index`). The layout
pads the rows to a multiple of 128; the pad rows' words are written too (0), so every
byte the GEMM's TMA reads is defined. Plain loads and stores: it compiles for any arch.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from . import epilogue as epi
from .act_quant import BLOCK_K, ITEMS, LANES_PER_UNIT, THREADS, WORDS_PER_LANE_IN, WORDS_PER_LANE_OUT, quantize_unit

SF_ROWS = 128  # the scale-factor atom's rows: the layout pads M to a multiple of this


def sf_word_index(row, kb, k_blocks):
    """Index of the int32 word holding the four UE8M0 bytes of (row, 128-K block kb) in the
    128x4 atom layout of an [M, K] operand with k_blocks = K / 128 (kernels.gemm_sm100.
    sf_atom_offset(row, 4 kb, K) / 4). Python ints or DSL Int32s."""
    return ((row >> 7) * k_blocks + kb) * 128 + (row & 31) * 4 + ((row >> 5) & 3)


def sf_words(m: int, k: int) -> int:
    """int32 words of the activation's scale-factor layout (rows padded to 128)."""
    return -(-m // SF_ROWS) * SF_ROWS * (k // BLOCK_K)


class ActQuantFp8Sf:
    def __init__(self, arch: str = "sm_100a"):
        self.arch = arch

    @cute.jit
    def __call__(
        self,
        qr_words: cute.Tensor,  # int32 [M, K/2]: the bf16 activation, two values a word
        out_words: cute.Tensor,  # int32 [M, K/4]: four e4m3 bytes a word
        sf_out: cute.Tensor,  # int32 [sf_words(M, K)]: the scale-factor layout, four bytes a word
        stream,
    ):
        m = qr_words.shape[0]
        k_blocks = out_words.shape[1] // (BLOCK_K // 4)
        units = cute.ceil_div(m, SF_ROWS) * SF_ROWS * k_blocks  # pad rows included
        units_per_block = THREADS // LANES_PER_UNIT * ITEMS
        grid = cute.ceil_div(units, units_per_block)
        self.kernel(qr_words, out_words, sf_out, m, units, k_blocks).launch(
            grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, qr_words, out_words, sf_out, m, units, k_blocks):
        # The fused GEMM is launched after this kernel with programmatic dependent launch:
        # let it start now (it waits for this grid before it reads what we write).
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        groups = THREADS // LANES_PER_UNIT
        group = tidx // LANES_PER_UNIT
        lane16 = tidx % LANES_PER_UNIT
        first = bidx * (groups * ITEMS) + group
        loaded = []
        for it in cutlass.range_constexpr(ITEMS):
            unit = cutlass.min(first + it * groups, units - 1)  # tail: a valid unit, not stored
            row = unit // k_blocks
            kb = unit - row * k_blocks
            src_row = cutlass.min(row, m - 1)  # a pad row quantizes a real row, stores no data
            col = kb * (BLOCK_K // 2) + lane16 * WORDS_PER_LANE_IN
            words = epi.load_f32x4(qr_words.iterator + cute.crd2idx((src_row, col), qr_words.layout))
            loaded.append((row, src_row, kb, words))
        for it in cutlass.range_constexpr(ITEMS):
            row, src_row, kb, words = loaded[it]
            out, scale = quantize_unit(words)  # every lane of the half-warp: it shuffles
            in_grid = first + it * groups < units
            real = in_grid & (row < m)
            col = kb * (BLOCK_K // 4) + lane16 * WORDS_PER_LANE_OUT
            for w in cutlass.range_constexpr(WORDS_PER_LANE_OUT):
                epi.store_i32_if(out_words.iterator + cute.crd2idx((src_row, col + w), out_words.layout), out[w],
                                 real)
            byte = scale.bitcast(Int32) >> 23  # e + 127, 0xFF for NaN / Inf
            word = epi.sel_i32(row < m, byte * 0x01010101, 0)
            epi.store_i32_if(sf_out.iterator + sf_word_index(row, kb, k_blocks), word, in_grid & (lane16 == 0))
