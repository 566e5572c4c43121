"""SPEC steps 3-6 as a kernel of their own: the second launch of the two-kernel tactic.

The GEMM (the native kernel with out_format "gemm-bf16") writes its bf16 output y
[M, N]; this kernel reads it back a head row at a time and runs the same
kernels/epilogue.py code the fused kernels run on their shared-memory rows (RoPE, the
Hadamard's butterfly, MXFP4 / FP8 quantization and the stores), so its bytes are the
fused kernel's. It owns the whole SM, where the fused epilogue competes with the MMA
warps for issue slots: at large M that costs the fused kernel more than this kernel's
extra pass over y (NOTES, issue 17).

`lanes_per_row` lanes share a (row, head) unit, with the sm_90a epilogue warpgroup's
layouts (4 lanes: 32 values a thread; 8 lanes: 16). Consecutive lane groups take
consecutive heads of a row, so a warp reads one contiguous run of y; each group takes
`units_per_group` units, all loads issued before any math. Arch-neutral (plain loads,
shuffles and stores).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from . import epilogue as epi
from .numerics import HEAD_DIM

THREADS = 256
LAYOUTS = {4: epi.SM90_EPI_ROW_LAYOUT, 8: epi.SM90_EPI8_ROW_LAYOUT}
VALUES_PER_LOAD = 8  # bf16 in one 16-byte load


class RowEpilogue:
    """`config`: a GemmConfig whose numerics fields (hadamard, fp4_rounding, out_format,
    positions_dtype, pdl) are this kernel's; `n`: the weight's rows (heads x 128)."""

    def __init__(self, config, n: int, lanes_per_row: int = 4, units_per_group: int = 2):
        if config.out_format == "gemm-bf16":
            raise ValueError("RowEpilogue: out_format 'gemm-bf16' is its input, not an output")
        if lanes_per_row not in LAYOUTS:
            raise ValueError(f"RowEpilogue: lanes_per_row={lanes_per_row} (one of {sorted(LAYOUTS)})")
        if n % HEAD_DIM:
            raise ValueError(f"RowEpilogue: N={n} is not a multiple of {HEAD_DIM}")
        self.config = config
        self.heads = n // HEAD_DIM
        self.lanes = lanes_per_row
        self.layout = LAYOUTS[lanes_per_row]
        self.items = units_per_group
        self.units_per_cta = THREADS // lanes_per_row * units_per_group

    @cute.jit
    def __call__(
        self,
        y_words: cute.Tensor,  # int32 [M, N/2]: the GEMM's bf16 output, two values a word
        positions: cute.Tensor,  # [M] int32 / int64
        cos_sin: cute.Tensor,  # f32 [P, 64]
        out_q: cute.Tensor,  # int32 words [M, heads x bytes a head / 4]
        out_scale: cute.Tensor,  # int32 [M, heads] (a 1 x 1 dummy for unscaled formats)
        stream,
    ):
        m = y_words.shape[0]
        units = m * self.heads
        grid = cute.ceil_div(units, self.units_per_cta)
        # Launched with programmatic dependent launch after the GEMM: the launch overlaps
        # its tail, and the kernel waits for it before reading y.
        self.kernel(y_words, positions, cos_sin, out_q, out_scale, m, units).launch(
            grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.config.pdl
        )

    @cute.kernel
    def kernel(self, y_words, positions, cos_sin, out_q, out_scale, m, units):
        if cutlass.const_expr(self.config.pdl):
            cute.arch.griddepcontrol_wait()
        layout = self.layout
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        groups = THREADS // self.lanes
        lane_in_row = tidx % self.lanes
        lane_cols = layout.column_lane_bits(lane_in_row)
        num_pos = cos_sin.shape[0]
        first = bidx * (groups * self.items) + tidx // self.lanes
        loaded = []
        for it in cutlass.range_constexpr(self.items):
            # a unit past the last is given row M: its loads are clamped to row M - 1 and
            # its stores predicated off (every lane still joins the row's shuffles)
            unit = cutlass.min(first + it * groups, units)
            row = unit // self.heads
            head = unit - row * self.heads
            safe_row = cutlass.min(row, m - 1)
            words = []
            for local in cutlass.range_constexpr(0, layout.num_local, VALUES_PER_LOAD):
                word = (head * HEAD_DIM + lane_cols + layout.column_static(local)) >> 1
                words.extend(epi.load_f32x4(y_words.iterator + cute.crd2idx((safe_row, word), y_words.layout)))
            cs = epi.load_cos_sin(layout, row, m, num_pos, positions, cos_sin, lane_cols)
            loaded.append((row, head, words, cs))
        for it in cutlass.range_constexpr(self.items):
            row, head, words, cs = loaded[it]
            words = [w.bitcast(cutlass.Int32) for w in words]
            epi.head_row_epilogue(words, layout, lane_in_row, cs, self.config, row, m, head, out_q, out_scale)
