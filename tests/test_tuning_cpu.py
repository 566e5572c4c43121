"""The benchmark's and tuner's host-side logic (CPU)."""
from __future__ import annotations

import json

import pytest
import torch

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


def test_bench_markdown_lists_the_forced_tactics(tmp_path):
    """Forced contenders (`fused[<name>]_us`) get a table of their own under the main one,
    '-' where a row did not run one, and their names in a key."""
    env = {"date": "2026-12-02", "gpu": "X", "sms": 1, "torch": "t", "cuda": "c", "cutlass_dsl": "d",
           "triton": "r", "indexer_q": "0", "copy_bandwidth_TBps": 4.2}
    base = {"shape": "v4-pro", "N": 8192, "K": 1536, "hadamard": True, "out_format": "mxfp4", "floor_us": 5.0,
            "fused_over_floor": 2.0}
    rows = [base | {"M": 1, "fused_us": 10.0, "fused[tile_m=64]_us": 11.25},
            base | {"M": 2, "fused_us": 12.0, "fused[split_k=2]_us": 9.5}]
    bench.write_outputs(env, rows, tmp_path / "b", plots=False)
    md = (tmp_path / "b.md").read_text()
    assert "| v4-pro | mxfp4 | 1 | 10.00 | - | 11.25 |" in md and "| v4-pro | mxfp4 | 2 | 12.00 | 9.50 | - |" in md
    assert "- f0: `split_k=2`" in md and "- f1: `tile_m=64`" in md
    bench.write_outputs(env, [{k: v for k, v in r.items() if "[" not in k} for r in rows], tmp_path / "c",
                        plots=False)
    assert "Forced tactics" not in (tmp_path / "c.md").read_text()


def test_bench_markdown_says_where_the_fused_tactics_came_from(tmp_path):
    """A stale table (kernels changed since it was tuned) makes the op fall back to the
    heuristic silently: the bench's markdown says so, with the reason."""
    env = {"date": "2026-12-01", "gpu": "X", "sms": 1, "torch": "t", "cuda": "c", "cutlass_dsl": "d",
           "triton": "r", "indexer_q": "0", "copy_bandwidth_TBps": 4.2, "tactic_table": "none (heuristic)",
           "tactic_tables_skipped": ["pkg.json (package): kernel_fingerprint a != b here"]}
    rows = [{"shape": "v4-pro", "M": 1, "N": 8192, "K": 1536, "hadamard": True, "out_format": "mxfp4",
             "fused_us": 10.0, "floor_us": 5.0, "fused_over_floor": 2.0}]
    bench.write_outputs(env, rows, tmp_path / "b", plots=False)
    md = (tmp_path / "b.md").read_text()
    assert "ran the heuristic's tactics" in md and "kernel_fingerprint a != b" in md
    env |= {"tactic_table": "pkg.json", "tactic_tables_skipped": []}
    bench.write_outputs(env, rows, tmp_path / "c", plots=False)
    assert "ran the tactics of pkg.json." in (tmp_path / "c.md").read_text()


def test_ab_summary_pairs_the_runs(tmp_path):
    """tuning/ab_bench.sh's summary: each run's time per (shape, M, contender), the means
    of A and B and B - A."""
    from tuning import ab_summary

    for tag, us in (("A1", 10.0), ("B1", 9.0), ("A2", 10.4), ("B2", 9.2)):
        rows = [{"shape": "v4-pro", "M": 256, "fused_us": us, "fused[tile_m=128]_us": us + 1, "floor_us": 3.0,
                 "fused_over_floor": us / 3}]
        (tmp_path / f"{tag}.json").write_text(json.dumps({"environment": {}, "rows": rows}))
    md = ab_summary.table(ab_summary.load(sorted(tmp_path.glob("*.json"))))
    assert "| v4-pro | 256 | fused | 10.00 | 9.00 | 10.40 | 9.20 | 10.20 | 9.10 | -1.10 |" in md
    assert "| v4-pro | 256 | [tile_m=128] |" in md and "floor" not in md
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="A<round>"):
        ab_summary.load([tmp_path / "x.json"])


def test_problem_bytes_counts_the_output_format():
    assert bench.problem_bytes(16, 8192, 1536, "fp8") - bench.problem_bytes(16, 8192, 1536) == 16 * 8192 // 2


def test_bench_forces_the_tactics_asked_for():
    from indexer_q.tactics import heuristic, valid_tactics

    m, n, k = 32, 8192, 1536
    assert bench.forced_tactics(m, n, k) == {}
    spec = bench.forced_tactics(m, n, k, specs=["split_k=1"])
    assert spec == {"split_k=1": Tactic(**{**heuristic("sm_90a", m, n, k).as_dict(), "split_k": 1})}
    shared = bench.forced_tactics(m, n, k, where=["cluster_n=2", "tile_m=8,split_k=2"])
    assert shared and all(t.cluster_n == 2 or (t.tile_m == 8 and t.split_k == 2) for t in shared.values())
    assert sorted(map(str, shared.values())) == sorted(
        str(t) for t in valid_tactics("sm_90a", m, n, k) if t.cluster_n == 2 or (t.tile_m == 8 and t.split_k == 2))
    assert len(bench.forced_tactics(m, n, k, every=True)) == len(valid_tactics("sm_90a", m, n, k))


def test_bench_table_twin_replaces_fields_of_the_ops_own_tactic(monkeypatch):
    """bench --table-twin: the tactic the op picks (here stubbed) with the given fields
    replaced, named `table+<fields>`; a twin that cannot run, or names no field, is left out."""
    import dataclasses

    from indexer_q import dispatch

    m, n, k = 64, 8192, 1536
    picked = Tactic(kind="swap_ab", tile_m=32, epilogue_warpgroups=2, fused_act_quant=True, pipelined_promotion=True)
    monkeypatch.setattr(dispatch, "choose_tactic", lambda *a, **kw: picked)
    twins = bench.forced_tactics(m, n, k, twins=["tensor_core_hadamard=True", "split_k=5", "no_such_field=1"])
    assert twins == {"table+tensor_core_hadamard=True": dataclasses.replace(picked, tensor_core_hadamard=True)}


def test_warm_activations_copy_only_the_weights():
    """bench --warm-activations: the input sets share qr and the positions (one copy, left in
    L2), each has its own weight; so do the peers' operands (`_per_set`); and more sets are
    needed to cycle the weights alone through 3x the L2."""
    def addresses(x):
        return {name: t.data_ptr() for name, t in x.items()}

    warm = bench.cold_input_sets(3, 256, 256, 3, warm_activations=True, device="cpu")
    cold = bench.cold_input_sets(3, 256, 256, 3, device="cpu")
    for sets, shared in ((warm, {"qr", "positions", "cos_sin"}), (cold, set())):
        first = addresses(sets[0])
        for x in sets[1:]:
            assert {name for name, a in addresses(x).items() if a == first[name]} == shared
            assert all(torch.equal(t.view(torch.uint8), sets[0][name].view(torch.uint8)) for name, t in x.items())
    operands = bench._per_set(lambda x: {"a": x["qr"] + 0, "w": x["weight"]}, warm, True,
                              lambda c, x: dict(c, w=x["weight"]))
    assert all(o["a"] is operands[0]["a"] and o["w"] is x["weight"] for o, x in zip(operands, warm))
    assert len({id(o["a"]) for o in bench._per_set(lambda x: {"a": x["qr"] + 0}, cold, False, None)}) == 3
    assert bench.n_cold_sets(4096, 8192, 1536, warm_activations=True) == -(-3 * bench.L2_BYTES // (8192 * 1536))
    assert bench.n_cold_sets(4096, 8192, 1536) < bench.n_cold_sets(4096, 8192, 1536, warm_activations=True)


def test_tuner_prefers_the_heuristic_within_the_noise():
    a, b = Tactic(tile_m=64), Tactic(tile_m=128)
    assert tune.NOISE == 0.03
    assert tune.choose({a: 100.0, b: 97.5}, default=a) == a
    assert tune.choose({a: 100.0, b: 96.0}, default=a) == b
    assert tune.choose({b: 98.0}, default=a) == b


def test_rechoose_rederives_entries_from_recorded_timings(tmp_path):
    """--rechoose applies the current rule to a table's own timings, nothing else."""
    from indexer_q import table as tables

    a, b = Tactic(tile_m=128, epilogue_warpgroups=2), Tactic(tile_m=128, cluster_n=2, epilogue_warpgroups=2)
    assert tune.heuristic("sm_90a", 256, 8192, 1536) == a
    meta = {"gpu": "NVIDIA H200", "timings_us": {"256": {str(a.as_dict()): 10.8, str(b.as_dict()): 10.6}}}
    path = tmp_path / "t.json"
    tables.write_table(path, meta, [{"n": 8192, "k": 1536, "m_max": 256, "tactic": b}])
    tune.rechoose(path)
    doc = json.loads(path.read_text())
    assert doc["metadata"] == meta and Tactic.from_dict(doc["entries"][0]["tactic"]) == a


def test_timing_keys_are_tactic_specs_and_older_dict_keys_still_read(tmp_path):
    """A table's timings are keyed by Tactic.spec() (the kind and the fields off their
    defaults); every candidate reads back as itself, and an older table's dict keys read
    (and re-key) as the same tactics."""
    from indexer_q import table as tables
    from indexer_q.tactics import valid_tactics

    for m, n, k in ((1, 1024, 1536), (32, 8192, 1536), (256, 8192, 1024), (4096, 8192, 1536)):
        for t in valid_tactics("sm_90a", m, n, k):
            assert Tactic.from_spec(t.spec()) == t and tune.tactic_of_key(str(t.as_dict())) == t
    assert Tactic().spec() == "kind=native"
    lanes = Tactic(kind="swap_ab", tile_m=16, fused_act_quant=True, act_quant_lanes=4)
    assert lanes.spec() == "kind=swap_ab,tile_m=16,fused_act_quant=True,act_quant_lanes=4"
    for bad in ("kind=native,tile=64", "kind=native,pdl=1", "kind=native,spec=1", "kind=native,tile_m=64,tile_m=128"):
        with pytest.raises(ValueError, match="tactic spec"):
            Tactic.from_spec(bad)
    assert tune._rekeyed({str(lanes.as_dict()): 1.0, "kind=native": 2.0}) == {lanes.spec(): 1.0, "kind=native": 2.0}
    # a spec is read over the defaults its table recorded: a default changed since (here
    # pdl) keeps the timing on the tactic that was timed; a field removed since is dropped at
    # its recorded default and refused where a key sets it
    then = Tactic().as_dict() | {"pdl": False, "retired_knob": 0}
    assert tune.tactic_of_key("kind=native,tile_m=64", then) == Tactic(tile_m=64, pdl=False)
    # a field added since (stage_qr) reads at its default in a table that did not record it
    for added, default in (("stage_qr", True), ("scales_before_pdl_wait", False), ("uniform_descriptors", False)):
        before = {name: v for name, v in Tactic().as_dict().items() if name != added}
        assert getattr(tune.tactic_of_key("kind=swap_ab,tile_m=16,fused_act_quant=True", before), added) == default
        assert getattr(Tactic.from_dict(before), added) == default
    with pytest.raises(ValueError, match="retired_knob"):
        tune.tactic_of_key("kind=native,retired_knob=1", then)
    a, b = Tactic(tile_m=128, epilogue_warpgroups=2), Tactic(tile_m=128, cluster_n=2, epilogue_warpgroups=2)
    path = tmp_path / "t.json"
    tables.write_table(path, {"timings_us": {"256": {a.spec(): 10.8, b.spec(): 10.6}}},
                       [{"n": 8192, "k": 1536, "m_max": 256, "tactic": b}])
    tune.rechoose(path)
    assert Tactic.from_dict(json.loads(path.read_text())["entries"][0]["tactic"]) == a


def test_partial_retune_keeps_the_entries_outside_and_refuses_a_stale_table(tmp_path):
    """--m-max / --m-min: the earlier table's entries, timings and checks outside the
    re-tuned buckets are kept (they are the same setup's); a table of other kernels is
    refused, not mixed in."""
    from indexer_q import table as tables

    x, y = Tactic(tile_m=64).spec(), Tactic(tile_m=64, loads_in_flight=3).spec()
    meta = {"gpu": "G", "sms": 132, "cutlass_dsl": "1", "kernel_fingerprint": "f",
            "timings_us": {"64": {x: 0.5}, "256": {x: 1.0}, "512": {y: 2.0}}, "codes_equal": {y: 1.0}}
    path = tmp_path / "t.json"
    tables.write_table(path, meta, [{"n": 8192, "k": 1536, "m_max": m, "tactic": Tactic()} for m in (64, 256, 512)])
    entries, timings, checks = tune._kept_outside(path, None, 256, meta, 8192, 1536)
    assert [e["m_max"] for e in entries] == [512] and timings == {"512": {y: 2.0}} and checks == {y: 1.0}
    entries, timings, _ = tune._kept_outside(path, 64, None, meta, 8192, 1536)
    assert [e["m_max"] for e in entries] == [64] and timings == {"64": {x: 0.5}}
    entries, timings, _ = tune._kept_outside(path, 64, 256, meta, 8192, 1536)
    assert [e["m_max"] for e in entries] == [64, 512] and sorted(timings) == ["512", "64"]
    with pytest.raises(SystemExit, match="kernel_fingerprint"):
        tune._kept_outside(path, None, 256, meta | {"kernel_fingerprint": "g"}, 8192, 1536)
    with pytest.raises(SystemExit, match="N = 1024"):  # another model / TP's table
        tune._kept_outside(path, None, 256, meta, 1024, 1536)
    with pytest.raises(SystemExit, match="not a bucket"):
        tune._kept_outside(path, None, 300, meta, 8192, 1536)
    with pytest.raises(SystemExit, match="below"):
        tune._kept_outside(path, 256, 64, meta, 8192, 1536)


def test_merge_tables(tmp_path):
    """Per-(model, TP) tables merge into one per GPU; clashing metadata or shapes refuse."""
    import json

    from indexer_q import table
    from indexer_q.tactics import Tactic
    from tuning.tune import merge

    meta = {"gpu": "G", "sms": 1, "indexer_q": "0", "cutlass_dsl": "0", "torch": "0", "cuda": "0",
            "kernel_fingerprint": "f", "model": "x"}
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    table.write_table(a, meta, [{"n": 8192, "k": 1536, "m_max": 1, "tactic": Tactic(tile_m=64, split_k=2)}])
    table.write_table(b, meta, [{"n": 1024, "k": 1536, "m_max": 16384, "tactic": Tactic()}])
    table.write_table(c, meta | {"kernel_fingerprint": "g"}, [{"n": 2048, "k": 1536, "m_max": 1, "tactic": Tactic()}])
    out = merge([a, b], tmp_path / "m.json")
    merged = json.loads(out.read_text())
    assert [(e["n"], e["tactic"]["split_k"]) for e in merged["entries"]] == [(1024, 1), (8192, 2)]
    assert merged["metadata"]["merged_from"] == ["a.json", "b.json"] and "model" not in merged["metadata"]
    with pytest.raises(SystemExit, match="kernel_fingerprint"):
        merge([a, c], tmp_path / "x.json")
    with pytest.raises(SystemExit, match="already"):
        merge([a, a], tmp_path / "x.json")


def test_committed_tables_match_the_kernels():
    """Every committed tactic table was tuned on the kernels as committed: an edit under
    kernels/ changes the fingerprint, and the runtime would then ignore the table (one
    warning, heuristic tactics). Re-tune (tuning/NOTES.md, "GPU time") after such an edit.
    The per-(model, TP) tables are in tuning/tables, the merged one per GPU that the
    package ships in src/indexer_q/tables; it holds exactly its sources' entries."""
    import json
    from pathlib import Path

    from indexer_q import table

    root = Path(__file__).resolve().parent.parent
    tuned, packaged = root / "tuning" / "tables", root / "src" / "indexer_q" / "tables"
    paths = sorted(tuned.glob("*.json")) + sorted(packaged.glob("*.json"))
    assert sorted(packaged.glob("*.json"))
    fingerprint = table.kernel_fingerprint("sm_90a")  # the tables are the H200's
    for p in paths:
        meta = json.loads(p.read_text())["metadata"]
        assert meta["kernel_fingerprint"] == fingerprint, f"{p.name} was tuned on other kernels"
    for merged in sorted(packaged.glob("*.json")):
        doc = json.loads(merged.read_text())
        parts = [json.loads((tuned / name).read_text())["entries"] for name in doc["metadata"]["merged_from"]]
        key = lambda e: (e["n"], e["k"], e["m_max"])  # noqa: E731
        assert sorted(doc["entries"], key=key) == sorted((e for part in parts for e in part), key=key)


def test_restamp_jobs_are_the_tables_distinct_tactics(tmp_path):
    """restamp compiles each (tactic, N, K) of the tables once."""
    from pathlib import Path

    from tuning import restamp

    tables = sorted(Path(tune.__file__).parent.joinpath("tables").glob("NVIDIA_H200_*.json"))
    arch, jobs = restamp.table_jobs(tables + tables)  # a table twice adds nothing
    entries = {json.dumps({"tactic": e["tactic"], "n": e["n"], "k": e["k"]}, sort_keys=True)
               for t in tables for e in json.loads(t.read_text())["entries"]}
    assert arch == "sm_90a" and len(jobs) == len(entries) and all(j["sms"] == 132 for j in jobs)
    # --retune-up-to 64: only the tactics of buckets above M = 64 are compared
    _, above = restamp.table_jobs(tables, 64)
    kept = {json.dumps({"tactic": e["tactic"], "n": e["n"], "k": e["k"]}, sort_keys=True)
            for t in tables for e in json.loads(t.read_text())["entries"] if e["m_max"] > 64}
    assert len(above) == len(kept) < len(jobs)


def test_restamp_refuses_tables_not_tuned_with_the_baseline(tmp_path):
    """A table whose fingerprint is not the baseline's is left alone (nothing compiled)."""
    import shutil
    import subprocess
    from pathlib import Path

    from tuning import restamp

    if shutil.which("git") is None or subprocess.run(["git", "rev-parse", "HEAD"], cwd=restamp.ROOT,
                                                      capture_output=True).returncode:
        pytest.skip("needs the git checkout")
    src = next(Path(tune.__file__).parent.joinpath("tables").glob("NVIDIA_H200_*.json"))
    table = json.loads(src.read_text())
    table["metadata"]["kernel_fingerprint"] = "0" * 16
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    before = path.read_text()
    assert restamp.main(["--baseline", "HEAD", str(path)]) == 1
    assert path.read_text() == before


def test_ncu_sass_splits_the_k_loops_stall_samples(tmp_path):
    """tuning.ncu_sass: the K loop is the instructions executed as often as the first
    WGMMA, and its stall mix counts only theirs."""
    from tuning import ncu_sass

    cols = ["Address", "Source", ncu_sass.SAMPLES, "Instructions Executed", "stall_barrier", "stall_not_selected",
            "stall_not_selected (Not Issued)"]
    body = [["0x0", "MOV R1, R2", "10", "8", "0", "10", "10"],
            ["0x1", "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR12], RZ", "6", "96", "2", "4", "4"],
            ["0x2", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "30", "96", "30", "0", "0"]]
    path = tmp_path / "p"
    path.mkdir()
    (path / "sass.csv").write_text("\n".join(",".join(f'"{v}"' for v in line)
                                             for line in [["Kernel Name", "k"], cols, *body]) + "\n")
    rows = ncu_sass.read(path / "sass.csv")
    assert [r["Address"] for r in ncu_sass.k_loop(rows)] == ["0x1", "0x2"]
    assert ncu_sass.stall_mix(ncu_sass.k_loop(rows)) == {"barrier": 32, "not_selected": 4}
    assert ncu_sass.stall_mix(rows)["not_selected"] == 14  # the "(Not Issued)" copy is not counted twice
    assert "K loop: 36 samples, 2 instructions;" in ncu_sass.report(path, top=1)
    assert "[barrier 30]" in ncu_sass.report(path, top=1)  # the top instruction's reasons
    listing = ncu_sass.listing(path).splitlines()  # program order, every instruction
    assert len(listing) == 3 and "QGMMA" in listing[1] and listing[2].endswith("[barrier 30]")


def test_sass_mix_counts_opcodes():
    from tuning.sass_mix import opcode_counts

    listing = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
                                                                           /* 0x000fe40000000800 */
        /*0010*/              @!P0 FADD R2, R3, R4 ;                       /* 0x0000000403028221 */
        /*0020*/                   FADD.FTZ R5, R6, R7 ;                   /* 0x0000000706057221 */
        /*0030*/                   SHFL.BFLY PT, R8, R9, 0x1, 0x1f ;      /* 0x0c201f0009087f89 */
"""
    assert opcode_counts(listing) == {"LDC": 1, "FADD": 2, "SHFL": 1}


def test_sass_mix_of_the_row_epilogue():
    """The mix the NOTES quote (mxfp4 with the Hadamard, 4 lanes a row): the butterfly's 5
    local stages and RoPE's half are 5.5 FADD a value; the total stays under 30."""
    from tuning.sass_mix import cuda_tool, mix

    if not cuda_tool("cuobjdump"):
        pytest.skip("needs cuobjdump")
    total, per_value = mix("mxfp4", True, 4, 2)
    assert per_value["FADD"] == 5.5 and total / 64 < 30, (total, per_value)


def test_restamp_compare_refuses_by_numerics():
    """Without --timed-numerics-only any changed digest refuses; with it only the tuner's
    numerics (index 0) does, and the other numerics that moved are reported."""
    from tuning import restamp

    n = len(restamp.NUMERICS)
    old = [["a"] * n, ["b"] * n]
    fp8_only = [["a"] * n, ["b"] * (n - 2) + ["x", "b"]]
    assert restamp.compare(old, old, False) == ([], [])
    assert restamp.compare(old, fp8_only, False) == ([1], [n - 2])
    assert restamp.compare(old, fp8_only, True) == ([], [n - 2])
    timed = [["a"] * n, ["y"] + ["b"] * (n - 1)]
    assert restamp.compare(old, timed, True) == ([1], [])


def test_trace_outputs_hold_every_ctas_stamps():
    """tuning.trace_decode: the q output the probe writes its stamps into is the start of a
    buffer with room for every CTA's slots, however few its M rows (M = 1 at 8192 heads'
    width holds 4 KB; 132 CTAs write 21 KB); traced whole, the stamps follow the q output
    (kernels/sm90_parts.py: the q output's cosize past its start), clear of its bytes."""
    import torch

    from indexer_q.kernels.sm90_parts import TRACE_BLOCKS, TRACE_SLOTS
    from tuning.trace_decode import KBLOCKS, PHASES, _stamps, trace_outputs

    # every phase's slot is one the kernels write, the per-block ones as many as they stamp
    assert KBLOCKS == TRACE_BLOCKS
    assert all(0 <= slot < TRACE_SLOTS for phases in PHASES.values() for slot in phases.values())
    assert len(set(PHASES["swap_ab"].values())) == len(PHASES["swap_ab"])

    for m, n in ((1, 8192), (16, 1024), (128, 8192)):
        for whole in (False, True):
            buffer, q_words, scale_words, stamps = trace_outputs(m, n, "cpu", 132, whole)
            assert q_words.shape == (m, n // 8) and q_words.dtype == torch.int32
            assert q_words.data_ptr() == buffer.data_ptr() and scale_words.shape == (m, n // 128)
            rows = _stamps(stamps)
            assert rows.shape == (132, TRACE_SLOTS)
            start = stamps.data_ptr() - buffer.data_ptr()
            assert start == (m * n // 2 if whole else 0) and start % 8 == 0
            assert stamps.numel() == 132 * TRACE_SLOTS * 8
