#!/bin/bash
# The package as a user gets it: a wheel installed into a fresh virtualenv (not the
# checkout), then `indexer-q info` and fused_indexer_q at the V4 shapes, failing on any
# indexer_q warning (a packaged table must serve without one), printing the tactic
# each call takes and where it came from. Usage, on a GPU machine with torch and CuTe DSL
# importable (the device kit's bootstrap puts them on PYTHONPATH):
#   bash tuning/wheel_check.sh path/to/indexer_q-*.whl OUT
set -euo pipefail
wheel=$1 out=$2
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
# torch and its CUDA libraries from the interpreter that has them (python3 may itself be
# a virtualenv, whose packages --system-site-packages would not see)
python3 -c "import site, torch; print('\n'.join(site.getsitepackages()))" \
  > "$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')/outer.pth"
"$venv/bin/pip" install -q --no-deps --no-index "$wheel"
# the checkout's src/ and root off the path: only the wheel provides indexer_q
export PYTHONPATH=$(echo "${PYTHONPATH:-}" | tr ':' '\n' | grep -v -x -e "$PWD/src" -e "$PWD" | paste -sd:)
export INDEXER_Q_CACHE_DIR="${INDEXER_Q_CACHE_DIR:-$(mktemp -d)}"  # a fresh cache: the wheel compiles its own kernels
cd "$(mktemp -d)"
"$venv/bin/indexer-q" info
"$venv/bin/python" - <<'PY'
import warnings
warnings.simplefilter("always")
caught = warnings.catch_warnings(record=True)
log = caught.__enter__()
import torch, indexer_q
from indexer_q import dispatch, table
from indexer_q.testing import make_inputs
print("indexer_q from", indexer_q.__file__)
print("table", table.table_source(torch.device("cuda")))
for name, (n, k) in {"V4-Pro": (8192, 1536), "V4-Flash": (8192, 1024)}.items():
    for m in (1, 16, 128, 4096):
        x = make_inputs(m, n, k, seed=m, device="cuda")
        w = indexer_q.prepare_weights(x["weight"], x["weight_scale"])
        q, s = indexer_q.fused_indexer_q(x["qr"], w, x["positions"], x["cos_sin"], hadamard=True)
        torch.cuda.synchronize()
        t = dispatch.choose_tactic("sm_90a", torch.device("cuda"), m, n, k)
        print(f"{name} M={m}: q {tuple(q.shape)} {q.dtype}, tactic {t.as_dict()}")
caught.__exit__(None, None, None)
ours = [str(w.message) for w in log if "indexer_q" in str(w.message) or "table" in str(w.message)]
others = sorted({f"{w.category.__name__}: {str(w.message)[:80]}" for w in log} - set(ours))
print("warnings from other packages:", others)
assert not ours, ours
print("no indexer_q warnings")
PY
echo "$venv"
