"""Tactic tables: the offline tuner's choices for one GPU, per (N, K) and M bucket.

A table is JSON: {"version": 1, "metadata": {...}, "entries": [{"n", "k", "m_max",
"tactic": {...}}, ...]}, entries sorted by (n, k, m_max). A call with M tokens takes the
entry of its (N, K) with the smallest m_max >= M (the last one past the end). A table
whose metadata does not match this GPU and these kernels is ignored, with one warning.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import warnings
from pathlib import Path

from .tactics import Tactic

TABLE_VERSION = 1
_LOCK = threading.Lock()
_STATE = {"explicit": None, "cache": {}, "resolved": {}, "warned": set()}


def kernel_fingerprint() -> str:
    """sha256 of the kernel sources: a table (or a cached binary) is only valid for these."""
    from . import kernels

    h = hashlib.sha256()
    root = Path(kernels.__file__).resolve().parent
    for path in sorted(root.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def metadata(device=None) -> dict:
    """What a table must match: the GPU, the kernels and the library versions."""
    import importlib.metadata as md

    import torch

    from . import __version__

    props = torch.cuda.get_device_properties(device if device is not None else 0)

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "unknown"

    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "indexer_q": __version__,
        "cutlass_dsl": version("nvidia-cutlass-dsl"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "kernel_fingerprint": kernel_fingerprint(),
    }


# Fields whose change invalidates a table (torch / CUDA patch versions do not).
MATCHED_FIELDS = ("gpu", "sms", "cutlass_dsl", "kernel_fingerprint")


def set_tactic_table(path) -> None:
    """Use this table (overrides INDEXER_Q_TACTIC_TABLE); None goes back to the env var."""
    with _LOCK:
        _STATE["explicit"] = None if path is None else Path(path)
        _STATE["cache"].clear()
        _STATE["resolved"].clear()
        _STATE["warned"].clear()


def table_path():
    from .env import tactic_table_path

    return _STATE["explicit"] or tactic_table_path()


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


def pick(table: dict, m: int, n: int, k: int):
    """The table's tactic for M tokens at (N, K), or None if (N, K) is not in it."""
    rows = [e for e in table["entries"] if e["n"] == n and e["k"] == k]
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


def _usable_table(path, device):
    """The table at `path` if it matches this GPU and these kernels, else None (warned).
    Resolved once per (path, device): nothing here runs per call after the first."""
    key = (str(path), str(device))
    with _LOCK:
        if key in _STATE["resolved"]:
            return _STATE["resolved"][key]
    try:
        table = load_table(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # missing, not JSON, bad entries
        warn_once(("unreadable", str(path)), f"indexer_q: tactic table {path} cannot be used ({exc}); "
                  "using the heuristic tactic")
        with _LOCK:
            _STATE["resolved"][key] = None
        return None
    here = metadata(device)
    stale = [f for f in MATCHED_FIELDS if table["metadata"].get(f) != here[f]]
    if stale:
        diffs = ", ".join(f"{f}: {table['metadata'].get(f)} != {here[f]}" for f in stale)
        warn_once(("stale", str(path)), f"indexer_q: tactic table {path} was made for another "
                   f"setup ({diffs}); using the heuristic tactic")
        table = None
    if table is not None:  # entries that cannot run at their own N: found once, here
        # (their M buckets get None, i.e. the heuristic)
        bad = [e for e in table["entries"] if e["tactic"].problems(e["n"])]
        for e in bad:
            warn_once(("bad entry", str(path), e["n"], e["k"], e["m_max"]),
                      f"indexer_q: tactic table {path} entry {e['tactic']} cannot run at N = {e['n']} "
                      f"({'; '.join(e['tactic'].problems(e['n']))}); using the heuristic tactic there")
        if bad:
            table = dict(table, entries=[dict(e, tactic=None) if e in bad else e for e in table["entries"]])
    with _LOCK:
        _STATE["resolved"][key] = table
    return table


def lookup(m: int, n: int, k: int, device=None):
    """The tuned tactic for this call, or None (then the caller uses the heuristic)."""
    path = table_path()
    if path is None:
        warn_once(("none",), "indexer_q: no tactic table is set (INDEXER_Q_TACTIC_TABLE or "
                   "indexer_q.set_tactic_table); using the heuristic tactic")
        return None
    table = _usable_table(path, device)
    if table is None:
        return None
    tactic = pick(table, m, n, k)
    if tactic is None and not any(e["n"] == n and e["k"] == k for e in table["entries"]):
        warn_once(("shape", str(path), n, k), f"indexer_q: tactic table {path} has no entry for "
                   f"N={n}, K={k}; using the heuristic tactic")
    return tactic


def write_table(path, meta: dict, entries: list[dict]) -> None:
    """Write a table atomically (temp file in the same directory, then rename)."""
    rows = sorted(
        ({"n": e["n"], "k": e["k"], "m_max": e["m_max"],
          "tactic": e["tactic"].as_dict() if isinstance(e["tactic"], Tactic) else e["tactic"]}
         for e in entries),
        key=lambda e: (e["n"], e["k"], e["m_max"]),
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": TABLE_VERSION, "metadata": meta, "entries": rows}, f, indent=1)
    os.replace(tmp, path)
