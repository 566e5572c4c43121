"""CPU: where a call's tactic table comes from (set_tactic_table, INDEXER_Q_TACTIC_TABLE,
the user's, the package's, none), which of them warn, `install_table`, `indexer-q info`'s
rows and the wheel's package data. The GPU is faked by `table.metadata`."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

from indexer_q import table
from indexer_q.tactics import Tactic

ROOT = Path(__file__).resolve().parent.parent
GPU = "Test GPU 9000"
N, K = 8192, 1536


def _meta(**over):
    return {"gpu": GPU, "sms": 100, "indexer_q": "0", "cutlass_dsl": "4.8.1", "torch": "t", "cuda": "c",
            "kernel_fingerprint": "f00d"} | over


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """A fake GPU; an empty package table directory and user data directory under tmp_path.
    Returns a namespace of the paths and a counter of metadata() calls."""
    calls = []

    def fake_metadata(device=None):
        calls.append(device)
        return _meta()

    monkeypatch.setattr(table, "metadata", fake_metadata)
    monkeypatch.setattr(table, "PACKAGE_TABLES", tmp_path / "package")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv("INDEXER_Q_TACTIC_TABLE", raising=False)
    table.set_tactic_table(None)

    class P:
        package = tmp_path / "package" / "Test_GPU_9000.json"
        user = tmp_path / "data" / "indexer_q" / "tables" / "Test_GPU_9000.json"
        explicit = tmp_path / "explicit.json"
        env = tmp_path / "env.json"
        metadata_calls = calls

    yield P
    table.set_tactic_table(None)


def _write(path, tile_m, n=N, k=K, **meta):
    table.write_table(path, _meta(**meta), [{"n": n, "k": k, "m_max": 16384, "tactic": Tactic(tile_m=tile_m)}])


def test_table_file_name_from_the_gpu_name():
    assert table.table_file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert table.table_file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"
    assert table.table_file_name("a/b: c") == "a_b_c.json"
    for path in sorted((ROOT / "src" / "indexer_q" / "tables").glob("*.json")):
        assert path.name == table.table_file_name(json.loads(path.read_text())["metadata"]["gpu"])


def test_user_data_dir_follows_xdg(monkeypatch, tmp_path):
    from indexer_q.env import user_table_dir

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert user_table_dir() == tmp_path / "indexer_q" / "tables"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert str(user_table_dir()).endswith(".local/share/indexer_q/tables")


def test_lookup_order(gpu, monkeypatch):
    """set_tactic_table, then INDEXER_Q_TACTIC_TABLE, then the user's table for this GPU,
    then the package's, then the heuristic; none of them warns."""
    for path, tile in ((gpu.explicit, 8), (gpu.env, 16), (gpu.user, 32), (gpu.package, 64)):
        _write(path, tile)
    steps = [(gpu.explicit, "set_tactic_table", 8), (gpu.env, "INDEXER_Q_TACTIC_TABLE", 16),
             (gpu.user, "user", 32), (gpu.package, "package", 64), (None, "none (heuristic)", None)]
    table.set_tactic_table(gpu.explicit)
    monkeypatch.setenv("INDEXER_Q_TACTIC_TABLE", str(gpu.env))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, (path, source, tile) in enumerate(steps):
            assert table.table_source() == (path, source)
            got = table.lookup(5, N, K, "cuda:0")
            assert (got.tile_m if got else None) == tile, source
            # the next step: take this source away
            if i == 0:
                table.set_tactic_table(None)
            elif i == 1:
                monkeypatch.delenv("INDEXER_Q_TACTIC_TABLE")
            elif i == 2:
                gpu.user.unlink()
                table.set_tactic_table(None)  # forget what was read
            elif i == 3:
                gpu.package.unlink()
                table.set_tactic_table(None)


def test_resolved_once_per_device(gpu):
    """After a device's first call, lookup reads no metadata and no file: one dict get."""
    _write(gpu.package, 64)
    for m in (1, 100, 5000):
        assert table.lookup(m, N, K, "cuda:0").tile_m == 64
    assert gpu.metadata_calls == ["cuda:0"]
    table.lookup(1, N, K, "cuda:1")
    assert gpu.metadata_calls == ["cuda:0", "cuda:1"]


def test_m_buckets_and_shapes_of_a_packaged_table(gpu):
    """The packaged table's own (N, K) by M bucket; other shapes the heuristic, silently."""
    table.write_table(gpu.package, _meta(), [
        {"n": N, "k": K, "m_max": 64, "tactic": Tactic(tile_m=64)},
        {"n": N, "k": K, "m_max": 1024, "tactic": Tactic(tile_m=128, mma_per_promotion=2)},
        {"n": N, "k": K, "m_max": 16384, "tactic": Tactic(tile_m=128)}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [table.lookup(m, N, K).tile_m for m in (1, 64)] == [64, 64]
        assert table.lookup(65, N, K).mma_per_promotion == 2
        assert table.lookup(99999, N, K) == Tactic(tile_m=128)  # past the end: the last
        assert table.lookup(8, 1024, 1536) is None


def test_the_shipped_table_serves_without_warning(monkeypatch, tmp_path):
    """The real packaged table, on a GPU faked to be the one it was tuned for."""
    shipped = ROOT / "src" / "indexer_q" / "tables" / "NVIDIA_H200.json"
    meta = json.loads(shipped.read_text())["metadata"]
    monkeypatch.setattr(table, "metadata", lambda device=None: meta)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.delenv("INDEXER_Q_TACTIC_TABLE", raising=False)
    table.set_tactic_table(None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert table.table_source() == (table.PACKAGE_TABLES / "NVIDIA_H200.json", "package")
            assert table.PACKAGE_TABLES.resolve() == shipped.parent.resolve()
            for m in (1, 128, 4096, 16384):
                for n, k in ((8192, 1536), (1024, 1536), (8192, 1024), (1024, 1024)):
                    assert isinstance(table.lookup(m, n, k), Tactic)
            assert table.lookup(1, 2048, 1536) is None  # TP4: not tuned, the heuristic
    finally:
        table.set_tactic_table(None)


def test_no_table_for_this_gpu_is_silent(gpu):
    _write(gpu.package.with_name("Another_GPU.json"), 64, gpu="Another GPU")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert table.lookup(1, N, K) is None
    assert table.table_source() == (None, "none (heuristic)")


def test_stale_packaged_table_warns_once_and_falls_to_the_heuristic(gpu):
    _write(gpu.package, 64, kernel_fingerprint="0000")
    with pytest.warns(UserWarning) as seen:
        assert table.lookup(1, N, K) is None
    assert len(seen) == 1
    text = str(seen[0].message)
    assert text == (f"indexer_q: tactic table {gpu.package} (package) was made for another setup: "
                    "kernel_fingerprint 0000 != f00d here (the kernels changed since it was tuned); "
                    "using the heuristic tactic")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert table.lookup(2, N, K) is None  # warned once only
        assert table.table_source() == (None, "none (heuristic)")  # and never here


def test_stale_user_table_falls_through_to_the_package(gpu):
    _write(gpu.user, 32, sms=66)
    _write(gpu.package, 64)
    with pytest.warns(UserWarning) as seen:
        assert table.lookup(1, N, K).tile_m == 64
    assert len(seen) == 1
    text = str(seen[0].message)
    assert f"{gpu.user} (user) was made for another setup: sms 66 != 100 here (another SM count" in text
    assert text.endswith(f"; using {gpu.package} (package)")
    d = table.describe_tables()
    assert (d["path"], d["source"]) == (gpu.package, "package")
    assert [(p, s) for p, s, _ in d["skipped"]] == [(gpu.user, "user")]


def test_a_table_that_is_set_but_missing_warns(gpu, monkeypatch):
    _write(gpu.package, 64)
    monkeypatch.setenv("INDEXER_Q_TACTIC_TABLE", str(gpu.env))  # not written
    with pytest.warns(UserWarning, match=r"env.json \(INDEXER_Q_TACTIC_TABLE\) cannot be used .*No such file.*"
                                         r"; using .*Test_GPU_9000.json \(package\)"):
        assert table.lookup(1, N, K).tile_m == 64


def test_a_table_that_is_set_warns_for_a_shape_it_lacks(gpu):
    _write(gpu.explicit, 8)
    table.set_tactic_table(gpu.explicit)
    with pytest.warns(UserWarning, match=r"\(set_tactic_table\) has no entry for N=1024, K=1536"):
        assert table.lookup(1, 1024, K) is None


def test_install_table_merges_shapes_of_the_same_setup(gpu):
    a, b, c = Tactic(tile_m=64), Tactic(tile_m=128), Tactic(tile_m=64, split_k=2)
    tuned = gpu.explicit.parent / "tuned_pro.json"
    table.write_table(tuned, _meta(model="v4-pro", timings_us={"1": {}}),
                      [{"n": N, "k": K, "m_max": 1, "tactic": a}, {"n": N, "k": K, "m_max": 16384, "tactic": b}])
    assert table.install_table(tuned) == gpu.user
    doc = json.loads(gpu.user.read_text())
    assert doc["metadata"]["model"] == "v4-pro"  # alone: its metadata whole
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert table.table_source() == (gpu.user, "user")
        assert table.lookup(1, N, K) == a
    # another shape: merged, under the metadata both share
    flash = {"version": 1, "metadata": _meta(model="v4-flash"),
             "entries": [{"n": 1024, "k": 1024, "m_max": 16384, "tactic": c.as_dict()}]}
    table.install_table(flash)
    doc = json.loads(gpu.user.read_text())
    assert [(e["n"], e["k"], e["m_max"]) for e in doc["entries"]] == [(1024, 1024, 16384), (N, K, 1), (N, K, 16384)]
    assert doc["metadata"] == {f: _meta()[f] for f in table.SHARED_FIELDS}
    assert table.lookup(5, 1024, 1024) == c  # this process reads the new table
    # the same shape again: replaced, the other kept
    table.install_table({"version": 1, "metadata": _meta(),
                         "entries": [{"n": N, "k": K, "m_max": 16384, "tactic": c.as_dict()}]})
    doc = json.loads(gpu.user.read_text())
    assert [(e["n"], e["k"], e["m_max"], e["tactic"]["split_k"]) for e in doc["entries"]] == [
        (1024, 1024, 16384, 2), (N, K, 16384, 2)]
    # a table for another setup is refused; an installed one of another setup is replaced
    with pytest.raises(ValueError, match="kernel_fingerprint 0000 != f00d here"):
        table.install_table({"version": 1, "metadata": _meta(kernel_fingerprint="0000"), "entries": []})
    _write(gpu.user, 8, kernel_fingerprint="0000")
    table.install_table(tuned)
    doc = json.loads(gpu.user.read_text())
    assert [(e["n"], e["k"]) for e in doc["entries"]] == [(N, K), (N, K)] and doc["metadata"]["model"] == "v4-pro"
    assert not gpu.package.exists()  # the package is never touched


def test_tune_install_cli(gpu):
    from tuning import tune

    path = gpu.explicit.parent / "t.json"
    _write(path, 64)
    assert tune.main(["--install", str(path)]) == 0
    assert json.loads(gpu.user.read_text())["entries"][0]["tactic"]["tile_m"] == 64


def test_merge_defaults_to_the_packaged_table(gpu, monkeypatch):
    from tuning import tune

    assert tune.PACKAGED == ROOT / "src" / "indexer_q" / "tables"
    monkeypatch.setattr(tune, "PACKAGED", gpu.package.parent)
    a = gpu.explicit.parent / "a.json"
    _write(a, 64)
    assert tune.merge([a]) == gpu.package


def test_info_rows(gpu, capsys, monkeypatch):
    from indexer_q import cli

    _write(gpu.package, 64)
    rows = dict(cli._table_rows(have_gpu=True))
    assert rows["tactic table"] == f"{gpu.package} (package): matches this GPU and these kernels"
    _write(gpu.user, 32, sms=1)
    table.set_tactic_table(None)
    rows = cli._table_rows(have_gpu=True)
    assert rows[1][0] == "  skipped" and rows[1][1].startswith(f"{gpu.user} (user) was made for another setup")
    # no GPU: what is set, installed and shipped
    monkeypatch.setattr(table, "software_metadata", lambda: {"cutlass_dsl": "4.8.1", "kernel_fingerprint": "f00d"})
    monkeypatch.setenv("INDEXER_Q_TACTIC_TABLE", str(gpu.env))
    text = "\n".join(f"{k} | {v}" for k, v in cli._table_rows(have_gpu=False))
    assert "tactic table | none (heuristic): no GPU" in text
    assert f"  INDEXER_Q_TACTIC_TABLE | {gpu.env} (missing)" in text
    assert f"user tables | {gpu.user.parent}\n |   Test_GPU_9000.json ({GPU}, 1 SMs): matches these kernels" in text
    assert f"packaged tables | {gpu.package.parent}\n |   Test_GPU_9000.json ({GPU}, 100 SMs)" in text


def test_package_data_is_configured():
    tomllib = pytest.importorskip("tomllib")

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "tables/*.json" in cfg["package-data"]["indexer_q"]
    assert not (ROOT / "tuning" / "tables" / "NVIDIA_H200.json").exists()  # one copy: the package's


def test_the_wheel_ships_the_tables(tmp_path):
    """Build the wheel (offline, from a copy of the sources: the checkout gets no build/)."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src_copy"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("src", "kernels"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=ignore)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-q", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "dist").glob("indexer_q-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.name for p in (ROOT / "src" / "indexer_q" / "tables").glob("*.json"))
    assert "NVIDIA_H200.json" in shipped
    for name in shipped:
        assert f"indexer_q/tables/{name}" in names
    assert "indexer_q/kernels/gemm_sm90.py" in names
