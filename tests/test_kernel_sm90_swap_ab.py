"""The sm_90a swapped-A/B kernel (decode) on the H200, on the SPEC's criteria.

Without a K split the kernel sums K in cuBLAS's order (one promotion per 128-K block),
so its bytes must equal the cuBLAS chain's (cuBLAS's block-scaled GEMM, then the
reference's steps 3-6) for every format, both roundings and the Hadamard on and off:
steps 3-6 exact on the same bf16 GEMM output. With a K split it must agree with the
float64 pipeline at least as well as that chain does. Without the Hadamard, MXFP4 holds
the SPEC's 99.9% against the float64 pipeline with every differing code one step away.
The fused activation quantizer must write the bytes the separate one does (bit-exact
step 1), edge values included. Outputs are poisoned twice (tests/test_kernel_sm90.py).
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from indexer_q import reference as ref
from indexer_q.tactics import Tactic, swap_ab_tile
from test_kernel_sm90 import (_allowed, _check_case, _inputs, _mismatches, _needs_sm90,  # noqa: F401 (fixture)
                              _out_of_range_inputs, _run_twice, big_cos_sin)

pytestmark = pytest.mark.gpu

MS = (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 65, 127, 128, 200, 256)
SHAPES = ((8192, 1536), (1024, 1024))  # (N, K): V4-Pro, and TP8 with V4-Flash's K
FORMATS = ([("mxfp4", had, rnd) for had in (False, True) for rnd in ("floor-ties", "rne")]
           + [(fmt, had, "floor-ties") for fmt in ("fp8", "fp8-unscaled") for had in (False, True)])


def exact_tactic(m, fused=True):
    """No K split: cuBLAS's summation order."""
    return Tactic(kind="swap_ab", tile_m=swap_ab_tile(m), fused_act_quant=fused)


def split_tactic(m, n, fused=False):
    return Tactic(kind="swap_ab", tile_m=swap_ab_tile(m), split_k=2 if n > 1024 else 4, fused_act_quant=fused)


@pytest.fixture(scope="module")
def precompiled():
    """Every kernel these tests launch, compiled at once in worker processes."""
    _needs_sm90()
    from indexer_q import jit

    jobs = []
    for m in MS:
        for n, k in SHAPES:
            for fmt, had, rnd in FORMATS:
                opts = dict(hadamard=had, fp4_rounding=rnd, out_format=fmt, positions_dtype="int64")
                for t in (exact_tactic(m), exact_tactic(m, fused=False), split_tactic(m, n)):
                    jobs.append((t.to_config("sm_90a", **opts), n, k))
    errors = jit.precompile(jobs)
    assert not errors, errors[:3]


def _seed():
    return int.from_bytes(os.urandom(4), "little")


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_swap_ab_equals_the_cublas_chain(m, n, k, big_cos_sin, precompiled):
    """Bytes and scales identical to cuBLAS's GEMM + the reference's steps 3-6, for the
    fused quantizer and the separate one (which also proves the fused step 1 exact)."""
    from indexer_q import prepare_weights
    from tuning.bench import cublas_gemm, cublas_reference_chain

    seed = _seed()
    x = _inputs(m, n, k, seed, big_cos_sin)
    weights = prepare_weights(x["weight"], x["weight_scale"])
    q_bf16 = cublas_gemm(x)
    for fmt, had, rnd in FORMATS:
        cq, cs = cublas_reference_chain(x, hadamard=had, out_format=fmt, fp4_rounding=rnd, q=q_bf16)
        for tactic in (exact_tactic(m), exact_tactic(m, fused=False)):
            q, s = _run_twice(x, weights, tactic=tactic, hadamard=had, fp4_rounding=rnd, out_format=fmt)
            tag = f"M={m} N={n} K={k} {fmt} had={had} {rnd} seed={seed} {tactic}"
            same = (q.view(torch.uint8) == cq.view(torch.uint8)).double().mean().item()
            assert torch.equal(q.view(torch.uint8), cq.view(torch.uint8)), f"{tag}: {same:.6f} of the bytes"
            assert s is None or torch.equal(s.view(torch.int32), cs.view(torch.int32)), f"{tag}: scales"


@pytest.mark.parametrize("m", (1, 9, 33, 128, 256))
@pytest.mark.parametrize("n,k", SHAPES)
def test_swap_ab_split_k_is_as_good_as_the_chain(m, n, k, big_cos_sin, precompiled):
    """A K split adds the ranks' fp32 partials in rank order (another summation order):
    near-agreement with the chain, and agreement with the float64 pipeline no worse."""
    from indexer_q import prepare_weights
    from tuning.bench import cublas_gemm, cublas_reference_chain

    seed = _seed()
    x = _inputs(m, n, k, seed, big_cos_sin)
    weights = prepare_weights(x["weight"], x["weight_scale"])
    q_bf16 = cublas_gemm(x)
    tactic = split_tactic(m, n)
    for fmt, had, rnd in FORMATS:
        opts = dict(hadamard=had, fp4_rounding=rnd, out_format=fmt)
        cq, _ = cublas_reference_chain(x, q=q_bf16, **opts)
        rq, _ = ref.fused_indexer_q(x["qr"], x["weight"], x["weight_scale"], x["positions"], x["cos_sin"], **opts)
        q, _ = _run_twice(x, weights, tactic=tactic, **opts)
        tag = f"M={m} N={n} K={k} {fmt} had={had} {rnd} seed={seed} {tactic}"
        assert _same_bytes(q, cq) >= 0.99, f"{tag}: {_same_bytes(q, cq)} of the chain's bytes"
        if m * n >= 1 << 16:
            assert _same_bytes(q, rq) >= _same_bytes(cq, rq) - 0.002, (tag, _same_bytes(q, rq), _same_bytes(cq, rq))


# The first token tile is quantized by the consumer and the epilogue warpgroups together:
# 1 or 2 helper warpgroups; K splits whose units the helpers divide and do not (T = 8 at
# split 4, K = 1536: 3 units a row over 16 half-warps); ragged M (only rows below M are
# quantized); a later token tile, quantized by the consumer alone over the previous tile's
# rows: M = 129 at T = 32, split 1, over 64 heads (5 token tiles, 320 tiles on 132 CTAs: CTA
# c takes tiles c, c + 132, c + 264, of token tiles c % 5, (c + 2) % 5, (c + 4) % 5; a grid
# of 132 with 3 or 4 token tiles would give a CTA the same token tile every time).
HELPER_OPTS = dict(hadamard=True, fp4_rounding="rne", out_format="mxfp4")
HELPER_CASES = [
    (m, n, k, Tactic(kind="swap_ab", tile_m=t, split_k=s, epilogue_warpgroups=e, fused_act_quant=True))
    for m, n, k, t, s, e in (
        (1, 1024, 1536, 8, 4, 1), (7, 1024, 1536, 8, 3, 2), (16, 8192, 1536, 16, 2, 1), (31, 8192, 1536, 32, 2, 2),
        (33, 8192, 1024, 64, 2, 2), (64, 1024, 1536, 64, 2, 1), (200, 1024, 1536, 64, 1, 2), (65, 8192, 1536, 32, 1, 2),
        (129, 8192, 1536, 32, 1, 2), (129, 8192, 1536, 32, 1, 1),
        # K of 9 blocks in 3, 10 unsplit and 5 in 5
        (20, 8192, 1152, 16, 3, 2), (40, 1024, 1280, 32, 1, 2), (70, 1024, 640, 64, 1, 2))
]


def _assert_same_bytes(m, n, k, tactic, reference, big_cos_sin):
    """`tactic` writes the bytes (q and scales) `reference` writes, on fresh random inputs
    (outputs poisoned, each run twice)."""
    from indexer_q import prepare_weights

    seed = _seed()
    x = _inputs(m, n, k, seed, big_cos_sin)
    weights = prepare_weights(x["weight"], x["weight_scale"])
    q, s = _run_twice(x, weights, tactic=tactic, **HELPER_OPTS)
    rq, rs = _run_twice(x, weights, tactic=reference, **HELPER_OPTS)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), f"M={m} N={n} K={k} seed={seed} {tactic}"
    assert torch.equal(s.view(torch.int32), rs.view(torch.int32)), f"scales, M={m} seed={seed} {tactic}"


# Heads sharing the first token tile's quantizer (cluster_n): each CTA of a cluster along
# the heads quantizes 1 / cluster_n of the K blocks and sends them to the others. Clusters of
# 2 and 4; one and two epilogue warpgroups; K = 1024 and 1536 (8 and 12 blocks); M below the
# tile (M = 1 and 13); a last tile with 1 live row (M = 33 at T = 16); later token tiles,
# quantized by the consumer alone over what the peers sent: M = 33 at T = 8 over 64 heads (5
# token tiles x 32 head pairs on 66 clusters: cluster c takes token tiles c % 5, (c + 1) % 5,
# (c + 2) % 5; M = 45's 6 token tiles divide 66, so each cluster keeps its first one there).
SHARED_CASES = [
    (m, n, k, Tactic(kind="swap_ab", tile_m=t, cluster_n=c, epilogue_warpgroups=e, fused_act_quant=True,
                     pipelined_promotion=p))
    for m, n, k, t, c, e, p in (
        (16, 8192, 1536, 16, 2, 2, True), (13, 8192, 1024, 16, 4, 1, False), (1, 1024, 1536, 8, 4, 2, True),
        (45, 8192, 1536, 8, 2, 2, True), (33, 1024, 1536, 16, 2, 2, True), (33, 8192, 1536, 8, 2, 2, True),
        # tiles whose quantizers load qr themselves (32 and 64 tokens)
        (32, 8192, 1536, 32, 2, 2, True), (40, 8192, 1024, 32, 2, 1, False), (64, 8192, 1536, 64, 4, 2, True),
        (100, 1024, 1536, 64, 2, 2, True))
]


@pytest.mark.parametrize("m,n,k,tactic", SHARED_CASES, ids=lambda c: str(c) if isinstance(c, int) else None)
def test_swap_ab_heads_sharing_the_quantizer_equal_one_head(m, n, k, tactic, big_cos_sin):
    """Whoever quantized a block, the bytes are those of the unshared tactic."""
    _needs_sm90()
    _assert_same_bytes(m, n, k, tactic, dataclasses.replace(tactic, cluster_n=1), big_cos_sin)


# Token tiles sharing a head's weight (cluster_m = 2): each CTA of a pair requests half of
# every weight block and multicasts it to both. Tiles of 8 and 16 (qr staged by TMA) and 32
# (quantizers loading qr); one and two epilogue warpgroups; the separate quantizer; K = 1024
# and 1536. An odd number of token tiles, where the pair's second tile lies wholly past M and
# only takes part in the weight's loads: M = 1 at T = 8 (the only tile), M = 40 at T = 16
# (fused and separate), M = 33 at T = 32 (a first tile whose quantizers load nothing, and a
# last tile of 1 live row). A CTA moving to another token tile (its tiles quantized by the
# consumer alone, a second staging of qr, a padded tile on a later work unit): 7 token
# tiles make 4 token-tile clusters, which 66 clusters do not divide, at T = 8, 16 and 32
# (with 2 or 3 token-tile clusters, which divide 66, a CTA keeps one token tile throughout).
WEIGHT_SHARED_CASES = [
    (m, n, k, Tactic(kind="swap_ab", tile_m=t, cluster_m=2, epilogue_warpgroups=e, fused_act_quant=f,
                     pipelined_promotion=p))
    for m, n, k, t, e, f, p in (
        (16, 8192, 1536, 8, 2, True, True), (24, 8192, 1024, 16, 2, True, True), (1, 1024, 1536, 8, 2, True, True),
        (40, 8192, 1536, 16, 2, True, True), (64, 8192, 1536, 32, 2, True, True), (33, 1024, 1536, 32, 2, True, True),
        (50, 8192, 1536, 8, 2, True, True), (100, 8192, 1536, 16, 2, True, True), (200, 8192, 1536, 32, 2, True, True),
        (100, 1024, 1024, 16, 1, True, False), (40, 8192, 1536, 16, 1, False, False),
        # the separate quantizer at 32 tokens; 64-token tiles, separate quantizer (plain K
        # loop) and fused (the halves' pipelined loop); M = 70: the second tile 6 rows; M = 200:
        # two pairs a head, the second pair's last tile past M
        (64, 8192, 1536, 32, 2, False, True), (128, 8192, 1536, 64, 2, False, False),
        (70, 8192, 1024, 64, 2, False, False), (200, 1024, 1536, 64, 2, False, False),
        (100, 8192, 1536, 64, 2, True, True))
]


@pytest.mark.parametrize("m,n,k,tactic", WEIGHT_SHARED_CASES, ids=lambda c: str(c) if isinstance(c, int) else None)
def test_swap_ab_token_tiles_sharing_the_weight_equal_one_tile(m, n, k, tactic, big_cos_sin):
    """The same blocks in the same order, whoever requested them: the bytes of the
    unclustered tactic."""
    _needs_sm90()
    _assert_same_bytes(m, n, k, tactic, dataclasses.replace(tactic, cluster_m=1), big_cos_sin)


@pytest.fixture(scope="module")
def helpers_precompiled():
    _needs_sm90()
    from indexer_q import jit

    jobs = [(t.to_config("sm_90a", positions_dtype="int64", **HELPER_OPTS), n, k)
            for _, n, k, tactic in HELPER_CASES for t in (tactic, dataclasses.replace(tactic, fused_act_quant=False))]
    errors = jit.precompile(jobs)
    assert not errors, errors[:3]


@pytest.mark.parametrize("m,n,k,tactic", HELPER_CASES, ids=lambda c: str(c) if isinstance(c, int) else None)
def test_swap_ab_fused_quantizer_with_helpers_equals_the_separate_one(m, n, k, tactic, big_cos_sin,
                                                                      helpers_precompiled):
    """Same summation order, so the bytes equal those of the same tactic with the separate
    quantizer, whoever quantized the tile."""
    _assert_same_bytes(m, n, k, tactic, dataclasses.replace(tactic, fused_act_quant=False), big_cos_sin)


# The fused quantizer at 4 lanes a (token, 128-K block) unit against 16: the same bytes.
# qr staged by TMA (8-16 tokens) and loaded by the quantizers (32-64); the first tile with one
# and two helper warpgroups, later tiles by the consumer alone (M = 129 at T = 32); K splits
# (3 a K of 12 and of 9 blocks, 4); heads sharing the quantizer (pairs, fours); token tiles
# sharing the weight (a pair's second tile past M at M = 40); ragged M.
LANES_CASES = [
    (m, n, k, Tactic(kind="swap_ab", tile_m=t, split_k=s, cluster_n=c, cluster_m=w, epilogue_warpgroups=e,
                     fused_act_quant=True, pipelined_promotion=p, act_quant_lanes=4))
    for m, n, k, t, s, c, w, e, p in (
        (1, 1024, 1536, 8, 4, 1, 1, 1, False), (7, 1024, 1536, 8, 3, 1, 1, 2, True),
        (16, 8192, 1536, 16, 1, 2, 1, 2, True), (13, 8192, 1024, 16, 1, 4, 1, 1, False),
        (31, 8192, 1536, 32, 2, 1, 1, 2, True), (33, 8192, 1536, 32, 1, 2, 1, 2, True),
        (64, 8192, 1536, 64, 1, 4, 1, 2, True), (129, 8192, 1536, 32, 1, 1, 1, 2, False),
        (20, 8192, 1152, 16, 3, 1, 1, 2, False), (40, 8192, 1536, 16, 1, 1, 2, 2, True),
        (100, 1024, 1536, 64, 1, 2, 1, 2, True), (200, 1024, 1536, 64, 1, 1, 1, 2, False))
]


@pytest.mark.parametrize("m,n,k,tactic", LANES_CASES, ids=lambda c: str(c) if isinstance(c, int) else None)
def test_swap_ab_quantizer_at_4_lanes_equals_16(m, n, k, tactic, big_cos_sin):
    """Whichever lanes share a unit, the amax, the scale and every e4m3 byte are the same."""
    _needs_sm90()
    _assert_same_bytes(m, n, k, tactic, dataclasses.replace(tactic, act_quant_lanes=16), big_cos_sin)


# 8-16-token tiles whose quantizers load qr themselves (stage_qr=False) against qr staged by
# TMA: the same bytes. Token tiles sharing the weight (a pair's second tile past M at M = 40),
# heads sharing the quantizer (pairs, fours; the tables' tactic at its shape, M = 32),
# gathering and scattering K splits, one epilogue warpgroup, CTAs with later tiles quantized
# by the consumer alone (M = 200: 13 token tiles x 64 heads on 132 SMs; at 16 lanes 24 units
# a batch). The last four were added after the session's last device call.
LOADED_QR_CASES = [
    (m, n, k, Tactic(kind="swap_ab", tile_m=t, split_k=s, cluster_m=w, cluster_n=c, epilogue_warpgroups=e,
                     fused_act_quant=True, pipelined_promotion=True, act_quant_lanes=lanes,
                     tensor_core_hadamard=tc, stage_qr=False))
    for m, n, k, t, s, w, c, e, lanes, tc in (
        (24, 8192, 1536, 16, 1, 2, 1, 2, 4, False), (40, 8192, 1536, 16, 1, 2, 1, 2, 4, False),
        (7, 1024, 1536, 8, 2, 1, 1, 2, 16, False), (200, 8192, 1536, 16, 1, 1, 1, 2, 4, False),
        (16, 8192, 1024, 16, 1, 1, 2, 2, 4, False), (13, 1024, 1536, 16, 1, 1, 1, 1, 16, False),
        (32, 8192, 1536, 16, 1, 1, 2, 2, 4, True), (200, 8192, 1536, 16, 1, 1, 1, 2, 16, False),
        (64, 8192, 1536, 16, 2, 1, 1, 2, 4, False), (16, 8192, 1536, 16, 1, 1, 4, 2, 4, False))
]


@pytest.mark.parametrize("m,n,k,tactic", LOADED_QR_CASES, ids=lambda c: str(c) if isinstance(c, int) else None)
def test_swap_ab_quantizer_loading_qr_equals_staged(m, n, k, tactic, big_cos_sin):
    """However qr comes into the SM, the bytes are the same."""
    _needs_sm90()
    _assert_same_bytes(m, n, k, tactic, dataclasses.replace(tactic, stage_qr=True), big_cos_sin)


# The first tile's weight scales loaded before the consumer's PDL wait against after it: the
# same bytes. The tables' 32-token head pair (M = 24: a tile part past M), a CTA with later
# tiles (M = 200 on 7 token tiles x 64 heads), 64 tokens in a reduce-scatter split, TP8's
# heads unshared, token tiles sharing the weight.
EARLY_SCALES_CASES = [
    (m, n, k, Tactic(kind="swap_ab", tile_m=t, split_k=s, cluster_m=w, cluster_n=c, epilogue_warpgroups=2,
                     fused_act_quant=True, pipelined_promotion=True, act_quant_lanes=4,
                     tensor_core_hadamard=True, scales_before_pdl_wait=True))
    for m, n, k, t, s, w, c in (
        (24, 8192, 1024, 32, 1, 1, 2), (200, 8192, 1024, 32, 1, 1, 2), (64, 8192, 1536, 64, 2, 1, 1),
        (33, 1024, 1536, 32, 1, 1, 1), (64, 8192, 1536, 32, 1, 2, 1))
]


@pytest.mark.parametrize("m,n,k,tactic", EARLY_SCALES_CASES, ids=lambda c: str(c) if isinstance(c, int) else None)
def test_swap_ab_scales_before_pdl_wait_equal_after(m, n, k, tactic, big_cos_sin):
    """Where the PDL wait sits changes no byte."""
    _needs_sm90()
    _assert_same_bytes(m, n, k, tactic, dataclasses.replace(tactic, scales_before_pdl_wait=False), big_cos_sin)


# Each block's WGMMA descriptors made from warp-uniform stage addresses against the ones made
# before the tile loop (the default): the same operands, so the same bytes. The three K
# loops: pipelined (TP8's 16-token tile at M = 128, 8 tiles a head; the 32-token head pair at
# M = 24, a tile part past M, and M = 200, later tiles; 16-token weight pairs; 8 tokens split
# in 2, a reduce-scatter; qr loaded by the quantizers), the 64-token halves (split in 2) and
# the plain one; and the separate quantizer (B from the ring, its stage the weight's).
UNIFORM_CASES = [
    (m, n, k, Tactic(kind="swap_ab", tile_m=t, split_k=s, cluster_m=w, cluster_n=c, epilogue_warpgroups=2,
                     fused_act_quant=f, pipelined_promotion=p, act_quant_lanes=4 if f else 16,
                     tensor_core_hadamard=True, stage_qr=q, uniform_descriptors=True))
    for m, n, k, t, s, w, c, q, f, p in (
        (128, 1024, 1536, 16, 1, 1, 1, True, True, True), (24, 8192, 1024, 32, 1, 1, 2, True, True, True),
        (200, 8192, 1024, 32, 1, 1, 2, True, True, True), (32, 8192, 1536, 16, 1, 2, 1, True, True, True),
        (13, 1024, 1536, 8, 2, 1, 1, True, True, True), (32, 8192, 1536, 16, 1, 1, 2, False, True, True),
        (130, 8192, 1024, 64, 2, 1, 1, True, True, True), (17, 1024, 1536, 16, 1, 1, 1, True, True, False),
        (65, 1024, 1024, 32, 1, 1, 1, True, False, True),
        (128, 1024, 1536, 16, 1, 1, 2, False, True, True),  # TP8's qr-loading head pairs (30th session)
        (9, 1024, 4352, 16, 1, 1, 1, False, True, True))  # 34 K blocks: two lanes' worth of weight scales
] + [  # the TP8 tables' 8-token tiles with four heads sharing the quantizer (16 lanes)
    (13, 1024, 1024, Tactic(kind="swap_ab", tile_m=8, cluster_n=4, epilogue_warpgroups=2, fused_act_quant=True,
                            pipelined_promotion=True, tensor_core_hadamard=True, uniform_descriptors=True))
]


@pytest.mark.parametrize("m,n,k,tactic", UNIFORM_CASES, ids=lambda c: str(c) if isinstance(c, int) else None)
def test_swap_ab_uniform_descriptors_equal_hoisted(m, n, k, tactic, big_cos_sin):
    """Where the WGMMA descriptors are formed, and where the weight's scales live (a register
    a block, or spread over the lanes and shuffled back), changes no byte."""
    _needs_sm90()
    _assert_same_bytes(m, n, k, tactic, dataclasses.replace(tactic, uniform_descriptors=False), big_cos_sin)


# The first tile's qr rows prefetched into L2 before the PDL wait: a hint, so the same bytes.
# The V4 tables' head pairs (M = 24: a tile part past M; M = 200: later tiles), a 16-token tile
# staging qr by TMA, TP8's 8-token tiles split in 4 (each rank its K range), token tiles sharing
# the weight (the last wholly past M at M = 40), 64 tokens over two token tiles of TP8's heads.
PREFETCH_CASES = [
    (m, n, k, Tactic(kind="swap_ab", tile_m=t, split_k=s, cluster_m=w, cluster_n=c, epilogue_warpgroups=2,
                     fused_act_quant=True, pipelined_promotion=True, act_quant_lanes=4 if t >= 16 else 16,
                     tensor_core_hadamard=True, prefetch_qr=True))
    for m, n, k, t, s, w, c in (
        (24, 8192, 1024, 32, 1, 1, 2), (200, 8192, 1536, 32, 1, 1, 2), (13, 8192, 1536, 16, 1, 1, 2),
        (7, 1024, 1536, 8, 4, 1, 1), (40, 8192, 1024, 16, 1, 2, 1), (64, 1024, 1536, 32, 1, 1, 1))
]


@pytest.mark.parametrize("m,n,k,tactic", PREFETCH_CASES, ids=lambda c: str(c) if isinstance(c, int) else None)
def test_swap_ab_qr_prefetch_changes_no_byte(m, n, k, tactic, big_cos_sin):
    """An L2 prefetch before the PDL wait is a hint: the same bytes as without it."""
    _needs_sm90()
    _assert_same_bytes(m, n, k, tactic, dataclasses.replace(tactic, prefetch_qr=False), big_cos_sin)


# Reduce-scatter (a split dividing the tile's groups of 8 tokens) against the gathering
# reduction at the same split: the same summation order over the ranks, each token's column
# its own, so the same bytes, the tile sizes differing. (M, N, K, gathering tile, scattering
# tile, split): a tile of T tokens scatters where the split divides T / 8.
# The last two span several token tiles (row origins past the first tile, every rank's rows
# visible) and give clusters a second tile (slot reuse, the barriers' second phases): 7 token
# tiles x 64 heads on 66 clusters, 7 x 8 heads on 33.
SCATTER_CASES = [(5, 8192, 1536, 8, 16, 2), (8, 1024, 1536, 8, 32, 4), (16, 1024, 1536, 16, 64, 4),
                 (13, 8192, 1536, 16, 32, 4), (1, 1024, 1024, 8, 64, 8), (29, 1024, 1024, 32, 64, 8),
                 (100, 8192, 1536, 8, 16, 2), (200, 1024, 1536, 16, 32, 4)]


@pytest.fixture(scope="module")
def scatter_precompiled():
    _needs_sm90()
    from indexer_q import jit

    jobs = [(Tactic(kind="swap_ab", tile_m=t, split_k=s, epilogue_warpgroups=2, fused_act_quant=True)
             .to_config("sm_90a", positions_dtype="int64", **HELPER_OPTS), n, k)
            for _, n, k, tg, ts, s in SCATTER_CASES for t in (tg, ts)]
    errors = jit.precompile(jobs)
    assert not errors, errors[:3]


@pytest.mark.parametrize("m,n,k,gather_tile,scatter_tile,split", SCATTER_CASES)
def test_swap_ab_reduce_scatter_equals_the_gather(m, n, k, gather_tile, scatter_tile, split, big_cos_sin,
                                                   scatter_precompiled):
    from indexer_q import prepare_weights
    from indexer_q.kernels.gemm_sm90_swap_ab import Sm90SwapABFusedIndexerQ as S90

    def tactic(t):
        return Tactic(kind="swap_ab", tile_m=t, split_k=split, epilogue_warpgroups=2, fused_act_quant=True)

    def cfg(t):
        return tactic(t).to_config("sm_90a", positions_dtype="int64", **HELPER_OPTS)

    assert not S90.reduce_scatters(cfg(gather_tile)) and S90.reduce_scatters(cfg(scatter_tile))
    seed = _seed()
    x = _inputs(m, n, k, seed, big_cos_sin)
    weights = prepare_weights(x["weight"], x["weight_scale"])
    q, s = _run_twice(x, weights, tactic=tactic(scatter_tile), **HELPER_OPTS)
    rq, rs = _run_twice(x, weights, tactic=tactic(gather_tile), **HELPER_OPTS)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), f"M={m} N={n} K={k} seed={seed} split={split}"
    assert torch.equal(s.view(torch.int32), rs.view(torch.int32)), f"scales, M={m} seed={seed} split={split}"


# Pipelined promotion (block kb promoted under block kb+1's WGMMAs) adds the same products
# in the same order as the plain loop: the same bytes. Fused and separate quantizers, the
# gathering and scattering K splits, a K split of 3 (odd block count a rank), several token
# tiles a CTA (M = 129 at T = 32, split 1); 64-token tiles (the m64 halves as separate
# commit groups), with several token tiles a CTA and a split of 3.
PIPELINED_CASES = [(16, 8192, 1536, 16, 2, 2, True), (9, 8192, 1024, 16, 1, 1, True), (32, 1024, 1536, 32, 4, 1, False),
                   (3, 1024, 1536, 8, 3, 2, True), (129, 8192, 1536, 32, 1, 2, True), (27, 1024, 1536, 32, 2, 2, False),
                   (64, 8192, 1536, 64, 2, 2, True), (200, 1024, 1536, 64, 4, 2, True),
                   (61, 1024, 1536, 64, 3, 1, True)]


def _pipelined_tactic(t, s, e, fused, pipelined):
    return Tactic(kind="swap_ab", tile_m=t, split_k=s, epilogue_warpgroups=e, fused_act_quant=fused,
                  pipelined_promotion=pipelined)


@pytest.fixture(scope="module")
def pipelined_precompiled():
    _needs_sm90()
    from indexer_q import jit

    jobs = [(_pipelined_tactic(t, s, e, f, p).to_config("sm_90a", positions_dtype="int64", **HELPER_OPTS), n, k)
            for _, n, k, t, s, e, f in PIPELINED_CASES for p in (False, True)]
    errors = jit.precompile(jobs)
    assert not errors, errors[:3]


@pytest.mark.parametrize("m,n,k,tile,split,ewg,fused", PIPELINED_CASES)
def test_swap_ab_pipelined_promotion_equals_the_plain_loop(m, n, k, tile, split, ewg, fused, big_cos_sin,
                                                           pipelined_precompiled):
    from indexer_q import prepare_weights

    seed = _seed()
    x = _inputs(m, n, k, seed, big_cos_sin)
    weights = prepare_weights(x["weight"], x["weight_scale"])
    q, s = _run_twice(x, weights, tactic=_pipelined_tactic(tile, split, ewg, fused, True), **HELPER_OPTS)
    rq, rs = _run_twice(x, weights, tactic=_pipelined_tactic(tile, split, ewg, fused, False), **HELPER_OPTS)
    tag = f"M={m} N={n} K={k} seed={seed} tile={tile} split={split} fused={fused}"
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), tag
    assert torch.equal(s.view(torch.int32), rs.view(torch.int32)), f"scales, {tag}"


def _same_bytes(a, b):
    return (a.view(torch.uint8) == b.view(torch.uint8)).double().mean().item()


@pytest.mark.parametrize("m", (128, 256))
@pytest.mark.parametrize("rounding", ("floor-ties", "rne"))
def test_swap_ab_mxfp4_without_hadamard_meets_the_spec(m, rounding, big_cos_sin, precompiled):
    """SPEC: without the Hadamard, >= 99.9% identical codes and scale bytes against the
    float64 pipeline, every differing code one step away under the same scale."""
    for tactic in (exact_tactic(m), split_tactic(m, 8192)):
        _check_case(m, 8192, 1536, False, rounding, "mxfp4", _seed(), big_cos_sin, tactic=tactic)


def test_swap_ab_fused_quantizer_edge_values(big_cos_sin, precompiled):
    """The fused quantizer on the act_quant test's edge rows (amax floor, exact 448,
    ties, tiny values, -0, NaN, Inf) writes what the separate quantizer does: same
    output bytes, NaN / Inf tokens included (their blocks get scale 0xFF)."""
    from indexer_q import prepare_weights

    m, n, k = 33, 1024, 1024
    x = _inputs(m, n, k, _seed(), big_cos_sin)
    qr = x["qr"].clone()
    qr[0, :128] = 0
    qr[1, :128] = 448.0
    qr[2, :128] = torch.tensor([448 * 1.0625, -0.0, 1e-30, -1e-30] * 32, dtype=torch.bfloat16)
    qr[3, 130] = float("nan")
    qr[4, 500] = float("inf")
    qr[5] = -0.0
    x["qr"] = qr
    weights = prepare_weights(x["weight"], x["weight_scale"])
    for fmt, had, rnd in FORMATS:
        opts = dict(hadamard=had, fp4_rounding=rnd, out_format=fmt)
        q2, s2 = _run_twice(x, weights, tactic=exact_tactic(m, fused=False), **opts)
        # at 16 lanes a unit (8 values a lane) and at 4 (32 a lane, the amax on bf16 pairs),
        # qr loaded by the quantizers (64-token tile) and staged by TMA (16 tokens)
        staged = Tactic(kind="swap_ab", tile_m=16, fused_act_quant=True, act_quant_lanes=4)
        for tactic in (exact_tactic(m), dataclasses.replace(exact_tactic(m), act_quant_lanes=4), staged):
            q1, s1 = _run_twice(x, weights, tactic=tactic, **opts)
            assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)), (fmt, had, rnd, tactic)
            assert s1 is None or torch.equal(s1.view(torch.int32), s2.view(torch.int32)), (fmt, had, rnd, tactic)


def test_swap_ab_positions_int32_and_out_of_range(big_cos_sin, precompiled):
    """int32 positions; positions outside [0, P) leave the token unrotated: equal to the
    cuBLAS chain, whose reference steps do the same."""
    from indexer_q import prepare_weights
    from tuning.bench import cublas_reference_chain

    m, n, k = 65, 8192, 1536
    x = _out_of_range_inputs(m, n, k, big_cos_sin)
    weights = prepare_weights(x["weight"], x["weight_scale"])
    opts = dict(hadamard=True, fp4_rounding="rne", out_format="mxfp4")
    cq, cs = cublas_reference_chain(x, **opts)
    for tactic in (exact_tactic(m), dataclasses.replace(exact_tactic(m), epilogue_warpgroups=2)):
        q, s = _run_twice(x, weights, tactic=tactic, **opts)
        assert torch.equal(q, cq) and torch.equal(s, cs), tactic


# The Hadamard's H16 factor on the tensor cores, one row a thread at 8 lanes
# (tensor_core_hadamard on swap_ab, hadamard_mma_sm90.tc_hadamard_row): the same products,
# summed 16 at a time in the tensor core's order, so held to the native tensor-core
# Hadamard's allowance against the butterfly, every format with the Hadamard. Tiles of 8-64
# tokens; unsplit, split (gathering and reduce-scatter), heads sharing the quantizer, token
# tiles sharing the weight; M below a tile and across several.
def _fused_tile(tile_m, epilogue_warpgroups=2, pipelined_promotion=True, **knobs):
    return Tactic(kind="swap_ab", tile_m=tile_m, epilogue_warpgroups=epilogue_warpgroups, fused_act_quant=True,
                  pipelined_promotion=pipelined_promotion, **knobs)


TC8_CASES = [
    (1, 8192, 1536, _fused_tile(8, pipelined_promotion=False)),
    (7, 1024, 1536, _fused_tile(8, split_k=4)),
    (13, 8192, 1536, _fused_tile(16, cluster_n=2)),
    (33, 8192, 1024, _fused_tile(32, split_k=2)),
    (64, 8192, 1536, _fused_tile(32, cluster_n=2)),
    (40, 8192, 1024, _fused_tile(16, cluster_m=2)),
    (100, 1024, 1536, _fused_tile(64, split_k=2)),
    (200, 1024, 1024, _fused_tile(16, epilogue_warpgroups=1, pipelined_promotion=False)),
]
TC8_FORMATS = [("mxfp4", "floor-ties"), ("mxfp4", "rne"), ("fp8", "floor-ties"), ("fp8-unscaled", "floor-ties"),
               ("bf16", "floor-ties")]


@pytest.fixture(scope="module")
def tc8_precompiled():
    _needs_sm90()
    from indexer_q import jit

    jobs = [(t.to_config("sm_90a", hadamard=True, fp4_rounding=rnd, out_format=fmt, positions_dtype="int64"), n, k)
            for _, n, k, tactic in TC8_CASES for fmt, rnd in TC8_FORMATS
            for t in (tactic, dataclasses.replace(tactic, tensor_core_hadamard=True))]
    errors = jit.precompile(jobs)
    assert not errors, errors[:3]


@pytest.mark.parametrize("m,n,k,tactic", TC8_CASES, ids=lambda c: str(c) if isinstance(c, int) else None)
def test_swap_ab_tensor_core_hadamard_meets_the_butterfly(m, n, k, tactic, big_cos_sin, tc8_precompiled):
    from indexer_q import prepare_weights

    seed = _seed()
    x = _inputs(m, n, k, seed, big_cos_sin)
    weights = prepare_weights(x["weight"], x["weight_scale"])
    tc = dataclasses.replace(tactic, tensor_core_hadamard=True)
    for fmt, rnd in TC8_FORMATS:
        opts = dict(hadamard=True, fp4_rounding=rnd, out_format=fmt)
        q, s = _run_twice(x, weights, tactic=tc, **opts)
        bq, bs = _run_twice(x, weights, tactic=tactic, **opts)
        tag = f"M={m} N={n} K={k} {fmt} {rnd} seed={seed} {tc}"
        qb, bqb = q.view(torch.uint8), bq.view(torch.uint8)
        print(f"{tag}: {_mismatches(qb, bqb)} of {qb.numel()} bytes differ")
        assert _mismatches(qb, bqb) <= _allowed(qb), tag
        if s is not None:
            assert _mismatches(s.view(torch.int32), bs.view(torch.int32)) <= _allowed(s), f"{tag}: scales"
