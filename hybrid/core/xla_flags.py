"""Flags in the environment variables TensorFlow and XLA read theirs from (``TF_XLA_FLAGS``,
``XLA_FLAGS``): one flag's value, and a flag added beside the others. Each variable is read
once per process, at its first XLA compile: what is added later changes nothing."""

from __future__ import annotations

import os
import shlex

__all__ = ["add", "value"]


def value(variable: str, name: str) -> str | None:
    """The value the environment variable ``variable`` gives the flag ``name`` ("" for the
    flag without one), or None where it does not set it."""
    for word in shlex.split(os.environ.get(variable, "")):
        flag, _, found = word.partition("=")
        if flag == name:
            return found
    return None


def add(variable: str, name: str, setting: str) -> None:
    """Appends ``name=setting`` to the environment variable ``variable``, keeping its other
    flags."""
    flags = os.environ.get(variable, "").strip()
    os.environ[variable] = f"{flags} {name}={shlex.quote(setting)}".strip()
