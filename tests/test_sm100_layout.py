"""The sm_100a kernel's scale-factor layout helper agrees with CuTe's own layout (CPU)."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import pytest
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


ALL = {}


@cute.jit
def _all_offsets(m: cutlass.Constexpr, k: cutlass.Constexpr):
    layout = blockscaled_utils.tile_atom_to_shape_SF((m, k, 1), SF_VEC)
    ALL[(m, k, "cosize")] = cute.cosize(layout)
    for row in cutlass.range_constexpr(m):
        for kb in cutlass.range_constexpr(k // SF_VEC):
            ALL[(m, k, row, kb)] = cute.crd2idx((row, kb * SF_VEC, 0), layout)


@pytest.mark.filterwarnings("ignore:This static loop")
@pytest.mark.parametrize("m", [1, 129, 200])
@pytest.mark.parametrize("k", [128, 640, 1152])
def test_sf_atom_offset_matches_cute_layout_at_ragged_shapes(m, k):
    """Every (row, 32-K block) of M not a multiple of 128 (one row; one past an atom; the
    host test's 200) and K of 1, 5 and 9 atoms, against CuTe's layout the kernel's TMA
    reads; its size is the rows padded to 128 (what the buffers hold), and the quantizer's
    word for a 128-K block holds exactly that block's four bytes."""
    from indexer_q.kernels.act_quant_sm100 import sf_word_index, sf_words

    _all_offsets(m, k)
    assert int(ALL[(m, k, "cosize")]) == -(-m // 128) * 128 * (k // SF_VEC) == 4 * sf_words(m, k)
    for row in range(m):
        for kb in range(k // SF_VEC):
            assert int(ALL[(m, k, row, kb)]) == sf_atom_offset(row, kb, k), (row, kb)
            assert sf_word_index(row, kb // 4, k // 128) * 4 + kb % 4 == sf_atom_offset(row, kb, k), (row, kb)


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


COLUMNS = {}


@cute.jit
def _sf_columns(tile_k: cutlass.Constexpr):
    from indexer_q.kernels.gemm_base import GemmConfig
    from indexer_q.kernels.gemm_sm100 import ACC_STAGES, Sm100FusedIndexerQ, sf_tmem_tensors

    fp8, sf = cutlass.Float8E4M3FN, cutlass.Float8E8M0FNU
    kernel = Sm100FusedIndexerQ(GemmConfig(arch="sm_100a"))
    mma = kernel._tiled_mma(fp8, fp8, sf, kernel.mma_tiler_mn)
    tiler = (*kernel.mma_tiler_mn, tile_k)
    sfa_smem = blockscaled_utils.make_smem_layout_sfa(mma, tiler, SF_VEC, 2)
    sfb_smem = blockscaled_utils.make_smem_layout_sfb(mma, tiler, SF_VEC, 2)
    acc_layout = mma.make_fragment_C(cute.append(mma.partition_shape_C(tiler[:2]), ACC_STAGES)).layout
    acc = cute.make_tensor(cute.make_ptr(cutlass.Float32, 0, cute.AddressSpace.tmem), acc_layout)
    _, _, sfa_col, sfb_col = sf_tmem_tensors(mma, tiler, acc, sfa_smem, sfb_smem)
    COLUMNS[tile_k] = (cute.size(mma.shape_mnk, mode=[2]), sfa_col, sfb_col)


@pytest.mark.parametrize("tile_k", [128, 256, 512, 1024])
def test_scale_factor_tmem_columns_follow_the_k_tile(tile_k):
    """SFA starts after the two 128-column accumulator stages and SFB after SFA's columns,
    which are the MMA tiler's K over the MMA's K (4 for the kernel's 128-K tile): taken
    from the TMEM layouts, not from SCALE_BLOCK_K. The old fixed offset (16 columns) was
    wrong for every other K tile and overlapped SFA from K = 1024 on."""
    _sf_columns(tile_k)
    mma_k, sfa_col, sfb_col = COLUMNS[tile_k]
    assert (mma_k, sfa_col) == (32, 2 * 128)
    assert sfb_col - sfa_col == tile_k // mma_k
    assert sfb_col + tile_k // mma_k <= 512  # SFB's columns fit the allocation too
