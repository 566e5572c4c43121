"""The indexer-q command line (run in-process, and once through python -m)."""
import subprocess
import sys

import pytest

from indexer_q import cli, dispatch


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_import_is_light():
    code = "import sys, indexer_q, indexer_q.cli; assert 'torch' not in sys.modules; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_info(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("INDEXER_Q_CACHE_DIR", str(tmp_path / "c"))
    rc, out, _ = run(capsys, "info")
    assert rc == 0
    for key in ("GPU", "arch", "indexer_q", "torch", "nvidia-cutlass-dsl", "apache-tvm-ffi",
                "cache dir", "tactic table"):
        assert key in out
    assert str(tmp_path / "c") in out
    assert "none (heuristic)" in out and "packaged tables" in out and "NVIDIA_H200.json" in out


def test_cache_dir_xdg(monkeypatch, tmp_path):
    from indexer_q.env import cache_dir

    monkeypatch.delenv("INDEXER_Q_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "indexer_q"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(cache_dir()).endswith(".cache/indexer_q")


def test_compile_empty(capsys, monkeypatch):
    monkeypatch.setattr(dispatch, "compile_for_arch", lambda arch, out_dir=None: [])
    rc, out, _ = run(capsys, "compile", "--arch", "sm_90a")
    assert rc == 0 and "no kernels are built yet" in out and "sm_90a" in out


def test_compile_lists_results(capsys, monkeypatch, tmp_path):
    seen = {}

    def fake(arch, out_dir=None):
        seen["args"] = (arch, out_dir)
        return [{"kernel": "act_quant", "arch": arch, "seconds": 1.25, "ptx": "/x.ptx",
                 "checks": {"tcgen05": True}}]

    monkeypatch.setattr(dispatch, "compile_for_arch", fake)
    rc, out, _ = run(capsys, "compile", "--arch", "sm_100a", "--out", str(tmp_path))
    assert rc == 0 and seen["args"] == ("sm_100a", str(tmp_path))
    assert "act_quant" in out and "1.2 s" in out and "tcgen05=ok" in out


def test_compile_rejects_unknown_arch(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["compile", "--arch", "sm_80"])
    assert e.value.code == 2


def test_tune_needs_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("runs only without a GPU")
    rc, out, err = run(capsys, "tune", "--model", "v4-pro", "--tp", "8")
    assert rc == 2 and "needs a CUDA GPU" in err


def test_bench_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_demo_without_gpu(capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU demo runs only without a GPU")
    calls = []
    monkeypatch.setattr(dispatch, "compile_for_arch", lambda arch, out_dir=None: calls.append(arch) or [])
    rc, out, _ = run(capsys, "demo")
    assert rc == 0
    assert out.splitlines()[0].startswith("no GPU found")
    assert calls == ["sm_90a", "sm_100a"]
    errs = [float(line.split("= ")[-1].split()[0]) for line in out.splitlines() if "relative error" in line]
    assert len(errs) == 2 and all(0.08 < e < 0.14 for e in errs), out


def test_python_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "indexer_q", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "compile" in r.stdout and "demo" in r.stdout
