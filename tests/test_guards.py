"""CPU: guards between a bad tactic / table / size and a kernel launch."""
from __future__ import annotations

import warnings

import pytest
import torch

import indexer_q
from indexer_q import dispatch, jit, table
from indexer_q import validate as V
from indexer_q.kernels.gemm_base import GemmConfig
from indexer_q.tactics import Tactic


@pytest.mark.parametrize("fields,name", [
    ({"tile_m": "128"}, "tactic.tile_m"),
    ({"swizzle": 0}, "tactic.swizzle"),
    ({"raster_along_m": "no"}, "tactic.raster_along_m"),
    ({"kind": "sideways"}, "tactic.kind"),
    ({"cluster_m": True}, "tactic.cluster_m"),
])
def test_tactic_fields_are_typed(fields, name):
    with pytest.raises(V.InvalidInputError, match=name):
        Tactic(**fields)
    with pytest.raises(V.InvalidInputError, match=name):
        Tactic.from_dict(fields)


def test_swizzle_that_pads_the_heads_is_refused_before_launch():
    bad = Tactic(swizzle=2)
    assert bad.problems(1152) and not bad.problems(1024)  # 9 heads vs 8
    with pytest.raises(V.InvalidInputError, match="swizzle"):
        dispatch.choose_tactic("sm_90a", None, 100, 1152, 1536, bad)
    assert dispatch.choose_tactic("sm_90a", None, 100, 1024, 1536, bad) == bad


def test_separate_epilogue_past_32_bit_offsets(monkeypatch):
    """The two-kernel tactic's bf16 y [M, N] is wider than any of the op's own tensors: where
    its offsets would pass 32 bits an explicit such tactic is refused before any launch, and
    a table's is run fused (the same tactic otherwise, the same bytes)."""
    sep = Tactic(tile_m=128, epilogue_warpgroups=2, separate_epilogue=True)
    most = V.MAX_INDEX // (8192 // 2)
    assert dispatch.choose_tactic("sm_90a", None, most, 8192, 1536, sep) == sep
    with pytest.raises(V.InvalidInputError, match="separate_epilogue"):
        dispatch.choose_tactic("sm_90a", None, most + 1, 8192, 1536, sep)
    monkeypatch.setattr(table, "lookup", lambda m, n, k, device: sep)
    assert dispatch.choose_tactic("sm_90a", None, most, 8192, 1536) == sep
    fused = dispatch.choose_tactic("sm_90a", None, most + 1, 8192, 1536)
    assert fused == Tactic(tile_m=128, epilogue_warpgroups=2)


def test_kernel_limits_are_checked_before_compiling():
    # 9 heads cannot be split over 2-CTA clusters along N: refused before any compile.
    cfg = GemmConfig(arch="sm_90a", cluster_n=2)
    with pytest.raises(V.InvalidInputError, match="cluster_n"):
        jit.compile_fused(cfg, 1152, 1536)
    with pytest.raises(V.InvalidInputError, match="tile_m"):
        jit.compile_fused(GemmConfig(arch="sm_90a", tile_m=96), 1024, 1536)


def test_profiling_probe_is_not_a_public_tactic():
    with pytest.raises(V.InvalidInputError, match="profiling probe"):
        indexer_q.fused_indexer_q(torch.zeros(1, 128), None, None, None, tactic=Tactic(epilogue=False))
    with pytest.raises(V.InvalidInputError, match="profiling probe"):
        indexer_q.fused_indexer_q(torch.zeros(1, 128), None, None, None, tactic={"epilogue": False})


def test_unreadable_tactic_table_falls_back_with_one_warning(tmp_path, monkeypatch):
    meta = {"gpu": "No Table GPU", "sms": 1, "cutlass_dsl": "0", "kernel_fingerprint": "0"}
    monkeypatch.setattr(table, "metadata", lambda device=None: meta)  # no GPU here
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    bad = tmp_path / "table.json"
    bad.write_text("{not json")
    try:
        for path in (bad, tmp_path / "missing.json"):
            table.set_tactic_table(path)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                assert table.lookup(1, 1024, 1536, "cuda:0") is None
                assert table.lookup(2, 1024, 1536, "cuda:0") is None
            assert len([w for w in seen if "cannot be used" in str(w.message)]) == 1
    finally:
        table.set_tactic_table(None)


def test_sizes_past_32_bit_offsets_are_refused():
    V.check_index_range(2**21 - 1, 8192, 1536, 4096, "mxfp4")
    with pytest.raises(V.InvalidInputError, match="tokens per call"):
        V.check_index_range(2**21, 8192, 1536, 4096, "mxfp4")
    with pytest.raises(V.InvalidInputError, match="tokens per call"):
        V.check_index_range(2**20, 8192, 1536, 4096, "fp8")
    with pytest.raises(V.InvalidInputError, match="cos_sin"):
        V.check_index_range(1, 8192, 1536, 2**25, "mxfp4")


def test_non_contiguous_weight_scale_is_refused():
    s = torch.ones(12, 8).t()  # [8, 12], not contiguous
    with pytest.raises(V.InvalidInputError, match="weight_scale"):
        V.check_weight_scale(s, 1024, 1536)


def test_fake_impl_refuses_an_unknown_format():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import indexer_q.op  # noqa: F401

    with FakeTensorMode():
        args = (torch.empty(5, 1536, dtype=torch.bfloat16, device="cuda"),
                torch.empty(1024, 1536, dtype=torch.uint8, device="cuda"),
                torch.empty(8, 12, device="cuda"), torch.empty(5, dtype=torch.int64, device="cuda"),
                torch.empty(10, 64, device="cuda"))
        with pytest.raises(V.InvalidInputError, match="out_format"):
            torch.ops.indexer_q.fused_indexer_q(*args, True, "rne", "fp16", "", "sm_90a")
