"""The tensor-core Hadamard of the sm_90a epilogue (the tensor_core_hadamard tactic), on
kernels/epilogue.py's row layouts and primitives.

H128 = H8 x H16 (Sylvester's matrix factors over any split of the column bits): the H16 on
column bits 3..6 as bf16 mma.sync m16n8k16 against a +-1 matrix, one per 8 output columns
of each of 8 blocks (column bits 0..2), then H8 over the blocks as a butterfly in
registers. The products are exact; the tensor core sums each group of 16 in its own
order, so a sum that rounds in fp32 may differ from the reference's butterfly.
"""
from __future__ import annotations

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .epilogue import HeadRowLayout, bf16x2_word, lane_butterfly, prmt

# The Hadamard's output: lane q of a row's quad holds the whole MXFP4 block q, columns
# 32q + {0..31} in local order, so amax, codes and a 16-byte store stay in the thread.
SM90_MMA_HADAMARD_OUT_LAYOUT = HeadRowLayout(
    (("local", 0), ("local", 1), ("local", 2), ("local", 3), ("local", 4), ("lane", 0), ("lane", 1)),
    rope=False,
)

# The MMA's k bit t is input column bit TC_K_COLUMN_BITS[t]: with SM90_EPI_ROW_LAYOUT's
# input (lane q holds columns 16q + {0..15} and the same + 64), k bits 1, 2 are the lane's
# and k bit 0 (the halves of an A word) is column bit 6, so a word pairs columns c, c + 64.
# The MMA's n bit t is output column bit TC_N_COLUMN_BITS[t]: n bits 1, 2 (the lane's in the
# accumulator) are column bits 5, 6, so lane q ends with MXFP4 block q
# (SM90_MMA_HADAMARD_OUT_LAYOUT).
TC_K_COLUMN_BITS = (6, 4, 5, 3)
TC_N_COLUMN_BITS = (3, 5, 6, 4)


def scatter_bits(x, targets: tuple):
    """Bit t of x moved to bit targets[t] (x a Python int or a run-time Int32)."""
    out = 0
    for t, target in enumerate(targets):
        out = out | (((x >> t) & 1) << target)
    return out


def tc_a_word_source(block: int, khalf: int) -> tuple:
    """A word (rows g or g + 8, k bit 3 = khalf) of block `block`: (local index of its
    low column in SM90_EPI_ROW_LAYOUT, prmt selector). The high half is column + 64, local
    + 16; the selector takes the low (even column) or high (odd) bf16 of word local // 2
    and of word local // 2 + 8."""
    local = block + 8 * khalf
    return local, (0x5410 if local % 2 == 0 else 0x7632)


def tc_b_words(lane, k_bits: tuple = TC_K_COLUMN_BITS, n_bits: tuple = TC_N_COLUMN_BITS) -> list:
    """The +-1 matrix as this lane's B fragments of the two n8 halves: [half][register],
    B[k][n] = H[in column of k][out column of n] on the column bits k_bits / n_bits name
    (PTX's m16n8k16 .col B: register r holds k = 2 (lane % 4) + 8r + {0, 1}, n = 8 half +
    lane // 4)."""
    words = []
    for half in range(2):
        n_out = scatter_bits(lane // 4 + 8 * half, n_bits)
        regs = []
        for r in range(2):
            k = 2 * (lane % 4) + 8 * r
            regs.append(bf16x2_word(sylvester_sign(scatter_bits(k, k_bits), n_out),
                                    sylvester_sign(scatter_bits(k + 1, k_bits), n_out)))
        words.append(regs)
    return words


# One row a thread, at 4 or 8 lanes a row (SM90_EPI_ROW_LAYOUT, SM90_EPI8_ROW_LAYOUT): the
# m16n8k16's operands come straight from a thread's bf16x2 words. k bit 0 is a word's halves
# (column bit 0), k bits 1, 2 are lane % 4 (the layout's first two lane bits), k bit 3 is
# word bit 0 (local bit 1's column); the A rows g, g + 8 are word bit 1 (local bit 2's
# column) over the warp's rows (and at 8 lanes lane bit 2); the word bits above pick one of
# 2 (8 lanes) or 4 (4 lanes) MMAs. The accumulators land in the same layout (the n bits
# name the k bits' columns), so H8 over the other three column bits finishes in registers
# (and, at 8 lanes, one exchange across lanes), and the butterfly's quantizer runs on it
# unchanged.
def tc_row_column_bits(layout: HeadRowLayout) -> tuple:
    """k (and n) bit t -> column bit, for tc_hadamard_row on `layout`."""
    lane_cols = sorted(b for b in range(7) if layout.lane_mask(b))
    local_col = {i: b for b in range(7) for kind, i in [layout.col_bits[b]] if kind == "local"}
    assert local_col[0] == 0 and layout.lane_mask(lane_cols[0]) == 1 and layout.lane_mask(lane_cols[1]) == 2
    return (0, lane_cols[0], lane_cols[1], local_col[1])


def tc_row_b_words(lane, layout: HeadRowLayout) -> list:
    """tc_b_words for tc_hadamard_row on `layout`."""
    bits = tc_row_column_bits(layout)
    return tc_b_words(lane, bits, bits)


def tc_row_a_word(i: int, reg: int) -> int:
    """The word of a thread's row that is A register `reg` of MMA i: register h + 2 kh holds
    A row g + 8h, k bit 3 = kh; h is word bit 1, kh word bit 0, i the word bits above."""
    return 4 * i + 2 * (reg % 2) + reg // 2


def tc_row_sum_local(i: int, half: int, reg: int) -> int:
    """The local index of accumulator value `reg` (2h + v: A row g + 8h, n bit 0 = v) of MMA
    i's n8 half `half`: local bits 0 = v, 1 = half, 2 = h, 3.. = i (the words' order)."""
    return reg % 2 + 2 * half + 4 * (reg // 2) + 8 * i


def tc_hadamard_row(words: list, b_words: list, lane_in_row, layout: HeadRowLayout) -> list:
    """SPEC step 4's sums (the tensor core's order within each 16, see above) on one row a
    thread: `words` its bf16x2 words after RoPE in `layout`'s order (word w: locals 2w,
    2w + 1); returns the fp32 sums in the same local order (not yet scaled or rounded).
    Every lane of the warp must call it (mma.sync and the exchange are warp-wide)."""
    sums = [None] * (2 * len(words))
    for i in range(len(words) // 4):
        a = [words[tc_row_a_word(i, r)] for r in range(4)]
        for half in range(2):  # n bit 3
            acc = mma_bf16_16816(a, b_words[half])
            for reg in range(4):
                sums[tc_row_sum_local(i, half, reg)] = acc[reg]
    m = 4
    while m < len(sums):  # H8's local column bits: local bits 2 and up
        for local in range(len(sums)):
            if not local & m:
                lo, hi = sums[local], sums[local | m]
                sums[local], sums[local | m] = lo + hi, lo - hi
        m *= 2
    lane_bits = sorted(layout.lane_mask(b) for b in range(7) if layout.lane_mask(b))
    for xm in lane_bits[2:]:  # and its lane bits past lane % 4 (8 lanes a row: one)
        sign = Float32(1.0) - Float32(2.0) * Float32((lane_in_row >> (xm.bit_length() - 1)) & 1)
        sums = [lane_butterfly(v, xm, sign) for v in sums]
    return sums


def sylvester_sign(i, j) -> Float32:
    """H[i][j] = (-1)^popcount(i & j) for 7-bit i, j (run-time Int32s)."""
    x = i & j
    x = x ^ (x >> 4)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)
    return Float32(1.0) - Float32(2.0) * Float32(x & 1)


@dsl_user_op
def mma_bf16_16816(a: list, b: list, *, loc=None, ip=None) -> list:
    """One mma.sync m16n8k16 (bf16 in, fp32 out, C = 0) on PTX's register fragments: a =
    4 words, b = 2 words; returns the 4 fp32 accumulator values."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [Int32(w).ir_value(loc=loc, ip=ip) for w in (*a, *b)],
        "{ .reg .f32 z; mov.f32 z, 0f00000000; "
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
        "{$8, $9}, {z, z, z, z}; }",
        "=f,=f,=f,=f,r,r,r,r,r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


def tc_hadamard_rows(words: list, b_words: list) -> list:
    """SPEC step 4 (sums in the tensor core's order, see above) on a quad's rows g and
    g + 8: words[h] are row h's 16 bf16x2 words after RoPE in SM90_EPI_ROW_LAYOUT's local
    order. Returns [h] -> the 32 fp32 sums of row h, SM90_MMA_HADAMARD_OUT_LAYOUT's local
    order (not yet scaled or rounded)."""
    sums = []  # [block][half]: the MMA's 4 accumulator values
    for block in range(8):
        a = [None] * 4
        for khalf in range(2):
            local, sel = tc_a_word_source(block, khalf)
            for h in range(2):
                a[h + 2 * khalf] = prmt(words[h][local // 2], words[h][local // 2 + 8], sel)
        sums.append([mma_bf16_16816(a, b_words[half]) for half in range(2)])
    for bit in range(3):  # H8 over the blocks: out column bits 0..2
        m = 1 << bit
        for block in range(8):
            if not block & m:
                for half in range(2):
                    lo, hi = sums[block][half], sums[block | m][half]
                    sums[block][half] = [x + y for x, y in zip(lo, hi)]
                    sums[block | m][half] = [x - y for x, y in zip(lo, hi)]
    # accumulator value 2h + v of block b, half t: n = 2 (lane % 4) + v + 8t, i.e. out
    # column 32 (lane % 4) + 16t + 8v + b: local 16t + 8v + b
    return [[sums[t % 8][t // 16][2 * h + (t // 8) % 2] for t in range(32)] for h in range(2)]
