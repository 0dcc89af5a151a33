"""Where hybrid keeps what it measures or compiles on this host, between processes: the
planner's host calibration and the persistent XLA compile cache the launcher turns on.

    $HYBRID_CACHE_DIR                 when set
    $XDG_CACHE_HOME/hybrid            else, when XDG_CACHE_HOME is set
    ~/.cache/hybrid                   else

Everything in it is derived (a measurement, a compiled program keyed by its fingerprint):
deleting the directory loses nothing but the time to measure or compile again.
"""

from __future__ import annotations

import os

__all__ = ["root"]


def root() -> str:
    """The directory hybrid caches into (not created here)."""
    return os.environ.get("HYBRID_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hybrid"
    )
