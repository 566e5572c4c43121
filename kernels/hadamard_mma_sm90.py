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

from .epilogue import HeadRowLayout, bf16x2_word, prmt

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


def tc_b_words(lane) -> list:
    """The +-1 matrix as this lane's B fragments of the two n8 halves: [half][register],
    B[k][n] = H[in column of k][out column of n] on column bits 3..6 (PTX's m16n8k16 .col
    B: register r holds k = 2 (lane % 4) + 8r + {0, 1}, n = 8 half + lane // 4)."""
    words = []
    for half in range(2):
        n_out = scatter_bits(lane // 4 + 8 * half, TC_N_COLUMN_BITS)
        regs = []
        for r in range(2):
            k = 2 * (lane % 4) + 8 * r
            regs.append(bf16x2_word(sylvester_sign(scatter_bits(k, TC_K_COLUMN_BITS), n_out),
                                    sylvester_sign(scatter_bits(k + 1, TC_K_COLUMN_BITS), n_out)))
        words.append(regs)
    return words


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
