"""Environment variables read by indexer_q (always at call time, never at import)."""
from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE_DIR = "INDEXER_Q_CACHE_DIR"
ENV_TACTIC_TABLE = "INDEXER_Q_TACTIC_TABLE"
ENV_CHECK = "INDEXER_Q_CHECK"


def check_mode() -> bool:
    """INDEXER_Q_CHECK=1: extra host checks that read input values (they synchronize)."""
    return os.environ.get(ENV_CHECK, "0") not in ("", "0")


def cache_dir() -> Path:
    """INDEXER_Q_CACHE_DIR, else $XDG_CACHE_HOME/indexer_q, else ~/.cache/indexer_q."""
    explicit = os.environ.get(ENV_CACHE_DIR)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "indexer_q"


def data_dir() -> Path:
    """$XDG_DATA_HOME/indexer_q, else ~/.local/share/indexer_q: what a user installs
    (tables/<GPU>.json, from `indexer-q tune --install`)."""
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "indexer_q"


def user_table_dir() -> Path:
    """Where `indexer-q tune --install` puts this user's tactic tables, one per GPU."""
    return data_dir() / "tables"


def tactic_table_path():
    """INDEXER_Q_TACTIC_TABLE, or None."""
    value = os.environ.get(ENV_TACTIC_TABLE)
    return Path(value).expanduser() if value else None
