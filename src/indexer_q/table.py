"""Tactic tables: the offline tuner's choices for one GPU, per (N, K) and M bucket.

A table is JSON: {"version": 1, "metadata": {...}, "entries": [{"n", "k", "m_max",
"tactic": {...}}, ...]}, entries sorted by (n, k, m_max). A call with M tokens takes the
entry of its (N, K) with the smallest m_max >= M (the last one past the end).

Which table a call uses, the first usable one of:

1. `set_tactic_table(path)`                                         source "set_tactic_table"
2. `INDEXER_Q_TACTIC_TABLE`                                         "INDEXER_Q_TACTIC_TABLE"
3. this user's table for the GPU, `$XDG_DATA_HOME/indexer_q/tables/<GPU>.json`
   (default `~/.local/share/indexer_q/tables/`; `indexer-q tune --install`)  "user"
4. the table shipped in the package for the GPU, `indexer_q/tables/<GPU>.json`  "package"
5. none: the heuristic (`tactics.heuristic`)                        "none (heuristic)"

<GPU> is the device's name with spaces (and anything but letters, digits, '.', '-', '_')
made '_': "NVIDIA H200" -> NVIDIA_H200.json. No table for this GPU at 3 and 4 is not
worth a warning (the heuristic is the default); a table that is set (1, 2) but missing or
unreadable, and any table whose metadata does not match this GPU and these kernels
(MATCHED_FIELDS), is skipped with one warning naming it, the fields and the table used
instead. This is resolved once per (table settings, device): a call after the first
reads INDEXER_Q_TACTIC_TABLE and does one dict lookup and a bisect.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path

from .env import ENV_TACTIC_TABLE
from .tactics import Tactic

TABLE_VERSION = 1
PACKAGE_TABLES = Path(__file__).parent / "tables"  # shipped in the wheel (package data)

SOURCE_SET = "set_tactic_table"
SOURCE_ENV = ENV_TACTIC_TABLE
SOURCE_USER = "user"
SOURCE_PACKAGE = "package"
SOURCE_NONE = "none (heuristic)"

_LOCK = threading.Lock()
_STATE = {"explicit": None, "cache": {}, "warned": set()}
# (set_tactic_table's path, INDEXER_Q_TACTIC_TABLE's value, device) -> _Resolved: the
# per-call path is one get here (written under _LOCK, read without it).
_RESOLVED: dict = {}


# Kernel sources that only one arch's kernels import, by a part of their file name; the
# other files (epilogue, act_quant, gemm_base, numerics) are every arch's.
ARCH_SOURCE_TAGS = {"sm_90a": "sm90", "sm_100a": "sm100"}


def kernel_fingerprint(arch: str | None = None) -> str:
    """sha256 of the kernel sources: a table (or a cached binary) is only valid for these.
    With `arch`, only the sources that arch's kernels import (so Blackwell-only edits do
    not make the Hopper tables stale); without, all of them."""
    from . import kernels

    others = [tag for a, tag in ARCH_SOURCE_TAGS.items() if a != arch] if arch else []
    h = hashlib.sha256()
    root = Path(kernels.__file__).resolve().parent
    for path in sorted(root.glob("*.py")):
        if any(tag in path.name for tag in others):
            continue
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def software_metadata(arch: str | None = "sm_90a") -> dict:
    """The part of `metadata` that needs no GPU: versions and the fingerprint of `arch`'s
    kernels."""
    import importlib.metadata as md

    import torch

    from . import __version__

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "unknown"

    return {
        "indexer_q": __version__,
        "cutlass_dsl": version("nvidia-cutlass-dsl"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "kernel_fingerprint": kernel_fingerprint(arch),
    }


def metadata(device=None) -> dict:
    """What a table must match: the GPU, the kernels and the library versions."""
    import torch

    from .constants import ARCH_BY_CAPABILITY

    props = torch.cuda.get_device_properties(device if device is not None else 0)
    arch = ARCH_BY_CAPABILITY.get((props.major, props.minor))
    return {"gpu": props.name, "sms": props.multi_processor_count} | software_metadata(arch)


# Fields whose change invalidates a table (torch / CUDA patch versions do not).
MATCHED_FIELDS = ("gpu", "sms", "cutlass_dsl", "kernel_fingerprint")
# The metadata a table for one GPU keeps when tables of several shapes are merged
# (`indexer-q tune --merge`, `install_table`); the per-run details stay in the sources.
SHARED_FIELDS = ("gpu", "sms", "indexer_q", "cutlass_dsl", "torch", "cuda", "kernel_fingerprint")
_WHY = {
    "gpu": "tuned on another GPU",
    "sms": "another SM count: another variant of the GPU, or a partition of it",
    "cutlass_dsl": "another nvidia-cutlass-dsl, which compiles the kernels differently",
    "kernel_fingerprint": "the kernels changed since it was tuned",
}


def mismatches(table_meta: dict, here: dict) -> list[str]:
    """The MATCHED_FIELDS (of those `here` has) on which a table's metadata differs, each
    as "field table's != this setup's here (why)"; empty when the table fits."""
    return [f"{f} {table_meta.get(f)} != {here[f]} here ({_WHY[f]})"
            for f in MATCHED_FIELDS if f in here and table_meta.get(f) != here[f]]


def table_file_name(gpu: str) -> str:
    """The file name of a GPU's table: "NVIDIA H200" -> "NVIDIA_H200.json"."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", gpu.strip()) + ".json"


def packaged_tables() -> list[Path]:
    """The tables shipped in the package, one per GPU."""
    return sorted(PACKAGE_TABLES.glob("*.json"))


def user_table_path(gpu: str) -> Path:
    from .env import user_table_dir

    return user_table_dir() / table_file_name(gpu)


def _reset() -> None:
    with _LOCK:
        _STATE["cache"].clear()
        _STATE["warned"].clear()
        _RESOLVED.clear()


def set_tactic_table(path) -> None:
    """Use this table first (before INDEXER_Q_TACTIC_TABLE, the user's and the packaged
    table); None removes it. Also forgets what was read: call it again after rewriting a
    table in place."""
    _STATE["explicit"] = None if path is None else Path(path)
    _reset()


def load_table(path) -> dict:
    """Read and check a table (once per path: set_tactic_table again after rewriting one)."""
    path = Path(path)
    key = str(path)
    with _LOCK:
        hit = _STATE["cache"].get(key)
    if hit is not None:
        return hit
    with open(path) as f:
        table = json.load(f)
    if table.get("version") != TABLE_VERSION:
        raise ValueError(f"tactic table {path}: expected version {TABLE_VERSION}, got {table.get('version')}")
    for e in table["entries"]:
        e["tactic"] = Tactic.from_dict(e["tactic"])
    with _LOCK:
        _STATE["cache"][key] = table
    return table


# An entry's "qr": the activation the tactic was tuned for. Entries without it are for the bf16
# qr (the op quantizes it); "fp8" entries for qr passed quantized (fused_indexer_q's qr_scale).
QR_BF16, QR_FP8 = "bf16", "fp8"


def entry_qr(e: dict) -> str:
    return e.get("qr", QR_BF16)


def entry_shape(e: dict) -> tuple:
    """What an entry's M buckets are keyed by: (N, K, the activation's form)."""
    return e["n"], e["k"], entry_qr(e)


def pick(table: dict, m: int, n: int, k: int, quantized_input: bool = False):
    """The table's tactic for M tokens at (N, K), or None if (N, K) is not in it."""
    qr = QR_FP8 if quantized_input else QR_BF16
    rows = [e for e in table["entries"] if e["n"] == n and e["k"] == k and entry_qr(e) == qr]
    if not rows:
        return None
    for e in rows:  # sorted by m_max
        if m <= e["m_max"]:
            return e["tactic"]
    return rows[-1]["tactic"]


def warn_once(key, message):
    if key in _STATE["warned"]:  # the common case, every call after the first: no lock
        return
    with _LOCK:
        if key in _STATE["warned"]:
            return
        _STATE["warned"].add(key)
    warnings.warn(message, stacklevel=3)


# ----------------------------------------------------------------------------------
# which table
# ----------------------------------------------------------------------------------
def candidates(gpu) -> list[tuple[Path, str]]:
    """(path, source) in lookup order: the tables that are set, whether or not they
    exist, then this GPU's user and packaged tables that exist (none when gpu is None)."""
    from .env import tactic_table_path

    out = []
    if _STATE["explicit"] is not None:
        out.append((_STATE["explicit"], SOURCE_SET))
    env = tactic_table_path()
    if env is not None:
        out.append((env, SOURCE_ENV))
    if gpu is not None:
        for path, source in ((user_table_path(gpu), SOURCE_USER),
                             (PACKAGE_TABLES / table_file_name(gpu), SOURCE_PACKAGE)):
            if path.is_file():
                out.append((path, source))
    return out


def _check(path, here: dict):
    """(table, None) if the table at `path` can serve `here`, else (None, why). No warning."""
    try:
        table = load_table(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # missing, not JSON, bad entries
        return None, f"cannot be used ({exc})"
    stale = mismatches(table["metadata"], here)
    if stale:
        return None, f"was made for another setup: {' and '.join(stale)}"
    return table, None


def _walk(device):
    """(path, source, table) of the first usable candidate or None, and the skipped
    candidates before it as (path, source, why). Reads the tables; no warning."""
    here = metadata(device)
    skipped = []
    for path, source in candidates(here["gpu"]):
        table, why = _check(path, here)
        if table is not None:
            return (path, source, table), skipped
        skipped.append((path, source, why))
    return None, skipped


def describe_tables(device=None) -> dict:
    """For `indexer-q info` and benchmark records: {"path", "source", "skipped": [(path,
    source, why), ...]} for calls on `device` (path None and source "none (heuristic)"
    when no table serves). Needs the GPU; no warning."""
    served, skipped = _walk(device)
    path, source = (served[0], served[1]) if served else (None, SOURCE_NONE)
    return {"path": path, "source": source, "skipped": skipped}


def table_source(device=None) -> tuple:
    """(path, source) of the table calls on `device` take their tactics from: source is
    "set_tactic_table", "INDEXER_Q_TACTIC_TABLE", "user" or "package"; (None,
    "none (heuristic)") without one. Needs the GPU; no warning."""
    d = describe_tables(device)
    return d["path"], d["source"]


def table_path(device=None):
    """The path of the table calls on `device` use, or None (the heuristic)."""
    return table_source(device)[0]


class _Resolved:
    """A table as lookup reads it: (N, K) -> (sorted m_max list, tactics; None where an
    entry cannot run at its N, i.e. the heuristic there)."""

    __slots__ = ("path", "source", "shapes")

    def __init__(self, path=None, source=SOURCE_NONE, shapes=None):
        self.path, self.source, self.shapes = path, source, shapes or {}


def _index(table: dict) -> dict:
    shapes: dict = {}
    for e in sorted(table["entries"], key=lambda e: (*entry_shape(e), e["m_max"])):
        m_maxes, tactics = shapes.setdefault(entry_shape(e), ([], []))
        m_maxes.append(e["m_max"])
        tactics.append(e["tactic"])
    return shapes


def _usable_table(path, table: dict) -> dict:
    """The table with its entries that cannot run at their own N made None (the heuristic
    there), each warned about once: found once, when the table is chosen."""
    bad = [e for e in table["entries"] if e["tactic"].problems(e["n"])]
    for e in bad:
        warn_once(("bad entry", str(path), e["n"], e["k"], e["m_max"]),
                  f"indexer_q: tactic table {path} entry {e['tactic']} cannot run at N = {e['n']} "
                  f"({'; '.join(e['tactic'].problems(e['n']))}); using the heuristic tactic there")
    if bad:
        table = dict(table, entries=[dict(e, tactic=None) if e in bad else e for e in table["entries"]])
    return table


def _resolve(key, device) -> _Resolved:
    """Choose the table for `device` (once per key), warning about what was skipped."""
    served, skipped = _walk(device)
    instead = f"using {served[0]} ({served[1]})" if served else "using the heuristic tactic"
    for path, source, why in skipped:
        warn_once(("skipped", str(path)), f"indexer_q: tactic table {path} ({source}) {why}; {instead}")
    resolved = _Resolved()
    if served is not None:
        path, source, table = served
        resolved = _Resolved(path, source, _index(_usable_table(path, table)))
    with _LOCK:
        return _RESOLVED.setdefault(key, resolved)


def lookup(m: int, n: int, k: int, device=None, quantized_input: bool = False):
    """The tuned tactic for this call, or None (then the caller uses the heuristic);
    `quantized_input`: the entries tuned for qr passed quantized."""
    key = (_STATE["explicit"], os.environ.get(ENV_TACTIC_TABLE), device)
    resolved = _RESOLVED.get(key)
    if resolved is None:
        resolved = _resolve(key, device)
    rows = resolved.shapes.get((n, k, QR_FP8 if quantized_input else QR_BF16))
    if rows is None:
        if quantized_input:  # not tuned for it: the caller derives one from the bf16 qr's
            return None
        # a table that was set should cover the shapes it is used for; the user's and the
        # packaged tables cover what was tuned, the heuristic the rest
        if resolved.source in (SOURCE_SET, SOURCE_ENV):
            warn_once(("shape", str(resolved.path), n, k), f"indexer_q: tactic table {resolved.path} "
                      f"({resolved.source}) has no entry for N={n}, K={k}; using the heuristic tactic")
        return None
    m_maxes, tactics = rows
    i = bisect.bisect_left(m_maxes, m)
    if i == len(tactics) and quantized_input:  # tuned up to the swapped-A/B range: the bf16 qr's above
        return None
    return tactics[i] if i < len(tactics) else tactics[-1]


# ----------------------------------------------------------------------------------
# writing and installing
# ----------------------------------------------------------------------------------
def write_table(path, meta: dict, entries: list[dict]) -> None:
    """Write a table atomically (temp file in the same directory, then rename)."""
    rows = sorted(
        ({"n": e["n"], "k": e["k"], "m_max": e["m_max"]} | ({"qr": entry_qr(e)} if entry_qr(e) != QR_BF16 else {})
         | {"tactic": e["tactic"].as_dict() if isinstance(e["tactic"], Tactic) else e["tactic"]}
         for e in entries),
        key=lambda e: (*entry_shape(e), e["m_max"]),
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": TABLE_VERSION, "metadata": meta, "entries": rows}, f, indent=1)
    os.replace(tmp, path)


def install_table(table, device=None) -> Path:
    """Install a table (a path, or a dict as `write_table` writes it) as this user's table
    for `device`'s GPU, `$XDG_DATA_HOME/indexer_q/tables/<GPU>.json`, which calls then
    use before the packaged one. The entries of an installed table of the same setup
    (MATCHED_FIELDS) for other (N, K) stay; one of another setup is replaced. A table
    made for another GPU or other kernels is refused (ValueError). Returns the path."""
    name = "the table" if isinstance(table, dict) else str(table)
    doc = table if isinstance(table, dict) else json.loads(Path(table).read_text())
    if doc.get("version") != TABLE_VERSION:
        raise ValueError(f"{name}: expected version {TABLE_VERSION}, got {doc.get('version')}")
    here = metadata(device)
    stale = mismatches(doc["metadata"], here)
    if stale:
        raise ValueError(f"{name} was made for another setup: {' and '.join(stale)}; not installed")
    meta, entries = doc["metadata"], list(doc["entries"])
    for e in entries:
        if not isinstance(e["tactic"], Tactic):
            Tactic.from_dict(e["tactic"])  # a bad entry fails here, not in every later process
    path = user_table_path(here["gpu"])
    try:
        old = json.loads(path.read_text())
        same = old.get("version") == TABLE_VERSION and not mismatches(old["metadata"], here)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        old, same = None, False
    if same:
        shapes = {entry_shape(e) for e in entries}
        kept = [e for e in old["entries"] if entry_shape(e) not in shapes]
        if kept:  # several tunings' shapes: what they share (as tune --merge)
            meta = {f: meta[f] for f in SHARED_FIELDS if f in meta}
            entries += kept
    write_table(path, meta, entries)
    _reset()  # this process reads the new table on its next call
    return path
