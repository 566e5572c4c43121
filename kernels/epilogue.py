"""The fused epilogue, written once for every arch: RoPE, Hadamard-128, amax,
MXFP4 / FP8 quantization and packing, on one thread's share of one head row.

A head row is 128 fp32 accumulator values. Each arch's MMA leaves them spread over
`lanes_per_row` lanes of a warp; `HeadRowLayout` says which column every local value
is. Every helper here is a plain trace-time function (called from inside a kernel) on plain Python lists of DSL scalars plus the lane's index
within its row group, so the sm_90a WGMMA kernel, the sm_100a TMEM kernel and test
kernels call the same code. All loops are unrolled at trace time.

Exactness (SPEC steps 3-6, bit for bit with `indexer_q.reference`):
- products in RoPE use `mul.rn` so the compiler cannot contract them into an FMA;
- the Hadamard is a butterfly over column bits 0..6 in that order, in fp32;
- power-of-two exponents come from the float's bits, never from log2.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

HEAD_DIM = 128
ROPE_DIMS = 64
MXFP4_BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
AMAX_FLOOR = 1e-4
HADAMARD_SCALE = 128.0 ** -0.5  # rounded to fp32 once, as the reference does

# Output formats; plain ints so they can be compile-time constants of a kernel.
OUT_MXFP4 = 0
OUT_FP8 = 1
OUT_FP8_UNSCALED = 2
OUT_FORMATS = {"mxfp4": OUT_MXFP4, "fp8": OUT_FP8, "fp8-unscaled": OUT_FP8_UNSCALED}


class HeadRowLayout:
    """Where the 128 columns of a head row live: column bit b is either bit
    `local_bit[b]` of the thread-local index or lane-xor `lane_mask[b]` within the row
    group. Compile-time only."""

    def __init__(self, col_bits: tuple):
        # col_bits[b] = ("local", i) or ("lane", i) for column bit b = 0..6
        assert len(col_bits) == 7
        self.col_bits = col_bits
        self.num_local = 1 << sum(1 for kind, _ in col_bits if kind == "local")
        self.lanes_per_row = 1 << sum(1 for kind, _ in col_bits if kind == "lane")
        assert col_bits[0] == ("local", 0), "RoPE pairs and FP4 nibble pairs must be thread-local"
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
# SM100 tcgen05.ld 32x32b: one thread owns a whole row.
SM100_ROW_LAYOUT = HeadRowLayout(tuple(("local", b) for b in range(7)))


# ---------------------------------------------------------------- scalar primitives
def sel_i32(cond, a, b) -> Int32:
    return Int32(cutlass.select_(cond, Int32(a), Int32(b)))


def sel_f32(cond, a, b) -> Float32:
    return Float32(cutlass.select_(cond, Float32(a), Float32(b)))


def _f32_asm(ptx: str, *args, loc=None, ip=None) -> Float32:
    """One fp32 result from inline PTX over fp32 operands ($0 = result, $1.. = args)."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(a).ir_value(loc=loc, ip=ip) for a in args],
            ptx,
            ",".join(["=f"] + ["f"] * len(args)),
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def mul_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """fp32 multiply rounded on its own (never fused into an FMA)."""
    return _f32_asm("mul.rn.f32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def fmax_nan(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """max that propagates NaN (as torch.amax does), so a NaN block gets scale 0xFF."""
    return _f32_asm("max.NaN.f32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def fmax_abs_nan(m: Float32, v: Float32, *, loc=None, ip=None) -> Float32:
    """max(m, |v|), NaN-propagating; ptxas folds the abs into the max."""
    return _f32_asm("{ .reg .f32 t; abs.f32 t, $2; max.NaN.f32 $0, $1, t; }", m, v, loc=loc, ip=ip)


def bf16x2_word(lo: Float32, hi: Float32) -> Int32:
    """Two fp32 -> one word of two bf16 (RNE): `lo` in bits 0..15."""
    return cute.arch.inline_ptx(
        "cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Int32], read_only_args=[hi, lo]
    )


def bf16x2_unpack(word: Int32):
    """One word of two bf16 -> (lo, hi) as exact fp32."""
    return (word << 16).bitcast(Float32), (word & Int32(-65536)).bitcast(Float32)


def round_bf16_pair(lo: Float32, hi: Float32):
    return bf16x2_unpack(bf16x2_word(lo, hi))


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


def store_i32_if(ptr, value: Int32, pred) -> None:
    """Predicated 4-byte global store: no branch, so the compiler can schedule the
    epilogue of several rows as one block."""
    cute.arch.inline_ptx("st.global.b32 [{$r0}], {$r1};", read_only_args=[ptr, Int32(value)], predicate=pred)


def ceil_log2_exact(x: Float32) -> Int32:
    """ceil(log2(x)) for a positive float, from its bits; capped at 128 so that an
    Inf/NaN amax gives the UE8M0 byte 0xFF."""
    bits = x.bitcast(Int32)
    e = ((bits >> 23) & 0xFF) - 127
    e = e + sel_i32((bits & 0x7FFFFF) != 0, 1, 0)
    return sel_i32(e > 128, 128, e)


def exp2_neg(e: Int32) -> Float32:
    """2^-e as fp32 for e in [-127, 126] (every exponent a finite amax can give)."""
    return ((Int32(127) - e) << 23).bitcast(Float32)


def e2m1_code(y: Float32, rne: bool) -> Int32:
    """E2M1 nibble of y (magnitude code + sign bit 3), for y = (bf16 value) * 2^-e.

    The magnitude is rounded to one mantissa bit in the integer domain: adding
    0x1FFFFF (plus the kept bit, for rne) below bit 22 rounds ties down (floor-ties)
    or to even (rne), and the carry moves into the exponent, so
    code = ((bits + bias) >> 22) - 252 for |y| in [1, 8), clamped to 7 (= 6.0).
    Below 1 the E2M1 spacing is 0.5 as in [1, 2), so |y| + 1 takes the same path
    (code - 2); that add is exact because y carries at most 8 significant bits."""
    ybits = y.bitcast(Int32)
    a = (ybits & 0x7FFFFFFF).bitcast(Float32)
    small = a < 1.0
    c = (a + sel_f32(small, 1.0, 0.0)).bitcast(Int32)
    bias = Int32(0x1FFFFF)
    if rne:
        bias = bias + ((c >> 22) & 1)
    code = ((c + bias) >> 22) - sel_i32(small, 254, 252)
    code = cutlass.min(code, Int32(7))
    # sign only for a non-zero code (no -0): bit 3 of code + 7 is set iff code >= 1
    return code | ((ybits >> 28) & 8 & (code + 7))


def lane_butterfly(v: Float32, lane_xor: int, sign: Float32) -> Float32:
    """One Hadamard butterfly across lanes: the lower index gets a + b, the upper a - b.
    With sign = +1 (lower) or -1 (upper), v * sign + other is that one rounded add,
    fused into an FMA or not (v * sign is exact)."""
    other = cute.arch.shuffle_sync_bfly(v, offset=lane_xor)
    return v * sign + other


def lane_max(v: Float32, lane_xor: int) -> Float32:
    return fmax_nan(v, cute.arch.shuffle_sync_bfly(v, offset=lane_xor))


# ---------------------------------------------------------------- row transforms
def rope_row(vals: list, layout: HeadRowLayout, cos_vals: list, sin_vals: list) -> list:
    """SPEC step 3 on bf16-valued fp32 `vals`: GPT-J pairs on columns 64..127. cos_vals[k]
    and sin_vals[k] belong to the k-th entry of layout.rope_pairs() (the caller loads
    them, c = 1 and s = 0 for an out-of-range position)."""
    out = list(vals)
    for k, (local, _) in enumerate(layout.rope_pairs()):
        c, s = cos_vals[k], sin_vals[k]
        x, y = vals[local], vals[local + 1]
        out[local], out[local + 1] = round_bf16_pair(
            mul_rn(x, c) - mul_rn(y, s), mul_rn(x, s) + mul_rn(y, c)
        )
    return out


def hadamard_row(vals: list, layout: HeadRowLayout, lane_in_row) -> list:
    """SPEC step 4: Sylvester Hadamard-128, butterflies over column bit 0, 1, ..., 6,
    fp32, then one multiply by fp32(128^-0.5) and a bf16 rounding."""
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
    out = []
    for i in range(0, len(cur), 2):
        out.extend(round_bf16_pair(cur[i] * HADAMARD_SCALE, cur[i + 1] * HADAMARD_SCALE))
    return out


def absmax_over(vals: list, locals_: tuple, lane_masks: tuple) -> Float32:
    m = Float32(0.0)
    for local in range(len(locals_)):
        m = fmax_abs_nan(m, vals[locals_[local]])
    for xm in range(len(lane_masks)):
        m = lane_max(m, lane_masks[xm])
    return fmax_nan(m, Float32(AMAX_FLOOR))


def _lane_masks_below(layout: HeadRowLayout, nbits: int) -> tuple:
    return tuple(layout.lane_mask(b) for b in range(nbits) if layout.lane_mask(b))


def _block_groups(layout: HeadRowLayout) -> dict:
    """Local indices grouped by the MXFP4 block they fall in, keyed by the block's static
    column (the lane bits of the column add to it at run time)."""
    groups: dict = {}
    for l in range(layout.num_local):
        groups.setdefault(layout.column_static(l) >> 5 << 5, []).append(l)
    return groups


def mxfp4_row(vals: list, layout: HeadRowLayout, lane_in_row, rne: bool):
    """SPEC step 5 on one head row. Returns (packed, scale_word): packed[p] is the byte
    of local pair (2p, 2p+1), whose column byte index is column(2p) / 2; scale_word holds
    the four UE8M0 bytes, little-endian, in every lane of the row."""
    nibbles = [Int32(0)] * layout.num_local
    scale_word = Int32(0)
    lane_cols = layout.column_lane_bits(lane_in_row)
    for block_static, locals_ in _block_groups(layout).items():
        amax = absmax_over(vals, tuple(locals_), _lane_masks_below(layout, 5))
        e = ceil_log2_exact(amax / FP4_MAX)
        inv = exp2_neg(e)
        for l in locals_:
            nibbles[l] = e2m1_code(vals[l] * inv, rne)
        block = (lane_cols + block_static) >> 5
        scale_word = scale_word | (((e + 127) & 0xFF) << (block * 8))
    for b in range(5, 7):  # gather the bytes of blocks held by other lanes of the row
        if layout.lane_mask(b):
            scale_word = scale_word | cute.arch.shuffle_sync_bfly(scale_word, offset=layout.lane_mask(b))
    packed = [nibbles[2 * p] | (nibbles[2 * p + 1] << 4) for p in range(layout.num_local // 2)]
    return packed, scale_word


def fp8_row(vals: list, layout: HeadRowLayout, scaled: bool):
    """SPEC step 6 on one head row. Returns (pairs, e): `pairs[p]` holds the two e4m3
    bytes of local pair p in its low 16 bits; e is the head's exponent (0 if unscaled)."""
    e = Int32(0)
    inv = Float32(1.0)
    if (scaled):
        all_locals = tuple(range(layout.num_local))
        amax = absmax_over(vals, all_locals, _lane_masks_below(layout, 7))
        e = ceil_log2_exact(amax / FP8_MAX)
        inv = exp2_neg(e)
    pairs = [
        cvt_e4m3x2(vals[2 * p] * inv, vals[2 * p + 1] * inv) for p in range(layout.num_local // 2)
    ]
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


def store_row(layout: HeadRowLayout, out_format_id: int, row, m, head, lane_in_row, lane_cols,
              packed, scale_word, out_q, out_scale):
    """Word stores of one head row, predicated on row < M. out_q is viewed as int32 words;
    4 consecutive packed bytes (or 2 e4m3 pairs) make one word."""
    ok = row < m
    safe_row = cutlass.min(row, m - 1)
    if out_format_id == OUT_MXFP4:
        base = head * (HEAD_DIM // 2) + (lane_cols >> 1)
        for p in range(0, len(packed), 4):
            word = packed[p] | (packed[p + 1] << 8) | (packed[p + 2] << 16) | (packed[p + 3] << 24)
            col = (base + layout.column_static(2 * p) // 2) >> 2
            store_i32_if(out_q.iterator + cute.crd2idx((safe_row, col), out_q.layout), word, ok)
    else:
        base = head * HEAD_DIM + lane_cols
        for p in range(0, len(packed), 2):
            word = (packed[p] & 0xFFFF) | (packed[p + 1] << 16)
            col = (base + layout.column_static(2 * p)) >> 2
            store_i32_if(out_q.iterator + cute.crd2idx((safe_row, col), out_q.layout), word, ok)
    if out_format_id != OUT_FP8_UNSCALED:
        store_i32_if(out_scale.iterator + cute.crd2idx((safe_row, head), out_scale.layout),
                     scale_word, ok & (lane_in_row == 0))


def head_row_epilogue(vals: list, layout: HeadRowLayout, lane_in_row, cos_sin_vals, config, row, m,
                      head, out_q, out_scale) -> None:
    """SPEC steps 3-6 on one head row of bf16-valued fp32 `vals` and its stores: what
    every arch's kernel runs once it holds a row (`config`: a kernels.gemm_base.GemmConfig)."""
    lane_cols = layout.column_lane_bits(lane_in_row)
    vals = rope_row(vals, layout, cos_sin_vals[0], cos_sin_vals[1])
    if config.hadamard:
        vals = hadamard_row(vals, layout, lane_in_row)
    if config.out_format_id == OUT_MXFP4:
        packed, scale_word = mxfp4_row(vals, layout, lane_in_row, config.rne)
    else:
        packed, e = fp8_row(vals, layout, config.out_format_id == OUT_FP8)
        scale_word = (e + 127) << 23  # fp32 bits of 2^e
    store_row(layout, config.out_format_id, row, m, head, lane_in_row, lane_cols, packed, scale_word,
              out_q, out_scale)
