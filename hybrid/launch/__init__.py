"""absl-flagged entry points: the only place in the project where flags live."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

from absl import app, flags

__all__ = [
    "define_xla_cache_flag",
    "exit_now",
    "parse_flags",
    "run_app",
    "show_in_help",
    "use_xla_cache",
]

_HELP = ("--help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def show_in_help(*modules: str) -> None:
    """Makes the flags defined in ``modules`` the ones ``--help`` lists for this command.

    absl's ``--help`` shows the flags of the program's main module (``sys.argv[0]``); a
    console script (``hybrid-train``) is a small wrapper that defines none itself.
    """
    for module in modules:
        for flag in flags.FLAGS.get_flags_for_module(module):
            flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)


def parse_flags(argv: list[str], command: str = "the command") -> list[str]:
    """absl's parsing of ``argv``, each refusal one line: ``error: `` and the check's own
    message (which names the flags and the fix), not absl's ``FATAL Flags parsing error:
    flags a=…, b=…, …:`` with every flag the check reads; exits 1."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as err:
        prefixes = {
            v.print_flags_with_values(flags.FLAGS) + ": "
            for name in flags.FLAGS
            for v in flags.FLAGS[name].validators
            if hasattr(v, "flag_names")  # a check of several flags
        }
        for line in str(err).splitlines():
            prefix = max((p for p in prefixes if line.startswith(p)), key=len, default="")
            print(f"error: {line[len(prefix) :]}", file=sys.stderr)
        print(f"({command} --help lists the flags)", file=sys.stderr)
        sys.exit(1)


def run_app(main: Callable[[list[str]], Any], command: str) -> None:
    """``absl.app.run(main)`` for ``command`` with :func:`parse_flags`; ``--help`` prints
    the flags and exits 0 (absl ends it with 1). The process then ends at once
    (:func:`exit_now`)."""
    try:
        app.run(main, flags_parser=lambda argv: parse_flags(argv, command))
    except SystemExit as done:
        if done.code == 1 and any(arg in _HELP for arg in sys.argv[1:]):
            exit_now(0)
        exit_now(done.code)
    exit_now(0)


def exit_now(code: Any) -> None:
    """Ends the process with ``code`` (``SystemExit``'s meaning: None 0, a string printed
    and 1) after the ``atexit`` handlers and a flush of stdout and stderr, without tearing
    the interpreter down: once the work is done and written, TensorFlow's C++ threads (a
    ``tf.data`` reader's, a runtime's) can meet their objects' destruction in the wrong
    order and abort the finished run ("terminate called without an active exception",
    exit -6: seen here on a run that read TFRecord files)."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(int(code or 0))


def define_xla_cache_flag() -> None:
    """Defines ``--xla_cache_dir`` (:func:`use_xla_cache` reads it)."""
    flags.DEFINE_string(
        "xla_cache_dir",
        None,
        "The persistent XLA compile cache (hybrid.core.xla_cache): a stage program compiled on "
        "one replica's device is loaded by the others (each step's first call runs the "
        "replicas in turn) and by a restarted or repeated run. Default: "
        "~/.cache/hybrid/xla/tf-<version> (HYBRID_CACHE_DIR moves it); 'off' for none. "
        "TF_XLA_FLAGS' own directory wins.",
    )


def use_xla_cache(value: str | None) -> None:
    """Turns the persistent XLA cache on: in ``value``, or by default in
    ``xla_cache.default_directory()`` (a default that cannot be created: a warning, no
    cache); ``off`` (or empty): none, unless ``TF_XLA_FLAGS`` names one. Then, cache or
    not, stderr loses TensorFlow's lines the launchers say otherwise (the cache's loader
    lines, an out-of-memory cascade: ``quiet.hide_known_noise``). Call it before TensorFlow
    loads (it reads its XLA flags once).

    Raises:
      ValueError: ``value`` names a directory that cannot be created.
    """
    from hybrid.core import xla_cache
    from hybrid.core.quiet import hide_known_noise

    if value is None or value.lower() not in xla_cache.OFF:
        path = value or xla_cache.default_directory()
        try:
            xla_cache.enable(path)
        except OSError as err:
            if value is not None:
                raise ValueError(
                    f"--xla_cache_dir={value}: cannot create it ({err.strerror}); give a "
                    "writable directory, or --xla_cache_dir=off"
                ) from err
            print(
                f"warning: no XLA compile cache: cannot create {path} ({err.strerror})",
                file=sys.stderr,
            )
    hide_known_noise()
