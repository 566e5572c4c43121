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
    """The tensor-core Hadamard's index bookkeeping (kernels/gemm_sm90.py,
    _tc_hadamard_chunk and _tc_hadamard_quantize) on the exact +-1 matrix:
    - the consumer thread with lane q of a row quad writes that row's columns 8j + 2q +
      {0, 1} as word 4j + q; the epilogue thread of the same index puts that word in
      register A word h + 2j, which the ((2, 2, 2), 1, 8) bf16 fragment reads as columns
      16 kk + 8 khalf + 2q + {0, 1} with j = 2 kk + khalf: the same columns;
    - with the matrix's columns permuted by kernels.epilogue.hadamard_output_column, the
      accumulator value 4j + 2h + v (column 8j + 2q + v) is the Hadamard's column
      32q + 2j + v: lane q holds MXFP4 block q, value t = 2j + v in order."""
    from indexer_q.kernels import epilogue as epi

    perm = [int(epi.hadamard_output_column(n)) for n in range(128)]
    assert sorted(perm) == list(range(128))
    i = np.arange(128)
    had = np.array([[(-1) ** int(a & b).bit_count() for b in i] for a in i], dtype=np.int8)  # Sylvester
    permuted = had[:, perm]  # what the kernel stores as the WGMMA's B (its [n, k] = this [k, n])
    layout_in, layout_out = epi.SM90_MMA_ROW_LAYOUT, epi.SM90_MMA_HADAMARD_OUT_LAYOUT
    for q in range(4):
        for kk in range(8):
            for khalf in range(2):
                for h in range(2):
                    for v in range(2):
                        j = 2 * kk + khalf
                        element = v + 2 * h + 4 * khalf + 8 * kk  # of the A fragment
                        assert element // 2 == h + 2 * j  # the A word the kernel writes
                        a_col = 16 * kk + 8 * khalf + 2 * q + v  # the column WGMMA reads there
                        assert a_col == 8 * j + 2 * q + v  # the consumer's word 4j + q, half v
                        local = 2 * j + v  # SM90_MMA_ROW_LAYOUT's local index of that column
                        assert layout_in.column_static(local) + int(layout_in.column_lane_bits(q)) == a_col
        for t in range(32):  # the output: accumulator value 4 (t // 2) + 2h + t % 2
            acc_col = 8 * (t // 2) + 2 * q + t % 2
            out_col = layout_out.column_static(t) + int(layout_out.column_lane_bits(q))
            assert out_col == 32 * q + t
            assert (permuted[:, acc_col] == had[:, out_col]).all()
