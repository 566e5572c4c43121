"""The compile cache on disk (CPU: compile, export, load in another process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch  # a process calling the op has torch already
    from indexer_q import jit
    t0 = time.perf_counter()
    ck = jit.compile_act_quant("sm_90a")
    print(json.dumps({"source": ck.source, "seconds": time.perf_counter() - t0,
                      "callable": callable(ck.fn)}))
""")


def _run(cache_dir, n=1):
    env = dict(os.environ, INDEXER_Q_CACHE_DIR=str(cache_dir))
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(n)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-2000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_second_process_loads_from_disk(tmp_path):
    (first,) = _run(tmp_path)
    assert first["source"] == "compiled"
    entries = list((tmp_path / "kernels").glob("*.so"))
    assert len(entries) == 1
    (second,) = _run(tmp_path)
    assert second["source"] == "disk" and second["callable"]
    assert second["seconds"] < 0.5, second


def test_concurrent_processes_leave_one_good_entry(tmp_path):
    results = _run(tmp_path, n=2)
    assert sorted(r["source"] for r in results) == ["compiled", "disk"]
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1
    assert not list((tmp_path / "kernels").glob("*.tmp"))


def test_disk_key_changes_with_the_compile_key():
    from indexer_q import jit
    from indexer_q.kernels.gemm_base import GemmConfig

    a = jit.disk_key(("fused_indexer_q", "sm_90a", GemmConfig(), 8192, 1536))
    b = jit.disk_key(("fused_indexer_q", "sm_90a", GemmConfig(hadamard=True), 8192, 1536))
    c = jit.disk_key(("fused_indexer_q", "sm_90a", GemmConfig(), 1024, 1536))
    assert len({a, b, c}) == 3


def test_versions_match_the_installed_metadata():
    """The disk key's library versions, read from dist-info directory names, equal what
    importlib.metadata says about the same distributions."""
    import importlib.metadata as md

    from indexer_q import jit

    expected = sorted(
        f"{(d.metadata['Name'] or '').lower()}={d.version}" for d in md.distributions()
        if (d.metadata["Name"] or "").lower().startswith("nvidia-cutlass-dsl")
        or (d.metadata["Name"] or "").lower() == "apache-tvm-ffi")
    jit._versions.cache_clear()
    assert jit._versions() == (";".join(sorted(set(expected))) or "kit")


class _KillsItsWorker:
    """A job part whose unpickling ends the worker process at once (os._exit), as a crash
    inside the compiler would."""

    def __reduce__(self):
        return (os._exit, (3,))


def test_precompile_names_a_job_whose_worker_dies(monkeypatch):
    """One worker dying breaks the pool; precompile compiles the jobs it took down again,
    each alone, and reports the killer and the ordinary failure, in job order, instead of
    raising. One worker and the killer first: the other job is always taken down with it."""
    from indexer_q import jit

    monkeypatch.setenv("INDEXER_Q_DISK_CACHE", "1")
    failures = jit.precompile([(_KillsItsWorker(), 1024, 1024), ("not a config", 1024, 1024)], workers=1)
    assert len(failures) == 2, failures
    assert "compile worker process died" in failures[0]
    assert failures[1].startswith("not a config: AttributeError"), failures[1]
