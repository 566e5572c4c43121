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


def test_host_scale_factor_layout_puts_every_byte_where_the_kernel_reads_it():
    import torch

    from indexer_q.reference import scale_to_ue8m0
    from indexer_q.weights import sf_atom_layout

    g = torch.Generator().manual_seed(0)
    rows, k = 200, 512  # rows not a multiple of 128: padded
    per_row = torch.pow(2.0, torch.randint(-20, 10, (rows, k // 128), generator=g).double()).float()
    flat = sf_atom_layout(per_row, rows)
    assert flat.dtype == torch.uint8 and flat.numel() == 256 * (k // 32)
    e = scale_to_ue8m0(per_row)
    for row in (0, 1, 31, 32, 100, 127, 128, 199):
        for kb in range(k // 32):
            assert flat[sf_atom_offset(row, kb, k)] == e[row, kb // 4], (row, kb)
    n = 256
    per_block = torch.pow(2.0, torch.randint(-8, -3, (n // 128, k // 128), generator=g).double()).float()
    flat = sf_atom_layout(per_block, n)
    eb = scale_to_ue8m0(per_block)
    for row in (0, 77, 128, 255):
        for kb in range(k // 32):
            assert flat[sf_atom_offset(row, kb, k)] == eb[row // 128, kb // 4]
