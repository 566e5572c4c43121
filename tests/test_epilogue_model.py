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


def e2m1_nibbles(q: np.ndarray, e: int, rne: bool) -> np.ndarray:
    """kernels.epilogue.E2M1Block.code_bits + nibble_word's sign rule, in numpy."""
    qb = q.view(np.int32).astype(np.int64)
    ck = 0x3F800000 + (e << 23)
    kk = (22 << 23) + 0x400000 - (e << 23) - (ck >> 22)
    x = np.maximum(qb & 0x7F800000, ck)
    magic = (x + (x >> 22) + kk).astype(np.int32).view(np.float32)
    scale = np.float32(2.0 ** -e)
    if not rne:
        scale = scale * np.float32(1.0 - 2.0 ** -20)
    # one fma: |q| * scale is exact in float64 and the sum rounds once to fp32 (the
    # products that are not exact in float64 are far below every rounding boundary)
    t = (np.abs(q).astype(np.float64) * np.float64(scale) + magic.astype(np.float64)).astype(np.float32)
    code = t.view(np.int32) & 0xFF
    return code | (((qb < 0) & (code != 0)).astype(np.int32) << 3)


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
    q = _all_finite_bf16()
    checked = 0
    for e in range(-20, 21):
        qq = q[np.abs(q) <= np.float32(6.0 * 2.0 ** e)]  # the block's exponent bounds |q|
        y = torch.from_numpy(qq) * (2.0 ** -e)
        mag = ref.e2m1_codes(y.abs(), rounding).numpy().astype(np.int64)
        want = mag | (((qq < 0) & (mag != 0)).astype(np.int64) << 3)
        got = e2m1_nibbles(qq, e, rounding == "rne")
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
