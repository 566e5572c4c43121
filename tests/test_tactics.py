"""Tactics and tactic tables (CPU)."""
from __future__ import annotations

import dataclasses
import json
import warnings

import pytest

from indexer_q import table
from indexer_q.tactics import PREFETCH_QR_MIN_M, Tactic, can_run, heuristic, valid_tactics


def test_tactic_is_frozen_named_and_round_trips():
    t = Tactic(tile_m=64, cluster_m=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.tile_m = 128
    assert Tactic.from_dict(json.loads(json.dumps(t.as_dict()))) == t
    with pytest.raises(ValueError, match="unknown fields"):
        Tactic.from_dict({"tile_m": 64, "tile_n": 128})


@pytest.mark.parametrize("m", [1, 16, 32, 64, 65, 4096, 16384])
@pytest.mark.parametrize("n,k", [(8192, 1536), (1024, 1024), (2048, 1536), (8192, 1152), (1024, 384),
                                 (8192, 4096), (9216, 4096), (8192, 8192), (1024, 16384), (32768, 1536)])
def test_heuristic_is_always_a_valid_candidate(m, n, k):
    """Odd K-block counts (1152 = 9 x 128, 384 = 3 x 128) included: the pipelined promotion
    the heuristic takes up to 32 tokens needs an even count. Large K: the swapped-A/B
    kernel's resident quantized tile and qr staging buffer grow with K (the heuristic falls
    back to a larger split, then the separate quantizer); 256 heads: more than the SMs."""
    cands = valid_tactics("sm_90a", m, n, k)
    assert cands[0] == heuristic("sm_90a", m, n, k)
    assert can_run("sm_90a", cands[0], n, k), cands[0]
    assert len(set(cands)) == len(cands) > 1


def test_swap_ab_limits_match_the_kernel():
    """The host's copies of the sm_90a swapped-A/B kernel's tile limits (the heuristic and
    the candidates use them without importing the kernel)."""
    from indexer_q import tactics
    from indexer_q.kernels import swap_ab_kloop_sm90, swap_ab_quant_sm90

    assert tactics.SWAP_AB_PIPELINED_MAX_TILE == swap_ab_kloop_sm90.PIPELINED_MAX_TILE
    assert tactics.SWAP_AB_QR_STAGED_MAX_TILE == swap_ab_quant_sm90.QR_TMA_MAX_TILE
    # where the kernel stages qr and the heads fill half the SMs, the heuristic does not split K
    assert heuristic("sm_90a", 16, 8192, 1536).split_k == 1
    assert heuristic("sm_90a", 32, 8192, 1536).split_k == 2
    assert heuristic("sm_90a", 16, 1024, 1536).split_k == 4
    # unsplit staged 16-token tiles at many heads: a pair of heads shares the quantizer;
    # not 8-token tiles, nor a K split (TP8)
    assert heuristic("sm_90a", 16, 8192, 1536).cluster_n == 2
    assert heuristic("sm_90a", 8, 8192, 1536).cluster_n == 1
    assert heuristic("sm_90a", 16, 1024, 1536).cluster_n == 1


@pytest.mark.parametrize("sms", [78, 114, 132])  # H20, H100 PCIe, H100 / H200 SXM
@pytest.mark.parametrize("n", [8192, 1024])
def test_decode_heuristic_sizes_its_grid_to_the_sms(sms, n):
    """The decode heuristic's swapped-A/B CTAs (token tiles x heads x K split) fit the GPU's
    SMs once the split is used (a cluster of 4 on at most half of them), and stay the
    tuner's first candidate for that GPU."""
    k = 1536
    for m in (1, 2, 8, 13, 16, 32, 48, 64, 128, 256):
        tactic = heuristic("sm_90a", m, n, k, sms=sms)
        assert valid_tactics("sm_90a", m, n, k, sms)[0] == tactic
        if tactic.kind != "swap_ab":
            continue
        ctas = -(-m // tactic.tile_m) * (n // 128) * tactic.split_k
        if tactic.split_k > 1:
            assert ctas <= (sms // 2 if tactic.split_k == 4 else sms), (m, tactic)
    # fewer SMs, no more CTAs: TP8 M = 32 splits K in 2 across 64 CTAs on 132 SMs, not on 78
    assert heuristic("sm_90a", 32, 1024, k, sms=132).split_k == 2
    assert heuristic("sm_90a", 32, 1024, k, sms=78).split_k == 1


def test_op_heuristic_takes_the_device_sm_count(monkeypatch):
    """Without a table the op asks the heuristic for its device's SM count (none on the CPU)."""
    import torch

    from indexer_q import dispatch

    seen = []
    monkeypatch.setattr(table, "lookup", lambda *a, **kw: None)
    monkeypatch.setattr(dispatch, "_sm_count", lambda device: 78)
    monkeypatch.setattr("indexer_q.tactics.heuristic", lambda *a, sms=None: seen.append(sms) or Tactic())
    dispatch.choose_tactic("sm_90a", torch.device("cuda", 0), 32, 1024, 1536)
    dispatch.choose_tactic("sm_90a", torch.device("cpu"), 32, 1024, 1536)
    assert seen == [78, None]


def test_loaded_qr_candidates_are_unsplit_16_token_tiles():
    """stage_qr=False is offered where its ring gains stages: 16-token fused tiles without a
    K split, at V4's 64 heads and (since the 30th session) TP8's 8 alike, wherever such
    tiles are candidates; the heuristic never picks it."""
    for n in (8192, 1024):
        for m in (8, 16, 32, 64, 256):
            tactics = valid_tactics("sm_90a", m, n, 1536)
            loaded = [t for t in tactics if not t.stage_qr]
            assert all(t.tile_m == 16 and t.split_k == 1 and t.fused_act_quant for t in loaded)
            assert all(dataclasses.replace(t, stage_qr=True) in tactics for t in loaded)
            sixteens = [t for t in tactics if t.tile_m == 16 and t.split_k == 1 and t.fused_act_quant
                        and t.tensor_core_hadamard and t.pipelined_promotion and t.stage_qr]
            assert all(dataclasses.replace(t, stage_qr=False) in tactics for t in sixteens
                       if can_run("sm_90a", dataclasses.replace(t, stage_qr=False), n, 1536)), (n, m)
            assert bool(loaded) == bool(sixteens) == (16 <= m <= (64 if n == 8192 else 256)), (n, m)
            assert heuristic("sm_90a", m, n, 1536).stage_qr


def test_scales_before_pdl_wait_candidates_are_4_lane_fused_tiles_of_32_or_more():
    """The weight's scales before the PDL wait are offered as twins of the 4-lane fused
    quantizer's 32-64-token tiles (where its later qr loads waited on them), at every head
    count; never by the heuristic."""
    for n, k in ((8192, 1536), (8192, 1024), (1024, 1536)):
        for m in (8, 16, 24, 64, 256):
            tactics = valid_tactics("sm_90a", m, n, k)
            early = [t for t in tactics if t.scales_before_pdl_wait]
            assert all(t.tile_m >= 32 and t.fused_act_quant and t.act_quant_lanes == 4 and t.pipelined_promotion
                       for t in early)
            assert all(dataclasses.replace(t, scales_before_pdl_wait=False) in tactics for t in early)
            assert bool(early) == (m >= 24), (n, m)
            assert not heuristic("sm_90a", m, n, k).scales_before_pdl_wait


def test_uniform_descriptors_are_twins_of_fused_pipelined_tiles():
    """Warp-uniform WGMMA descriptors are offered as twins of the fused, pipelined swapped
    tiles up to 32 tokens, at every head count (the 30th session's lane-spread weight scales
    shrank their loss on V4's head pairs to 0.0-0.16 us); never by the heuristic."""
    for n, k in ((8192, 1536), (8192, 1024), (1024, 1536), (1024, 1024)):
        for m in (1, 16, 24, 64, 256):
            tactics = valid_tactics("sm_90a", m, n, k)
            tactics = [t for t in tactics if not t.prefetch_qr]  # prefetch_qr's twins: their own test
            uniform = [t for t in tactics if t.uniform_descriptors]
            assert all(t.kind == "swap_ab" and t.fused_act_quant and t.pipelined_promotion and t.tile_m <= 32
                       for t in uniform)
            assert all(dataclasses.replace(t, uniform_descriptors=False) in tactics for t in uniform)
            plain = [t for t in tactics if t.kind == "swap_ab" and t.fused_act_quant and t.pipelined_promotion
                     and t.tile_m <= 32]
            assert len(uniform) == len(plain) // 2 and bool(uniform) == (m <= 64 or n == 1024), (n, m)
            assert not heuristic("sm_90a", m, n, k).uniform_descriptors


def test_valid_tactics_come_from_can_implement():
    # 9 heads: no cluster of 2 along N; no kernel at all for a K that is not a multiple of 128
    assert all(t.cluster_n == 1 for t in valid_tactics("sm_90a", 4096, 9 * 128, 1536))
    sm100 = valid_tactics("sm_100a", 1, 8192, 1536)  # one native tile and the swapped 128 tokens, no clusters
    assert sm100[0] == Tactic(tile_m=128) and Tactic(kind="swap_ab", tile_m=128) in sm100
    assert all(t.tile_m == 128 and t.cluster_m == t.cluster_n == 1 for t in sm100)
    assert Tactic(kind="swap_ab", tile_m=128) not in valid_tactics("sm_90a", 1, 8192, 1536)
    assert valid_tactics("sm_80", 1, 8192, 1536) == []


def test_to_config_carries_the_call_numerics():
    cfg = Tactic(tile_m=64).to_config("sm_90a", hadamard=True, fp4_rounding="rne",
                                      out_format="fp8", positions_dtype="int32")
    assert (cfg.tile_m, cfg.hadamard, cfg.rne, cfg.out_format, cfg.positions_dtype) == (
        64, True, True, "fp8", "int32")
    from indexer_q.kernels.gemm_sm100 import Sm100FusedIndexerQ
    from indexer_q.kernels.gemm_sm90 import Sm90FusedIndexerQ

    probe = dict(hadamard=False, fp4_rounding="rne", out_format="mxfp4", positions_dtype="int64")
    assert Sm90FusedIndexerQ.can_implement(Tactic(tile_m=64, split_k=4).to_config("sm_90a", **probe), 1024, 1536)
    for bad in (Tactic(tile_m=128, split_k=2), Tactic(tile_m=64, split_k=3), Tactic(tile_m=64, split_k=2, cluster_m=2)):
        assert not Sm90FusedIndexerQ.can_implement(bad.to_config("sm_90a", **probe), 1024, 1536), bad
    assert not Sm90FusedIndexerQ.can_implement(Tactic(tile_m=64, split_k=4).to_config("sm_90a", **probe), 1024, 384)
    assert not Sm100FusedIndexerQ.can_implement(Tactic(split_k=2).to_config("sm_100a", **probe), 1024, 1536)


def _meta():
    return {"gpu": "NVIDIA H200", "sms": 132, "cutlass_dsl": "4.8.1",
            "kernel_fingerprint": table.kernel_fingerprint()}


@pytest.fixture
def fresh_table_state(monkeypatch, tmp_path):
    """A GPU faked by its metadata; no user or packaged table unless a test writes one."""
    monkeypatch.setattr(table, "metadata", lambda device=None: _meta())
    monkeypatch.setattr(table, "PACKAGE_TABLES", tmp_path / "package")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv("INDEXER_Q_TACTIC_TABLE", raising=False)
    table.set_tactic_table(None)
    yield
    table.set_tactic_table(None)


def test_table_written_sorted_and_atomically(tmp_path):
    path = tmp_path / "t.json"
    entries = [{"n": 8192, "k": 1536, "m_max": 16384, "tactic": Tactic()},
               {"n": 1024, "k": 1536, "m_max": 64, "tactic": Tactic(tile_m=64)},
               {"n": 8192, "k": 1536, "m_max": 64, "tactic": Tactic(tile_m=64)}]
    table.write_table(path, _meta(), entries)
    data = json.loads(path.read_text())
    keys = [(e["n"], e["k"], e["m_max"]) for e in data["entries"]]
    assert keys == sorted(keys)
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temp file left


def test_table_picks_by_m_bucket(tmp_path, fresh_table_state, monkeypatch):
    path = tmp_path / "t.json"
    table.write_table(path, _meta(), [
        {"n": 8192, "k": 1536, "m_max": 64, "tactic": Tactic(tile_m=64)},
        {"n": 8192, "k": 1536, "m_max": 1024, "tactic": Tactic(tile_m=128, mma_per_promotion=2)},
        {"n": 8192, "k": 1536, "m_max": 16384, "tactic": Tactic(tile_m=128)},
    ])
    monkeypatch.setenv("INDEXER_Q_TACTIC_TABLE", str(path))
    assert table.lookup(1, 8192, 1536).tile_m == 64
    assert table.lookup(64, 8192, 1536).tile_m == 64
    assert table.lookup(65, 8192, 1536).mma_per_promotion == 2
    assert table.lookup(99999, 8192, 1536) == Tactic(tile_m=128)  # past the end: the last
    with pytest.warns(UserWarning, match="no entry for N=1024"):
        assert table.lookup(8, 1024, 1536) is None


def test_stale_table_is_ignored_with_one_warning(tmp_path, fresh_table_state):
    path = tmp_path / "t.json"
    meta = _meta() | {"kernel_fingerprint": "0000"}
    table.write_table(path, meta, [{"n": 8192, "k": 1536, "m_max": 64, "tactic": Tactic(tile_m=64)}])
    table.set_tactic_table(path)
    with pytest.warns(UserWarning, match="kernel_fingerprint"):
        assert table.lookup(1, 8192, 1536) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert table.lookup(1, 8192, 1536) is None  # warned once only


def test_no_table_for_this_gpu_is_silent(fresh_table_state):
    """No table set, installed or shipped for this GPU: the heuristic, the documented
    default, without a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert table.lookup(1, 8192, 1536) is None
        assert table.lookup(2, 8192, 1536) is None
    assert table.table_source() == (None, "none (heuristic)")


def test_swap_ab_shared_quantizer_refuses_padded_token_tiles():
    """Rastered along N, a swizzle pads the token tiles: a cluster sharing the quantizer
    would wait for a tile past M that no peer quantizes."""
    t = Tactic(kind="swap_ab", tile_m=16, cluster_n=2, fused_act_quant=True, swizzle=2, raster_along_m=False)
    assert t.problems(8192) and not dataclasses.replace(t, cluster_n=1, fused_act_quant=False).problems(8192)
    assert not can_run("sm_90a", t, 8192, 1536)
    # nor may the fused quantizer alone: where its quantizers load qr themselves (32-64
    # tokens), the producer waits for their first loads, and a tile past M has none
    fused = dataclasses.replace(t, cluster_n=1, tile_m=32)
    assert fused.problems(8192) and not can_run("sm_90a", fused, 8192, 1536)


@pytest.mark.parametrize("fields,n,k,why", [
    (dict(cluster_n=3), 8192, 1536, "cluster_n=3"),
    (dict(cluster_n=2, split_k=2), 8192, 1536, "split_k=1"),
    (dict(cluster_n=2, fused_act_quant=False), 8192, 1536, "fused_act_quant"),
    (dict(cluster_n=4), 8192, 768, "does not divide the 6 K blocks"),
    (dict(cluster_n=4), 256, 1536, "not a multiple of cluster_n=4"),
    # token tiles sharing the weight: pairs only, and neither with a K split nor with heads
    # sharing the quantizer (one cluster axis each)
    (dict(cluster_m=4), 8192, 1536, "cluster_m=4"),
    (dict(cluster_m=2, split_k=2), 8192, 1536, "needs split_k=1 and cluster_n=1"),
    (dict(cluster_m=2, cluster_n=2), 8192, 1536, "needs split_k=1 and cluster_n=1"),
])
def test_swap_ab_shared_quantizer_limits_are_stated(fields, n, k, why):
    """The sm_90a swapped-A/B kernel says why it cannot share the quantizer."""
    from indexer_q.tactics import kernel_class

    t = Tactic(**{**dict(kind="swap_ab", tile_m=16, fused_act_quant=True), **fields})
    cfg = t.to_config("sm_90a", hadamard=True, fp4_rounding="rne", out_format="mxfp4", positions_dtype="int64")
    problems = kernel_class("sm_90a", "swap_ab").problems(cfg, n, k)
    assert any(why in p for p in problems), problems
    assert not can_run("sm_90a", t, n, k)


def test_separate_epilogue_tactic():
    """The two-kernel tactic: its GEMM's key drops the numerics (one GEMM for every format),
    the second kernel's holds them; native kind only; offered from SEPARATE_EPILOGUE_MIN_M."""
    from indexer_q.tactics import SEPARATE_EPILOGUE_MIN_M, Tactic, valid_tactics

    t = Tactic(tile_m=128, epilogue_warpgroups=2, separate_epilogue=True)
    num = dict(hadamard=True, fp4_rounding="rne", out_format="fp8", positions_dtype="int32")
    gemm = t.to_config("sm_90a", **num)
    assert (gemm.out_format, gemm.hadamard, gemm.fp4_rounding, gemm.positions_dtype) == (
        "gemm-bf16", False, "floor-ties", "int32")
    assert gemm == Tactic(tile_m=128, epilogue_warpgroups=2, separate_epilogue=True).to_config(
        "sm_90a", **(num | dict(hadamard=False, out_format="mxfp4")))
    epi = t.epilogue_config("sm_90a", **num)
    assert (epi.out_format, epi.hadamard, epi.fp4_rounding, epi.positions_dtype) == ("fp8", True, "rne", "int32")
    assert Tactic(kind="swap_ab", tile_m=16, separate_epilogue=True).problems(8192)
    assert Tactic(tensor_core_hadamard=True, separate_epilogue=True).problems(8192)
    assert not t.problems(8192)
    assert t in valid_tactics("sm_90a", SEPARATE_EPILOGUE_MIN_M, 8192, 1536)
    assert not any(c.separate_epilogue for c in valid_tactics("sm_90a", SEPARATE_EPILOGUE_MIN_M - 1, 8192, 1536))
    assert not any(c.separate_epilogue for c in valid_tactics("sm_100a", 4096, 8192, 1536))


def test_qr_prefetch_twins_from_m24():
    """GemmConfig.prefetch_qr is offered from PREFETCH_QR_MIN_M on, only as the twin of an
    offered fused, pipelined, tensor-core-Hadamard, uniform-descriptor swapped tactic; it is
    refused where the kernel cannot do it."""
    for n, k in ((8192, 1536), (8192, 1024), (1024, 1536)):
        for m in (1, 8, 16, 23, 24, 32, 64, 96):
            tactics = valid_tactics("sm_90a", m, n, k)
            twins = [t for t in tactics if t.prefetch_qr]
            if m < PREFETCH_QR_MIN_M:
                assert not twins, (m, n, k)
                continue
            assert twins, (m, n, k)
            for t in twins:
                assert t.fused_act_quant and t.pipelined_promotion and t.tensor_core_hadamard and t.uniform_descriptors
                assert dataclasses.replace(t, prefetch_qr=False) in tactics
            assert not heuristic("sm_90a", m, n, k).prefetch_qr
    fused = Tactic(kind="swap_ab", tile_m=32, cluster_n=2, fused_act_quant=True, pipelined_promotion=True,
                   epilogue_warpgroups=2, prefetch_qr=True)
    assert can_run("sm_90a", fused, 8192, 1536)
    assert not can_run("sm_90a", Tactic(kind="swap_ab", tile_m=16, prefetch_qr=True), 8192, 1536)  # not fused
    assert not can_run("sm_90a", Tactic(kind="native", tile_m=64, prefetch_qr=True), 8192, 1536)
    assert not can_run("sm_90a", dataclasses.replace(fused, pdl=False), 8192, 1536)
