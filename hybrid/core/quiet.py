"""Quiet by default: TensorFlow's INFO lines (C++ start-up banners, absl notes about saving)
hidden unless the user asked for them; warnings and errors always shown.

    TF_CPP_MIN_LOG_LEVEL unset  -> "1": TensorFlow's C++ INFO lines hidden, its warnings kept
    TF_ENABLE_ONEDNN_OPTS unset -> "0": no oneDNN banner (printed before the level applies),
                                   and the CPU kernels the launcher and the tests run
    absl INFO from TensorFlow/Keras modules -> dropped (the launcher, unless --verbosity);
    hybrid's own INFO lines and every WARNING or worse -> kept

No TensorFlow here: this runs before TensorFlow is imported, which is when the C++ level is read.
"""

from __future__ import annotations

import logging
import os

__all__ = ["LIBRARY_INFO_FILTER", "hide_library_info", "quiet_cpp_info"]

_HYBRID = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quiet_cpp_info() -> None:
    """Hides TensorFlow's C++ INFO lines (``TF_CPP_MIN_LOG_LEVEL=1``) and its oneDNN banner
    (``TF_ENABLE_ONEDNN_OPTS=0``, as the launcher and the tests run), each unless the
    variable is set already; it must run before TensorFlow is imported to take effect."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


class _LibraryInfoFilter(logging.Filter):
    """Drops records below WARNING that do not come from hybrid's own modules."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.pathname.startswith(_HYBRID)


LIBRARY_INFO_FILTER = _LibraryInfoFilter()


def hide_library_info(logger: str = "absl") -> None:
    """Drops the INFO lines other libraries write through ``logger`` (absl's, which
    TensorFlow's SavedModel and checkpoint code use: "Sharding callback duration", "Writing
    fingerprint"); hybrid's INFO lines and every warning pass. Idempotent."""
    target = logging.getLogger(logger)
    if LIBRARY_INFO_FILTER not in target.filters:
        target.addFilter(LIBRARY_INFO_FILTER)
