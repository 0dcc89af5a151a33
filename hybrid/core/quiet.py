"""Quiet by default: TensorFlow's INFO lines (C++ start-up banners, absl notes about saving)
hidden unless the user asked for them; warnings and errors always shown.

    TF_CPP_MIN_LOG_LEVEL unset  -> "1": TensorFlow's C++ INFO lines hidden, its warnings kept
    TF_ENABLE_ONEDNN_OPTS unset -> "0": no oneDNN banner (printed before the level applies),
                                   and the CPU kernels the launcher and the tests run
    absl INFO from TensorFlow/Keras modules -> dropped (the launcher, unless --verbosity);
    hybrid's own INFO lines and every WARNING or worse -> kept
    TensorFlow's start-up lines written straight to file descriptor 2 while it loads and
    finds its devices (import_tensorflow, and each first device list), before any log level
    applies (no CUDA driver on a CPU host, the CPU
    features it was built for, absl's log initialization) -> dropped (``quiet_start``),
    unless TF_CPP_MIN_LOG_LEVEL=0 asks for everything; every other line passes
    the persistent XLA cache's loader lines (an ``E`` line per program loaded: TensorFlow
    tries the file as text before reading it as binary), the out-of-memory and lost-worker
    reports the engine says in one line of its own -> dropped by a filter process
    on file descriptor 2 (``hide_known_noise``, the launcher), unless TF_CPP_MIN_LOG_LEVEL=0

No TensorFlow here: this runs before TensorFlow is imported, which is when the C++ level is read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

__all__ = [
    "CACHE_LOAD_NOISE",
    "LIBRARY_INFO_FILTER",
    "LOST_WORKER_NOISE",
    "drop_lost_worker_unraisables",
    "hide_known_noise",
    "hide_library_info",
    "import_tensorflow",
    "quiet_cpp_info",
    "quiet_start",
]

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


# TensorFlow's start-up lines that say nothing about the run: a CPU host has no CUDA driver
# (the standard build probes for one), the CPU instructions its kernels could use, and absl's
# note that it logs to stderr before its initialization.
_START_UP_NOISE = re.compile(
    r"cuda_platform\.cc|cudart_stub\.cc|cuda_(dnn|fft|blas)\.cc|cpu_feature_guard\.cc"
    r"|All log messages before absl::InitializeLog|^To enable the following instructions"
)


@contextlib.contextmanager
def quiet_start() -> Iterator[None]:
    """Runs the block with file descriptor 2 caught, then writes back to stderr every line
    it got except TensorFlow's start-up noise (``_START_UP_NOISE``). For loading TensorFlow
    and listing its devices, where its C++ writes before any log level applies."""
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL") == "0":  # everything asked for
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.writelines(line for line in lines if not _START_UP_NOISE.search(line))
            sys.stderr.flush()


# What TensorFlow logs for each program it loads from a persistent XLA cache: it reads the
# entry as a text proto first, fails, then reads it as binary (and loads it); and XLA:CPU's
# loader, on hosts whose CPU XLA compiles for with its own tuning features (+prefer-no-gather,
# +prefer-no-scatter: code-generation preferences, not instructions the host lacks), says
# twice per program that the host does not list them. A feature the host truly lacks is
# still said.
CACHE_LOAD_NOISE = (
    r"text_format\.cc:\d+\] Error parsing text-format tensorflow\.XlaSerializedCacheEntry"
    r"|cpu_aot_loader\.cc:\d+\] Loading XLA:CPU AOT result\. Target machine feature "
    r"\+prefer-no-(gather|scatter) is not +supported on the host machine"
)
# What the process that feeds the devices logs when a device runs out of memory, before the
# error reaches Python, where the engine says it as one line (``out_of_memory.py``): its
# rendezvous aborting (with any status: the error it aborts with is raised), functions and
# tensors a device could not take (it could not allocate them: "Unable to parse tensor
# proto"), tensor handles it could not delete (the failed step never made them: "Unable to
# find the relevant tensor remote_handle"). Each message goes on over the lines after it
# (the node, hints, the remote task's report, "This could happen if ...").
OUT_OF_MEMORY_NOISE = (
    r"rendezvous\.cc:\d+\] Local rendezvous is aborting with status"
    r"|context\.cc:\d+\] Failed to (register|remove) function remotely due to Unable to parse"
    r"|remote_tensor_handle_data\.cc:\d+\] Unable to destroy remote tensor handles"
    r"|destroy_tensor_handle_node\.h:\d+\] Ignoring an error encountered when deleting remote"
)
# What the client's eager runtime logs when a worker it was receiving a tensor from is lost,
# before the step's error says which worker (``cluster.py``): "Ignoring an error encountered
# when setting remote shape ..." with the status, then "This should never happen. Please
# file an issue with the TensorFlow Team." (it happens whenever a worker dies mid-step).
LOST_WORKER_NOISE = r"\] Ignoring an error encountered when setting remote shape"
NOISE = f"{CACHE_LOAD_NOISE}|{OUT_OF_MEMORY_NOISE}|{LOST_WORKER_NOISE}"

# The filter process: stdin (the pipe that is now this process's fd 2) to stdout (the fd 2
# it had), every line but the noise and the lines that continue a noisy message (indented,
# empty, or a hint or remote report: not a line of their own); deaf to the terminal's and a
# supervisor's signals, so that it drains the pipe to its end (the parent's exit, however it
# exits) and then stops.
_FILTER = """
import os, re, signal, sys
for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
noise = re.compile(sys.argv[1].encode())
goes_on = re.compile(
    rb"^(\\s|Hint:|Additional GRPC|:UNKNOWN:|This could happen|This should never happen|\\r?$)"
)
out = sys.stdout.buffer
skipping = False
for line in sys.stdin.buffer:
    skipping = bool(noise.search(line)) or (skipping and bool(goes_on.match(line)))
    if not skipping:
        out.write(line)
        out.flush()
"""


_FILTERING = False  # whether this process's fd 2 goes through the filter already


def drop_lost_worker_unraisables() -> None:
    """Keeps TensorFlow's eager executors from printing "Exception ignored in: ...
    Executor.__del__ ... UnavailableError: Socket closed" (with a traceback) when a lost
    worker's executor is collected: the cluster's guard names the lost worker itself.
    Other unraisable exceptions reach the previous hook."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        where = getattr(unraisable.object, "__qualname__", "")
        error = type(unraisable.exc_value)
        if where == "Executor.__del__" and error.__module__.startswith("tensorflow"):
            return
        previous(unraisable)

    sys.unraisablehook = hook


def hide_known_noise() -> None:
    """Drops the persistent XLA cache's loader lines (:data:`CACHE_LOAD_NOISE`), the
    out-of-memory report the engine says itself (:data:`OUT_OF_MEMORY_NOISE`) and the lost
    worker's the launcher says (:data:`LOST_WORKER_NOISE`), each with the lines its message
    goes on over, from everything this process (and the processes it
    starts) writes to file descriptor 2: fd 2 becomes a pipe to a small filter process that
    passes every other line on to the stderr there was, and ends when the last writer
    closes the pipe, so nothing written before an exit, a crash or a kill is lost. Unless
    TF_CPP_MIN_LOG_LEVEL=0 asks for everything. Once per process (later calls do nothing;
    the launchers call it first thing, through ``hybrid.launch.use_xla_cache``)."""
    global _FILTERING
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL") == "0" or _FILTERING:
        return
    _FILTERING = True
    sys.stderr.flush()
    read, write = os.pipe()
    subprocess.Popen(  # noqa: S603 - this interpreter, our own code
        [sys.executable, "-I", "-S", "-c", _FILTER, NOISE],
        stdin=read,
        stdout=2,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # the terminal's Ctrl-C reaches the run, not the filter
    )
    os.close(read)
    os.dup2(write, 2)
    os.close(write)


def import_tensorflow() -> None:
    """Imports TensorFlow (once) without its start-up noise, its physical devices probed
    (not its logical ones, which start the runtime: those lists run under
    :func:`quiet_start` where they are made, ``hybrid.engine.devices``,
    ``hybrid.core.mesh``). A persistent XLA cache must be set
    before this (``hybrid.core.xla_cache``): in the launcher, with TensorFlow 2.21, one set
    after it was ignored."""
    if "tensorflow" in sys.modules:
        return
    with quiet_start():
        import tensorflow

        # The first look at the physical devices probes for CUDA ("failed call to cuInit" on
        # a host without a driver): here, not in TensorFlow's own callback after
        # ``absl.app.run`` parses its flags (``tf.distribute``'s GPU count), outside this
        # block. It starts no runtime: logical devices can still be configured.
        tensorflow.config.list_physical_devices()
