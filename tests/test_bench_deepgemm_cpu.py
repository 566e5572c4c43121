"""The DeepGEMM benchmark peer's host-side parts (CPU, no deep_gemm needed)."""
from __future__ import annotations

import sys

import pytest
import torch

from tuning import bench
from tuning.peers import deepgemm


def test_deep_gemm_is_imported_only_lazily_by_the_peer():
    """A benchmark peer only: no module-level import of deep_gemm in the peer, none at all
    in the package (src/, kernels/)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def imports(tree):
        for node in tree:
            if isinstance(node, ast.Import):
                yield from (a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                yield (node.module or "").split(".")[0]

    peer = ast.parse((root / "tuning/peers/deepgemm.py").read_text())
    assert "deep_gemm" not in set(imports(peer.body))
    for path in [*(root / "src").rglob("*.py"), *(root / "kernels").rglob("*.py")]:
        assert "deep_gemm" not in set(imports(ast.walk(ast.parse(path.read_text())))), path


@pytest.mark.parametrize("m", [1, 3, 4, 5, 130])
def test_mn_major_scale_layout(m):
    """DeepGEMM's SM90 activation scale: [M, K/128] float32, MN-major, M padded to 4."""
    kb = 12  # K = 1536
    sa = torch.rand(m, kb, dtype=torch.float32) + 0.5
    out = deepgemm.mn_major_scale(sa)
    pad = -(-m // 4) * 4
    assert deepgemm.align_mn(m) == pad
    assert out.shape == (m, kb) and out.dtype == torch.float32
    assert out.stride() == (1, pad)
    assert torch.equal(out, sa)
    # its storage is exactly a [K/128, align4(M)] buffer, starting at the view's first element
    assert out.storage_offset() == 0
    assert out.untyped_storage().nbytes() == kb * pad * 4
    # a non-contiguous input (as the cuBLAS peer's layout) gives the same
    assert torch.equal(deepgemm.mn_major_scale(sa.t().contiguous().t()), sa)


def test_load_reports_why_without_deep_gemm(monkeypatch):
    monkeypatch.setattr(deepgemm, "_loaded", {})
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import deep_gemm -> ImportError
    with pytest.raises(ImportError, match="deep_gemm"):
        deepgemm.load()
    assert deepgemm.version().startswith("none (")


def test_bench_markdown_has_the_deepgemm_columns(tmp_path):
    env = {"date": "2026-12-01", "gpu": "X", "sms": 1, "torch": "t", "cuda": "c", "cutlass_dsl": "d",
           "triton": "r", "deepgemm": "0.0.0+dev", "indexer_q": "0", "copy_bandwidth_TBps": 4.2}
    rows = []
    for m in (3, 128):
        r = {"shape": "v4-pro", "M": m, "N": 8192, "K": 1536, "hadamard": True, "out_format": "mxfp4",
             "fused_us": 10.0, "unfused_us": 20.0, "cublas_gemm_us": 8.0, "deepgemm_gemm_us": 6.25 * m,
             "deepgemm_chain_us": 12.5 * m, "floor_us": 5.0}
        for peer in ("unfused", "cublas_gemm", "deepgemm_gemm", "deepgemm_chain"):
            r[f"fused_over_{peer}"] = r["fused_us"] / r[f"{peer}_us"]
        r["fused_over_floor"] = 2.0
        rows.append(r)
    rows[0]["peer_m"] = 4
    bench.write_outputs(env, rows, tmp_path / "b", plots=False)
    md = (tmp_path / "b.md").read_text().splitlines()
    header = next(line for line in md if line.startswith("| shape"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    for name in ("fused", "unfused", "cuBLAS GEMM", "torch", "floor", "/unfused", "/cuBLAS", "/floor",
                 "DeepGEMM GEMM", "DeepGEMM chain", "/DeepGEMM GEMM", "/DeepGEMM chain"):
        assert name in cols, name
    assert "DeepGEMM 0.0.0+dev" in md[0]
    body = [line for line in md if line.startswith("| v4-pro")]
    assert len(body) == 2
    for line, m in zip(body, (3, 128)):
        cells = dict(zip(cols, (c.strip() for c in line.strip("|").split("|"))))
        assert cells["M"] == ("3*" if m == 3 else "128")
        assert cells["DeepGEMM GEMM"] == f"{6.25 * m:.1f}"
        assert cells["DeepGEMM chain"] == f"{12.5 * m:.1f}"
        assert cells["/DeepGEMM GEMM"] == f"{10.0 / (6.25 * m):.2f}"
        assert cells["/DeepGEMM chain"] == f"{10.0 / (12.5 * m):.2f}"
        assert cells["cuBLAS GEMM"] == "8.0" and cells["/cuBLAS"] == "1.25" and cells["unfused"] == "20.0"
    csv_head = (tmp_path / "b.csv").read_text().splitlines()[0].split(",")
    assert {"deepgemm_gemm_us", "deepgemm_chain_us", "fused_over_deepgemm_gemm",
            "fused_over_deepgemm_chain"} <= set(csv_head)


def test_bench_markdown_without_deepgemm(tmp_path):
    """A row where deep_gemm did not import: dashes, and the reason in the JSON/CSV."""
    env = {"date": "2026-12-01", "gpu": "X", "sms": 1, "torch": "t", "cuda": "c", "cutlass_dsl": "d",
           "triton": "r", "indexer_q": "0", "copy_bandwidth_TBps": 4.2}
    rows = [{"shape": "v4-pro", "M": 8, "N": 8192, "K": 1536, "hadamard": True, "out_format": "mxfp4",
             "fused_us": 10.0, "floor_us": 5.0, "fused_over_floor": 2.0,
             "deepgemm_error": "ImportError: No module named 'deep_gemm'"}]
    bench.write_outputs(env, rows, tmp_path / "b", plots=False)
    md = (tmp_path / "b.md").read_text()
    assert "| v4-pro | mxfp4 | 8 | 10.0 | - | - | - | - | - | 5.0 | - | - | - | - | 2.00 |" in md
    assert "deepgemm_error" in (tmp_path / "b.csv").read_text().splitlines()[0]


def test_gemm_calls_deep_gemm_as_documented(monkeypatch):
    """The peer's calls against a stand-in for deep_gemm that checks the documented SM90
    contract (operand pairs, dtypes, shapes, the scale's strides, compiled_dims) and
    computes the product on the CPU."""
    import types

    from indexer_q import reference as ref
    from indexer_q.testing import make_inputs

    seen = []

    def fp8_gemm_nt(a, b, d, compiled_dims=""):
        (a_fp8, sa), (w_fp8, sw) = a, b
        m, k = a_fp8.shape
        n = w_fp8.shape[0]
        assert a_fp8.dtype == w_fp8.dtype == torch.float8_e4m3fn and w_fp8.shape == (n, k)
        assert sa.dtype == sw.dtype == torch.float32 and sw.shape == (n // 128, k // 128)
        assert sa.shape == (m, k // 128) and sa.stride() == (1, deepgemm.align_mn(m))
        assert d.dtype == torch.bfloat16 and d.shape == (m, n) and d.is_contiguous()
        assert compiled_dims == "nk"
        seen.append(m)
        sa_full = sa.repeat_interleave(128, dim=1)
        sw_full = sw.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
        d.copy_((a_fp8.double() * sa_full.double()) @ (w_fp8.double() * sw_full.double()).t())

    monkeypatch.setattr(deepgemm, "_loaded", {"module": types.SimpleNamespace(fp8_gemm_nt=fp8_gemm_nt)})
    for m in (1, 3, 8):
        x = make_inputs(m, 256, 384, seed=m)
        a, sa = ref.quantize_act_fp8(x["qr"])
        want = ((a.double() * sa.double().repeat_interleave(128, 1))
                @ (x["weight"].double() * x["weight_scale"].double().repeat_interleave(128, 0)
                   .repeat_interleave(128, 1)).t()).to(torch.bfloat16)
        c = deepgemm.gemm_args(x, a, sa)
        assert torch.equal(deepgemm.run_gemm(c), want) and deepgemm.run_gemm(c) is c["out"]
        assert torch.equal(deepgemm.gemm(a, sa, x["weight"], x["weight_scale"]), want)
    assert seen == [1, 1, 1, 3, 3, 3, 8, 8, 8]
