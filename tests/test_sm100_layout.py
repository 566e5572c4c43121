"""The sm_100a kernel's scale-factor layout helper agrees with CuTe's own layout (CPU)."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.blockscaled_layout as blockscaled_utils

from indexer_q.kernels.gemm_sm100 import SF_VEC, sf_atom_offset

SEEN = {}


@cute.jit
def _offsets(m: cutlass.Constexpr, k: cutlass.Constexpr):
    layout = blockscaled_utils.tile_atom_to_shape_SF((m, k, 1), SF_VEC)
    for row in (0, 1, 31, 32, 33, 64, 127, 128, 200, 255):
        for kb in (0, 1, 3, 4, 5, k // SF_VEC - 1):
            SEEN[(row, kb)] = cute.crd2idx((row, kb * SF_VEC, 0), layout)


def test_sf_atom_offset_matches_cute_layout():
    m, k = 256, 512
    _offsets(m, k)
    assert len(SEEN) == 60
    for (row, kb), idx in SEEN.items():
        assert int(idx) == sf_atom_offset(row, kb, k), (row, kb)
