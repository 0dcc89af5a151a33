"""What a data source spec means and which model can read it (no TensorFlow).

    "synthetic"          a learnable synthetic task for the model
    "text:PATH"          byte-level language modelling on a text file
    "text:python-docs"   the same on the Python manual that ships with CPython

``hybrid.data`` builds the datasets; the launcher checks its flags with this module before
the TensorFlow runtime starts.
"""

from __future__ import annotations

import dataclasses
import os

__all__ = ["BUILTIN_TEXT", "VOCAB_SIZE", "DataSpec", "check_source", "parse_spec"]

BUILTIN_TEXT = "python-docs"
VOCAB_SIZE = 256  # byte-level
TOKEN_MODELS = ("transformer",)  # the models that read token sequences


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """A parsed data source spec: ``kind`` is "synthetic" or "text"; ``path`` for text."""

    kind: str
    path: str = ""


def parse_spec(spec: str) -> DataSpec:
    """``"synthetic"``, ``"text:PATH"`` or ``"text:python-docs"`` -> DataSpec.

    Raises:
      ValueError: an unknown kind, or a text file that does not exist.
    """
    if spec == "synthetic":
        return DataSpec("synthetic")
    kind, sep, path = spec.partition(":")
    if kind != "text" or not sep or not path:
        raise ValueError(
            f"unknown data source {spec!r}; use 'synthetic', 'text:PATH' (a text file) or "
            f"'text:{BUILTIN_TEXT}' (the Python manual, present on every machine)"
        )
    if path != BUILTIN_TEXT and not os.path.isfile(path):
        raise ValueError(f"data file {path!r} (from {spec!r}) does not exist or is not a file")
    return DataSpec("text", path)


def check_source(spec: str, model: str) -> DataSpec:
    """Parses ``spec`` and checks that ``model`` can read it.

    Raises:
      ValueError: a bad spec, or a text corpus for a model that does not read tokens.
    """
    source = parse_spec(spec)
    if source.kind == "text" and model not in TOKEN_MODELS:
        raise ValueError(
            f"data source {spec!r} is a language-modelling corpus, but model {model!r} "
            f"classifies vectors or images; use a model of {list(TOKEN_MODELS)} or the "
            "'synthetic' source"
        )
    return source
