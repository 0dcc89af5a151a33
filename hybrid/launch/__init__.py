"""absl-flagged entry points: the only place in the project where flags live."""

from __future__ import annotations

import sys

from absl import flags

__all__ = ["show_in_help"]


def show_in_help(*modules: str) -> None:
    """Makes the flags defined in ``modules`` the ones ``--help`` lists for this command.

    absl's ``--help`` shows the flags of the program's main module (``sys.argv[0]``); a
    console script (``hybrid-train``) is a small wrapper that defines none itself.
    """
    for module in modules:
        for flag in flags.FLAGS.get_flags_for_module(module):
            flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
