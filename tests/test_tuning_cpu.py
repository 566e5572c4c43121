"""The benchmark's and tuner's host-side logic (CPU)."""
from __future__ import annotations

import json

from indexer_q.tactics import Tactic
from tuning import bench, tune


def test_bench_writes_json_csv_markdown(tmp_path):
    env = {"date": "2026-11-30", "gpu": "X", "sms": 1, "torch": "t", "cuda": "c", "cutlass_dsl": "d",
           "triton": "r", "indexer_q": "0", "copy_bandwidth_TBps": 4.2}
    rows = [{"shape": "v4-pro", "M": m, "N": 8192, "K": 1536, "hadamard": True, "out_format": "mxfp4",
             "fused_us": 10.0 * m, "unfused_us": 20.0 * m, "floor_us": 5.0, "fused_over_unfused": 0.5,
             "fused_over_floor": 2.0 * m} for m in (1, 2)]
    bench.write_outputs(env, rows, tmp_path / "b", plots=False)
    assert json.loads((tmp_path / "b.json").read_text())["rows"] == rows
    assert (tmp_path / "b.csv").read_text().splitlines()[0].startswith("shape,M,N,K")
    md = (tmp_path / "b.md").read_text()
    assert "| v4-pro | mxfp4 | 2 | 20.0 | 40.0 |" in md and "2026-11-30" in md


def test_problem_bytes_counts_the_output_format():
    assert bench.problem_bytes(16, 8192, 1536, "fp8") - bench.problem_bytes(16, 8192, 1536) == 16 * 8192 // 2


def test_tuner_prefers_the_heuristic_within_one_percent():
    a, b = Tactic(tile_m=64), Tactic(tile_m=128)
    assert tune.choose({a: 100.0, b: 99.5}, default=a) == a
    assert tune.choose({a: 100.0, b: 98.0}, default=a) == b
    assert tune.choose({b: 98.0}, default=a) == b
