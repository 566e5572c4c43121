"""SPEC step 1: per-row, per-128-column FP8 (e4m3) quantization with UE8M0 scales.

Sixteen lanes (half a warp) per (row, 128-wide K block): each lane loads 8 bf16 values
with one 16-byte load, the half-warp reduces the absolute max over its 128 values,
every lane stores its 8 e4m3 bytes as two 32-bit words (the half-warp's 128 bytes are
contiguous) and lane 0 of the half writes the scale 2^e. Each half-warp takes ITEMS
units, all loads issued before any math, so enough bytes are in flight to stream at
the memory's rate. Arch-neutral (plain loads and stores): it serves sm_90a and sm_100a.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import epilogue as epi

# 128 threads of 32 registers: a CTA fits beside a native GEMM CTA (640 threads x 96 of the
# SM's 65536 registers), and on the H200 this ran 0.7 us faster alone at M <= 512 (2 us at
# M = 16384) than 256 threads with 4 units a half-warp (44 registers).
THREADS = 128
LANES_PER_UNIT = 16  # 16 lanes x 8 values = one 128-wide K block
ITEMS = 2  # units per half-warp
BLOCK_K = 128
WORDS_PER_LANE_IN = 4  # 8 bf16
WORDS_PER_LANE_OUT = 2  # 8 e4m3


class ActQuantFp8:
    def __init__(self, arch: str):
        self.arch = arch

    @cute.jit
    def __call__(
        self,
        qr_words: cute.Tensor,  # int32 [M, K/2]: the bf16 activation, two values a word
        out_words: cute.Tensor,  # int32 [M, K/4]: four e4m3 bytes a word
        out_scale: cute.Tensor,  # f32 [M, K/128]
        stream,
    ):
        m = qr_words.shape[0]
        k_blocks = out_scale.shape[1]
        units = m * k_blocks
        units_per_block = THREADS // LANES_PER_UNIT * ITEMS
        grid = cute.ceil_div(units, units_per_block)
        # Launched with programmatic dependent launch: its CTAs may start while the launch
        # before it (the previous call's GEMM) finishes, and wait for it in the kernel.
        self.kernel(qr_words, out_words, out_scale, units, k_blocks).launch(
            grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(self, qr_words, out_words, out_scale, units, k_blocks):
        # The fused GEMM after this kernel is launched with programmatic dependent launch:
        # let it start now (its prologue and weight loads overlap this kernel; it waits
        # for this grid's completion before it reads the activation).
        cute.arch.griddepcontrol_launch_dependents()
        # The previous grid may still run (this launch is PDL): qr may be its output, and it
        # may still read the buffers this kernel writes.
        cute.arch.griddepcontrol_wait()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        groups = THREADS // LANES_PER_UNIT
        group = tidx // LANES_PER_UNIT
        lane16 = tidx % LANES_PER_UNIT
        # Unit of item i: consecutive half-warps take consecutive units (coalesced rows).
        first = bidx * (groups * ITEMS) + group
        loaded = []
        for it in cutlass.range_constexpr(ITEMS):
            unit = cutlass.min(first + it * groups, units - 1)  # tail: a valid unit, not stored
            row = unit // k_blocks
            kb = unit - row * k_blocks
            col = kb * (BLOCK_K // 2) + lane16 * WORDS_PER_LANE_IN
            words = epi.load_f32x4(qr_words.iterator + cute.crd2idx((row, col), qr_words.layout))
            loaded.append((row, kb, words))
        for it in cutlass.range_constexpr(ITEMS):
            row, kb, words = loaded[it]
            out, scale = quantize_unit(words)
            ok = first + it * groups < units
            col = kb * (BLOCK_K // 4) + lane16 * WORDS_PER_LANE_OUT
            for w in cutlass.range_constexpr(WORDS_PER_LANE_OUT):
                epi.store_i32_if(out_words.iterator + cute.crd2idx((row, col + w), out_words.layout), out[w], ok)
            epi.store_i32_if(out_scale.iterator + cute.crd2idx((row, kb), out_scale.layout),
                             scale.bitcast(Int32), ok & (lane16 == 0))


def quantize_unit(words):
    """One lane's share of a (row, 128-K block) unit: its 8 bf16 values (4 words as loaded)
    -> two words of 4 e4m3 bytes each and the block's scale 2^e (fp32), the amax reduced
    over the 16 lanes of its half-warp. Shared with the swapped-A/B kernel's fused
    quantization, so both produce the same bytes."""
    vals = [v for w in words for v in epi.bf16x2_unpack(w.bitcast(Int32))]
    amax = epi.absmax_over(vals, tuple(range(8)), (1, 2, 4, 8))  # lanes of this half-warp
    e = epi.ceil_log2_of_ratio(amax, epi.FP8_MAX)
    inv = epi.exp2_neg(e)
    pairs = [epi.cvt_e4m3x2(vals[2 * p] * inv, vals[2 * p + 1] * inv) for p in range(4)]
    out = [pairs[2 * w] | (pairs[2 * w + 1] << 16) for w in range(WORDS_PER_LANE_OUT)]
    return out, ((e + 127) << 23).bitcast(Float32)


def quantize_words(words: list, lane_masks: tuple):
    """quantize_unit's arithmetic for a lane holding more of the unit (the swapped-A/B
    kernel's fused quantizer at 4 lanes a unit: 16 words, 32 values): its bf16x2 words (as
    Int32) -> one word of 4 e4m3 bytes per two words, in order, and the block's scale 2^e,
    the amax reduced over the lanes `lane_masks` reach. The amax is taken on the packed
    bf16 pairs (exact: the same maximum, NaN-propagating, and the 1e-4 floor is far above
    bf16's subnormals), so its bytes are quantize_unit's."""
    amax = epi.absmax_words(words, lane_masks)
    e = epi.ceil_log2_of_ratio(amax, epi.FP8_MAX)
    inv = epi.exp2_neg(e)
    out = []
    for w in range(0, len(words), 2):
        a0, a1 = epi.bf16x2_unpack(words[w])
        b0, b1 = epi.bf16x2_unpack(words[w + 1])
        out.append(epi.cvt_e4m3x2(a0 * inv, a1 * inv) | (epi.cvt_e4m3x2(b0 * inv, b1 * inv) << 16))
    return out, ((e + 127) << 23).bitcast(Float32)
