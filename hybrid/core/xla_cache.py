"""The persistent XLA compile cache's directory: which one ``TF_XLA_FLAGS`` names, turning
one on, and the launcher's default. No TensorFlow here: TensorFlow reads ``TF_XLA_FLAGS``
once, at the latest when it first lists its devices or compiles (in the launcher, measured
with TensorFlow 2.21: already when ``hybrid.engine`` loads it), so :func:`enable` must run
before that (``hybrid-train`` does, first thing: in :func:`default_directory` unless
``--xla_cache_dir`` names another or ``off``). What the cache is for, and the step that
fills it replica by replica: ``hybrid.engine.compile_cache``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os

from hybrid.core import user_cache, xla_flags

__all__ = ["FLAG", "OFF", "default_directory", "directory", "enable"]

FLAG = "--tf_xla_persistent_cache_directory"


def default_directory() -> str:
    """The launcher's cache: ``xla/tf-<version>`` under the user's cache directory
    (``hybrid.core.user_cache``), one per TensorFlow version (whose XLA wrote it), read
    from the installed distribution's metadata: it must be known before TensorFlow loads."""
    names = importlib.metadata.packages_distributions().get("tensorflow") or []
    versions = []
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(importlib.metadata.version(name))
    return os.path.join(user_cache.root(), "xla", f"tf-{(versions or ['unknown'])[0]}")


OFF = ("off", "")  # what turns the launcher's cache off (--xla_cache_dir=off)


def directory() -> str | None:
    """The persistent cache directory ``TF_XLA_FLAGS`` names, or None."""
    return xla_flags.value("TF_XLA_FLAGS", FLAG) or None


def enable(path: str) -> str:
    """Turns the persistent XLA cache on in ``path`` (created), keeping the other flags of
    ``TF_XLA_FLAGS``; returns the directory in use (one ``TF_XLA_FLAGS`` names already
    stays). Takes effect only before TensorFlow reads its flags (see above)."""
    found = directory()
    if found is not None:
        return found
    os.makedirs(path, exist_ok=True)
    xla_flags.add("TF_XLA_FLAGS", FLAG, path)
    return path
