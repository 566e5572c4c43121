"""The fused epilogue, written once for every arch: RoPE, Hadamard-128, amax,
MXFP4 / FP8 quantization and packing, on one thread's share of one head row.

A head row is 128 fp32 accumulator values. Each arch's MMA leaves them spread over
`lanes_per_row` lanes of a warp; `HeadRowLayout` says which column every local value
is. Every helper here is a plain trace-time function (called from inside a kernel) on
plain Python lists of DSL scalars plus the lane's index within its row group, so the sm_90a WGMMA kernel, the sm_100a TMEM kernel and test
kernels call the same code. All loops are unrolled at trace time.

Exactness (SPEC steps 3-6, bit for bit with `indexer_q.reference`):
- products in RoPE use `mul.rn` so the compiler cannot contract them into an FMA;
- the Hadamard is a butterfly over column bits 0..6 in that order, in fp32 (the
  tensor-core Hadamard, a tactic, sums each 16 exact products in the tensor core's order);
- power-of-two exponents come from the float's bits, never from log2.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .numerics import (  # noqa: F401  (re-exported for the kernels)
    AMAX_FLOOR, FP4_MAX, FP8_MAX, HADAMARD_SCALE, HEAD_DIM, MXFP4_BLOCK, OUT_BF16, OUT_FORMATS, OUT_FP8,
    OUT_FP8_UNSCALED, OUT_GEMM_BF16, OUT_MXFP4, ROPE_DIMS,
)


class HeadRowLayout:
    """Where the 128 columns of a head row live: column bit b is either bit
    `local_bit[b]` of the thread-local index or lane-xor `lane_mask[b]` within the row
    group. Compile-time only."""

    def __init__(self, col_bits: tuple, rope: bool = True):
        # col_bits[b] = ("local", i) or ("lane", i) for column bit b = 0..6
        assert len(col_bits) == 7
        self.col_bits = col_bits
        self.num_local = 1 << sum(1 for kind, _ in col_bits if kind == "local")
        self.lanes_per_row = 1 << sum(1 for kind, _ in col_bits if kind == "lane")
        assert col_bits[0] == ("local", 0), "RoPE pairs and FP4 nibble pairs must be thread-local"
        if rope:  # a layout that only quantizes (after the Hadamard) may split the halves
            assert col_bits[6][0] == "local", "which half gets RoPE must be known at compile time"

    def local_mask(self, b: int) -> int:
        kind, i = self.col_bits[b]
        return (1 << i) if kind == "local" else 0

    def lane_mask(self, b: int) -> int:
        kind, i = self.col_bits[b]
        return (1 << i) if kind == "lane" else 0

    def column_static(self, local: int) -> int:
        """Column bits that come from the local index (the lane bits are added at run time)."""
        col = 0
        for b, (kind, i) in enumerate(self.col_bits):
            if kind == "local" and (local >> i) & 1:
                col |= 1 << b
        return col

    def rope_pairs(self) -> list:
        """[(local index of x, static part of its pair index)] for every RoPE pair; the
        run-time part of each pair index is column_lane_bits(lane) // 2."""
        return [
            (l, (self.column_static(l) - ROPE_DIMS) // 2)
            for l in range(0, self.num_local, 2)
            if self.column_static(l) >= ROPE_DIMS
        ]

    def column_lane_bits(self, lane_in_row):
        """Column bits that come from the lane (a run-time Int32)."""
        col = Int32(0)
        for b, (kind, i) in enumerate(self.col_bits):
            if kind == "lane":
                col = col | (((lane_in_row >> i) & 1) << b)
        return col


# The sm_90a epilogue warpgroup reads bf16 rows from shared memory, 4 lanes a row: lane q
# holds columns 16*(q&1) + 32*(q>>1) + {0..15} and the same + 64. Column bit 6 (the RoPE
# half) is local, each MXFP4 block spans 2 lanes, and the packed bytes come out as
# 8-byte runs, so stores are wide.
SM90_EPI_ROW_LAYOUT = HeadRowLayout(
    (("local", 0), ("local", 1), ("local", 2), ("local", 3), ("lane", 0), ("lane", 1), ("local", 4))
)
# 8 lanes a row (the swapped-A/B kernel's epilogue): lane L holds columns 8L + {0..7} and
# 64 + 8L + {0..7} (16 values, to fit half the registers); an MXFP4 block spans 4 lanes.
SM90_EPI8_ROW_LAYOUT = HeadRowLayout(
    (("local", 0), ("local", 1), ("local", 2), ("lane", 0), ("lane", 1), ("lane", 2), ("local", 3))
)
# SM100 tcgen05.ld 32x32b: one thread owns a whole row.
SM100_ROW_LAYOUT = HeadRowLayout(tuple(("local", b) for b in range(7)))


# ---------------------------------------------------------------- scalar primitives
def sel_i32(cond, a, b) -> Int32:
    return Int32(cutlass.select_(cond, Int32(a), Int32(b)))


def sel_f32(cond, a, b) -> Float32:
    return Float32(cutlass.select_(cond, Float32(a), Float32(b)))


def _scalar_asm(dtype, ptx: str, *args, loc=None, ip=None):
    """One `dtype` result (Float32 or Int32) from inline PTX over operands of that type
    ($0 = result, $1.. = args)."""
    ir_type, reg = (T.f32(), "f") if dtype is Float32 else (T.i32(), "r")
    return dtype(
        llvm.inline_asm(
            ir_type,
            [dtype(a).ir_value(loc=loc, ip=ip) for a in args],
            ptx,
            ",".join([f"={reg}"] + [reg] * len(args)),
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def mul_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """fp32 multiply rounded on its own (never fused into an FMA)."""
    return _scalar_asm(Float32, "mul.rn.f32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def fmax_nan(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """max that propagates NaN (as torch.amax does), so a NaN block gets scale 0xFF."""
    return _scalar_asm(Float32, "max.NaN.f32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def fmax_abs_nan(m: Float32, v: Float32, *, loc=None, ip=None) -> Float32:
    """max(m, |v|), NaN-propagating; ptxas folds the abs into the max."""
    return _scalar_asm(Float32, "{ .reg .f32 t; abs.f32 t, $2; max.NaN.f32 $0, $1, t; }", m, v, loc=loc, ip=ip)


def bf16x2_word(lo: Float32, hi: Float32) -> Int32:
    """Two fp32 -> one word of two bf16 (RNE): `lo` in bits 0..15."""
    return cute.arch.inline_ptx(
        "cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Int32], read_only_args=[hi, lo]
    )


def bf16x2_unpack(word: Int32):
    """One word of two bf16 -> (lo, hi) as exact fp32."""
    return (word << 16).bitcast(Float32), (word & Int32(-65536)).bitcast(Float32)


@dsl_user_op
def cvt_e4m3x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """Two fp32 -> two e4m3 bytes (RNE, saturated to +-448), `lo` in bits 0..7."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
            "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $2; cvt.u32.u16 $0, t; }",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def load_f32x4(ptr) -> tuple:
    """16-byte global load through the read-only path; `ptr` must be 16-byte aligned."""
    return cute.arch.inline_ptx(
        "ld.global.nc.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Float32] * 4,
        read_only_args=[ptr],
    )


def load_f32(ptr) -> Float32:
    """4-byte global load through the read-only path."""
    return cute.arch.inline_ptx("ld.global.nc.f32 {$w0}, [{$r0}];", write_only_types=[Float32],
                                read_only_args=[ptr])


def store_v4_if(ptr, words: list, pred) -> None:
    """Predicated 16-byte global store; `ptr` must be 16-byte aligned."""
    cute.arch.inline_ptx("st.global.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                         read_only_args=[ptr, *[Int32(w) for w in words]], predicate=pred)


def store_i32_if(ptr, value: Int32, pred) -> None:
    """Predicated 4-byte global store: no branch, so the compiler can schedule the
    epilogue of several rows as one block."""
    cute.arch.inline_ptx("st.global.b32 [{$r0}], {$r1};", read_only_args=[ptr, Int32(value)], predicate=pred)


def ceil_log2_of_ratio(amax: Float32, divisor: float) -> Int32:
    """ceil(log2(fp32(amax / divisor))) for a positive normal amax and divisor = (1 + f) * 2^j
    (6 and 448 here), without the division: it is the least k with amax <= divisor * 2^k,
    because the float just above divisor * 2^k, divided by divisor, is more than half an
    ulp above 2^k, so the division cannot round it down onto 2^k. So k is amax's exponent
    - j, plus one when amax's mantissa exceeds f. Inf/NaN give 128 (UE8M0 byte 0xFF)."""
    bits = amax.bitcast(Int32)
    d_bits = _f32_bits(divisor)
    j = (d_bits >> 23) - 127
    carry = 0x800000 - (d_bits & 0x7FFFFF) - 1  # carries into the exponent iff mantissa > f
    e = ((bits + carry) >> 23) - (127 + j)
    return sel_i32(bits >= 0x7F800000, 128, e)


def _f32_bits(x: float) -> int:
    import struct

    return struct.unpack("<i", struct.pack("<f", x))[0]


def exp2_neg(e: Int32) -> Float32:
    """2^-e as fp32 for e in [-127, 126] (every exponent a finite amax can give)."""
    return ((Int32(127) - e) << 23).bitcast(Float32)


@dsl_user_op
def prmt(a: Int32, b: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """Byte permute: result byte i = byte (selector >> 4i) & 7 of the 8 bytes {b, a}."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
            f"prmt.b32 $0, $1, $2, {selector:#x};",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def bf16x2_max_abs_nan(m: Int32, w: Int32, *, loc=None, ip=None) -> Int32:
    """Per half: max(|m|, |w|), NaN-propagating; the sign bits come out as the xor of the
    operands' (callers mask them off). One instruction for two values."""
    return _scalar_asm(Int32, "max.NaN.xorsign.abs.bf16x2 $0, $1, $2;", m, w, loc=loc, ip=ip)


@dsl_user_op
def u16x2_max(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    """Per 16-bit half: unsigned max (sm_90+)."""
    return _scalar_asm(Int32, "max.u16x2 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def bf16x2_fma(a: Int32, b: Int32, c: Int32, *, loc=None, ip=None) -> Int32:
    """Per half: a * b + c on bf16 with one rounding (to nearest even)."""
    return _scalar_asm(Int32, "fma.rn.bf16x2 $0, $1, $2, $3;", a, b, c, loc=loc, ip=ip)


def gather_byte(words: list, byte: int, sign_fill: bool = False) -> Int32:
    """Byte `byte` of each of 4 words, in order, as one word (3 byte permutes); with
    `sign_fill` each byte comes out as 0xFF or 0x00 after its top bit (prmt's sign mode)."""
    lo = prmt(words[0], words[1], byte | (byte + 4) << 4)
    hi = prmt(words[2], words[3], (byte << 8) | (byte + 4) << 12)
    return prmt(lo, hi, 0xFE98 if sign_fill else 0x7610)


class E2M1PairBlock:
    """Per-block constants for E2M1 codes of y = q * 2^-e (SPEC step 5, |y| <= 6) on bf16x2
    words: two values a word, one fma for both.

    A code is |y| rounded to the E2M1 grid, whose spacing is 2^s with s = max(E, 0) - 1
    (E = floor(log2|y|); 0.5 below 2, 1 in [2, 4), 2 in [4, 6]). The fma computes
    2y + M, M = sign(q) * (1 + d / 2^7) * 2^(8 + s), d = 2 * max(E, 0): 2y is exact, the
    sum rounds once to bf16 with ulp 2^(s + 1), so 2y lands on the grid (2^(s + 1)) and
    the mantissa is n + d, n = round(|y| / 2^s); n + d is the code (bits 0-2, sign bit
    15). 2y rather than y keeps the scale 2^(1 - e) a normal bf16 for every finite block.
    M's bits come from q's exponent field with integer ops on both halves at once (the
    per-half constants never carry across: every half's true result is in 0..0xFFFF).
    Rounding is to nearest even, which is rne (ties at 0.75, 1.75, 3.5 go to the even
    code, the others down); floor-ties scales by (1 - 2^-8) too (exact in bf16), which
    moves exact ties below the midpoint and no other value across one (q has 8
    significant bits). tests/test_epilogue_model.py checks this over every bf16 q."""

    def __init__(self, e: Int32, rne: bool):
        ck = (Int32(127) + e) << 7  # exponent field of 2^e, in a half
        self.ck2 = ck * 0x10001
        self.kk2 = (Int32(134 << 7) - ck - (ck >> 6)) * 0x10001
        field = ((Int32(128) - e) << 7) if rne else (((Int32(127) - e) << 7) | 0x7F)
        self.scale2 = field * 0x10001  # bf16 2^(1 - e), times (1 - 2^-8) for floor-ties

    def code_word(self, w: Int32) -> Int32:
        """bf16x2 word -> word whose halves hold the two codes (bits 0-2) and signs (15)."""
        x = u16x2_max(w & 0x7F807F80, self.ck2)  # per half max(exponent of q, of 2^e)
        magic = (x + (x >> 6) + self.kk2) | (w & -0x7FFF8000)  # q's signs (0x80008000)
        return bf16x2_fma(w, self.scale2, magic)


def nibble_word(code_words: list) -> Int32:
    """4 E2M1PairBlock words (values 2i, 2i + 1 in word i) -> one word of 8 nibbles
    (value j in bits 4j..4j+3): the code, plus the sign bit 3 when the value is negative
    and its code non-zero (no -0). Byte permutes gather 4 codes (or 4 signs) at a time."""
    even = gather_byte(code_words, 0)  # code bytes of values 0, 2, 4, 6 (bit 7: exponent)
    odd = gather_byte(code_words, 2)
    mags = (even & 0x0F0F0F0F) | ((odd << 4) & -0x0F0F0F10)  # 0xF0F0F0F0
    signs = ((gather_byte(code_words, 1, sign_fill=True) & 0x0F0F0F0F)
             | (gather_byte(code_words, 3, sign_fill=True) & -0x0F0F0F10))  # 0xF per negative value
    nonzero = mags + 0x77777777  # bit 4j+3 set iff nibble j != 0
    return mags | (signs & nonzero & -0x77777778)  # 0x88888888


def lane_butterfly(v: Float32, lane_xor: int, sign: Float32) -> Float32:
    """One Hadamard butterfly across lanes: the lower index gets a + b, the upper a - b.
    With sign = +1 (lower) or -1 (upper), v * sign + other is that one rounded add,
    fused into an FMA or not (v * sign is exact)."""
    other = cute.arch.shuffle_sync_bfly(v, offset=lane_xor)
    return v * sign + other


def lane_max(v: Float32, lane_xor: int) -> Float32:
    return fmax_nan(v, cute.arch.shuffle_sync_bfly(v, offset=lane_xor))


# ---------------------------------------------------------------- row transforms
def rope_pair_word(x: Float32, y: Float32, c: Float32, s: Float32) -> Int32:
    """SPEC step 3 on one GPT-J pair: (x c - y s, x s + y c) rounded to bf16, as one word."""
    return bf16x2_word(mul_rn(x, c) - mul_rn(y, s), mul_rn(x, s) + mul_rn(y, c))


def rope_row(vals: list, layout: HeadRowLayout, cos_vals: list, sin_vals: list) -> list:
    """SPEC step 3 on bf16-valued fp32 `vals`: GPT-J pairs on columns 64..127. cos_vals[k]
    and sin_vals[k] belong to the k-th entry of layout.rope_pairs() (the caller loads
    them, c = 1 and s = 0 for an out-of-range position)."""
    out = list(vals)
    for k, (local, _) in enumerate(layout.rope_pairs()):
        word = rope_pair_word(vals[local], vals[local + 1], cos_vals[k], sin_vals[k])
        out[local], out[local + 1] = bf16x2_unpack(word)
    return out


def rope_row_words(words: list, layout: HeadRowLayout, cos_vals: list, sin_vals: list) -> list:
    """rope_row on bf16x2 words (word p: locals 2p, 2p + 1); the other words pass as they are."""
    out = list(words)
    for k, (local, _) in enumerate(layout.rope_pairs()):
        x, y = bf16x2_unpack(words[local // 2])
        out[local // 2] = rope_pair_word(x, y, cos_vals[k], sin_vals[k])
    return out


def unpack_words(words: list) -> list:
    return [v for w in words for v in bf16x2_unpack(w)]


def hadamard_sums(vals: list, layout: HeadRowLayout, lane_in_row) -> list:
    """SPEC step 4's sums: Sylvester Hadamard-128 as butterflies over column bit 0, 1,
    ..., 6, in fp32 (hadamard_scale_round finishes the step)."""
    cur = list(vals)
    for b in range(7):
        lm = layout.local_mask(b)
        if (lm != 0):
            nxt = list(cur)
            for local in range(layout.num_local):
                if ((local & lm) == 0):
                    lo = cur[local]
                    hi = cur[local | lm]
                    nxt[local] = lo + hi
                    nxt[local | lm] = lo - hi
            cur = nxt
        else:
            xm = layout.lane_mask(b)
            sign = sel_f32((lane_in_row & xm) != 0, -1.0, 1.0)
            cur = [lane_butterfly(v, xm, sign) for v in cur]
    return cur


def hadamard_scale_round(sums: list) -> list:
    """SPEC step 4's end on the fp32 sums: times fp32(128^-0.5), rounded to bf16, as
    bf16x2 words (word p: sums 2p, 2p + 1)."""
    return [bf16x2_word(sums[i] * HADAMARD_SCALE, sums[i + 1] * HADAMARD_SCALE) for i in range(0, len(sums), 2)]


def absmax_over(vals: list, locals_: tuple, lane_masks: tuple) -> Float32:
    """max(max |v|, AMAX_FLOOR) over fp32 `vals[locals_]` and the lanes `lane_masks` reach."""
    m = Float32(0.0)
    for local in range(len(locals_)):
        m = fmax_abs_nan(m, vals[locals_[local]])
    for xm in range(len(lane_masks)):
        m = lane_max(m, lane_masks[xm])
    return fmax_nan(m, Float32(AMAX_FLOOR))


def absmax_words(words: list, lane_masks: tuple) -> Float32:
    """max(max |q|, AMAX_FLOOR) over bf16x2 `words` and the lanes `lane_masks` reach,
    NaN-propagating, as fp32 (exact: a bf16 value)."""
    m = Int32(0)
    for w in words:
        m = bf16x2_max_abs_nan(m, w)
    for xm in lane_masks:
        m = bf16x2_max_abs_nan(m, cute.arch.shuffle_sync_bfly(m, offset=xm))
    lo = ((m << 16) & 0x7FFFFFFF).bitcast(Float32)
    hi = (m & 0x7FFF0000).bitcast(Float32)
    return fmax_nan(fmax_nan(lo, hi), Float32(AMAX_FLOOR))


def _lane_masks_below(layout: HeadRowLayout, nbits: int) -> tuple:
    return tuple(layout.lane_mask(b) for b in range(nbits) if layout.lane_mask(b))


def _block_pairs(layout: HeadRowLayout) -> dict:
    """Local pair (word) indices grouped by the MXFP4 block they fall in, keyed by the
    block's static column (the lane bits of the column add to it at run time). A pair's
    two columns differ in bit 0 only, so they share a block."""
    groups: dict = {}
    for p in range(layout.num_local // 2):
        groups.setdefault(layout.column_static(2 * p) >> 5 << 5, []).append(p)
    return groups


def mxfp4_row(words: list, layout: HeadRowLayout, lane_in_row, rne: bool):
    """SPEC step 5 on one head row of bf16x2 words (word p: locals 2p, 2p + 1). Returns
    (nibble_words, scale_word): nibble_words[w] holds the 8 nibbles of locals 8w..8w+7
    (consecutive columns in every layout here), scale_word the four UE8M0 bytes,
    little-endian, in every lane of the row."""
    code_words = [Int32(0)] * len(words)
    scale_word = Int32(0)
    lane_cols = layout.column_lane_bits(lane_in_row)
    for block_static, pairs in _block_pairs(layout).items():
        amax = absmax_words([words[p] for p in pairs], _lane_masks_below(layout, 5))
        e = ceil_log2_of_ratio(amax, FP4_MAX)
        blk = E2M1PairBlock(e, rne)
        for p in pairs:
            code_words[p] = blk.code_word(words[p])
        block = (lane_cols + block_static) >> 5
        scale_word = scale_word | (((e + 127) & 0xFF) << (block * 8))
    for b in range(5, 7):  # gather the bytes of blocks held by other lanes of the row
        if layout.lane_mask(b):
            scale_word = scale_word | cute.arch.shuffle_sync_bfly(scale_word, offset=layout.lane_mask(b))
    assert all(layout.column_static(8 * w + i) == layout.column_static(8 * w) + i
               for w in range(layout.num_local // 8) for i in range(8))
    nibble_words = [nibble_word(code_words[4 * w:4 * w + 4]) for w in range(len(words) // 4)]
    return nibble_words, scale_word


def fp8_row(words: list, layout: HeadRowLayout, scaled: bool):
    """SPEC step 6 on one head row of bf16x2 words. Returns (pairs, e): `pairs[p]` holds
    the two e4m3 bytes of local pair p in its low 16 bits; e is the head's exponent (0 if
    unscaled)."""
    e = Int32(0)
    inv = Float32(1.0)
    if (scaled):
        amax = absmax_words(words, _lane_masks_below(layout, 7))
        e = ceil_log2_of_ratio(amax, FP8_MAX)
        inv = exp2_neg(e)
    pairs = []
    for w in words:
        lo, hi = bf16x2_unpack(w)
        pairs.append(cvt_e4m3x2(lo * inv, hi * inv))
    return pairs, e


# ---------------------------------------------------------------- row I/O, whole row
def load_cos_sin(layout: HeadRowLayout, row, m, num_pos, positions, cos_sin, lane_cols):
    """(cos, sin) lists for the RoPE pairs this thread holds, in layout.rope_pairs()
    order; identity (1, 0) for a position outside [0, P). Rows past M and such positions
    never read outside the tensors. The pairs must come in runs of 4 that start 16-byte
    aligned (true of every layout here: the lane part of a pair index is a multiple of 4)."""
    pos = positions[cutlass.min(row, m - 1)]
    pos_ok = (pos >= 0) & (pos < num_pos)
    pos_idx = Int32(cutlass.select_(pos_ok, pos, type(pos)(0)))
    pair0 = lane_cols >> 1
    statics = [k for _, k in layout.rope_pairs()]
    assert all(statics[i] + 1 == statics[i + 1] for i in range(len(statics) - 1) if (i + 1) % 4)
    assert len(statics) % 4 == 0 and all(statics[i] % 4 == 0 for i in range(0, len(statics), 4))
    cos_vals, sin_vals = [], []
    for first in range(0, len(statics), 4):
        col = pair0 + statics[first]
        cos_vals.extend(load_f32x4(cos_sin.iterator + cute.crd2idx((pos_idx, col), cos_sin.layout)))
        sin_vals.extend(load_f32x4(cos_sin.iterator + cute.crd2idx((pos_idx, col + 32), cos_sin.layout)))
    cos_vals = [sel_f32(pos_ok, c, 1.0) for c in cos_vals]
    sin_vals = [sel_f32(pos_ok, v, 0.0) for v in sin_vals]
    return cos_vals, sin_vals


# values a 32-bit output word holds, by the formats quantize_store_row writes
_VALUES_PER_WORD = {OUT_MXFP4: 8, OUT_FP8: 4, OUT_FP8_UNSCALED: 4, OUT_BF16: 2}


def v4_stores_fit(layout: HeadRowLayout, out_format_id: int) -> bool:
    """Whether every thread's output words of a row come in runs of 4 consecutive words that
    start 16-byte aligned (the lane's columns included), so _store_row_v4 can store them.
    Narrow stores of a row whose lanes hold separate 32-byte sectors cost a sector each: at
    4 lanes a row, bf16 rows took 4x the store transactions a byte of MXFP4 rows (H200,
    twentieth session: native tail 7.7 us at V4-Pro M = 256 against 2.5)."""
    per_word = _VALUES_PER_WORD[out_format_id]
    if any(layout.lane_mask(b) and (1 << b) % (4 * per_word) for b in range(7)):
        return False
    words = sorted({layout.column_static(v) // per_word for v in range(layout.num_local)})
    return len(words) % 4 == 0 and all(
        words[g] % 4 == 0 and words[g:g + 4] == list(range(words[g], words[g] + 4)) for g in range(0, len(words), 4))


def _store_row_v4(layout: HeadRowLayout, out_format_id: int, ok, safe_row, head, lane_cols, packed, out_q):
    """store_row's q part as 16-byte stores: the thread's words must be runs of 4
    consecutive words starting 16-byte aligned (SM90_MMA_HADAMARD_OUT_LAYOUT's are)."""
    if out_format_id == OUT_MXFP4:
        base = (head * (HEAD_DIM // 2) + (lane_cols >> 1)) >> 2
        words = [(layout.column_static(8 * w) // 8, packed[w]) for w in range(len(packed))]
    elif out_format_id == OUT_BF16:
        base = (head * HEAD_DIM + lane_cols) >> 1
        words = [(layout.column_static(2 * p) // 2, packed[p]) for p in range(len(packed))]
    else:
        base = (head * HEAD_DIM + lane_cols) >> 2
        words = [(layout.column_static(2 * p) // 4, (packed[p] & 0xFFFF) | (packed[p + 1] << 16))
                 for p in range(0, len(packed), 2)]
    assert len(words) % 4 == 0
    for g in range(0, len(words), 4):
        first = words[g][0]
        assert first % 4 == 0 and [w for w, _ in words[g:g + 4]] == list(range(first, first + 4))
        ptr = out_q.iterator + cute.crd2idx((safe_row, base + first), out_q.layout)
        store_v4_if(ptr, [v for _, v in words[g:g + 4]], ok)


def store_row(layout: HeadRowLayout, out_format_id: int, row, m, head, lane_in_row, lane_cols,
              packed, scale_word, out_q, out_scale, vector: bool = False):
    """Word stores of one head row, predicated on row < M. out_q is viewed as int32 words;
    `packed` is mxfp4_row's words, fp8_row's e4m3 pairs (two make a word) or bf16_row's
    words. `vector`:
    16-byte stores (see _store_row_v4)."""
    ok = row < m
    safe_row = cutlass.min(row, m - 1)
    if vector:
        _store_row_v4(layout, out_format_id, ok, safe_row, head, lane_cols, packed, out_q)
    elif out_format_id == OUT_MXFP4:
        base = head * (HEAD_DIM // 2) + (lane_cols >> 1)
        for w in range(len(packed)):  # words of 8 nibbles
            col = (base + layout.column_static(8 * w) // 2) >> 2
            store_i32_if(out_q.iterator + cute.crd2idx((safe_row, col), out_q.layout), packed[w], ok)
    elif out_format_id == OUT_BF16:
        base = head * HEAD_DIM + lane_cols
        for p in range(len(packed)):  # words of 2 bf16
            col = (base + layout.column_static(2 * p)) >> 1
            store_i32_if(out_q.iterator + cute.crd2idx((safe_row, col), out_q.layout), packed[p], ok)
    else:
        base = head * HEAD_DIM + lane_cols
        for p in range(0, len(packed), 2):
            word = (packed[p] & 0xFFFF) | (packed[p + 1] << 16)
            col = (base + layout.column_static(2 * p)) >> 2
            store_i32_if(out_q.iterator + cute.crd2idx((safe_row, col), out_q.layout), word, ok)
    if out_format_id in (OUT_MXFP4, OUT_FP8):
        store_i32_if(out_scale.iterator + cute.crd2idx((safe_row, head), out_scale.layout),
                     scale_word, ok & (lane_in_row == 0))


def rope_hadamard(words: list, layout: HeadRowLayout, lane_in_row, cos_sin_vals, hadamard: bool,
                  hadamard_fn=None) -> list:
    """SPEC steps 3-4 on one head row of bf16x2 words (word p: locals 2p, 2p + 1), to
    bf16x2 words. Without the Hadamard only the RoPE pairs are unpacked.
    `hadamard_fn(vals) -> words`: an arch's own step 4 (default hadamard_sums, then
    hadamard_scale_round)."""
    if not hadamard:
        return rope_row_words(words, layout, cos_sin_vals[0], cos_sin_vals[1])
    vals = rope_row(unpack_words(words), layout, cos_sin_vals[0], cos_sin_vals[1])
    if hadamard_fn is not None:
        return hadamard_fn(vals)
    return hadamard_scale_round(hadamard_sums(vals, layout, lane_in_row))


def head_row_epilogue(words: list, layout: HeadRowLayout, lane_in_row, cos_sin_vals, config, row, m,
                      head, out_q, out_scale) -> None:
    """SPEC steps 3-6 on one head row of bf16x2 words (word p: locals 2p, 2p + 1) and its
    stores: what every arch's kernel runs once it holds a row (`config`: a
    kernels.gemm_base.GemmConfig)."""
    words = rope_hadamard(words, layout, lane_in_row, cos_sin_vals, config.hadamard)
    quantize_store_row(words, layout, lane_in_row, config, row, m, head, out_q, out_scale)


def quantize_store_row(words: list, layout: HeadRowLayout, lane_in_row, config, row, m, head, out_q,
                       out_scale, vector: bool = False) -> None:
    """SPEC steps 5-6 on one head row of bf16x2 words (after RoPE and the optional
    Hadamard) and its stores ("bf16": the words themselves, no quantization)."""
    lane_cols = layout.column_lane_bits(lane_in_row)
    if config.out_format_id == OUT_MXFP4:
        packed, scale_word = mxfp4_row(words, layout, lane_in_row, config.rne)
    elif config.out_format_id == OUT_BF16:
        packed, scale_word = list(words), Int32(0)  # no scale
    else:
        packed, e = fp8_row(words, layout, config.out_format_id == OUT_FP8)
        scale_word = (e + 127) << 23  # fp32 bits of 2^e
    store_row(layout, config.out_format_id, row, m, head, lane_in_row, lane_cols, packed, scale_word,
              out_q, out_scale, vector or v4_stores_fit(layout, config.out_format_id))
