"""Environment variables read by indexer_q (always at call time, never at import)."""
from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE_DIR = "INDEXER_Q_CACHE_DIR"
ENV_TACTIC_TABLE = "INDEXER_Q_TACTIC_TABLE"


def cache_dir() -> Path:
    """INDEXER_Q_CACHE_DIR, else $XDG_CACHE_HOME/indexer_q, else ~/.cache/indexer_q."""
    explicit = os.environ.get(ENV_CACHE_DIR)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "indexer_q"


def tactic_table_path():
    """INDEXER_Q_TACTIC_TABLE (tactic tables come in a later issue), or None."""
    value = os.environ.get(ENV_TACTIC_TABLE)
    return Path(value).expanduser() if value else None
