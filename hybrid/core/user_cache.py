"""Where hybrid keeps what it measures or compiles on this host, between processes (the
planner's host calibration and cost profiles, the persistent XLA compile cache the launcher
turns on), and how a JSON entry there is read and written.

    $HYBRID_CACHE_DIR                 when set
    $XDG_CACHE_HOME/hybrid            else, when XDG_CACHE_HOME is set
    ~/.cache/hybrid                   else

Everything in it is derived (a measurement, a compiled program keyed by its fingerprint):
deleting the directory loses nothing but the time to measure or compile again.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["read_json", "root", "write_json"]


def root() -> str:
    """The directory hybrid caches into (not created here)."""
    return os.environ.get("HYBRID_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hybrid"
    )


def read_json(path: str) -> Any:
    """The JSON value in ``path``, or None when there is none or it does not parse (a
    cache entry is derived: a bad one is measured again)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path: str, value: Any) -> bool:
    """Writes ``value`` to ``path`` atomically (a temporary file, then renamed), making its
    directory; False where it cannot be written (a read-only home: measured again next
    time)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            json.dump(value, f, indent=1)
        os.replace(temporary, path)
    except OSError:
        return False
    return True
