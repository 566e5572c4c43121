"""CPU: the kernels' integer / magic-number formulations of SPEC steps 1, 5 and 6, modelled
in numpy operation for operation, against the reference over every bf16 value.

The kernels (kernels/epilogue.py) compute ceil(log2(amax / 6)) and ceil(log2(amax / 448))
without a division, and E2M1 codes with one fma against a magic number. Those are
rewrites of the SPEC's formulas, so they are checked here exhaustively; the GPU tests
then check the kernels against the same reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from indexer_q import reference as ref


def _f32_bits(x: float) -> int:
    return int(np.array([x], dtype=np.float32).view(np.int32)[0])


def ceil_log2_of_ratio(amax: np.ndarray, divisor: float) -> np.ndarray:
    """kernels.epilogue.ceil_log2_of_ratio, in numpy."""
    bits = amax.view(np.int32).astype(np.int64)
    d_bits = _f32_bits(divisor)
    j = (d_bits >> 23) - 127
    carry = 0x800000 - (d_bits & 0x7FFFFF) - 1
    e = ((bits + carry) >> 23) - (127 + j)
    return np.where(bits >= 0x7F800000, 128, e)


M32 = 0xFFFFFFFF


def _round_bf16_rne(x: np.ndarray) -> np.ndarray:
    """float64 -> the nearest bf16 (ties to even) as float64, for |x| >= 2^-100 or 0."""
    m, ex = np.frexp(x)
    return np.ldexp(np.rint(m * 256.0), ex - 8)


def _bf16x2_fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fma.rn.bf16x2 on uint32 words: per half, a * b + c with one rounding. The product
    of two 8-bit significands is exact in float64, and the sums here round at the
    magic number's ulp, far above float64's."""
    out = np.zeros_like(a)
    for shift in (0, 16):
        def half(w):
            return ((((w >> shift) & 0xFFFF) << 16).astype(np.uint32)).view(np.float32).astype(np.float64)
        r = _round_bf16_rne(half(a) * half(b) + half(c)).astype(np.float32).view(np.uint32).astype(np.int64)
        out |= ((r >> 16) & 0xFFFF) << shift
    return out


def e2m1_code_words(words: np.ndarray, e: int, rne: bool) -> np.ndarray:
    """kernels.epilogue.E2M1PairBlock.code_word on uint32 bf16x2 words, op for op (32-bit
    integer arithmetic on both halves at once, as the kernel does)."""
    ck = (127 + e) << 7
    ck2 = (ck * 0x10001) & M32
    kk2 = (((134 << 7) - ck - (ck >> 6)) * 0x10001) & M32
    field = ((128 - e) << 7) if rne else (((127 - e) << 7) | 0x7F)
    scale2 = (field * 0x10001) & M32
    x0 = words & 0x7F807F80
    x = np.maximum(x0 & 0xFFFF, ck2 & 0xFFFF) | (np.maximum(x0 >> 16, ck2 >> 16) << 16)  # max.u16x2
    magic = ((x + (x >> 6) + kk2) & M32) | (words & 0x80008000)
    return _bf16x2_fma(words, np.full_like(words, scale2), magic)


def _gather_byte(w: list, byte: int, sign_fill: bool = False) -> np.ndarray:
    out = np.zeros_like(w[0])
    for i in range(4):
        b = (w[i] >> (8 * byte)) & 0xFF
        if sign_fill:
            b = np.where(b & 0x80, 0xFF, 0)
        out |= b << (8 * i)
    return out


def nibble_word(code_words: list) -> np.ndarray:
    """kernels.epilogue.nibble_word in numpy."""
    even, odd = _gather_byte(code_words, 0), _gather_byte(code_words, 2)
    mags = (even & 0x0F0F0F0F) | ((odd << 4) & 0xF0F0F0F0)
    signs = (_gather_byte(code_words, 1, True) & 0x0F0F0F0F) | (_gather_byte(code_words, 3, True) & 0xF0F0F0F0)
    nonzero = (mags + 0x77777777) & M32
    return mags | (signs & nonzero & 0x88888888)


def e2m1_nibbles(q: np.ndarray, e: int, rne: bool, rng) -> np.ndarray:
    """The kernel's signed E2M1 nibble of every value of q (float32, bf16-valued, a
    multiple of 8 of them), each value paired in a word with a random other one and
    packed with 7 random others, as the kernel's words and nibble words hold them."""
    n = q.size
    perm = rng.permutation(n)
    bits = (q.view(np.uint32).astype(np.int64) >> 16) & 0xFFFF
    lo, hi = bits[perm[: n // 2]], bits[perm[n // 2:]]
    codes = e2m1_code_words(lo | (hi << 16), e, rne)  # word i: values perm[i], perm[n/2 + i]
    groups = codes.reshape(-1, 4)
    packed = nibble_word([groups[:, i] for i in range(4)])
    out = np.zeros(n, dtype=np.int64)
    for i in range(4):  # word i of a group holds nibbles 2i (low half) and 2i + 1
        for h, src in ((0, perm[: n // 2]), (1, perm[n // 2:])):
            out[src.reshape(-1, 4)[:, i]] = (packed >> (4 * (2 * i + h))) & 0xF
    return out


def _all_finite_bf16() -> np.ndarray:
    q = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    return q[np.isfinite(q)]


@pytest.mark.parametrize("divisor", [6.0, 448.0])
def test_division_free_exponent_matches_reference(divisor):
    rng = np.random.default_rng(0)
    mantissas = np.arange(1 << 23, dtype=np.int32)
    amax = np.concatenate([
        rng.uniform(1e-4, 1e6, 200_000).astype(np.float32),
        (mantissas | (127 << 23)).view(np.float32),  # every mantissa, two exponents
        (mantissas | (113 << 23)).view(np.float32),
        np.array([1e-4, 6.0, 448.0, 3.0e38, np.inf, np.nan], dtype=np.float32),
    ])
    want = ref.ceil_log2_exact(torch.from_numpy(amax) / divisor).numpy()
    got = ceil_log2_of_ratio(amax, divisor)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("rounding", ["floor-ties", "rne"])
def test_magic_number_e2m1_matches_reference_for_every_bf16(rounding):
    """Every finite bf16 q, for every block exponent e that a block holding it can have
    (|q| <= 6 * 2^e, e from the amax floor's -15 up to 126, the largest a finite bf16
    amax gives), through the kernel's bf16x2 code words and nibble packing."""
    q = _all_finite_bf16()
    rng = np.random.default_rng(0)
    checked = 0
    for e in list(range(-16, 21)) + [60, 120, 125, 126]:
        qq = q[np.abs(q).astype(np.float64) <= 6.0 * 2.0 ** e]  # the block's exponent bounds |q|
        qq = qq[: qq.size // 8 * 8]
        y = torch.from_numpy(qq.astype(np.float64) * 2.0 ** -e)
        mag = ref.e2m1_codes(y.abs(), rounding).numpy().astype(np.int64)
        want = mag | (((qq < 0) & (mag != 0)).astype(np.int64) << 3)
        got = e2m1_nibbles(qq, e, rounding == "rne", rng)
        bad = np.nonzero(got != want)[0]
        assert bad.size == 0, (e, qq[bad[:5]], want[bad[:5]], got[bad[:5]])
        checked += qq.size
    assert checked > 1_000_000


def test_tensor_core_hadamard_layout_bookkeeping():
    """The tensor-core Hadamard's index bookkeeping (kernels/hadamard_mma_sm90.py tc_a_word_source,
    tc_b_words and tc_hadamard_rows), modelled with PTX's m16n8k16 fragment layouts on
    integer rows (every sum exact): each lane builds its A words from its SM90_EPI_ROW_LAYOUT
    words by byte permutes, the +-1 B fragments from the column-bit maps, 16 MMAs and the
    butterfly over the blocks give H128 q in SM90_MMA_HADAMARD_OUT_LAYOUT's order."""
    from indexer_q.kernels import epilogue as epi
    from indexer_q.kernels import hadamard_mma_sm90 as hmma

    rng = np.random.default_rng(0)
    q = rng.integers(-50, 51, size=(16, 128)).astype(np.int64)  # a warp's 16 rows
    i = np.arange(128)
    had = np.array([[(-1) ** int(a & b).bit_count() for b in i] for a in i], dtype=np.int64)  # Sylvester
    expect = q @ had
    layout_in, layout_out = epi.SM90_EPI_ROW_LAYOUT, hmma.SM90_MMA_HADAMARD_OUT_LAYOUT

    def col_in(lane, local):
        return layout_in.column_static(local) + int(layout_in.column_lane_bits(lane % 4))

    def word_halves(lane, row, w):  # the lane's word w of `row`: its locals 2w, 2w + 1
        return q[row, col_in(lane, 2 * w)], q[row, col_in(lane, 2 * w + 1)]

    def prmt_halves(lo_word, hi_word, sel):
        halves = list(lo_word) + list(hi_word)
        return {0x5410: (halves[0], halves[2]), 0x7632: (halves[1], halves[3])}[sel]

    def b_matrix(half):  # B[k][n] for n in the half's 8 columns, from the k/n column-bit maps
        return np.array([[(-1) ** (hmma.scatter_bits(k, hmma.TC_K_COLUMN_BITS)
                                   & hmma.scatter_bits(n + 8 * half, hmma.TC_N_COLUMN_BITS)).bit_count()
                          for n in range(8)] for k in range(16)], dtype=np.int64)

    for block in range(8):
        a_tile = np.zeros((16, 16), dtype=np.int64)  # what the MMA reads from the A fragments
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for khalf in range(2):
                local, sel = hmma.tc_a_word_source(block, khalf)
                for h in range(2):  # A register h + 2 khalf: row g + 8h, k = 2t + 8 khalf + {0, 1}
                    lo, hi = prmt_halves(word_halves(lane, g + 8 * h, local // 2),
                                         word_halves(lane, g + 8 * h, local // 2 + 8), sel)
                    a_tile[g + 8 * h, 2 * t + 8 * khalf] = lo
                    a_tile[g + 8 * h, 2 * t + 8 * khalf + 1] = hi
        for k in range(16):  # the A tile is q's columns block + the k bits' columns
            assert (a_tile[:, k] == q[:, block + hmma.scatter_bits(k, hmma.TC_K_COLUMN_BITS)]).all()
    # The B fragments the kernel's tc_b_words builds hold B's entries at PTX's places.
    for half in range(2):
        bm = b_matrix(half)
        for n in range(8):
            for k in range(16):
                j = hmma.scatter_bits(n + 8 * half, hmma.TC_N_COLUMN_BITS)
                assert bm[k, n] == had[hmma.scatter_bits(k, hmma.TC_K_COLUMN_BITS), j]
    # Sums: per block the MMA (k over column bits 3..6), then the butterfly over bits 0..2.
    partial = np.stack([np.stack([q[:, [b + hmma.scatter_bits(k, hmma.TC_K_COLUMN_BITS) for k in range(16)]]
                                  @ b_matrix(half) for half in range(2)]) for b in range(8)])  # [b, half, row, n]
    for bit in range(3):
        m = 1 << bit
        for b in range(8):
            if not b & m:
                partial[b], partial[b | m] = partial[b] + partial[b | m], partial[b] - partial[b | m]
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for h in range(2):
            for local in range(32):  # tc_hadamard_rows' return order, accumulator value 2h + v
                block, v, half = local % 8, (local // 8) % 2, local // 16
                value = partial[block, half, g + 8 * h, 2 * t + v]
                col = layout_out.column_static(local) + int(layout_out.column_lane_bits(t))
                assert value == expect[g + 8 * h, col] and col == 32 * t + local


@pytest.mark.parametrize("lanes", (4, 8))
def test_tensor_core_hadamard_one_row_a_thread_bookkeeping(lanes):
    """The one-row-a-thread tensor-core Hadamard (hadamard_mma_sm90.tc_hadamard_row: the
    swapped-A/B epilogue's at 8 lanes a row, the native two-warpgroup epilogue's at 4),
    modelled on integer rows with PTX's m16n8k16 fragments: a warp holds 32 / lanes rows,
    `lanes` lanes each in the layout; each lane's A registers are its own words
    (tc_row_a_word), the B fragments come from tc_row_column_bits, the accumulators land at
    tc_row_sum_local, and H8 over the other column bits (local, then lane bits past lane % 4)
    gives H128 q in the same layout."""
    from indexer_q.kernels import epilogue as epi
    from indexer_q.kernels import hadamard_mma_sm90 as hmma

    layout = {4: epi.SM90_EPI_ROW_LAYOUT, 8: epi.SM90_EPI8_ROW_LAYOUT}[lanes]
    rng = np.random.default_rng(lanes)
    rows = 32 // lanes
    q = rng.integers(-50, 51, size=(rows, 128)).astype(np.int64)  # a warp's rows
    i = np.arange(128)
    had = np.array([[(-1) ** int(a & b).bit_count() for b in i] for a in i], dtype=np.int64)
    expect = q @ had
    bits = hmma.tc_row_column_bits(layout)
    n_local = layout.num_local

    def col(lane, local):  # the epilogue's rows: lane // lanes of the warp's
        return layout.column_static(local) + int(layout.column_lane_bits(lane % lanes))

    def word(lane, w):  # (lo, hi) values of the lane's word w: locals 2w, 2w + 1
        return q[lane // lanes, col(lane, 2 * w)], q[lane // lanes, col(lane, 2 * w + 1)]

    b = np.array([[[(-1) ** (hmma.scatter_bits(k, bits) & hmma.scatter_bits(n + 8 * half, bits)).bit_count()
                    for n in range(8)] for k in range(16)] for half in range(2)], dtype=np.int64)
    sums = np.zeros((32, n_local), dtype=np.int64)  # [lane, local]
    for mma in range(n_local // 8):
        a_tile = np.zeros((16, 16), dtype=np.int64)  # what the MMA reads from the A fragments
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for reg in range(4):  # register h + 2 kh: row g + 8h, k = 2t + 8 kh + {0, 1}
                h, kh = reg % 2, reg // 2
                lo, hi = word(lane, hmma.tc_row_a_word(mma, reg))
                a_tile[g + 8 * h, 2 * t + 8 * kh], a_tile[g + 8 * h, 2 * t + 8 * kh + 1] = lo, hi
        for half in range(2):
            c = a_tile @ b[half]  # [A row, n]
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for reg in range(4):  # value 2h + v: row g + 8h, n = 2t + v
                    sums[lane, hmma.tc_row_sum_local(mma, half, reg)] = c[g + 8 * (reg // 2), 2 * t + reg % 2]
    m = 4
    while m < n_local:  # H8's local bits
        for local in range(n_local):
            if not local & m:
                lo, hi = sums[:, local].copy(), sums[:, local | m].copy()
                sums[:, local], sums[:, local | m] = lo + hi, lo - hi
        m *= 2
    lanes_idx = np.arange(32)
    for xm in sorted(layout.lane_mask(c) for c in range(7) if layout.lane_mask(c))[2:]:  # lane bits past lane % 4
        other = sums[lanes_idx ^ xm]  # the upper lane takes other - own
        upper = ((lanes_idx & xm) != 0)[:, None]
        sums = np.where(upper, other - sums, sums + other)
    for lane in range(32):
        for local in range(n_local):
            assert sums[lane, local] == expect[lane // lanes, col(lane, local)], (lane, local)


def test_sixteen_byte_stores_where_the_layout_allows():
    """epilogue.v4_stores_fit: a thread's output words of a row in aligned runs of 4 (one
    16-byte store each). At 4 lanes a row bf16 and both FP8 formats fit, MXFP4's runs of 2
    words do not; at 8 lanes only bf16; sm_100a's row a thread and the tensor-core
    Hadamard's output layout fit every format."""
    from indexer_q.kernels import epilogue as epi
    from indexer_q.kernels import hadamard_mma_sm90 as hmma

    formats = (epi.OUT_MXFP4, epi.OUT_FP8, epi.OUT_FP8_UNSCALED, epi.OUT_BF16)
    fits = {name: tuple(epi.v4_stores_fit(layout, f) for f in formats)
            for name, layout in (("4 lanes", epi.SM90_EPI_ROW_LAYOUT), ("8 lanes", epi.SM90_EPI8_ROW_LAYOUT),
                                 ("sm_100a", epi.SM100_ROW_LAYOUT), ("tc out", hmma.SM90_MMA_HADAMARD_OUT_LAYOUT))}
    assert fits == {"4 lanes": (False, True, True, True), "8 lanes": (False, False, False, True),
                    "sm_100a": (True,) * 4, "tc out": (True,) * 4}
